"""L4, the shared tier on Redis: a session hibernated on one host resumes on another.

Every test runs a real redis-server on a free loopback port (tests/kvtier/redis_server.py)
and real TieredCaches with separate L3 roots; the model is a tiny Llama with random weights.
"""

from __future__ import annotations

import threading
import time
from array import array
from pathlib import Path

import pytest
import torch
from conftest import tiny_llama
from redis_server import RedisServer, free_port, need_redis
from transformers import DynamicCache

from kvtier import CacheConfig, TieredCache
from kvtier.cache.keys import ZERO_KEY, chunk_key, namespace
from kvtier.integrations.hf import cache_kwarg
from kvtier.tiers.l3 import SessionRecord
from kvtier.tiers.l4 import codec, keys

CHUNK = 16
L4_KEYS = {
    "up",
    "shards",  # a cluster's primaries: replicas, hits, misses ([] on one server)
    "breaker",
    "bytes_written",
    "bytes_read",
    "hits",
    "misses",
    "errors",
    "writes_shed",
    "get_seconds_sum",
    "get_count",
    "put_seconds_sum",
    "put_count",
    "url",
}


@pytest.fixture
def redis_server(tmp_path: Path):
    need_redis()
    srv = RedisServer(tmp_path / "redis")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


def config(root: Path, url: str | None = None, **kw) -> CacheConfig:
    base = dict(
        l3_root=root,
        l1_bytes=64 << 20,
        l2_bytes=16 << 20,
        chunk_tokens=CHUNK,
        cost_model=False,  # always load: these tests check the loaded bytes
        pin_memory=False,
        l4_url=url,
        l4_health_s=0.1,
        l4_backoff_s=0.2,
    )
    base.update(kw)
    return CacheConfig(**base)


