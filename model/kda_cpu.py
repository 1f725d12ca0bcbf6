"""Build and load the fused CPU kernels of `chunk_kda` (model/kda_cpu.cpp).

The kernels fuse the elementwise work of one block of chunks (`tile_factors`: every per-token decay
product in one pass; `tile_inverse`: the diagonal-block masks and 16 x 16 WY inverses). They serve the
no-autograd fp32 CPU path: inference, rollout prefill, the benchmark. `_wy_intra_chunk` in
model/kda_chunk.py is the reference and the autograd path; tests/test_kda.py checks that the two agree.

The extension is compiled with the C++ compiler torch uses (about 30-60 s) into a cache keyed by its
content (model/artifact_cache.py): a hash of the source, the flags, torch's and Python's versions, the
compiler and the CPU (-march=native), never the path of the checkout. A local run, another worktree and a
`ray job submit` job (which imports the package from an uploaded copy of the repo) therefore load the same
binary: the first process on a machine builds it once under a lock, with a progress line, and every
later one loads it. `make setup` does the build. If it fails, `load()` warns once with the compiler
output's tail and chunk_kda uses the torch path. ODYSSEY_KDA_CPU_KERNEL=0 turns the kernels off.

    python -m model.kda_cpu        # build (if needed) and say where the module is; --verbose: compiler log
"""

from __future__ import annotations

import functools
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from types import ModuleType

from model import artifact_cache

SOURCE = Path(__file__).with_name("kda_cpu.cpp")
CACHE_NAME = "kda_cpu"
CFLAGS = ("-O3", "-march=native", "-fno-trapping-math", "-fopenmp")
LDFLAGS = ("-fopenmp",)
_state: dict[str, ModuleType | None] = {}


def enabled() -> bool:
    """False when ODYSSEY_KDA_CPU_KERNEL=0 (then chunk_kda always takes the torch path)."""
    return os.environ.get("ODYSSEY_KDA_CPU_KERNEL", "1") != "0"


def load(verbose: bool = False) -> ModuleType | None:
    """The compiled module (built on first use, cached per machine), or None if disabled or the build
    failed (warned once). Thread-unsafe on first call only; later calls are a dict lookup."""
    if not enabled():
        return None
    if "module" not in _state:
        _state["module"] = _build(verbose)
    return _state["module"]


@functools.cache
def build_key() -> str:
    """Hash of everything the binary depends on: the source bytes, the flags, torch (version, C++ ABI),
    Python's ABI, the compiler (which one and its version) and the CPU (-march=native)."""
    import torch

    cxx = os.environ.get("CXX", "c++")
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = "unavailable"
    return artifact_cache.content_key(
        SOURCE.read_bytes(),
        " ".join(CFLAGS) + " | " + " ".join(LDFLAGS),
        f"torch {torch.__version__} cxx11abi {int(torch.compiled_with_cxx11_abi())}",
        sys.implementation.cache_tag,
        f"{cxx} {shutil.which(cxx)} {version}",
        platform.machine() + " " + _cpu_identity(),
    )


def _cpu_identity() -> str:
    """The first CPU's model name and feature flags (what -march=native compiles for)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    first = text.split("\n\n", 1)[0]
    keep = ("vendor_id", "cpu family", "model\t", "model name", "flags")
    return "\n".join(ln for ln in first.splitlines() if ln.startswith(keep))


def module_name() -> str:
    """The extension's name; it carries the key, so two versions never clash in one process or cache."""
    return f"odyssey_kda_cpu_{build_key()}"


def _build(verbose: bool) -> ModuleType | None:
    from torch.utils.cpp_extension import load as load_extension

    name = module_name()

    def compile_into(tmp: Path) -> ModuleType:
        module = load_extension(
            name=name,
            sources=[str(SOURCE)],
            extra_cflags=list(CFLAGS),
            extra_ldflags=list(LDFLAGS),
            build_directory=str(tmp),
            verbose=verbose,
        )
        for p in tmp.iterdir():  # keep only the binary: the ninja files name this temporary directory
            if p.name != f"{name}.so":
                p.unlink()
        return module

    try:
        where, built = artifact_cache.cached_build(
            CACHE_NAME, build_key(), compile_into, what="the fused CPU kernels of model/kda_cpu.cpp"
        )
        module = built if built is not None else _import(name, where / f"{name}.so")
        artifact_cache.say(f"kda_cpu: fused CPU kernels from {where}")  # once per process
        return module
    except Exception as exc:  # a missing compiler or headers: fall back, loudly
        tail = str(exc).strip().splitlines()[-15:]
        warnings.warn(
            "model/kda_cpu.cpp did not build, so chunk_kda uses its (slower) torch path on CPU. Install a "
            "C++ compiler (g++) and ninja, then run `python -m model.kda_cpu` to see the full build log. "
            "Error tail:\n" + "\n".join(tail),
            RuntimeWarning,
            stacklevel=3,
        )
        return None


def _import(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> int:
    """Build entry point for setup: build (or find) the kernels; 1 if they are unavailable. The numerical
    check of fused vs torch path is tests/test_kda.py::test_fused_cpu_path_equals_torch_path."""
    import time

    t0 = time.perf_counter()
    module = load(verbose="--verbose" in sys.argv)
    if module is None:
        print("kda_cpu: kernels unavailable (disabled or build failed; see the warning above)")
        return 1
    where = artifact_cache.cache_root() / CACHE_NAME / build_key()
    print(f"kda_cpu: kernels ready in {time.perf_counter() - t0:.1f} s ({where})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
