"""An agent written against the OpenAI Python client, as for any OpenAI-compatible server: nothing in it
knows about Odyssey. Odyssey trains the policy behind `client` (docs/agents.md).

    env:
      id: agent
      dataset: examples/quickstart/arith_qa.jsonl
      kwargs: {agent: examples.openai_agent.agent:solve, verifier: exact-match}
"""

from __future__ import annotations

import ast
import json
import operator

from openai import OpenAI

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calc",
            "description": "Evaluate an arithmetic expression with + - * / and parentheses.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "description": "e.g. (3+4)*2"}},
                "required": ["expression"],
            },
        },
    }
]
SYSTEM = "Solve the problem. Use the calc tool for arithmetic, then give the final answer as \\boxed{N}."
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def calc(expression: str) -> str:
    """The value of an arithmetic expression (a small safe evaluator, no eval())."""

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError(f"unsupported expression {expression!r}")

    result = value(ast.parse(expression, mode="eval").body)
    return str(int(result)) if float(result).is_integer() else str(result)


def solve(client: OpenAI, task: dict) -> str:
    """Chat with the model, run the calls it makes, return its last answer."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task["prompt"]}]
    for _ in range(4):
        reply = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, max_tokens=96)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return message.content or ""
        for call in message.tool_calls:
            try:
                out = calc(**json.loads(call.function.arguments))
            except Exception as err:  # the model's bad call: tell it, as any agent would
                out = f"error: {err}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": out})
    return ""