def greedy(model, ids: torch.Tensor, pkv, steps: int = 5):
    out = model.generate(
        ids,
        **{cache_kwarg(model): pkv},
        max_new_tokens=steps,
        do_sample=False,
        output_scores=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    return out.sequences, torch.stack(out.scores)


def turn(model, cache: TieredCache, sid: str, ids: torch.Tensor, tenant: str = "t"):
    """One greedy turn on `cache`, checked against a full recompute; returns
    (sequence, restore_source, tokens restored)."""
    s = cache.session(sid, tenant=tenant)
    pkv = s.restore(ids)
    restored = pkv.get_seq_length()
    seq, scores = greedy(model, ids, pkv)
    s.commit(seq)
    ref_seq, ref_scores = greedy(model, ids, DynamicCache())
    assert torch.equal(seq, ref_seq), "tokens differ from a full recompute"
    torch.testing.assert_close(scores, ref_scores, atol=1e-5, rtol=0)
    return seq, s.restore_source, restored


def prompt(n: int, seed: int = 0) -> torch.Tensor:
    return torch.tensor([[(i * 7 + seed * 13) % 250 + 1 for i in range(n)]])


def hibernate_to_l4(cache: TieredCache, sid: str, tenant: str = "t") -> None:
    cache.session(sid, tenant=tenant).hibernate()
    assert cache.l4 is not None and cache.l4.wait_idle(30)


def test_session_hibernated_on_one_host_resumes_on_another(tmp_path: Path, model, redis_server):
    a = TieredCache(config(tmp_path / "a", redis_server.url), model)
    b = TieredCache(config(tmp_path / "b", redis_server.url), model)
    try:
        seq, src, _ = turn(model, a, "s1", prompt(70))
        assert src == "recompute"
        hibernate_to_l4(a, "s1")
        ids = torch.cat([seq, torch.tensor([[3, 4, 5]])], dim=1)
        seq, src, restored = turn(model, b, "s1", ids)
        assert src == "l4"
        assert restored == 74  # 70 + 5 generated, less the last token (computed)
        snap = b.stats()
        assert set(snap.l4) == L4_KEYS
        assert snap.l4["hits"] == 5 and snap.l4["up"] and snap.l4["breaker"] == "closed"
        assert snap.tier("l4").hits == 5
        assert dict(snap.restore_decisions)["l4"] == 1
        assert snap.moved_sessions == 1  # A served it last: a move
        assert a.stats().l4["put_count"] == 5  # 4 full chunks + the tail
        assert a.stats().moved_sessions == 0  # A opened it new
        # B hibernates the longer session (writing only its new chunks); a third host
        # resumes it from chunks written by A and by B
        hibernate_to_l4(b, "s1")
        assert b.stats().l4["put_count"] == 2  # the 5th full chunk and the new tail
        with TieredCache(config(tmp_path / "c", redis_server.url), model) as c:
            ids = torch.cat([seq, torch.tensor([[9, 9]])], dim=1)
            _, src, restored = turn(model, c, "s1", ids)
            assert src == "l4" and restored == seq.shape[1] - 1  # what B held
    finally:
        a.close()
        b.close()


def test_stats_without_l4_say_none(tmp_path: Path, model) -> None:
    with TieredCache(config(tmp_path / "a", None), model) as c:
        snap = c.stats()
        assert snap.l4 is None and snap.tier("l4") is None


def test_a_corrupted_value_is_recomputed(tmp_path: Path, model, redis_server) -> None:
    a = TieredCache(config(tmp_path / "a", redis_server.url), model)
    b = TieredCache(config(tmp_path / "b", redis_server.url), model)
    try:
        seq, _, _ = turn(model, a, "s1", prompt(70))
        hibernate_to_l4(a, "s1")
        first = a.session("s1", tenant="t").chunk_keys[0]
        r = redis_server.client()
        name = keys.chunk(first)
        byte = r.getrange(name, 5000, 5000)
        r.setrange(name, 5000, bytes([byte[0] ^ 0xFF]))  # one payload byte flipped
        ids = torch.cat([seq, torch.tensor([[3]])], dim=1)
        _, src, restored = turn(model, b, "s1", ids)
        assert src == "recompute" and restored == 0
        snap = b.stats()
        assert snap.l4["errors"] == 1 and snap.checksum_failures >= 1
        assert not r.exists(name)  # the damaged value is deleted, never served again
    finally:
        a.close()
        b.close()


def test_killing_redis_mid_restore_recomputes(tmp_path: Path, model, redis_server) -> None:
    url = redis_server.url
    a = TieredCache(config(tmp_path / "a", url, l4_timeout_s=10.0), model)
    b = TieredCache(config(tmp_path / "b", url, l4_timeout_s=10.0, l4_backoff_s=30.0), model)
    try:
        seq, _, _ = turn(model, a, "s1", prompt(70))
        hibernate_to_l4(a, "s1")
        b.session("s1", tenant="t")  # found in L4: the restore will read its chunks there
        redis_server.client().client_pause(5000)  # every reply waits: the restore is mid-read
        ids = torch.cat([seq, torch.tensor([[3]])], dim=1)
        box: dict = {}

        def run() -> None:
            try:
                box["out"] = turn(model, b, "s1", ids)
            except BaseException as exc:  # the test fails below on any exception
                box["exc"] = exc

        t = threading.Thread(target=run)
        t.start()
        time.sleep(0.5)
        redis_server.kill()
        t.join(60)
        assert not t.is_alive()
        assert "exc" not in box, box.get("exc")
        _, src, restored = box["out"]
        assert src == "recompute" and restored == 0
        snap = b.stats()
        assert snap.l4["breaker"] == "open" and not snap.l4["up"] and snap.l4["errors"] >= 1
        # with the breaker open, sessions and restores skip L4 at once and stay exact
        t0 = time.perf_counter()
        _, src, _ = turn(model, b, "s2", prompt(40, seed=3))
        assert src == "recompute" and time.perf_counter() - t0 < 5
    finally:
        a.close()
        b.close()


def test_redis_down_from_the_start_degrades_to_l3(tmp_path: Path, model) -> None:
    need_redis()
    url = f"redis://:secret@127.0.0.1:{free_port()}/0"  # nothing listens there
    with TieredCache(config(tmp_path / "a", url), model) as a:
        seq, src, _ = turn(model, a, "s1", prompt(40))
        a.session("s1", tenant="t").hibernate()
        a.evict_l2()
        _, src, restored = turn(model, a, "s1", torch.cat([seq, torch.tensor([[1]])], 1))
        assert src == "l3" and restored == seq.shape[1] - 1
        snap = a.stats()
        assert snap.l4["up"] is False and snap.l4["breaker"] in ("open", "half_open")
        assert "secret" not in snap.l4["url"] and snap.l4["url"].startswith("redis://127.0.0.1:")


def test_a_redis_restart_loses_nothing_l3_holds(tmp_path: Path, model, redis_server) -> None:
    a = TieredCache(config(tmp_path / "a", redis_server.url), model)
    try:
        seq, _, _ = turn(model, a, "s1", prompt(50))
        hibernate_to_l4(a, "s1")
        time.sleep(0.3)  # A's health check has seen this Redis
        redis_server.kill()
        redis_server.start()  # empty: no persistence
        deadline = time.monotonic() + 20
        r = redis_server.client()
        while time.monotonic() < deadline and not r.keys("kvtier:s:*"):
            time.sleep(0.1)  # A notices the new run_id and writes its sessions again
        assert r.keys("kvtier:s:*"), "the hibernated session was not written again"
        assert a.l4 is not None and a.l4.wait_idle(30)
        with TieredCache(config(tmp_path / "b", redis_server.url), model) as b:
            ids = torch.cat([seq, torch.tensor([[2]])], dim=1)
            _, src, restored = turn(model, b, "s1", ids)
            assert src == "l4" and restored == seq.shape[1] - 1
    finally:
        a.close()


def test_tenants_are_isolated_in_l4(tmp_path: Path, model, redis_server) -> None:
    a = TieredCache(config(tmp_path / "a", redis_server.url), model)
    b = TieredCache(config(tmp_path / "b", redis_server.url), model)
    try:
        seq, _, _ = turn(model, a, "same-id", prompt(60), tenant="a")
        hibernate_to_l4(a, "same-id", tenant="a")
        # the same session id under another tenant finds nothing
        _, src, restored = turn(model, b, "same-id", prompt(60, seed=5), tenant="b")
        assert src == "recompute" and restored == 0
        # a record of tenant a planted under tenant b's key is refused, and so are its chunks
        r = redis_server.client()
        fp = a.fingerprint
        r.set(keys.record(fp, "b", "planted"), r.get(keys.record(fp, "a", "same-id")))
        s = b.session("planted", tenant="b")
        assert s.tokens == () and b.stats().l4["errors"] == 1
        # tenant a's chunk copied under tenant b's chunk key, named by a valid record of
        # tenant b, fails the tenant check of the chunk's header
        sa = a.session("same-id", tenant="a")
        toks = seq[0, :CHUNK].tolist()
        kb = chunk_key(ZERO_KEY, toks, namespace(fp, "b"))
        r.set(keys.chunk(kb), r.get(keys.chunk(sa.chunk_keys[0])))
        rec = SessionRecord(
            "stolen",
            "b",
            fp,
            array("i", toks).tobytes(),
            (kb,),
            False,
            None,
            time.time(),
            "hibernated",
        )
        r.set(keys.record(fp, "b", "stolen"), codec.pack_record(rec))
        ids = torch.cat([seq[:, :CHUNK], torch.tensor([[5, 6]])], dim=1)
        _, src, restored = turn(model, b, "stolen", ids, tenant="b")
        assert restored == 0 and src == "recompute"
        assert b.stats().l4["errors"] == 2
    finally:
        a.close()
        b.close()


def test_write_behind_sheds_when_its_queue_is_full(tmp_path: Path, model, redis_server) -> None:
    cfg = config(tmp_path / "a", redis_server.url, l4_write_queue=6, l4_min_idle_s=3600)
    with TieredCache(cfg, model) as a:
        turn(model, a, "s1", prompt(70))  # 5 chunks
        a.session("s1", tenant="t").hibernate()  # queued (for an hour)
        turn(model, a, "s2", prompt(70, seed=1))  # 5 more: past the 6 the queue holds
        a.session("s2", tenant="t").hibernate()
        snap = a.stats()
        assert snap.l4["writes_shed"] == 5 and snap.l4["put_count"] == 0
        assert not redis_server.client().keys("kvtier:*")
    # closing writes what is queued (from L3) and nothing that was shed
    r = redis_server.client()
    assert r.exists(keys.record(a.fingerprint, "t", "s1"))
    assert not r.exists(keys.record(a.fingerprint, "t", "s2"))


def test_a_session_longer_than_the_queue_goes_when_nothing_waits(
    tmp_path: Path, model, redis_server
) -> None:
    with TieredCache(config(tmp_path / "a", redis_server.url, l4_write_queue=2), model) as a:
        turn(model, a, "s1", prompt(70))  # 5 chunks, the queue holds 2
        hibernate_to_l4(a, "s1")
        assert a.stats().l4["put_count"] == 5 and a.stats().l4["writes_shed"] == 0


def test_min_idle_writes_only_sessions_that_stay_hibernated(
    tmp_path: Path, model, redis_server
) -> None:
    cfg = config(tmp_path / "a", redis_server.url, l4_min_idle_s=0.5)
    with TieredCache(cfg, model) as a:
        seq, _, _ = turn(model, a, "busy", prompt(40))
        a.session("busy", tenant="t").hibernate()
        turn(model, a, "busy", torch.cat([seq, torch.tensor([[1]])], 1))  # back before 0.5 s
        turn(model, a, "quiet", prompt(40, seed=1))
        a.session("quiet", tenant="t").hibernate()
        assert a.l4 is not None and a.l4.wait_idle(30)
        r = redis_server.client()
        fp = a.fingerprint
        assert r.exists(keys.record(fp, "t", "quiet"))
        assert not r.exists(keys.record(fp, "t", "busy"))


def wide_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=256,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=4096,
    )
    return LlamaForCausalLM(cfg).eval().to(torch.float32)


