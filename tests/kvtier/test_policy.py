"""One contract suite, run over every eviction policy: policies are small pure objects, and
each must keep the same contract."""

from __future__ import annotations

import random

import pytest

from kvtier.policy import LFU, LRU, POLICIES, make_policy


@pytest.fixture(params=sorted(POLICIES))
def policy(request: pytest.FixtureRequest):
    return make_policy(request.param)


def test_empty_has_no_victim(policy) -> None:
    assert policy.victim() is None
    assert len(policy) == 0


def test_victim_is_tracked_and_not_removed(policy) -> None:
    for k in "abc":
        policy.touch(k)
    v = policy.victim()
    assert v in {"a", "b", "c"}
    assert v in policy and len(policy) == 3  # victim() only names, the caller removes


def test_remove_and_unknown_remove(policy) -> None:
    policy.touch("a")
    policy.remove("a")
    policy.remove("never-seen")
    assert "a" not in policy and policy.victim() is None


def test_exclude_is_respected(policy) -> None:
    for k in "abc":
        policy.touch(k)
    assert policy.victim(exclude={"a", "b", "c"}) is None
    assert policy.victim(exclude={"a", "b"}) == "c"


def test_draining_evicts_every_key_once(policy) -> None:
    rng = random.Random(7)
    keys = [f"k{i}" for i in range(200)]
    for _ in range(2000):
        policy.touch(rng.choice(keys))
    seen = set()
    while (v := policy.victim()) is not None:
        assert v not in seen
        seen.add(v)
        policy.remove(v)
    assert len(policy) == 0 and seen <= set(keys)


def test_lru_order() -> None:
    p = LRU()
    for k in "abc":
        p.touch(k)
    p.touch("a")
    assert p.victim() == "b"


def test_lfu_order_and_tiebreak() -> None:
    p = LFU()
    for k in "aabbc":
        p.touch(k)
    assert p.victim() == "c"
    p.touch("c")
    p.touch("c")  # c: 3 uses, a: 2 (older), b: 2 (newer)
    assert p.victim() == "a"


def test_unknown_policy_error_names_choices() -> None:
    with pytest.raises(ValueError, match="lfu"):
        make_policy("mru")
