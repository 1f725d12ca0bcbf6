"""glibc's malloc and long sequences: keep large freed blocks going back to the OS.

glibc serves an allocation above M_MMAP_THRESHOLD with its own mmap and returns it to the OS on free, but by
default it raises that threshold to the size of every mmapped block freed (up to 32 MiB). After the first
few windows of a sequence-chunked step, the windows' activations (each a few MiB) then come from the heap,
interleaved with the small tensors that live on (latents, carried states, per-token results), and the heap
cannot shrink: measured on `tiny` in windows of 1024 tokens, peak RSS grew by ~13 KiB per token of the
sequence instead of ~2 KiB (bench/long.py, docs/long_context.md). Fixing the threshold (which also turns the
dynamic adjustment off) keeps the memory of the step linear with the slope of what it really holds.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

M_MMAP_THRESHOLD = -3  # mallopt parameter (malloc.h)
MMAP_THRESHOLD_BYTES = 1 << 17  # glibc's initial default: blocks of 128 KiB and more are mmapped


def fix_mmap_threshold(nbytes: int = MMAP_THRESHOLD_BYTES) -> bool:
    """mallopt(M_MMAP_THRESHOLD, nbytes) in this process. True if applied (Linux with glibc), else False."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(M_MMAP_THRESHOLD, int(nbytes)))
    except (OSError, AttributeError):
        return False


__all__ = ["fix_mmap_threshold"]