def test_maxmemory_churn_never_serves_wrong_kv(tmp_path: Path, redis_server) -> None:
    """64 MB of allkeys-lru Redis under 160 MB of sessions: evicted chunks are misses (the
    restore recomputes from there), every restored prefix is exact, and the sessions written
    last are served from L4."""
    r = redis_server.client()
    r.config_set("maxmemory", "64mb")
    r.config_set("maxmemory-policy", "allkeys-lru")
    r.config_set("maxmemory-samples", "10")
    big = wide_llama()  # 4 layers x 4 KV heads x 64 dims x fp32: 8 KiB a token
    # l4_timeout_s: a busy machine is slow, not down
    cfg = dict(chunk_tokens=256, l1_bytes=64 << 20, l2_bytes=24 << 20, l4_timeout_s=20.0)
    n_sessions, length = 20, 4 * 256 + 8  # 4 chunks of 2 MiB and a tail each: 160 MiB in all
    a = TieredCache(config(tmp_path / "a", redis_server.url, **cfg), big)
    # B writes nothing back within the test (selective policy), so only A's writes churn
    b = TieredCache(config(tmp_path / "b", redis_server.url, l4_min_idle_s=3600, **cfg), big)
    try:
        prompts = [
            torch.randint(1, 250, (1, length), generator=torch.Generator().manual_seed(i))
            for i in range(n_sessions)
        ]
        for i, ids in enumerate(prompts):
            s = a.session(f"s{i}", tenant="t")
            pkv = s.restore(ids)
            with torch.no_grad():
                big(ids[:, pkv.get_seq_length() :], **{cache_kwarg(big): pkv})
            s.commit(ids)
            hibernate_to_l4(a, f"s{i}")
        used = redis_server.client().info("memory")
        assert used["used_memory"] <= 70 << 20
        served = []
        for i, ids in enumerate(prompts):
            full = torch.cat([ids, torch.tensor([[7]])], dim=1)
            s = b.session(f"s{i}", tenant="t")
            pkv = s.restore(full)
            restored = pkv.get_seq_length()
            with torch.no_grad():
                out = big(full[:, restored:], **{cache_kwarg(big): pkv})
                ref = big(full)
            torch.testing.assert_close(out.logits[0, -1], ref.logits[0, -1], atol=1e-4, rtol=0)
            s.commit(full)
            s.hibernate()
            served.append(restored)
        hits = sum(1 for n in served if n > 0)
        # Redis's LRU is approximate, a value takes a 2.5 MiB allocation for its 2 MiB and the
        # replies of B's GETs count against maxmemory too (they can evict even the newest
        # session while B reads the older ones): some sessions come back, at least one whole
        stats = b.stats().l4
        assert hits >= 2 and max(served) >= 4 * 256, str((served, stats))
        assert stats["hits"] >= stats["misses"], str((served, stats))
        assert hits < n_sessions, served  # churn did evict: a miss, never an error
        assert b.stats().l4["errors"] == 0
    finally:
        a.close()
        b.close()


