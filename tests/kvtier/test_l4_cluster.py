"""L4Store on a real Redis Cluster (3 masters + 3 replicas, tests/redis_cluster.py): chunks spread
over the shards, a read of many chunks pipelined per shard, MOVED followed after a manual
failover, a killed master's slots read again once its replica took over, the breaker as on one
server, and the URL's mistakes refused with what to write instead."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import redis_cluster
from test_l4_store import FP, header, record

from kvtier.errors import ChunkNotFound, ConfigError, L4Unavailable
from kvtier.tiers.l4 import Breaker, L4Store, keys
from kvtier.tiers.l4.breaker import CLOSED

pytestmark = pytest.mark.skipif(
    not redis_cluster.available(),
    reason="redis-server/redis-cli are not installed (scripts/bootstrap.sh dev installs them)",
)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    pytest.importorskip("redis")
    with redis_cluster.RedisCluster(tmp_path_factory.mktemp("cluster")) as c:
        yield c


def put_many(store: L4Store, n: int, size: int = 64 << 10) -> dict[bytes, bytes]:
    out = {}
    for _ in range(n):
        k, payload = os.urandom(16), os.urandom(size)
        store.put_chunk(header(k, len(payload)), payload)
        out[k] = payload
    return out


def read_all(store: L4Store, chunks: dict[bytes, bytes]) -> list[bytes | None]:
    ks = list(chunks)
    bufs = [bytearray(len(chunks[k])) for k in ks]
    batch = store.get_chunks(ks, FP, lambda i, h: memoryview(bufs[i]), tenants=("t",))
    out: list[bytes | None] = []
    for fut, buf in zip(batch.futures, bufs, strict=True):
        try:
            fut.result(10)
            out.append(bytes(buf))
        except ChunkNotFound:
            out.append(None)
    return out


def test_chunks_spread_over_the_shards_and_read_back(cluster) -> None:
    store = L4Store(cluster.url, ttl_s=60, streams=2)
    try:
        assert store.cluster
        chunks = put_many(store, 24)
        shards = {store._routes.shard_of(keys.chunk(k)) for k in chunks}
        assert len(shards) == 3  # digests spread over the three primaries
        assert read_all(store, chunks) == list(chunks.values())
        missing = os.urandom(16)
        assert store.exists([*chunks, missing]) == [True] * 24 + [False]
        store.put_record(record())
        assert store.get_record(FP, "t", "s") == record()
        store.ping()
        assert [s.replicas for s in store.shards] == [1, 1, 1]
        assert sorted(s.slots for s in store.shards)[0].startswith("0-")
        st = store.stats()
        assert st["hits"] == 24 and st["errors"] == 0 and st["breaker"] == CLOSED
    finally:
        store.close()


def test_moved_is_followed_after_a_manual_failover(cluster) -> None:
    """CLUSTER FAILOVER on a replica swaps it with its master: the store's slot map is stale,
    its next GETs and SETs on those slots are answered MOVED, and it follows them."""
    store = L4Store(cluster.url, ttl_s=60, breaker=Breaker(backoff_s=0.2, max_backoff_s=0.5))
    try:
        chunks = put_many(store, 12)
        probe = keys.chunk(next(iter(chunks)))
        old = cluster.master_of(probe)
        replica = next(p for p in cluster.replicas() if f":{old}@" in _master_line(cluster, p))
        assert "OK" in redis_cluster.cli(replica, "cluster", "failover")
        deadline = time.monotonic() + 20
        while cluster.master_of(probe) != replica:
            assert time.monotonic() < deadline, "the manual failover did not happen"
            time.sleep(0.05)
        cluster.wait_ok()
        # The demoted master closes its clients' connections: a read may fail once (a miss
        # for the caller), then the GETs answered MOVED are sent to the new master.
        assert until_read(store, chunks) == list(chunks.values())
        more = put_many(store, 6)  # writes follow MOVED too
        assert read_all(store, more) == list(more.values())
    finally:
        store.close()


def until_read(store: L4Store, chunks: dict[bytes, bytes], within: float = 10) -> list:
    deadline = time.monotonic() + within
    while True:
        try:
            return read_all(store, chunks)
        except L4Unavailable:
            assert time.monotonic() < deadline, "reads did not recover"
            time.sleep(0.1)


def _master_line(cluster, replica: int) -> str:
    """`CLUSTER NODES` line of `replica`'s master (its address appears in it)."""
    lines = redis_cluster.cli(replica, "cluster", "nodes").splitlines()
    me = next(ln for ln in lines if "myself" in ln)
    master_id = me.split()[3]
    return next(ln for ln in lines if ln.startswith(master_id))


