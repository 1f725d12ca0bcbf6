"""Resolve "pkg.module:attr" strings to callables, with errors that say what to fix."""

from __future__ import annotations

import contextlib
import difflib
import importlib
import io
import re
import sys
from collections.abc import Callable

_PATH_RE = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$")


def is_dotted_path(s: str) -> bool:
    return ":" in s


def import_callable(path: str, what: str = "reward function") -> Callable:
    """Import `attr` from `pkg.module` for `path = "pkg.module:attr"` (attr may be dotted, e.g. Cls.method).

    Raises ValueError naming the failing part: malformed path, module not importable (including one that
    calls sys.exit while importing, e.g. argparse on the command line: its usage message is quoted in the
    error, not printed), missing attribute (with close matches), or an attribute that is not callable.
    """
    if not isinstance(path, str) or not _PATH_RE.match(path):
        raise ValueError(
            f"{what} path {path!r} is malformed; expected 'pkg.module:function' "
            "(a module importable from the training process, a colon, then the attribute)"
        )
    mod_name, attr_path = path.split(":")
    printed = io.StringIO()
    try:
        with contextlib.redirect_stderr(printed):  # a usage message is quoted below, not printed as ours
            obj = importlib.import_module(mod_name)
    except SystemExit as e:
        said = printed.getvalue().strip()[-500:]
        raise ValueError(
            f"{what} {path!r}: importing module {mod_name!r} called sys.exit({e.code!r}); a module must not "
            "exit when imported (argparse parsing the command line at import does this: move it under "
            "`if __name__ == '__main__':`)" + (f". It printed: {said!r}" if said else "")
        ) from None
    except ModuleNotFoundError as e:
        if e.name is not None and (mod_name == e.name or mod_name.startswith(e.name + ".")):
            raise ValueError(
                f"{what} {path!r}: module {mod_name!r} not found ({e}); install the package that provides it "
                "or add its directory to PYTHONPATH"
            ) from e
        raise ValueError(
            f"{what} {path!r}: importing module {mod_name!r} failed: {type(e).__name__}: {e}"
        ) from e
    except Exception as e:
        raise ValueError(
            f"{what} {path!r}: importing module {mod_name!r} failed: {type(e).__name__}: {e}"
        ) from e
    finally:
        if printed.getvalue() and mod_name in sys.modules:
            sys.stderr.write(printed.getvalue())  # warnings of a module that imported fine stay visible
    owner = mod_name
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            names = [n for n in dir(obj) if not n.startswith("_")]
            close = difflib.get_close_matches(part, names, n=3)
            hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
            raise ValueError(f"{what} {path!r}: {owner!r} has no attribute {part!r}{hint}")
        obj = getattr(obj, part)
        owner = f"{owner}.{part}"
    if not callable(obj):
        raise ValueError(f"{what} {path!r} is a {type(obj).__name__}, not a callable")
    return obj
