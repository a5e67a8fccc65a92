"""A fleet with real processes on loopback: a Redis Cluster (3 masters + 3 replicas), three
`kvtier serve` hosts (CPU, the built-in model) sharing it as L4, and HAProxy in front of them
with the configuration `kvtier fleet haproxy-config` writes. 48 agent sessions run turns
through the proxy, each hibernated after its turn (the agent waits on a tool), while:

1. a host is SIGKILLed mid-turn: its sessions' next turns land on the survivors and restore from
   L4, each reply equals a recompute's (greedy), a turn in flight on it fails once and succeeds
   on the client's retry, no session is lost;
2. a Redis master is SIGKILLed: its replica takes over, no turn fails, and every host's L4 is up
   again within seconds;
3. a host is drained (POST /admin/drain) and restarted: its sessions move with 0 recomputed
   prompts, to the survivors and back.

It prints turns, failures, restore sources and the time to the first token of moved sessions
against a local restore and a recompute (the figures of docs/benchmarks.md, "Fleet").
"""

from __future__ import annotations

import collections
import json
import shutil
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import redis_cluster
from server_proc import ROOT, Server, free_port

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(900),
    pytest.mark.skipif(
        shutil.which("haproxy") is None or not redis_cluster.available(),
        reason="haproxy, redis-server or redis-cli is not installed "
        "(scripts/bootstrap.sh dev installs them)",
    ),
]

SESSIONS = 48
SYSTEM = "You are a careful agent. Answer in one short line. " * 4


@dataclass
class Turn:
    session: int
    n: int
    host: str
    source: str
    ttft: float
    text: str
    retried: bool = False


@dataclass
class Fleet:
    proxy: str
    hosts: list[Server]
    turns: list[Turn] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    convs: dict[int, list[dict[str, str]]] = field(default_factory=dict)

    def sid(self, i: int) -> str:
        return f"agent-{i:03d}"

    def ask(
        self, messages: list[dict[str, str]], sid: str, tenant: str = "fleet"
    ) -> tuple[str, str, str, float]:
        """One streamed chat turn through the proxy: (text, host, source, seconds to the first
        token). Raises on any failure."""
        body = {"model": "default", "messages": messages, "max_tokens": 6, "temperature": 0,
                "stream": True}  # fmt: skip
        t0 = time.perf_counter()
        ttft = None
        parts = []
        with httpx.stream("POST", f"{self.proxy}/v1/chat/completions", json=body, timeout=120,
                          headers={"X-Session-ID": sid, "X-Tenant": tenant}) as r:  # fmt: skip
            if r.status_code != 200:
                raise RuntimeError(f"{r.status_code}: {r.read()[:200]!r}")
            host = r.headers.get("x-kvtier-host", "?")
            source = r.headers.get("x-kvtier-restore-source", "?")
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                delta = json.loads(line[6:])["choices"][0]["delta"].get("content")
                if delta:
                    ttft = ttft or time.perf_counter() - t0
                    parts.append(delta)
        if ttft is None:
            ttft = time.perf_counter() - t0
        return "".join(parts), host, source, ttft

    def turn(self, i: int, n: int) -> Turn:
        """Session i's turn n (retried once on failure, as a client does); then it waits on a
        tool: hibernated, so its K/V goes to L3 and L4."""
        msgs = self.convs.setdefault(i, [{"role": "system", "content": SYSTEM}])
        msgs.append({"role": "user", "content": f"step {n} of task {i}: what next?"})
        retried = False
        try:
            text, host, source, ttft = self.ask(msgs, self.sid(i))
        except Exception as exc:
            with self.lock:
                self.failures.append(f"session {i} turn {n}: {exc}")
            time.sleep(0.5)
            retried = True
            text, host, source, ttft = self.ask(msgs, self.sid(i))
        msgs.append({"role": "assistant", "content": text})
        t = Turn(i, n, host, source, ttft, text, retried)
        with self.lock:
            self.turns.append(t)
        httpx.post(f"{self.proxy}/v1/sessions/{self.sid(i)}/hibernate", timeout=60,
                   params={"tenant": "fleet"}, headers={"X-Session-ID": self.sid(i)})  # fmt: skip
        return t

    def round(self, n: int, during: object = None) -> list[Turn]:
        with ThreadPoolExecutor(8) as pool:
            futs = [pool.submit(self.turn, i, n) for i in range(SESSIONS)]
            if callable(during):
                during()
            return [f.result() for f in futs]

    def recompute(self, t: Turn) -> str:
        """The same prompt in a tenant of its own (which shares no chunk with the fleet's):
        recomputed from scratch (greedy)."""
        msgs = self.convs[t.session][: 2 * t.n]  # system + the turns up to this user message
        check = f"check-{t.session}-{t.n}-{time.monotonic_ns()}"
        text, _, source, _ = self.ask(msgs, check, tenant=check)
        assert source == "recompute", source
        return text


