"""Run check snippets against a module the agent wrote and print what they observed: values, never verdicts.

    python3 observe.py WORKDIR MODULE TIMEOUT_S  < JSON [{"id": 0, "code": "observe(mean([4, 1, 7]))"}, ...]

Each check's code runs in a fresh namespace holding the module's public names plus two helpers:
`observe(value)` appends `encode(value)` to the check's trace, and `raised(fn)` calls `fn()` and returns
the name of the exception it raised (None if none). An exception escaping the code ends the trace with
{"error": "<ExceptionType>"}. One result line per check, in order:

    @@observed {"id": 0, "trace": [4.0], "note": ""}

This process imports the agent's code, so everything it prints is the agent's to forge (a result line is
just text). The env therefore never reads a verdict from here: it compares each trace with the trace of the
reference solution, computed outside the sandbox (see envs/observations.py). Only the right values pass,
and the inputs are drawn fresh for every run.

`encode` keeps exact built-in types only (an object that claims to equal everything is encoded as
{"object": "<type name>"}), so comparisons happen on plain JSON data. Also imported by the env (to compute
the reference traces with the same code); must stay compatible with the sandbox image's Python 3.11.
"""

import json
import math
import signal
import sys
import traceback

RESULT_PREFIX = "@@observed "
MAX_ITEMS = 1000
MAX_DEPTH = 20
_SELF = globals().get("__file__", "<string>")


def encode(value, depth=0):
    """A JSON-able copy of `value`: exact None/bool/int/float/str/list/tuple/dict only."""
    kind = type(value)
    if depth > MAX_DEPTH:
        return {"too_deep": True}
    if value is None or kind is bool or kind is str:
        return value
    if kind is int:
        return value if abs(value) < 2**63 else {"bigint_bits": value.bit_length()}
    if kind is float:
        return value if math.isfinite(value) else {"float": repr(value)}
    if kind is list or kind is tuple:
        out = [encode(v, depth + 1) for v in value[:MAX_ITEMS]]
        return out + ([{"more": len(value) - MAX_ITEMS}] if len(value) > MAX_ITEMS else [])
    if kind is dict:
        items = list(value.items())[:MAX_ITEMS]
        if all(type(k) is str for k, _ in items):
            return {k: encode(v, depth + 1) for k, v in items}
        return {"dict": [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in items]}
    return {"object": kind.__name__}


def raised(fn):
    """Name of the exception `fn()` raises, or None."""
    try:
        fn()
    except Exception as err:
        return type(err).__name__
    return None


def reason(err):
    """One line about an exception: type, message and the agent's line (for the report, not the verdict)."""
    frames = [f for f in traceback.extract_tb(err.__traceback__) if f.filename != _SELF]
    where = f" (line {frames[-1].lineno}: {frames[-1].line})" if frames and frames[-1].line else ""
    text = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return f"{type(err).__name__}{': ' + text if text else ''}{where}"[:300]


def run_check(names, code):
    """(trace, note) of one check's `code` run with the module's public `names`."""
    trace = []
    scope = dict(names)
    scope.update(observe=lambda value: trace.append(encode(value)), raised=raised)
    try:
        exec(compile(code, "<check>", "exec"), scope)
    except BaseException as err:  # SystemExit / KeyboardInterrupt from the agent's code included
        trace.append({"error": type(err).__name__})
        return trace, reason(err)
    return trace, ""


def public_names(module_dict):
    return {k: v for k, v in module_dict.items() if not k.startswith("_")}


def _on_alarm(signum, frame):
    raise TimeoutError("check timed out")


def main():
    workdir, module_name, timeout_s = sys.argv[1], sys.argv[2], int(sys.argv[3])
    checks = json.loads(sys.stdin.read())  # read before the agent's code runs
    out = sys.stdout
    sys.dont_write_bytecode = True
    sys.path.insert(0, workdir)
    signal.signal(signal.SIGALRM, _on_alarm)
    signal.alarm(timeout_s)
    names, failed = None, ""
    try:
        names = public_names(vars(__import__(module_name)))
    except BaseException as err:  # the code under test cannot be imported
        failed = f"cannot import the code under test: {reason(err)}"
    finally:
        signal.alarm(0)
    for check in checks:
        if names is None:
            trace, note = [{"error": "ImportError"}], failed
        else:
            signal.alarm(timeout_s)
            try:
                trace, note = run_check(names, check["code"])
            finally:
                signal.alarm(0)
        out.write(RESULT_PREFIX + json.dumps({"id": check["id"], "trace": trace, "note": note}) + "\n")
    out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
