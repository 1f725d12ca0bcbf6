"""A safe arithmetic evaluator: reads one expression on stdin, prints its value (exit 0) or
`error: ...` (exit 1). Only numbers, + - * / // % **, unary +/- and parentheses are allowed; every
other syntax (names, calls, attributes, strings...) is rejected by walking the AST, so nothing the
model writes is ever executed as code.

    echo "(3+4)*2" | python3 calc.py      ->  14
"""

import ast
import operator
import sys

MAX_CHARS = 200
MAX_ABS = 1e100
MAX_EXPONENT = 64

_BINOPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}


def _eval(node):
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        value = _eval(node.operand)
        return value if isinstance(node.op, ast.UAdd) else -value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent {right} too large (max {MAX_EXPONENT})")
        value = _BINOPS[type(node.op)](left, right)
        if isinstance(value, complex) or abs(value) > MAX_ABS:
            raise ValueError("result out of range")
        return value
    raise ValueError(
        f"unsupported syntax '{type(node).__name__}': use numbers, + - * / // % ** and parentheses"
    )


def evaluate(expression: str):
    """Value of an arithmetic-only expression; raises ValueError/ZeroDivisionError with a clear message."""
    text = expression.strip()
    if not text:
        raise ValueError("empty expression")
    if len(text) > MAX_CHARS:
        raise ValueError(f"expression longer than {MAX_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as err:
        raise ValueError(f"invalid expression ({err.msg})") from None
    value = _eval(tree)
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        value = int(value)
    return value


def main() -> int:
    try:
        print(evaluate(sys.stdin.read()))
    except ZeroDivisionError:
        print("error: division by zero")
        return 1
    except RecursionError:
        print("error: expression nested too deeply")
        return 1
    except (ValueError, OverflowError, TypeError) as err:
        print(f"error: {err}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
