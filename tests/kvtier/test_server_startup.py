"""Start-up and event-loop behaviour of the server, in this process over real HTTP.

The warm-up prefill that gives the cache's cost model a measured rate before the first request,
a second server on an L3 root that a first one holds (exits at once, one line), and handlers that
never run blocking cache code on the event loop.
"""

from __future__ import annotations

import dataclasses
import logging
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from server_proc import ROOT, Server, free_port

from kvtier import CacheConfig, apikeys
from kvtier.server.backend import PrefillEstimate
from kvtier.server.batch.engine import WARM_UP_TOKENS
from kvtier.server.config import ServerConfig
from kvtier.server.http.app import create_app

GUESS_FIELD = "initial_prefill_s_per_token"  # the cost model's configured prefill guess
# L3 chunks a start leaves: the warm-up prompt's (1024 tokens: 4 and a 1-token tail) and the
# warm-up request's one full chunk (271 tokens)
WARM_UP_CHUNKS = WARM_UP_TOKENS // 256 + 1 + 1


class _InProcess:
    """The app under uvicorn in a thread of this process, so a test can reach its state."""

    def __init__(self, config: ServerConfig) -> None:
        self.app = create_app(config)
        self.state = self.app.state.kvtier
        self.server = uvicorn.Server(
            uvicorn.Config(self.app, host="127.0.0.1", port=config.port, log_level="warning")
        )
        self.url = f"http://127.0.0.1:{config.port}"
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self, timeout: float = 90.0) -> _InProcess:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.state.load_error is not None:
                raise RuntimeError(f"load failed: {self.state.load_error!r}")
            try:
                if httpx.get(self.url + "/readyz", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise RuntimeError("server not ready")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(60)


def _config(l3_root: Path) -> ServerConfig:
    return ServerConfig(
        port=free_port(),
        l3_root=l3_root,
        device="cpu",
        l1_bytes=32 * 2**20,
        l2_bytes=32 * 2**20,
        l3_writer="threads",
        log_level="warning",
    )


@pytest.fixture
def live(tmp_path: Path) -> Iterator[_InProcess]:
    srv = _InProcess(_config(tmp_path / "l3")).start()
    try:
        yield srv
    finally:
        srv.stop()


def test_warm_up_leaves_a_measured_prefill_rate_and_no_session(tmp_path: Path) -> None:
    chunks = []
    for _start in range(2):  # a first start on an empty root, then a restart
        srv = _InProcess(_config(tmp_path / "l3")).start()
        try:
            backend = srv.state.engine.backend
            estimate = backend.prefill_estimate()
            assert isinstance(estimate, PrefillEstimate)
            # measured, not the configured guess (1 ms a token), which a restart used to keep
            # until its first request had chosen L3 over recomputing on the guess's strength
            assert estimate.samples >= 1
            guess = next(
                f.default for f in dataclasses.fields(CacheConfig) if f.name == GUESS_FIELD
            )
            assert 0 < estimate.seconds_per_token != guess
            snap = backend.snapshot()
            assert snap is not None and snap.sessions == ()  # the throwaway session is closed
            # the warm-up's L3 restore was real: read from L3, not recomputed or from L2
            assert dict(snap.restore_decisions).get("l3", 0) >= 1
            # the warm-up request's chunk is written through to L3 in the background
            deadline = time.monotonic() + 20
            while snap.tier("l3").chunks < WARM_UP_CHUNKS and time.monotonic() < deadline:
                time.sleep(0.05)
                snap = backend.snapshot()
                assert snap is not None
            chunks.append(snap.tier("l3").chunks)
            listing = httpx.get(srv.url + "/v1/sessions", timeout=5).json()
            assert listing["data"] == []
        finally:
            srv.stop()
    # the warm-up's chunks are kept and found again at the next start: no start adds to the store
    assert chunks[0] == chunks[1] == WARM_UP_CHUNKS


def test_warm_up_request_runs_before_ready_and_counts_nowhere(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The in-process warm-up request (kvtier.server.warm_request) is served through the HTTP
    route and the scheduler before /readyz says ready, with API keys configured too (it needs
    none, and clients still do), and it shows in no request metric and no session listing."""
    keys = tmp_path / "keys"
    admin = apikeys.add(keys, "ops", admin=True)[1]
    caplog.set_level(logging.INFO, logger="kvtier.server")
    srv = _InProcess(dataclasses.replace(_config(tmp_path / "l3"), api_keys=keys)).start()
    try:
        served = [r.getMessage() for r in caplog.records if "warm-up request" in r.getMessage()]
        assert len(served) == 1 and "served in" in served[0], served
        assert srv.state.warming is False
        metrics = httpx.get(srv.url + "/metrics", timeout=5).text
        assert "kvtier_server_requests_total{" not in metrics  # no response counted yet
        assert _sample(metrics, "kvtier_server_e2e_request_latency_seconds_count") == 0
        assert _sample(metrics, "kvtier_server_prompt_tokens_total") in (0, None)
        auth = {"Authorization": f"Bearer {admin}"}
        listing = httpx.get(srv.url + "/v1/sessions", headers=auth, timeout=5).json()
        assert listing["data"] == []  # the warm-up tenant's ephemeral session is forgotten
        body = {"model": "default", "prompt": "hi", "max_tokens": 1}
        assert httpx.post(srv.url + "/v1/completions", json=body, timeout=30).status_code == 401
        r = httpx.post(srv.url + "/v1/completions", json=body, headers=auth, timeout=30)
        assert r.status_code == 200
        metrics = httpx.get(srv.url + "/metrics", timeout=5).text
        done = {"endpoint": "/v1/completions", "code": "200"}
        assert _labelled(metrics, "kvtier_server_requests_total", done) == 1  # the client's only
        refused = {**done, "code": "401"}
        assert _labelled(metrics, "kvtier_server_requests_total", refused) == 1
    finally:
        srv.stop()


def _labelled(text: str, name: str, labels: dict[str, str]) -> float | None:
    """The value of the sample `name` with exactly `labels` in Prometheus text (None: absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and s.labels == labels:
                return float(s.value)
    return None


def _sample(text: str, name: str) -> float | None:
    """The value of an unlabelled sample in Prometheus text (None when absent)."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def _slow(fn: Any, seconds: float, started: threading.Event) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        started.set()
        time.sleep(seconds)  # a restore throttled from L3, holding the cache's lock
        return fn(*args, **kwargs)

    return call


def test_a_blocked_cache_call_never_stalls_the_event_loop(live: _InProcess) -> None:
    backend = live.state.engine.backend
    body = {"model": "default", "prompt": "hello there", "max_tokens": 2, "temperature": 0}
    headers = {"X-Session-ID": "busy"}
    assert httpx.post(live.url + "/v1/completions", json=body, headers=headers).status_code == 200
    assert httpx.get(live.url + "/v1/sessions").json()["fresh"] is True  # one listing is known

    restoring, snapping = threading.Event(), threading.Event()
    backend.restore = _slow(backend.restore, 1.5, restoring)
    # with paged L1 the session's next turn starts from its pages: that call is slowed too
    backend.resume_pages = _slow(backend.resume_pages, 1.5, restoring)
    backend.snapshot = _slow(backend.snapshot, 1.5, snapping)
    slow = threading.Thread(
        target=lambda: httpx.post(
            live.url + "/v1/completions", json=body, headers=headers, timeout=30
        )
    )
    slow.start()
    try:
        assert restoring.wait(10)
        with httpx.Client(base_url=live.url, timeout=10) as client:
            t0 = time.perf_counter()
            listing = client.get("/v1/sessions")
            t_list = time.perf_counter() - t0
            assert snapping.is_set()  # the snapshot is in its (slow) thread
            t0 = time.perf_counter()
            health = client.get("/healthz")
            t_health = time.perf_counter() - t0
            t0 = time.perf_counter()
            again = client.get("/v1/sessions")  # shares the snapshot in flight
            t_again = time.perf_counter() - t0
        assert health.status_code == 200 and listing.status_code == 200
        assert listing.json()["fresh"] is False
        assert [s["session_id"] for s in listing.json()["data"]] == ["busy"]
        assert again.json()["fresh"] is False
        assert max(t_list, t_health, t_again) < 0.5, (t_list, t_health, t_again)
    finally:
        slow.join(30)
        del backend.restore, backend.snapshot  # the class's own methods again
    time.sleep(1.6)  # the slow snapshot in flight finishes
    assert httpx.get(live.url + "/v1/sessions", timeout=10).json()["fresh"] is True


def test_second_server_on_a_held_root_exits_with_one_line(tmp_path: Path) -> None:
    l3 = tmp_path / "l3"
    first = Server(l3, "--l1-bytes", "32MiB", "--l2-bytes", "32MiB", "--l3-writer", "threads")
    first.start()
    try:
        cmd = [sys.executable, "-m", "ops.cli", "serve", "--port", str(free_port())]
        cmd += ["--l3-root", str(l3), "--log-level", "warning", "--l3-writer", "threads"]
        cmd += ["--l1-bytes", "32MiB", "--l2-bytes", "32MiB"]
        env = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
        second = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        assert first.proc is not None and first.proc.poll() is None  # the holder is untouched
        assert httpx.get(first.url + "/readyz", timeout=5).status_code == 200
    finally:
        first.stop()
    assert second.returncode == 1
    err = second.stderr
    assert "Traceback" not in err
    # refused before the app starts: no banner, no uvicorn start-up, no model loaded
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    # the store's typed error, by name and message (which names the holder and what to do)
    assert lines[0].startswith("kvtier serve: StoreInUse: ")
    assert str(l3) in lines[0] and f"process {first.proc.pid}" in lines[0]
    assert "another --l3-root" in lines[0] and "gc, migrate" not in lines[0]
