"""A tiny test runner (no pytest in the sandbox image).

    python3 run_tests.py WORKDIR TEST_FILE_NAME TIMEOUT_S TEST_NAME... < (nonce line + test source)

stdin holds a one-line nonce, then the test module's source: the tests come from the env, never from
the file the agent can see, so editing them changes nothing. Every `test_*` function runs in
definition order with a per-test alarm. Result lines are `<nonce> PASS name` / `<nonce> FAIL name:
reason`; anything the code under test prints goes through unprefixed, so it cannot forge a result.
If the test module cannot even be imported (say, a syntax error in the code under test), every
test named on the command line fails with that error.
"""

import signal
import sys
import traceback
import types

_SELF = globals().get("__file__", "<string>")  # "<string>" under `python3 -c`


def _reason(err: BaseException) -> str:
    frames = [f for f in traceback.extract_tb(err.__traceback__) if f.filename != _SELF]
    where = f" (line {frames[-1].lineno}: {frames[-1].line})" if frames and frames[-1].line else ""
    text = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return f"{type(err).__name__}{': ' + text if text else ''}{where}"[:300]


def _on_alarm(signum, frame):
    raise TimeoutError("test timed out")


def main() -> int:
    workdir, test_file, timeout_s, expected = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:]
    nonce = sys.stdin.readline().strip()
    source = sys.stdin.read()
    out = sys.stdout
    sys.dont_write_bytecode = True
    sys.path.insert(0, workdir)
    signal.signal(signal.SIGALRM, _on_alarm)
    results: list[tuple[str, bool, str]] = []
    module = types.ModuleType(test_file.rsplit(".", 1)[0])
    module.__file__ = f"{workdir}/{test_file}"
    signal.alarm(timeout_s)
    try:
        exec(compile(source, module.__file__, "exec"), module.__dict__)
        names = [n for n, f in list(module.__dict__.items()) if n.startswith("test_") and callable(f)]
    except BaseException as err:  # the code under test cannot be imported
        names, reason = [], f"cannot import the code under test: {_reason(err)}"
        results = [(n, False, reason) for n in expected]
    finally:
        signal.alarm(0)
    for name in names:
        signal.alarm(timeout_s)
        try:
            module.__dict__[name]()
            results.append((name, True, ""))
        except BaseException as err:
            results.append((name, False, _reason(err)))
        finally:
            signal.alarm(0)
    for name, ok, reason in results:
        out.write(f"{nonce} PASS {name}\n" if ok else f"{nonce} FAIL {name}: {reason}\n")
    passed = sum(ok for _, ok, _ in results)
    out.write(f"{nonce} SUMMARY {passed} passed, {len(results) - passed} failed\n")
    out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