def test_l4_url_reaches_the_server_cache(tmp_path: Path, redis_server) -> None:
    """`kvtier serve --l4-url` (KVTIER_L4_URL, TOML l4_url) gives the server's cache an L4."""
    from kvtier.server.backend import TieredBackend
    from kvtier.server.config import ServerConfig
    from kvtier.server.devices.model import build_default

    assert ServerConfig.load({}, env={}).l4_url is None
    toml = tmp_path / "kvtier.toml"
    toml.write_text('[serve]\nl4_url = "redis://toml:1/0"\nl4_min_idle_s = 5\n')
    assert ServerConfig.load({}, env={}, file=toml).l4_url == "redis://toml:1/0"
    env = {"KVTIER_L4_URL": "redis://env:2/0"}
    assert ServerConfig.load({}, env=env, file=toml).l4_url == "redis://env:2/0"
    cfg = ServerConfig.load(
        {"l4_url": redis_server.url, "l3_root": str(tmp_path / "l3")}, env=env, file=toml
    )
    backend = TieredBackend(build_default("cpu").model, cfg, "shared")
    try:
        snap = backend.cache.stats()
        assert snap.l4 is not None and snap.l4["url"] == redis_server.url
        assert backend.cache.config.l4_min_idle_s == 5
    finally:
        backend.close()


