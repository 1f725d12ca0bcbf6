"""Build and load the fused CPU kernels of the model's sublayers (model/fused_cpu.cpp).

A decode step of a small model is bound by the number of torch ops it dispatches, not by arithmetic; these
kernels do one sublayer's work between its input and output matmuls in one call (KDA, MLA and MoE decode
steps, SiTU-GLU, the AttnRes read, the KDA short conv and recurrence; some with a hand-written backward for
training). They serve fp32 CPU tensors; the torch code of each component is the reference (and the path
for every other dtype and device), and the tests check that the two agree.

Built once per machine into the content-keyed artefact cache, like model/kda_cpu.py (model/cpp_extension.py):
`make setup` builds it; a `ray job submit` job loads the same binary. If the build fails, `load()` warns
once and the callers use their torch paths. ODYSSEY_FUSED_CPU_KERNEL=0 turns the kernels off.

    python -m model.fused_cpu        # build (if needed) and say where the module is; --verbose: compiler log
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import torch

from model.cpp_extension import CompiledKernels

SOURCE = Path(__file__).with_name("fused_cpu.cpp")
CACHE_NAME = "fused_cpu"
KERNELS = CompiledKernels(SOURCE, CACHE_NAME, "ODYSSEY_FUSED_CPU_KERNEL", "the model's CPU path")
load = KERNELS.load
enabled = KERNELS.enabled


def applies(*tensors: torch.Tensor) -> ModuleType | None:
    """The kernels if they serve these tensors (all fp32 on CPU, none needing a gradient), else None.
    (Called per sublayer and step on the decode path: plain loops, no generator expressions.)"""
    grad = torch.is_grad_enabled()
    for t in tensors:
        if t.dtype != torch.float32 or not t.is_cpu or (grad and t.requires_grad):
            return None
    return load()


if __name__ == "__main__":
    raise SystemExit(KERNELS.main())
