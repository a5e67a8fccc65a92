"""Sessions in memory are bounded (`max_sessions`, `session_idle_s`): an idle session past
either is hibernated and forgotten from memory, and its next turn finds it in L3 again."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from conftest import tiny_llama
from test_cache_exact import greedy, reference
from test_cache_lifecycle import cfg

from kvtier import TieredCache
from kvtier.geometry import KVGeometry
from kvtier.integrations.hf import cache_kwarg
from kvtier.paged import PagePool
from kvtier.types import SessionState


def ids_of(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 250, (1, n), generator=g)


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


def turn(model, cache: TieredCache, sid: str, ids: torch.Tensor, pool: PagePool | None = None):
    """One turn; returns the session and the tokens its restore took from the cache."""
    s = cache.session(sid, tenant="t")
    pkv = s.restore(ids) if pool is None else s.restore(ids, pool=pool)
    cached = pkv.get_seq_length()
    with torch.no_grad():
        model(ids[:, cached:], **{cache_kwarg(model): pkv})
    s.commit(ids)
    return s, cached


def _names(cache: TieredCache) -> set[str]:
    return {s.session_id for s in cache.sessions()}


@pytest.mark.parametrize("paged", [False, True], ids=["l1", "pages"])
def test_sessions_past_the_max_leave_memory_and_resume_from_l3(
    tmp_path: Path, model, paged: bool
) -> None:
    cache = TieredCache(cfg(tmp_path, max_sessions=16), model)
    forgotten: list[tuple[str, str]] = []
    cache.on_forget(lambda sid, tenant: forgotten.append((tenant, sid)))
    pool = None
    if paged:
        g = KVGeometry.from_config(model.config)
        pool = PagePool(g, 8192 * g.bytes_per_token, page_size=4, dtype=torch.float32)
    history = {}
    for i in range(60):
        history[f"s{i}"] = ids_of(40 + i % 7, i)
        turn(model, cache, f"s{i}", history[f"s{i}"], pool)
        assert len(cache.sessions()) <= 16
    assert "s0" not in _names(cache) and ("t", "s0") in forgotten
    assert cache.find_session("s0", "t") is None
    if pool is not None:  # a forgotten session's pages went back to the pool
        held = pool.num_pages - pool.num_free
        assert held <= 16 * pool.pages_for(47)
    # its next turn: the record from L3, every token it had (partial tail included)
    more = torch.cat([history["s0"], ids_of(5, 99)], 1)
    s = cache.session("s0", tenant="t")
    assert s.state is SessionState.HIBERNATED and len(s.tokens) == history["s0"].shape[1]
    pkv = s.restore(more) if pool is None else s.restore(more, pool=pool)
    assert pkv.get_seq_length() == history["s0"].shape[1]
    assert s.restore_source in ("l2", "l3")
    seq, scores = greedy(model, more, pkv)
    ref_seq, ref_scores = reference(model, more)
    assert torch.equal(seq, ref_seq)
    torch.testing.assert_close(scores, ref_scores, atol=1e-5, rtol=0)
    s.commit(seq)
    assert len(cache.sessions()) <= 16
    cache.close()


def test_an_idle_session_leaves_memory_after_the_ttl_with_no_call(tmp_path: Path, model) -> None:
    cache = TieredCache(cfg(tmp_path, session_idle_s=0.2), model)
    ids = ids_of(50, 1)
    s, _ = turn(model, cache, "a", ids)
    assert s.resident
    deadline = time.monotonic() + 10
    while cache.find_session("a", "t") is not None:  # the upkeep thread forgets it
        assert time.monotonic() < deadline, "an idle session stayed in memory past its TTL"
        time.sleep(0.05)
    assert not s.resident and cache.l1.used_bytes == 0  # its L1 is free
    # a handle kept across the forgetting still works: its restore puts it back
    pkv = s.restore(torch.cat([ids, ids_of(3, 2)], 1))
    assert pkv.get_seq_length() == 50 and cache.find_session("a", "t") is s
    s.abort()
    cache.close()


def test_a_restart_loads_the_most_recent_sessions_and_finds_the_rest(tmp_path: Path, model) -> None:
    cache = TieredCache(cfg(tmp_path), model)
    for i in range(12):
        turn(model, cache, f"h{i}", ids_of(30 + i, i))[0].hibernate()
        time.sleep(0.01)  # distinct last_active
    cache.close()
    again = TieredCache(cfg(tmp_path, max_sessions=5), model)
    assert _names(again) == {f"h{i}" for i in range(7, 12)}
    found = again.find_sessions("h0")  # an admin's lookup: L3 too
    assert [(s.tenant, len(s.tokens)) for s in found] == [("t", 30)]
    assert again.find_sessions("h0", "other") == []
    s, cached = turn(model, again, "h1", torch.cat([ids_of(31, 1), ids_of(4, 7)], 1))
    assert cached == 31 and s.restore_source == "l3"
    assert len(again.sessions()) <= 5
    again.close()


def test_serve_settings_reach_the_cache(tmp_path: Path) -> None:
    """`--session-ttl-s`, `--max-sessions`, `--l3-write-bound-s` (flags, KVTIER_*, TOML)."""
    from kvtier.errors import ConfigError
    from kvtier.server.backend import TieredBackend
    from kvtier.server.config import ServerConfig
    from kvtier.server.devices.model import build_default

    default = ServerConfig.load({}, env={})
    assert (default.session_ttl_s, default.max_sessions, default.l3_write_bound_s) == (
        3600.0,
        10_000,
        5.0,
    )
    env = {"KVTIER_MAX_SESSIONS": "7", "KVTIER_L3_WRITE_BOUND_S": "2"}
    cfg = ServerConfig.load({"session_ttl_s": 60, "l3_root": str(tmp_path / "l3")}, env=env)
    backend = TieredBackend(build_default("cpu").model, cfg, "bounded")
    try:
        c = backend.cache.config
        assert (c.session_idle_s, c.max_sessions, c.l3_write_bound_s) == (60.0, 7, 2.0)
    finally:
        backend.close()
    off = ServerConfig.load(
        {"session_ttl_s": 0, "max_sessions": 0, "l3_root": str(tmp_path)}, env={}
    )
    backend = TieredBackend(build_default("cpu").model, off, "unbounded")
    try:
        assert (backend.cache.config.session_idle_s, backend.cache.config.max_sessions) == (
            None,
            None,
        )
    finally:
        backend.close()
    with pytest.raises(ConfigError, match="max_sessions"):
        ServerConfig.load({"max_sessions": -1}, env={})
    with pytest.raises(ConfigError, match="l3_write_bound_s"):
        ServerConfig.load({"l3_write_bound_s": 0}, env={})
