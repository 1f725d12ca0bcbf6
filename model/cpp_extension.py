"""A C++ extension of fused CPU kernels, compiled once per machine into the content-keyed artefact cache.

`CompiledKernels(source, cache_name, env_switch)` is what model/kda_cpu.py (chunk_kda's kernels) and
model/fused_cpu.py (decode and training sublayer kernels) each are. The binary is keyed by content
(model/artifact_cache.py): a hash of the source, the flags, torch's and Python's versions, the compiler and
the CPU (-march=native), never the path of the checkout. A local run, another worktree and a `ray job submit`
job (which imports the package from an uploaded copy of the repo) therefore load the same binary: the first
process on a machine builds it once under a lock, with a progress line, and every later one loads it.
If the build fails, `load()` warns once with the compiler output's tail and the callers use their torch
paths (the reference, checked against the kernels in the tests).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path
from types import ModuleType

from model import artifact_cache

CFLAGS = ("-O3", "-march=native", "-fno-trapping-math", "-fopenmp")
LDFLAGS = ("-fopenmp",)


class CompiledKernels:
    """The kernels of one C++ source file: `load()` -> the module, or None (disabled, or the build failed)."""

    def __init__(self, source: Path, cache_name: str, env_switch: str, fallback: str) -> None:
        self.source, self.cache_name, self.env_switch = source, cache_name, env_switch
        self.fallback = fallback  # what runs instead when the kernels are unavailable, for the warning
        self._module: ModuleType | None = None
        self._loaded = False

    def enabled(self) -> bool:
        """False when the environment switch is "0" (then every caller takes its torch path)."""
        return os.environ.get(self.env_switch, "1") != "0"

    def load(self, verbose: bool = False) -> ModuleType | None:
        """The compiled module (built on first use, cached per machine), or None if disabled or the build
        failed (warned once). After the first call: an attribute read."""
        if not self.enabled():
            return None
        if not self._loaded:
            self._module, self._loaded = self._build(verbose), True
        return self._module

    @functools.cached_property
    def build_key(self) -> str:
        """Hash of everything the binary depends on: the source bytes, the flags, torch (version, C++ ABI),
        Python's ABI, the compiler (which one and its version) and the CPU (-march=native)."""
        import torch

        cxx = os.environ.get("CXX", "c++")
        try:
            version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.SubprocessError):
            version = "unavailable"
        return artifact_cache.content_key(
            self.source.read_bytes(),
            " ".join(CFLAGS) + " | " + " ".join(LDFLAGS),
            f"torch {torch.__version__} cxx11abi {int(torch.compiled_with_cxx11_abi())}",
            sys.implementation.cache_tag,
            f"{cxx} {shutil.which(cxx)} {version}",
            platform.machine() + " " + _cpu_identity(),
        )

    @property
    def module_name(self) -> str:
        """The extension's name; it carries the key, so two versions never clash in one process or cache."""
        return f"odyssey_{self.cache_name}_{self.build_key}"

    @property
    def binary(self) -> Path:
        """Where the built shared object lives (or will)."""
        return artifact_cache.cache_root() / self.cache_name / self.build_key / f"{self.module_name}.so"

    def _build(self, verbose: bool) -> ModuleType | None:
        from torch.utils.cpp_extension import load as load_extension

        name = self.module_name

        def compile_into(tmp: Path) -> ModuleType:
            module = load_extension(
                name=name,
                sources=[str(self.source)],
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
            what = f"the fused CPU kernels of {self.source.name}"
            key = self.build_key
            where, built = artifact_cache.cached_build(self.cache_name, key, compile_into, what=what)
            module = built if built is not None else _import(name, where / f"{name}.so")
            artifact_cache.say(f"{self.cache_name}: fused CPU kernels from {where}")  # once per process
            return module
        except Exception as exc:  # a missing compiler or headers: fall back, loudly
            tail = str(exc).strip().splitlines()[-15:]
            warnings.warn(
                f"model/{self.source.name} did not build, so {self.fallback} runs its (slower) torch path. "
                f"Install a C++ compiler (g++) and ninja, then run `python -m model.{self.cache_name} "
                "--verbose` to see the full build log. Error tail:\n" + "\n".join(tail),
                RuntimeWarning,
                stacklevel=4,
            )
            return None

    def main(self) -> int:
        """Build entry point for setup: build (or find) the kernels; 1 if they are unavailable."""
        t0 = time.perf_counter()
        if self.load(verbose="--verbose" in sys.argv) is None:
            print(f"{self.cache_name}: kernels unavailable (disabled or build failed; see the warning above)")
            return 1
        print(f"{self.cache_name}: kernels ready in {time.perf_counter() - t0:.1f} s ({self.binary.parent})")
        return 0


def _cpu_identity() -> str:
    """The first CPU's model name and feature flags (what -march=native compiles for)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    first = text.split("\n\n", 1)[0]
    keep = ("vendor_id", "cpu family", "model\t", "model name", "flags")
    return "\n".join(ln for ln in first.splitlines() if ln.startswith(keep))


def _import(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
