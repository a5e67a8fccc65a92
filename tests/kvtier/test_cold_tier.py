"""A cold tier plugs in with one class and one registration line (`kvtier.cache.coldtier`).

`PeerL2` below stands for another host's host RAM: an in-memory map of chunk bytes. Registered
after L2, it is handed every chunk the cache stores (`write`), and a restore asks it before L3
for every chunk L2 no longer holds. Nothing in the restore or commit code knows of it.
"""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import MODELS
from test_cache_exact import TURNS, config, greedy, reference

from kvtier import TieredCache
from kvtier.cache.directory import Chunk
from kvtier.cache.restoreplan import TierReads
from kvtier.errors import ChunkNotFound, ConfigError
from kvtier.types import Tier


class PeerL2:
    """Chunks kept in a dict, by key; a read copies one into its L2 slot at once."""

    tier = "peer"

    def __init__(self, cache: TieredCache) -> None:
        self.directory = cache.directory
        self.arena = cache.l2
        self.engine = cache.engine
        self.payload = cache.codec.payload_bytes
        self.chunks: dict[bytes, bytes] = {}
        self.tokens: dict[bytes, int] = {}
        self.failing = False  # reads fail, as from a peer that went away
        self.observed: list[tuple[int, int]] = []  # (usable bytes, failed reads) per restore

    def holds(self, key: bytes) -> int | None:
        return self.tokens.get(key)

    def start_read(self, e: Chunk, reads: TierReads) -> Future[Any] | None:
        def fetch(slot: int) -> Future[Any]:
            fut: Future[Any] = Future()
            data = self.chunks.get(e.key)
            if self.failing or data is None:
                self.tokens.pop(e.key, None)  # gone: not asked for again
                fut.set_exception(ChunkNotFound(e.key.hex()))
                return fut
            view = memoryview(self.arena.buffer(slot)).cast("B")
            view[: len(data)] = data
            fut.set_result(None)
            return fut

        return self.directory.start_fetch(e, fetch, self)

    def launch(self, reads: TierReads, tenant: str) -> None:
        pass  # each read is done when `start_read` returns

    def write(self, e: Chunk) -> None:
        assert e.l2_slot is not None
        self.engine.synchronize()  # the slot's copy down from L1 has landed
        view = memoryview(self.arena.buffer(e.l2_slot)).cast("B")
        self.chunks[e.key] = bytes(view[: self.payload(e.tokens)])
        self.tokens[e.key] = e.tokens

    def observe(self, reads: TierReads, nbytes: int, t_read: float, t_copy: float) -> None:
        self.observed.append((nbytes, reads.failed))


def to_cold(cache: TieredCache, s: Any) -> None:
    """Hibernate the session and drop L2's copies (L3 holds them): L2 misses every chunk."""
    s.hibernate()
    cache.evict_l2()


def turn(cache: TieredCache, model: Any, ids: torch.Tensor) -> tuple[str, int, Any, Any]:
    """One turn of session "s1" on `ids`, checked against a full recompute, then hibernated to
    the cold tiers: the restore's source, the tokens it restored, the greedy steps' scores and
    the tokens after them."""
    s = cache.session("s1", tenant="t")
    pkv = s.restore(ids)
    restored = pkv.get_seq_length()
    seq, scores = greedy(model, ids, pkv)
    s.commit(seq)
    ref_seq, ref_scores = reference(model, ids)
    assert torch.equal(seq, ref_seq)
    torch.testing.assert_close(scores, ref_scores, atol=1e-5, rtol=0)
    to_cold(cache, s)
    return s.restore_source, restored, scores, seq


def turns(cache: TieredCache, model: Any) -> list[tuple[str, int, Any]]:
    """The turns of `TURNS` one after the other (`turn`)."""
    ids = torch.tensor([[1]], dtype=torch.long)
    out = []
    for new in TURNS:
        src, restored, scores, ids = turn(cache, model, torch.cat([ids, torch.tensor([new])], 1))
        out.append((src, restored, scores))
    return out


@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_session_comes_back_from_a_tier_registered_in_one_line(tmp_path: Path, name: str):
    model = MODELS[name]()
    cache = TieredCache(config(tmp_path / "a"), model)
    peer = PeerL2(cache)
    cache.tiers.register(peer, after=Tier.L2)
    got = turns(cache, model)
    snap = cache.stats()
    cache.close()
    assert [src for src, _, _ in got[1:]] == ["peer"] * (len(TURNS) - 1)
    assert all(n > 0 for _, n, _ in got[1:])
    assert peer.chunks and all(failed == 0 for _, failed in peer.observed)
    assert sum(nbytes for nbytes, _ in peer.observed) > 0
    assert dict(snap.restore_decisions)["peer"] == len(TURNS) - 1

    # the same turns from L3 (no peer) load the same bytes: the same scores, bit for bit
    plain = TieredCache(config(tmp_path / "b"), model)
    want = turns(plain, model)
    plain.close()
    assert [src for src, _, _ in want[1:]] == ["l3"] * (len(TURNS) - 1)
    for (_, n_got, s_got), (_, n_want, s_want) in zip(got, want, strict=True):
        assert n_got == n_want
        assert torch.equal(s_got, s_want)


def test_a_failed_read_from_a_registered_tier_is_recomputed(tmp_path: Path) -> None:
    model = MODELS["llama"]()
    cache = TieredCache(config(tmp_path), model)
    peer = PeerL2(cache)
    cache.tiers.register(peer, after=Tier.L2)
    ids = torch.tensor([[1, *TURNS[0]]])
    src, _, _, seq = turn(cache, model, ids)  # stored in L2, the peer and L3; then out of L2
    assert src == "recompute" and peer.chunks
    peer.failing = True
    # the prefix ends at the first chunk that failed to read: recomputed from there, exactly
    src, restored, _, seq = turn(cache, model, torch.cat([seq, torch.tensor([TURNS[1]])], 1))
    assert (src, restored) == ("recompute", 0)
    assert peer.observed[-1][1] > 0  # the failed reads, told to the tier
    # the peer forgot what failed, and L3 still holds it: the next restore finds it there
    peer.failing = False
    src, restored, _, _ = turn(cache, model, torch.cat([seq, torch.tensor([TURNS[2]])], 1))
    assert src == "l3" and restored > 0
    cache.close()


def test_registering_checks_the_name_and_the_cost_models_estimate(tmp_path: Path) -> None:
    model = MODELS["llama"]()
    with (
        TieredCache(config(tmp_path / "a"), model) as cache,
        pytest.raises(ValueError, match="registered already"),
    ):
        cache.tiers.register(cache.tiers[Tier.L3])
    with TieredCache(config(tmp_path / "b", cost_model=True), model) as cache:
        with pytest.raises(ConfigError, match="initial_bandwidth"):
            cache.tiers.register(PeerL2(cache))
        assert [t.tier for t in cache.tiers] == [Tier.L2, Tier.L3]
    bandwidth = {"l1": 200e9, "l2": 10e9, "l3": 1e9, "peer": 5e9}
    with TieredCache(
        config(tmp_path / "c", cost_model=True, initial_bandwidth=bandwidth), model
    ) as cache:
        cache.tiers.register(PeerL2(cache), after=Tier.L2)
        assert [t.tier for t in cache.tiers] == [Tier.L2, "peer", Tier.L3]