def test_the_cost_model_pays_l4_latency_once_per_plan() -> None:
    from kvtier.cache.costmodel import CostModel

    m = CostModel({"l2": 10e9, "l3": 1e9, "l4": 1e9}, prefill_s_per_token=1e-5)
    seg = [("l4", 1_000_000, 256)] * 4  # 1 ms of bytes each vs 2.56 ms of prefill each
    assert m.plan(seg) == 4
    m.observe_latency("l4", 0.050)  # a far Redis: 50 ms a round trip
    assert m.latency["l4"] == pytest.approx(0.050)
    assert m.plan(seg) == 0  # 54 ms to load 1024 tokens that recompute in 10 ms
    assert m.plan(seg * 16) == 64  # 64 chunks: 114 ms of load beat 164 ms of prefill
    m.observe_latency("l4", 0.0001)
    m.observe_latency("l4", 0.0001)
    assert m.latency["l4"] < 0.02 and m.plan(seg) == 4


def test_a_slow_l4_is_measured_and_recomputed(tmp_path: Path, model, redis_server) -> None:
    """B measures L4 on its restores; told L4 does 1 kB/s, it recomputes instead."""
    a = TieredCache(config(tmp_path / "a", redis_server.url), model)
    fast = config(tmp_path / "b", redis_server.url, cost_model=True)
    slow = config(
        tmp_path / "c",
        redis_server.url,
        cost_model=True,
        initial_bandwidth={"l1": 200e9, "l2": 10e9, "l3": 1e9, "l4": 1e3},
        initial_prefill_s_per_token=1e-2,
    )
    try:
        seq, _, _ = turn(model, a, "s1", prompt(70))
        hibernate_to_l4(a, "s1")
        ids = torch.cat([seq, torch.tensor([[3]])], dim=1)
        with TieredCache(fast, model) as b:
            b.cost.prefill_s_per_token = 1.0  # recomputing is hopeless: always load
            _, src, _ = turn(model, b, "s1", ids)
            assert src == "l4"
            assert b.cost.samples["l4"] == 1 and b.cost.bandwidth["l4"] != 1e9
            assert b.cost.latency.get("l4", 0) > 0  # the lookup's round trip
        with TieredCache(slow, model) as c:
            _, src, restored = turn(model, c, "s1", ids)
            assert src == "recompute" and restored == 0
    finally:
        a.close()


def test_a_restarted_host_finds_chunks_its_l3_lost_in_l4(tmp_path: Path, model, redis_server):
    """A session record from L3 whose chunks L3 no longer holds restores from L4."""
    from kvtier.tiers.l3 import L3Store

    a = TieredCache(config(tmp_path / "a", redis_server.url), model)
    seq, _, _ = turn(model, a, "s1", prompt(70))
    hibernate_to_l4(a, "s1")
    s = a.session("s1", tenant="t")
    lost = [*s.chunk_keys, s.tail_key]
    a.close()
    store = L3Store(tmp_path / "a")
    assert all(store.delete(k) for k in lost)
    store.close()
    with TieredCache(config(tmp_path / "a", redis_server.url), model) as again:
        _, src, restored = turn(model, again, "s1", torch.cat([seq, torch.tensor([[4]])], 1))
        assert src == "l4" and restored == seq.shape[1] - 1


