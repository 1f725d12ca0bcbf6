"""Build and load the fused CPU kernels of the small-batch (decode) paths (model/fused_cpu.cpp).

A decode step of a small model is bound by the number of torch ops it dispatches, not by arithmetic; these
kernels do one step's work of a component in one call: `moe_experts` (LatentMoE's routed experts for a few
tokens). They serve fp32 CPU tensors without autograd (rollout decoding, the benchmark); the torch code of
each component is the reference and the autograd path, and tests check that the two agree.

Built once per machine like model/kda_cpu.py (same compiler flags) into torch's extension cache
(TORCH_EXTENSIONS_DIR), in a directory keyed by the source's hash and the torch installation it is built
against: the same torch reached through two paths (a symlinked venv) gives two compiler command lines, and
one shared directory would be rebuilt at every switch. If the build fails, `load()` warns once and the
callers use their torch paths. ODYSSEY_FUSED_CPU_KERNEL=0 turns the kernels off.
"""

from __future__ import annotations

import hashlib
import os
import warnings
from pathlib import Path
from types import ModuleType

import torch

SOURCE = Path(__file__).with_name("fused_cpu.cpp")
_state: dict[str, ModuleType | None] = {}


def enabled() -> bool:
    """False when ODYSSEY_FUSED_CPU_KERNEL=0 (then every caller takes its torch path)."""
    return os.environ.get("ODYSSEY_FUSED_CPU_KERNEL", "1") != "0"


def load(verbose: bool = False) -> ModuleType | None:
    """The compiled module (built on first use), or None if disabled or the build failed (warned once)."""
    if not enabled():
        return None
    if "module" not in _state:
        _state["module"] = _build(verbose)
    return _state["module"]


def applies(*tensors: torch.Tensor) -> ModuleType | None:
    """The kernels if they serve these tensors (all fp32 on CPU, none needing a gradient), else None.
    (Called per sublayer and step on the decode path: plain loops, no generator expressions.)"""
    grad = torch.is_grad_enabled()
    for t in tensors:
        if t.dtype != torch.float32 or not t.is_cpu or (grad and t.requires_grad):
            return None
    return load()


def build_directory() -> Path:
    """TORCH_EXTENSIONS_DIR/odyssey_fused_cpu_<hash of the source and the torch it builds against>."""
    from torch.utils.cpp_extension import get_default_build_root

    key = hashlib.sha256(SOURCE.read_bytes() + f"{torch.__file__}|{torch.__version__}".encode()).hexdigest()
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    return Path(root) / f"odyssey_fused_cpu_{key[:12]}"


def _build(verbose: bool) -> ModuleType | None:
    from torch.utils.cpp_extension import load as load_extension

    try:
        build_dir = build_directory()
        build_dir.mkdir(parents=True, exist_ok=True)
        return load_extension(
            name="odyssey_fused_cpu",
            sources=[str(SOURCE)],
            build_directory=str(build_dir),
            extra_cflags=["-O3", "-march=native", "-fno-trapping-math", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            verbose=verbose,
        )
    except Exception as exc:  # a missing compiler or headers: fall back, loudly
        tail = str(exc).strip().splitlines()[-15:]
        warnings.warn(
            "model/fused_cpu.cpp did not build, so decoding uses the (slower) torch paths. Install a C++ "
            "compiler (g++) and ninja, then run `python -c 'from model import fused_cpu; "
            "fused_cpu.load(verbose=True)'` to see the full build log. Error tail:\n" + "\n".join(tail),
            RuntimeWarning,
            stacklevel=3,
        )
        return None
