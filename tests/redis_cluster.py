"""A real Redis Cluster for tests: 3 masters and 3 replicas, each a `redis-server
--cluster-enabled yes` on a free loopback port (tests/redis_proc.py), joined by
`redis-cli --cluster create --cluster-replicas 1`, stopped after.

    with RedisCluster(tmp_path / "cluster") as cluster:
        use(cluster.url)                    # redis+cluster://127.0.0.1:P1,127.0.0.1:P2,...
        old = cluster.kill_master_of(key)   # SIGKILL the primary owning `key`'s slot
        cluster.wait_promoted(old)          # its replica took over

The node timeout is short (1 s), so a replica takes over a killed master within about 2 s.
"""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import time
from pathlib import Path

from redis_proc import RedisServer

NODE_TIMEOUT_MS = 1000


def available() -> bool:
    return shutil.which("redis-server") is not None and shutil.which("redis-cli") is not None


def free_cluster_port() -> int:
    """A free loopback port whose cluster bus port (+10000) is free too (Redis needs both)."""
    for _ in range(200):
        port = random.randrange(20000, 55535)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 10000))
            return port
        except OSError:
            continue
    raise RuntimeError("no free port pair for a cluster node")


def cli(port: int, *args: str, timeout: float = 10) -> str:
    out = subprocess.run(
        ["redis-cli", "-h", "127.0.0.1", "-p", str(port), *args],
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    return out.stdout


class RedisCluster:
    def __init__(self, directory: Path, masters: int = 3, *config: str) -> None:
        self.dir = Path(directory)
        self.nodes = [
            RedisServer(
                self.dir / f"node{i}",
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
                "--cluster-node-timeout",
                str(NODE_TIMEOUT_MS),
                "--protected-mode",
                "no",
                *config,
                port=free_cluster_port(),
            )
            for i in range(masters * 2)
        ]

    @property
    def ports(self) -> list[int]:
        return [n.port for n in self.nodes]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports[:3])

    def start(self) -> RedisCluster:
        try:
            for n in self.nodes:
                n.start()
            out = subprocess.run(
                ["redis-cli", "--cluster", "create",
                 *(f"127.0.0.1:{p}" for p in self.ports),
                 "--cluster-replicas", "1", "--cluster-yes"],
                capture_output=True, text=True, timeout=60,
            )  # fmt: skip
            if out.returncode != 0:
                raise RuntimeError(f"redis-cli --cluster create failed:\n{out.stdout}{out.stderr}")
            self.wait_ok()
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ok(self, timeout: float = 30) -> None:
        """Until every running node says cluster_state:ok and, with all six up, three replicas
        are attached."""
        deadline = time.monotonic() + timeout
        live = [n.port for n in self.nodes if n.running]
        while time.monotonic() < deadline:
            ok = all("cluster_state:ok" in cli(p, "cluster", "info") for p in live)
            if ok and (len(live) < len(self.nodes) or len(self.replicas()) == len(live) // 2):
                return
            time.sleep(0.1)
        raise RuntimeError(
            f"the cluster is not ok in {timeout}s: {cli(live[0], 'cluster', 'nodes')}"
        )

    def _roles(self) -> dict[int, str]:
        out: dict[int, str] = {}
        for n in self.nodes:
            if n.running:
                role = cli(n.port, "role").split("\n", 1)[0].strip()
                out[n.port] = role
        return out

    def masters(self) -> list[int]:
        return [p for p, r in self._roles().items() if r == "master"]

    def replicas(self) -> list[int]:
        return [p for p, r in self._roles().items() if r == "slave"]

    def master_of(self, key: str) -> int:
        slot = int(cli(self.masters()[0], "cluster", "keyslot", key).strip())
        for line in cli(self.masters()[0], "cluster", "nodes").splitlines():
            f = line.split()
            if "master" in f[2] and "fail" not in f[2]:
                for r in f[8:]:
                    lo, _, hi = r.partition("-")
                    if lo.isdigit() and int(lo) <= slot <= int(hi or lo):
                        return int(f[1].split(":")[1].split("@")[0])
        raise RuntimeError(f"no master serves slot {slot}")

    def node(self, port: int) -> RedisServer:
        return next(n for n in self.nodes if n.port == port)

    def kill_master_of(self, key: str) -> int:
        port = self.master_of(key)
        self.node(port).kill()
        return port

    def wait_promoted(self, dead: int, timeout: float = 30) -> float:
        """Seconds until the slots of the dead master `dead` are served by a new master."""
        t0 = time.monotonic()
        live = [n.port for n in self.nodes if n.running]
        while time.monotonic() - t0 < timeout:
            if all("cluster_state:ok" in cli(p, "cluster", "info") for p in live):
                nodes = cli(live[0], "cluster", "nodes")
                if not any(f":{dead}@" in ln and "master" in ln and "fail" not in ln
                           for ln in nodes.splitlines()):  # fmt: skip
                    return time.monotonic() - t0
            time.sleep(0.05)
        raise RuntimeError(f"no replica took over from {dead} in {timeout}s")

    def stop(self) -> None:
        for n in self.nodes:
            n.kill()

    def __enter__(self) -> RedisCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