def test_closing_a_session_drops_its_l4_record_at_once(tmp_path: Path, model, redis_server):
    """A record delete is not held up behind writes waiting out l4_min_idle_s."""
    a = TieredCache(config(tmp_path / "a", redis_server.url), model)
    slow = config(tmp_path / "b", redis_server.url, l4_min_idle_s=3600)
    b = TieredCache(slow, model)
    try:
        turn(model, a, "s1", prompt(40))
        hibernate_to_l4(a, "s1")
        r = redis_server.client()
        assert r.exists(keys.record(a.fingerprint, "t", "s1"))
        turn(model, b, "other", prompt(40, seed=2))
        b.session("other", tenant="t").hibernate()  # queued for an hour
        b.session("s1", tenant="t").close()  # found in L4, then closed
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and r.exists(keys.record(a.fingerprint, "t", "s1")):
            time.sleep(0.05)
        assert not r.exists(keys.record(a.fingerprint, "t", "s1"))
        with TieredCache(config(tmp_path / "c", redis_server.url), model) as c:
            assert c.session("s1", tenant="t").tokens == ()  # gone for every host
    finally:
        a.close()
        b.close()


def test_a_slow_redis_times_out_opens_the_breaker_and_recomputes(
    tmp_path: Path, model, redis_server
) -> None:
    a = TieredCache(config(tmp_path / "a", redis_server.url), model)
    b = TieredCache(config(tmp_path / "b", redis_server.url, l4_timeout_s=0.3), model)
    try:
        seq, _, _ = turn(model, a, "s1", prompt(70))
        hibernate_to_l4(a, "s1")
        b.session("s1", tenant="t")
        redis_server.client().client_pause(3000)  # Redis answers nothing for 3 s
        t0 = time.perf_counter()
        _, src, restored = turn(model, b, "s1", torch.cat([seq, torch.tensor([[3]])], 1))
        assert src == "recompute" and restored == 0
        assert time.perf_counter() - t0 < 2.5  # the timeout, not the pause
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and b.stats().l4["breaker"] == "closed":
            time.sleep(0.05)  # the health ping times out too: two in a row open it
        assert b.stats().l4["breaker"] != "closed"
        time.sleep(3.5)  # the pause ends; the half-open probe closes the breaker
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and b.stats().l4["breaker"] != "closed":
            time.sleep(0.05)
        assert b.stats().l4["up"]
    finally:
        a.close()
        b.close()


def test_turns_alternating_between_two_hosts_resume_from_l4(tmp_path: Path, model, redis_server):
    """Each turn lands on the other host: a host that hibernated the session earlier adopts
    the newer record another host wrote since, and loads the rest from L4."""
    hosts = [
        TieredCache(config(tmp_path / "a", redis_server.url), model),
        TieredCache(config(tmp_path / "b", redis_server.url), model),
    ]
    try:
        ids = prompt(40)
        sources = []
        for i in range(5):
            cache = hosts[i % 2]
            seq, src, restored = turn(model, cache, "s1", ids)
            sources.append(src)
            if i:
                assert restored == ids.shape[1] - 4, (i, sources)  # all the previous turn held
            hibernate_to_l4(cache, "s1")
            ids = torch.cat([seq, torch.tensor([[i + 1, i + 2, i + 3]])], dim=1)
        assert sources == ["recompute", "l4", "l4", "l4", "l4"]
        # every turn but the first moved the session: B at turns 1 and 3, A at 2 and 4
        assert [c.stats().moved_sessions for c in hosts] == [2, 2]
        # a session that stays on its host is no move, though its record is in L4 too
        turn(model, hosts[0], "s2", prompt(40, seed=1))
        hibernate_to_l4(hosts[0], "s2")
        turn(model, hosts[0], "s2", prompt(50, seed=1))
        assert hosts[0].stats().moved_sessions == 2
    finally:
        for c in hosts:
            c.close()
