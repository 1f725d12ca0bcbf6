"""One resolver for "pkg.module:attr" names: env entry points, reward functions, process scorers.

    resolve_name("my_pkg.rewards:brevity", what="reward function")   # -> the function

It is `pkgutil.resolve_name`; what this module adds are errors that name the failing part (malformed
name, module not found, the module's own import failing, a missing attribute with close matches, not
callable) and the fix. A leaf module (standard library only): `envs/`, `rewards/` and `rl/` all use it.
"""

from __future__ import annotations

import difflib
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

    Raises DottedNameError (a ValueError) naming the failing part: malformed name, module not importable,
    missing attribute (with close matches), or, with `callable_`, an object that cannot be called.
    """
    if not is_well_formed(name):
        raise DottedNameError(
            what,
            name,
            "is malformed; expected 'pkg.module:function' (a module importable from the training process, "
            "a colon, then the attribute)",
        )
    try:
        obj = pkgutil.resolve_name(name)
    except Exception as e:
        raise DottedNameError(what, name, _why(name, e)) from e
    if callable_ and not callable(obj):
        raise DottedNameError(what, name, f"is a {type(obj).__name__}, not a callable")
    return obj


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
