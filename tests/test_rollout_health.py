"""`rl.rollout.health.InfraGuard`: the stop rule on infra errors, and `odyssey rollout`'s use of it."""

from __future__ import annotations

import pytest

from rl.rollout.health import BatchUnhealthy, InfraGuard


def test_guard_stops_only_when_an_env_fails_on_more_than_the_fraction():
    guard = InfraGuard(0.5)
    assert guard.verdict({"a": 4}, {"a": 8}) is None  # exactly half: not "most"
    assert "'a' ended 5 of the batch's 8" in guard.verdict({"a": 5}, {"a": 8})
    assert guard.verdict({"a": 5, "b": 0}, {"a": 10, "b": 10}) is None  # per env
    assert guard.verdict({"b": 6}, {"a": 10, "b": 10}) is not None
    assert guard.verdict({"a": 3}, {}) is None and guard.verdict({}, {"a": 0}) is None
    assert InfraGuard(1.0).verdict({"a": 8}, {"a": 8}) is None  # 1.0 never stops
    with pytest.raises(BatchUnhealthy, match=r"Sources: env 5 \(env: the env's own code.*First errors: x"):
        guard.check({"a": 5}, {"a": 8}, ["x"], {"env": 5})
    for bad in (0.0, -1, 1.5):
        with pytest.raises(ValueError, match="max_fraction"):
            InfraGuard(bad)


def test_guard_is_monotone_in_partial_counts():
    """Called on partial counts during a batch, it never stops a batch the final counts would keep."""
    guard = InfraGuard(0.5)
    planned = {"a": 10}
    for final in range(11):
        stops = [guard.verdict({"a": k}, planned) is not None for k in range(final + 1)]
        assert any(stops) == (guard.verdict({"a": final}, planned) is not None)
