"""Shared prompt prefixes: the tokens a group's trajectories begin with run through the model once.

GRPO samples G completions of one prompt, so a packed micro-batch would compute the prompt's tokens G times.
With sharing, the members of a group whose first segments agree on their first P tokens are laid out as

    [prefix: P tokens] [suffix_1] [suffix_2] ... [suffix_G]          (one segment each in cu_seqlens)

and suffix_i attends to the whole prefix and causally to itself, at positions P, P + 1, ... (MicroBatch.
prefix_of[s] = the index of segment s's prefix segment, else -1). For every token of suffix_i the keys are
the ones it had unshared (the prefix, then suffix_i up to itself) at the same positions, so log-probs and
gradients are the unshared ones up to float summation order: the prefix's activations feed G suffixes and
autograd adds their G gradients, which is what G copies received before. A scored position inside the prefix
(members that also agree on their first generated tokens) maps to the one prefix copy: the head gathers it
once per member, each with that member's target and weight.

    bins = pack_shared(samples, max_tokens)         # packing.pack, a group's members kept together
    mb = share_prefixes(collate(samples_of_bin), samples_of_bin)

P is capped one short of the shortest member's first segment (every suffix keeps a token) and sharing
needs P >= MIN_SHARED_TOKENS. Only models whose attention reads every earlier token can take this layout:
the learner applies it to Hugging Face policies with the packed SDPA (model/hf_policy.py; learner.
share_prefixes). Odyssey's KDA layers would need the prefix's recurrent state handed to every suffix, which
the chunkwise kernels do not take per segment, so Odyssey micro-batches stay unshared. Micro-batches with
images or routing replay are left as they are.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch

from rl.learner.packing import MicroBatch, pack

MIN_SHARED_TOKENS = 16  # a shorter common prefix is not worth a segment of its own


def common_prefix(seqs: Sequence[np.ndarray]) -> int:
    """Length of the longest prefix every sequence in `seqs` starts with (0 for none or an empty one)."""
    if not seqs:
        return 0
    n = min(len(s) for s in seqs)
    if n == 0:
        return 0
    rows = np.stack([np.asarray(s[:n]) for s in seqs])
    differs = (rows != rows[0]).any(0)
    return int(differs.argmax()) if differs.any() else n


def _first_segment(sample) -> np.ndarray:
    """The sample's input ids up to its first context restart (the whole sample when there is none)."""
    starts = np.asarray(getattr(sample, "segment_starts", ()), dtype=np.int64)
    end = int(starts.min()) if starts.size else len(sample.input_ids)
    return np.asarray(sample.input_ids[:end])


def group_prefixes(samples: Sequence,
                   min_tokens: int = MIN_SHARED_TOKENS) -> dict[object, tuple[list[int], int]]:
    """{group: (indices into samples of its members, P)} for the groups of >= 2 members that share
    P >= min_tokens tokens (P capped one short of the shortest member's first segment)."""
    members: dict[object, list[int]] = {}
    for i, s in enumerate(samples):
        if s.group is not None:
            members.setdefault(s.group, []).append(i)
    out = {}
    for g, idx in members.items():
        if len(idx) < 2:
            continue
        firsts = [_first_segment(samples[i]) for i in idx]
        P = min(common_prefix(firsts), min(len(f) for f in firsts) - 1)
        if P >= min_tokens:
            out[g] = (idx, P)
    return out


def pack_shared(samples: Sequence, max_tokens: int, min_tokens: int = MIN_SHARED_TOKENS) -> list[list[int]]:
    """`packing.pack` of samples (objects with .n_tokens, .input_ids, .group) with each sharing group's
    members in one bin, counted at their shared size (sum of lengths - (G - 1) P); a group too big for one
    bin that way is packed member by member. Returns sample indices per bin, ascending."""
    groups = group_prefixes(samples, min_tokens)
    units: list[list[int]] = []
    sizes: list[int] = []
    grouped: set[int] = set()
    for idx, P in groups.values():
        size = sum(int(samples[i].n_tokens) for i in idx) - (len(idx) - 1) * P
        if size <= max_tokens:
            units.append(idx)
            sizes.append(size)
            grouped.update(idx)
    for i, s in enumerate(samples):
        if i not in grouped:
            units.append([i])
            sizes.append(int(s.n_tokens))
    return [sorted(i for u in b for i in units[u]) for b in pack(sizes, max_tokens)]


def share_prefixes(mb: MicroBatch, samples: Sequence, min_tokens: int = MIN_SHARED_TOKENS) -> MicroBatch:
    """`mb` (collate of `samples`, in that order) with each sharing group's common prefix laid out once
    (module docstring). Returns mb itself when nothing is shared, or when it holds images or replay."""
    if mb.images is not None or mb.replay is not None or mb.prefix_of is not None:
        return mb
    groups = group_prefixes(samples, min_tokens)
    if not groups:
        return mb
    share = {i: (g, P) for g, (idx, P) in groups.items() for i in idx}
    offsets = np.concatenate([[0], np.cumsum([len(s.input_ids) for s in samples])]).astype(np.int64)
    starts = set(offsets[:-1].tolist())
    ids = mb.input_ids.numpy()
    cu = mb.cu_seqlens.numpy().astype(np.int64)
    new_pos = np.empty(len(ids), dtype=np.int64)  # old position -> new position
    pieces: list[tuple[int, int]] = []  # old [a, b) ranges, in new order
    new_cu, prefix_of = [0], []
    prefix_seg: dict[object, tuple[int, int]] = {}  # group -> (its prefix segment, that segment's start)
    sample_of = np.searchsorted(offsets, cu[:-1], side="right") - 1

    def emit(a: int, b: int, parent: int) -> int:
        new_pos[a:b] = np.arange(new_cu[-1], new_cu[-1] + b - a)
        pieces.append((a, b))
        new_cu.append(new_cu[-1] + b - a)
        prefix_of.append(parent)
        return len(prefix_of) - 1

    for a, b, i in zip(cu[:-1].tolist(), cu[1:].tolist(), sample_of.tolist()):
        if a not in starts or i not in share:
            emit(a, b, -1)
            continue
        g, P = share[i]
        if g not in prefix_seg:  # the group's first member in this micro-batch lays the prefix down
            start = new_cu[-1]
            prefix_seg[g] = (emit(a, a + P, -1), start)
        else:  # later members read the one copy
            new_pos[a:a + P] = np.arange(prefix_seg[g][1], prefix_seg[g][1] + P)
        emit(a + P, b, prefix_seg[g][0])
    new_ids = np.concatenate([ids[a:b] for a, b in pieces])
    return dataclasses.replace(
        mb,
        input_ids=torch.from_numpy(new_ids),
        cu_seqlens=torch.tensor(new_cu, dtype=torch.int32),
        scored_pos=torch.from_numpy(new_pos[mb.scored_pos.numpy()]),
        prefix_of=torch.tensor(prefix_of, dtype=torch.int64),
    )


__all__ = ["MIN_SHARED_TOKENS", "common_prefix", "group_prefixes", "pack_shared", "share_prefixes"]
