"""Build and load the fused CPU kernels of `chunk_kda` (model/kda_cpu.cpp).

The kernels fuse the elementwise work of one block of chunks (`tile_factors`: every per-token decay
product in one pass; `tile_inverse`: the diagonal-block masks and 16 x 16 WY inverses). They serve the
no-autograd fp32 CPU path: inference, rollout prefill, the benchmark. `_wy_intra_chunk` in
model/kda_chunk.py is the reference and the autograd path; tests/test_kda.py checks that the two agree.

The extension is compiled with the C++ compiler torch uses (about 30-60 s) into a cache keyed by its
content, so any checkout or `ray job submit` job on a machine loads the same binary (model/cpp_extension.py).
`make setup` does the build. If it fails, `load()` warns once with the compiler output's tail and chunk_kda
uses the torch path. ODYSSEY_KDA_CPU_KERNEL=0 turns the kernels off.

    python -m model.kda_cpu        # build (if needed) and say where the module is; --verbose: compiler log
"""

from __future__ import annotations

from pathlib import Path

from model.cpp_extension import CompiledKernels

SOURCE = Path(__file__).with_name("kda_cpu.cpp")
CACHE_NAME = "kda_cpu"
KERNELS = CompiledKernels(SOURCE, CACHE_NAME, "ODYSSEY_KDA_CPU_KERNEL", "chunk_kda")
load = KERNELS.load
enabled = KERNELS.enabled


def build_key() -> str:
    return KERNELS.build_key


def module_name() -> str:
    return KERNELS.module_name


if __name__ == "__main__":
    raise SystemExit(KERNELS.main())
