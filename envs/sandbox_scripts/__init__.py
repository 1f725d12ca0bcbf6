"""Stand-alone stdlib-only scripts that built-in envs run with `python3 -c` inside the sandbox.

They are ordinary modules too (importable for tests and the in-process fallback of `arith`), and
must stay compatible with the sandbox image's Python (Debian bookworm: 3.11).
"""

from importlib.resources import files


def script_source(name: str) -> str:
    """Source text of `envs/sandbox_scripts/<name>.py` (what is passed to `python3 -c`)."""
    return files(__name__).joinpath(f"{name}.py").read_text()
