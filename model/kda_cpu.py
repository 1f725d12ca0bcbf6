"""Build and load the fused CPU kernels of `chunk_kda` (model/kda_cpu.cpp).

The kernels fuse the elementwise work of one block of chunks (`tile_factors`: every per-token decay
product in one pass; `tile_inverse`: the diagonal-block masks and 16 x 16 WY inverses). They serve the
no-autograd fp32 CPU path: inference, rollout prefill, the benchmark. `_wy_intra_chunk` in
model/kda_chunk.py is the reference and the autograd path; tests/test_kda.py checks that the two agree.

The extension is compiled once per machine with the C++ compiler torch uses (about 30 s) into
torch's extension cache (TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions); `make setup` does it.
If the build fails, `load()` warns once with the compiler output's tail and chunk_kda uses the torch
path. ODYSSEY_KDA_CPU_KERNEL=0 turns the kernels off.

    python -m model.kda_cpu        # build (if needed) and say where the module is; --verbose: compiler log
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from types import ModuleType

SOURCE = Path(__file__).with_name("kda_cpu.cpp")
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


def _build(verbose: bool) -> ModuleType | None:
    from torch.utils.cpp_extension import load as load_extension

    try:
        return load_extension(
            name="odyssey_kda_cpu",
            sources=[str(SOURCE)],
            extra_cflags=["-O3", "-march=native", "-fno-trapping-math", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            verbose=verbose,
        )
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


def main() -> int:
    """Build entry point for setup: build (or find) the kernels; 1 if they are unavailable. The numerical
    check of fused vs torch path is tests/test_kda.py::test_fused_cpu_path_equals_torch_path."""
    import time

    t0 = time.perf_counter()
    module = load(verbose="--verbose" in sys.argv)
    if module is None:
        print("kda_cpu: kernels unavailable (disabled or build failed; see the warning above)")
        return 1
    print(f"kda_cpu: kernels ready in {time.perf_counter() - t0:.1f} s ({module.__file__})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
