"""One resolver for "pkg.module:attr" names: env entry points, reward functions, process scorers.

    resolve_name("my_pkg.rewards:brevity", what="reward function")   # -> the function

It is `pkgutil.resolve_name`; what this module adds are errors that name the failing part (malformed
name, module not found, the module's own import failing, a missing attribute with close matches, not
callable) and the fix. A leaf module (standard library only): `envs/`, `rewards/` and `rl/` all use it.
"""

from __future__ import annotations

import contextlib
import difflib
import io
import pkgutil
import re
import sys
from typing import Any

_NAME_RE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


class DottedNameError(ValueError):
    """A dotted name that does not resolve. `problem` says what failed and the fix, without the name."""

    def __init__(self, what: str, name: Any, problem: str) -> None:
        sep = " " if problem.startswith("is ") else ": "  # "... 'x' is malformed", "... 'x': module ..."
        super().__init__(f"{what} {name!r}{sep}{problem}")
        self.what, self.name, self.problem = what, name, problem


def is_dotted_name(s: Any) -> bool:
    """True for a string shaped like "pkg.module:attr" (a colon; not checked further)."""
    return isinstance(s, str) and ":" in s


def is_well_formed(s: Any) -> bool:
    """True for "pkg.module:attr.sub": identifiers separated by dots, exactly one colon."""
    return isinstance(s, str) and _NAME_RE.match(s) is not None


def resolve_name(name: str, what: str = "object", callable_: bool = True) -> Any:
    """The object `name = "pkg.module:attr"` points to (`attr` may be dotted, e.g. Cls.method).

    Raises DottedNameError (a ValueError) naming the failing part: malformed name, module not importable
    (including one that calls sys.exit while importing: its usage message is quoted, not printed),
    missing attribute (with close matches), or, with `callable_`, an object that cannot be called.
    """
    if not is_well_formed(name):
        raise DottedNameError(
            what,
            name,
            "is malformed; expected 'pkg.module:function' (a module importable from the training process, "
            "a colon, then the attribute)",
        )
    module = name.split(":")[0]
    printed = io.StringIO()
    try:
        with contextlib.redirect_stderr(printed):  # a usage message is quoted below, not printed as ours
            obj = pkgutil.resolve_name(name)
    except SystemExit as e:  # argparse parsing the command line at import time, for instance
        said = printed.getvalue().strip()[-500:]
        raise DottedNameError(
            what,
            name,
            f"importing module {module!r} called sys.exit({e.code!r}); a module must not exit when imported "
            "(argparse parsing the command line at import does this: move it under "
            "`if __name__ == '__main__':`)" + (f". It printed: {said!r}" if said else ""),
        ) from None
    except Exception as e:
        raise DottedNameError(what, name, _why(name, e)) from e
    finally:
        if printed.getvalue() and module in sys.modules:
            sys.stderr.write(printed.getvalue())  # warnings of a module that imported fine stay visible
    if callable_ and not callable(obj):
        raise DottedNameError(what, name, f"is a {type(obj).__name__}, not a callable")
    return obj


def builtin_or_dotted(
    name: str, builtins: dict[str, Any], what: str, yours: str, callable_: bool = True
) -> Any:
    """A registry lookup: `builtins[name]`, or the object "pkg.module:attr" names. Any other name is a
    ValueError listing the built-ins and saying how to name your own (`yours`, e.g. "fn(group) -> bool").
    The registries of estimators, policy losses, engines and group filters (rl/) all look up here."""
    if name in builtins:
        return builtins[name]
    if not is_dotted_name(name):
        raise ValueError(f"unknown {what} {name!r}: choose from {', '.join(builtins)}, or name your own "
                         f"{yours} as pkg.module:{'fn' if callable_ else 'attr'}")
    return resolve_name(name, what, callable_=callable_)


def _why(name: str, e: Exception) -> str:
    """What failed inside pkgutil.resolve_name, and the fix."""
    module, attrs = name.split(":")
    missing = e.name if isinstance(e, ModuleNotFoundError) else None
    if missing and (module == missing or module.startswith(missing + ".")):  # not a dependency of it
        return (
            f"module {module!r} not found (ModuleNotFoundError: {e}); install the package that provides it "
            "or add its directory to PYTHONPATH"
        )
    if isinstance(e, AttributeError) and module in sys.modules:  # it imported; an attribute is missing
        obj, owner = sys.modules[module], module
        for part in attrs.split("."):
            if not hasattr(obj, part):
                close = difflib.get_close_matches(part, [n for n in dir(obj) if not n.startswith("_")], n=3)
                hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
                return f"{owner!r} has no attribute {part!r}{hint}"
            obj, owner = getattr(obj, part), f"{owner}.{part}"
    return f"importing module {module!r} failed: {type(e).__name__}: {e}"