def test_a_killed_master_costs_misses_until_its_replica_takes_over(tmp_path: Path) -> None:
    """The failover the fleet test relies on: a killed master's chunks are L4Unavailable (the
    breaker opens: reads fall back to recompute), then its replica is promoted, and reads hit
    again within seconds, the replica having the chunks (replication)."""
    pytest.importorskip("redis")
    with redis_cluster.RedisCluster(tmp_path / "c") as cluster:
        store = L4Store(cluster.url, ttl_s=60, breaker=Breaker(backoff_s=0.2, max_backoff_s=0.5))
        try:
            chunks = put_many(store, 18)
            for p in cluster.masters():  # the replicas have every write
                redis_cluster.cli(p, "wait", "1", "2000")
            dead = cluster.kill_master_of(keys.chunk(next(iter(chunks))))
            t0 = time.monotonic()
            with pytest.raises(L4Unavailable):
                for _ in range(3):  # some read lands on the dead master's slots
                    got = read_all(store, chunks)
            cluster.wait_promoted(dead)
            got = until_read(store, chunks, within=20)
            recovered = time.monotonic() - t0
            assert got == list(chunks.values())
            assert store.stats()["breaker"] == CLOSED
            store.ping()
            assert len(store.shards) == 3 and sorted(s.replicas for s in store.shards) == [0, 1, 1]
            print(f"L4 reads recovered {recovered:.1f} s after the master was killed")
        finally:
            store.close()


def test_the_whole_cluster_down_and_back_costs_misses_then_reads_again(tmp_path: Path) -> None:
    """Every node stopped: each call is L4Unavailable (a miss for the caller), also the ones
    that ask the slot map again and find no node, never another error; the breaker's probes
    keep coming, so reads hit again once the nodes are back (their cluster config on disk)."""
    pytest.importorskip("redis")
    with redis_cluster.RedisCluster(tmp_path / "c") as cluster:
        store = L4Store(cluster.url, ttl_s=60, breaker=Breaker(backoff_s=0.1, max_backoff_s=0.2))
        try:
            chunks = put_many(store, 6)
            for p in cluster.masters():  # on disk before the nodes stop
                redis_cluster.cli(p, "wait", "1", "2000")
                redis_cluster.cli(p, "save")
            for n in cluster.nodes:
                n.stop()
            for _ in range(4):  # the first fails on a socket, the later probes on the slot map
                with pytest.raises(L4Unavailable):
                    read_all(store, chunks)
                time.sleep(0.25)
            assert store.breaker.state != "half_open"  # every probe was settled
            for n in cluster.nodes:
                n.start()
            cluster.wait_ok()
            assert until_read(store, chunks, within=20) == list(chunks.values())
            assert store.stats()["breaker"] == CLOSED
        finally:
            store.close()


@pytest.mark.parametrize(
    "url,message",
    [
        ("redis+cluster://", "names no node"),
        ("redis+cluster://h1:6379,h2", "'h2' is not host:port"),
        ("redis+cluster://h1:notaport", "is not host:port"),
    ],
)
def test_a_bad_cluster_url_says_what_to_write(url: str, message: str) -> None:
    pytest.importorskip("redis")
    with pytest.raises(ConfigError, match=message) as err:
        L4Store(url)
    assert "redis+cluster://host:port,host:port" in str(err.value)


def test_a_cluster_down_at_start_is_unavailable_not_a_crash() -> None:
    pytest.importorskip("redis")
    store = L4Store("redis+cluster://127.0.0.1:1", connect_timeout_s=0.2)
    try:
        with pytest.raises(L4Unavailable, match=r"127\.0\.0\.1:1"):
            store.get_record(FP, "t", "s")
    finally:
        store.close()


def test_shards_reach_the_exporter_with_their_replicas_and_reads(cluster) -> None:
    """`stats()["shards"]` (a cluster only) becomes kvtier_l4_shard_* series per primary."""
    from prometheus_client.core import Metric

    from ops.exporter.l4 import l4_families

    store = L4Store(cluster.url, ttl_s=60)
    try:
        # random keys over three shards: with 48 of them a shard gets none once in about 10^8
        # runs (with 12, once in 40)
        chunks = put_many(store, 48, size=4 << 10)
        read_all(store, chunks)
        store.ping()
        fams: dict[str, Metric] = {f.name: f for f in l4_families(store.stats())}
        replicas = {s.labels["shard"]: s.value for s in fams["kvtier_l4_shard_replicas"].samples}
        assert len(replicas) == 3 and set(replicas.values()) == {1.0}
        hits = [s.value for s in fams["kvtier_l4_shard_hits"].samples if s.name.endswith("_total")]
        assert sum(hits) == 48 and all(h > 0 for h in hits)  # every shard answered some
    finally:
        store.close()