def haproxy(tmp: Path, hosts: list[Server]) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    cfg = tmp / "haproxy.cfg"
    out = subprocess.run(
        [sys.executable, "-m", "ops.cli", "fleet", "haproxy-config", "--bind",
         f"127.0.0.1:{port}", "--check-ms", "300", "--out", str(cfg),
         "--hosts", ",".join(f"127.0.0.1:{h.port}" for h in hosts)],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    proc = subprocess.Popen(["haproxy", "-f", str(cfg)], stdout=subprocess.DEVNULL,
                            stderr=open(tmp / "haproxy.log", "wb"))  # noqa: SIM115  # fmt: skip
    return proc, f"http://127.0.0.1:{port}"


def wait_hosts_up(proxy: str, count: int, timeout: float = 60) -> None:
    """Until HAProxy sends fresh sessions to `count` distinct hosts."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        seen = set()
        for k in range(40):
            try:
                r = httpx.get(f"{proxy}/v1/models", headers={"X-Session-ID": f"probe-{k}"})
                seen.add(r.headers.get("x-kvtier-host"))
            except httpx.HTTPError:
                pass
        if len(seen - {None}) == count:
            return
        time.sleep(0.3)
    raise AssertionError(f"HAProxy did not reach {count} hosts")


def l4_up(host: Server) -> bool:
    try:
        text = httpx.get(f"{host.url}/metrics", timeout=5).text
    except httpx.HTTPError:
        return False
    return any(ln.startswith("kvtier_l4_up") and ln.endswith(" 1.0") for ln in text.splitlines())


def host_of(fleet: Fleet, server: Server) -> str:
    return f"kvtier{fleet.hosts.index(server) + 1}"


def test_fleet_survives_a_host_a_shard_and_a_rolling_restart(tmp_path: Path) -> None:
    pytest.importorskip("redis")
    serve = ["--device", "cpu", "--l1-bytes", "32MiB", "--l2-bytes", "8MiB", "--l3-max-bytes",
             "256MB", "--max-concurrency", "8", "--queue-timeout", "120"]  # fmt: skip
    with redis_cluster.RedisCluster(tmp_path / "redis") as cluster:
        hosts = [
            Server(tmp_path / f"l3-{k}", *serve, "--l4-url", cluster.url, module="ops.cli serve")
            for k in range(3)
        ]
        proxy_proc = None
        try:
            with ThreadPoolExecutor(3) as pool:
                list(pool.map(lambda h: h.start(timeout=300), hosts))
            proxy_proc, proxy = haproxy(tmp_path, hosts)
            wait_hosts_up(proxy, 3)
            fleet = Fleet(proxy, hosts)
            report: dict[str, object] = {}

            # -- warm: every session's first two turns, on the host its id hashes to ----------
            first = fleet.round(1)
            fleet.round(2)
            home = {t.session: t.host for t in first}
            assert len(set(home.values())) == 3

            # -- 1. SIGKILL a host mid-turn -------------------------------------------------
            victim = hosts[0]
            gone = host_of(fleet, victim)
            moved = sorted(i for i, h in home.items() if h == gone)
            failed_before = len(fleet.failures)
            fleet.round(3, during=lambda: (time.sleep(0.5), victim.kill()))
            third = [t for t in fleet.turns if t.n == 3]
            after_kill = fleet.round(4)
            assert all(t.host != gone for t in after_kill)
            killed_failures = fleet.failures[failed_before:]
            # every failure was a turn on the killed host, and its retry succeeded
            assert len(killed_failures) == sum(t.retried for t in third)
            assert all(home[t.session] == gone for t in third if t.retried)
            landed = [t for t in after_kill if t.session in moved]
            first_moves = [t for t in (*third, *landed) if t.session in moved and t.host != gone]
            moved_sources = collections.Counter(
                next(t.source for t in first_moves if t.session == i) for i in moved
            )
            assert moved_sources["l4"] >= len(moved) - sum(t.retried for t in third), moved_sources
            for t in first_moves:  # greedy: a restored session answers as a recompute
                assert t.text == fleet.recompute(t), (t.session, t.n, t.source)
            report["kill_host"] = {"moved_sessions": len(moved),
                                   "failed_then_retried": len(killed_failures),
                                   "first_turn_sources": dict(moved_sources)}  # fmt: skip

            # -- 2. SIGKILL a Redis master --------------------------------------------------
            failed_before = len(fleet.failures)
            t_kill = [0.0]

            def kill_master() -> None:
                time.sleep(0.3)
                t_kill[0] = time.monotonic()
                dead = cluster.kill_master_of("kvtier:c:{00}")
                report["failover_s"] = round(cluster.wait_promoted(dead), 2)

            fleet.round(5, during=kill_master)
            assert fleet.failures[failed_before:] == []  # no turn failed: misses recompute
            survivors = [h for h in hosts if h is not victim]
            while not all(l4_up(h) for h in survivors):
                assert time.monotonic() - t_kill[0] < 30, "L4 did not come back"
                time.sleep(0.2)
            report["l4_up_again_s"] = round(time.monotonic() - t_kill[0], 2)

            # -- 3. drain a host, restart it --------------------------------------------------
            drained = hosts[1]
            name = host_of(fleet, drained)
            mine = sorted(i for i, t in enumerate(fleet.round(6)) if t.host == name)
            assert mine
            r = httpx.post(f"{drained.url}/admin/drain", params={"quiet_s": 1.5}, timeout=120)
            assert r.status_code == 200 and r.json()["status"] == "drained", r.text
            assert drained.proc is not None and drained.proc.wait(60) == 0
            away = [t for t in fleet.round(7) if t.session in mine]
            drained.start(timeout=300)
            wait_hosts_up(proxy, 2)
            back = [t for t in fleet.round(8) if t.session in mine]
            assert all(t.host != name for t in away) and all(t.host == name for t in back)
            recomputed = [t for t in (*away, *back) if t.source == "recompute"]
            assert recomputed == [], [(t.session, t.n, t.source) for t in recomputed]
            report["drain"] = {"sessions": len(mine), "drain_seconds": r.json()["seconds"],
                               "away_sources": dict(collections.Counter(t.source for t in away)),
                               "back_sources": dict(collections.Counter(t.source for t in back))}  # fmt: skip

            # -- what it measured ---------------------------------------------------------------
            assert len({t.session for t in fleet.turns}) == SESSIONS  # no session lost
            by_source = collections.defaultdict(list)
            for t in fleet.turns:
                by_source[t.source].append(t.ttft * 1000)
            ttft = {s: round(statistics.median(v), 1) for s, v in by_source.items()}
            moved_ttft = [t.ttft * 1000 for t in (*first_moves, *away, *back) if t.source == "l4"]
            report.update(
                turns=len(fleet.turns),
                failures=len(fleet.failures),
                sources=dict(collections.Counter(t.source for t in fleet.turns)),
                ttft_ms_median_by_source=ttft,
                moved_l4_ttft_ms_median=round(statistics.median(moved_ttft), 1),
                recompute_ttft_ms_median=ttft.get("recompute"),
            )
            print("\nfleet:", json.dumps(report, indent=1))
        finally:
            if proxy_proc is not None:
                proxy_proc.terminate()
                proxy_proc.wait(10)
            for h in hosts:
                h.kill()
