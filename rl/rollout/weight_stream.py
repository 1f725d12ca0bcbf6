"""The engines' side of a bucketed weight sync (rl/learner/shard_export.py): check the manifest's names before
anything is loaded, then check each bucket as it arrives.

    check_weight_names(names, engine_keys)           # ValueError naming what is missing / unexpected
    for bucket in checked_buckets(names, buckets):   # ValueError on a name outside `names` or seen twice,
        load(bucket)                                 # and when the stream ends before every name came

A stream that fails part-way leaves the engine partly loaded: the engines then keep their old version number
and the sync reports the worker as failed (rl/train/weight_sync.py replaces it).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence

import torch


def check_weight_names(names: Sequence[str], expected: Collection[str]) -> None:
    """`names` (a sync's every key) must be exactly the engine's keys `expected`, each once."""
    got = set(names)
    missing, unexpected = sorted(set(expected) - got), sorted(got - set(expected))
    if missing or unexpected:
        raise ValueError(f"update_weights_stream: the buckets' names do not match the model: "
                         f"missing={missing[:5]} unexpected={unexpected[:5]} (stream the state_dict of the "
                         "same model and config)")
    if len(got) != len(names):
        twice = sorted(n for n, c in Counter(names).items() if c > 1)
        raise ValueError(f"update_weights_stream: names listed twice in the manifest: {twice[:5]}")


def checked_buckets(names: Sequence[str], buckets: Iterable[Mapping[str, torch.Tensor]]
                    ) -> Iterator[Mapping[str, torch.Tensor]]:
    """Yield `buckets` unchanged, refusing a bucket that holds a name outside `names` or one already loaded,
    and raising at the end if some of `names` never came."""
    want, seen = set(names), set()
    for i, bucket in enumerate(buckets):
        keys = set(bucket)
        extra, twice = sorted(keys - want), sorted(keys & seen)
        if extra or twice:
            raise ValueError(f"update_weights_stream: bucket {i} holds names outside the manifest "
                             f"{extra[:5]} or already loaded {twice[:5]}")
        seen |= keys
        yield bucket
    if seen != want:
        raise ValueError(f"update_weights_stream: the buckets ended with {len(want - seen)} of the "
                         f"manifest's names not loaded, e.g. {sorted(want - seen)[:5]}")


__all__ = ["check_weight_names", "checked_buckets"]
