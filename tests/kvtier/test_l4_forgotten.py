"""L4 and sessions forgotten from memory (`max_sessions`, kvtier.cache.sessiontable): a session
forgotten before its write-behind runs still reaches Redis, from its L3 record, unless it was
closed since; and a Redis restart writes forgotten sessions again, not only those in memory.

Every test runs a real redis-server (tests/kvtier/redis_server.py) and real TieredCaches with
separate L3 roots; the model is a tiny Llama with random weights.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from conftest import tiny_llama
from redis_server import RedisServer, need_redis
from test_l4 import config, hibernate_to_l4, prompt, turn

from kvtier import TieredCache
from kvtier.tiers.l4 import keys


@pytest.fixture
def redis_server(tmp_path: Path):
    need_redis()
    srv = RedisServer(tmp_path / "redis")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


def resume_elsewhere(model, root: Path, url: str, seq: torch.Tensor) -> None:
    """A second host resumes session s1 from L4 with everything the first one held."""
    with TieredCache(config(root, url), model) as b:
        _, src, restored = turn(model, b, "s1", torch.cat([seq, torch.tensor([[2]])], dim=1))
        assert src == "l4" and restored == seq.shape[1] - 1


def test_a_session_forgotten_before_its_write_behind_still_reaches_l4(
    tmp_path: Path, model, redis_server
) -> None:
    cfg = config(tmp_path / "a", redis_server.url, max_sessions=1, l4_min_idle_s=3.0)
    r = redis_server.client()
    with TieredCache(cfg, model) as a:
        fp = a.fingerprint
        seq, _, _ = turn(model, a, "s1", prompt(70))
        a.session("s1", tenant="t").hibernate()  # queued; written in 3 s
        turn(model, a, "gone", prompt(40, seed=1))  # opening it forgets s1
        a.session("gone", tenant="t").hibernate()
        a.session("other", tenant="t")  # forgets "gone"
        assert a.find_session("s1", "t") is None and a.find_session("gone", "t") is None
        a.session("gone", tenant="t").close()  # found in L3 again, then closed
        assert not r.exists(keys.record(fp, "t", "s1"))  # the write-behind has not run yet
        assert a.l4 is not None and a.l4.wait_idle(30)
        assert r.exists(keys.record(fp, "t", "s1"))
        assert not r.exists(keys.record(fp, "t", "gone"))  # closed: never published
        assert a.find_session("s1", "t") is None  # still forgotten: written from L3
    resume_elsewhere(model, tmp_path / "b", redis_server.url, seq)


def test_a_redis_restart_writes_forgotten_sessions_again(
    tmp_path: Path, model, redis_server
) -> None:
    a = TieredCache(config(tmp_path / "a", redis_server.url, max_sessions=1), model)
    try:
        seq, _, _ = turn(model, a, "s1", prompt(50))
        hibernate_to_l4(a, "s1")
        a.session("other", tenant="t")  # forgets s1: its record is in L3 alone
        assert a.find_session("s1", "t") is None
        assert a.l4 is not None and a.l4.wait_idle(30)
        time.sleep(0.3)  # A's health check has seen this Redis
        redis_server.kill()
        redis_server.start()  # empty: no persistence
        r = redis_server.client()
        name = keys.record(a.fingerprint, "t", "s1")
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not r.exists(name):
            time.sleep(0.1)  # A notices the new run_id and writes its sessions again
        assert r.exists(name), "the forgotten session was not written again"
        assert a.l4.wait_idle(30)
        assert a.find_session("s1", "t") is None  # written from L3, not brought back
        resume_elsewhere(model, tmp_path / "b", redis_server.url, seq)
    finally:
        a.close()
