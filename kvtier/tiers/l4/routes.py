"""Where an L4 key's commands go: one Redis server, or the shard of a Redis Cluster that owns the
key's hash slot.

`open_routes(url)` reads the URL's scheme:

- `redis://`, `rediss://`, `unix://`: one server (`Single`), one connection pool;
- `redis+cluster://[user:password@]host:port,host:port,...` (or `rediss+cluster://`, TLS): a
  Redis Cluster (`Cluster`), through redis-py's `RedisCluster`, which learns the slot map from
  any of the seed nodes. Valkey speaks the same protocol and is reached the same way.

The store (kvtier.tiers.l4.store) writes chunks and pipelines their GETs on raw connections of a
pool; `pool_for(key)` names that pool: the one server's, or the pool of the primary that owns the
key's slot now. A reply of `MOVED` (the slot moved: a failover, a reshard) makes the store call
`refresh()`, which asks the cluster for its slot map again, and retry; `ASK` (a slot being
migrated) is followed to the node it names, with `ASKING` first.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote, urlsplit

from kvtier.errors import ConfigError
from kvtier.tiers.l4 import keys

CLUSTER_SCHEMES = {"redis+cluster": False, "rediss+cluster": True}  # scheme -> TLS


@dataclass
class Shard:
    """One primary of a cluster as the health ping saw it: its slots and live replicas."""

    name: str  # host:port of the primary now serving the slots
    slots: str  # "0-5460" (ranges joined by commas)
    replicas: int  # replicas connected to it (INFO replication)
    used_memory: int = 0
    maxmemory: int = 0
    run_id: str = ""


class Single:
    """One Redis server: every key on one pool."""

    cluster = False

    def __init__(self, redis: Any, url: str, **conn: Any) -> None:
        try:
            self.pool = redis.ConnectionPool.from_url(url, health_check_interval=0, **conn)
        except ValueError as exc:
            raise ConfigError(
                f"l4_url {keys.redact(url)!r} is not a Redis URL ({exc}); use "
                "redis://host:port/db, or redis+cluster://host:port,host:port for a Redis Cluster"
            ) from None
        self.client = redis.Redis(connection_pool=self.pool)

    def pool_for(self, name: str) -> Any:
        return self.pool

    def node(self, name: str) -> Any:
        return self.client

    def pool_at(self, address: str) -> Any | None:
        return None  # one server never redirects

    def shard_of(self, name: str) -> str:
        return ""

    def groups(self, names: list[str], streams: int) -> list[tuple[Any, list[int]]]:
        """`streams` groups of indices into `names`, round robin, each with its pool."""
        n = min(streams, len(names))
        return [(self.pool, list(range(i, len(names), n))) for i in range(n)]

    epoch = 0

    def refresh(self, seen: int | None = None) -> None:
        pass

    def disconnect(self) -> None:
        self.pool.disconnect()


@dataclass
class _Seeds:
    nodes: list[tuple[str, int]] = field(default_factory=list)
    username: str | None = None
    password: str | None = None


def parse_cluster_url(url: str) -> _Seeds:
    """The seed nodes and credentials of a `redis+cluster://` URL; ConfigError if malformed."""
    shown = keys.redact(url)
    rest = url.split("://", 1)[1]
    auth, _, hosts = rest.rpartition("@")
    hosts = hosts.split("/", 1)[0].split("?", 1)[0]
    seeds = _Seeds()
    if auth:
        user, sep, password = auth.partition(":")
        seeds.username = unquote(user) or None
        seeds.password = unquote(password) if sep else None
    for part in filter(None, hosts.split(",")):
        try:
            parsed = urlsplit(f"//{part}")
            host, port = parsed.hostname, parsed.port
        except ValueError:
            host, port = None, None
        if not host or port is None:
            raise ConfigError(
                f"l4_url {shown!r}: {part!r} is not host:port; a Redis Cluster URL names its "
                "seed nodes: redis+cluster://host:port,host:port,host:port"
            )
        seeds.nodes.append((host, port))
    if not seeds.nodes:
        raise ConfigError(
            f"l4_url {shown!r} names no node; use redis+cluster://host:port,host:port,host:port"
        )
    return seeds


class Cluster:
    """A Redis (or Valkey) Cluster: each key on the pool of the primary owning its slot."""

    cluster = True

    def __init__(self, redis: Any, url: str, tls: bool, **conn: Any) -> None:
        from redis.cluster import ClusterNode, RedisCluster

        self._seeds = parse_cluster_url(url)  # a malformed URL fails now, at start
        self.shown_url = keys.redact(url)
        self._make = lambda: RedisCluster(
            startup_nodes=[ClusterNode(h, p) for h, p in self._seeds.nodes],
            username=self._seeds.username,
            password=self._seeds.password,
            ssl=tls,
            cluster_error_retry_attempts=2,
            require_full_coverage=False,  # a shard's loss costs its slots only (misses)
            **conn,
        )
        self._client: Any = None
        self._refreshing = threading.Lock()
        self.epoch = 0  # slot maps asked so far

    @property
    def client(self) -> Any:
        """redis-py's RedisCluster, made on first use: it asks a seed node for the slot map,
        which may be down at start (the tier degrades to misses, as one server's does)."""
        if self._client is None:
            from redis.exceptions import RedisClusterException

            try:
                self._client = self._make()
            except RedisClusterException as exc:  # not a RedisError: say it as one
                raise self._errors().ConnectionError(f"{self.shown_url}: {exc}") from exc
        return self._client

    def _pool(self, node: Any) -> Any:
        if node is None or node.redis_connection is None:
            raise self._errors().ConnectionError(f"no reachable node in {self.shown_url}")
        return node.redis_connection.connection_pool

    @staticmethod
    def _errors() -> Any:
        import redis

        return redis

    def pool_for(self, name: str) -> Any:
        return self._pool(self.client.get_node_from_key(name))

    def node(self, name: str) -> Any:
        """A `Redis` client of the primary owning `name`'s slot: for a MULTI/EXEC on keys of
        one hash tag (RedisCluster's pipelines refuse RENAME)."""
        node = self.client.get_node_from_key(name)
        if node is None or node.redis_connection is None:
            raise self._errors().ConnectionError(f"no reachable node in {self.shown_url}")
        return node.redis_connection

    def pool_at(self, address: str) -> Any | None:
        host, _, port = address.rpartition(":")
        node = self.client.get_node(host=host, port=int(port))
        if node is None:
            self.refresh()
            node = self.client.get_node(host=host, port=int(port))
        return None if node is None else self._pool(node)

    def shard_of(self, name: str) -> str:
        try:
            node = self.client.get_node_from_key(name)
        except Exception:  # no node owns the slot now (a shard lost)
            return ""
        return str(node.name) if node is not None else ""

    def groups(self, names: list[str], streams: int) -> list[tuple[Any, list[int]]]:
        """Indices into `names` grouped by the node owning their slot; a node's group split in
        up to `streams` round-robin parts (each one pipelined on its own connection)."""
        by_node: dict[str, tuple[Any, list[int]]] = {}
        for i, name in enumerate(names):
            node = self.client.get_node_from_key(name)
            by_node.setdefault(node.name, (node, []))[1].append(i)
        out = []
        for node, idx in by_node.values():
            n = min(streams, len(idx))
            pool = self._pool(node)
            out += [(pool, idx[j::n]) for j in range(n)]
        return out

    def refresh(self, seen: int | None = None) -> None:
        """Ask the cluster for its slot map again (after MOVED, or a node that went away).
        `seen`: the `epoch` the caller routed by; when another thread refreshed since, its map
        is used rather than asked again (parallel streams all see the same MOVED). Pools in use
        stay open: another stream may be reading on them."""
        with self._refreshing:
            if seen is not None and seen != self.epoch:
                return
            from redis.exceptions import RedisClusterException

            try:
                self.client.nodes_manager.initialize(disconnect_startup_nodes_pools=False)
            except RedisClusterException as exc:  # no node answered (all down): as `client` says
                raise self._errors().ConnectionError(f"{self.shown_url}: {exc}") from exc
            self.epoch += 1

    def shards(self) -> list[Shard]:
        """Every primary: its slots, replicas and memory (INFO on each; a round trip each)."""
        slots: dict[str, list[str]] = {}
        for lo, hi, *nodes in _slot_ranges(self.client):
            primary = nodes[0]
            name = f"{_text(primary[0])}:{primary[1]}"
            slots.setdefault(name, []).append(f"{lo}-{hi}")
        out = []
        for node in self.client.get_primaries():
            r = node.redis_connection
            repl = r.info("replication")
            server = r.info("server")
            mem = r.info("memory")
            replicas = int(repl.get("connected_slaves", 0))
            out.append(
                Shard(
                    name=node.name,
                    slots=",".join(slots.get(node.name, [])),
                    replicas=replicas,
                    used_memory=int(mem.get("used_memory", 0)),
                    maxmemory=int(mem.get("maxmemory", 0)),
                    run_id=str(server.get("run_id", "")),
                )
            )
        return sorted(out, key=lambda s: s.name)

    def disconnect(self) -> None:
        if self._client is not None:
            self._client.close()


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _slot_ranges(client: Any) -> list[Any]:
    node = client.get_random_node()
    return list(node.redis_connection.execute_command("CLUSTER SLOTS"))


def open_routes(redis: Any, url: str, **conn: Any) -> Single | Cluster:
    """The routes of `url` (see the module docstring); ConfigError for a URL of no kind."""
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme in CLUSTER_SCHEMES:
        return Cluster(redis, url, CLUSTER_SCHEMES[scheme], **conn)
    return Single(redis, url, **conn)
