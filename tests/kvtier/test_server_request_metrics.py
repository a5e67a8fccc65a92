"""The metrics a vLLM operator expects of `kvtier serve`: responses of the /v1 endpoints by route
template and status code, and each request's end-to-end latency, queue time, time per output
token and inter-token latency (kvtier.server.reqmetrics into kvtier.server.metrics).

The middleware and the turn clock on a small app of their own first, then a real server process
(batching on and off) serving requests whose figures the scrape must add up to.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI, HTTPException
from fastapi.responses import StreamingResponse
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from server_proc import Server
from starlette.testclient import TestClient

from kvtier.server.metrics import ServerMetrics
from kvtier.server.reqmetrics import UNMATCHED, RequestMetrics, TurnClock, arrived

SMALL = ("--l1-bytes", "32MiB", "--l2-bytes", "32MiB")
TOKENS = 6  # every completion below runs to max_tokens (the built-in model's text has no EOS)
NEW = (
    "kvtier_server_e2e_request_latency_seconds",
    "kvtier_server_request_queue_time_seconds",
    "kvtier_server_time_per_output_token_seconds",
    "kvtier_server_inter_token_latency_seconds",
)


def _requests(registry: CollectorRegistry, endpoint: str, code: int) -> float:
    labels = {"endpoint": endpoint, "code": str(code)}
    return registry.get_sample_value("kvtier_server_requests_total", labels) or 0.0


# ---- the middleware and the clock, in this process -------------------------------------------


def _app(metrics: ServerMetrics, seen: dict[str, float]) -> FastAPI:
    app = FastAPI()
    app.add_middleware(RequestMetrics, metrics=metrics)
    registry = metrics._registry

    @app.get("/v1/items/{item_id}")
    async def item(item_id: int) -> dict[str, float]:
        await asyncio.sleep(0.05)  # arrived() is when the request came, not when it is asked
        seen["arrived"], seen["handler"] = arrived(), time.perf_counter()
        if item_id in (400, 429, 503):
            raise HTTPException(item_id, "no")
        return {"id": item_id}

    @app.get("/v1/boom")
    async def boom() -> None:
        raise RuntimeError("a bug")

    @app.get("/v1/stream")
    async def stream() -> StreamingResponse:
        async def chunks() -> AsyncIterator[str]:
            yield "a"
            await asyncio.sleep(0)
            seen["during"] = _requests(registry, "/v1/stream", 200)  # not counted yet
            yield "b"

        return StreamingResponse(chunks())

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    return app


def test_responses_are_counted_by_route_template_and_code() -> None:
    registry = CollectorRegistry()
    metrics = ServerMetrics(registry)
    seen: dict[str, float] = {}
    with TestClient(_app(metrics, seen), raise_server_exceptions=False) as client:
        before = time.perf_counter()
        assert client.get("/v1/items/1").status_code == 200
        assert before <= seen["arrived"] <= seen["handler"] - 0.05  # the route sees the arrival
        assert arrived() >= seen["handler"]  # outside a request: now
        for code in (400, 429, 429, 503):
            assert client.get(f"/v1/items/{code}").status_code == code
        assert client.get("/v1/items/x").status_code == 422  # FastAPI's own validation
        assert client.get("/v1/boom").status_code == 500
        assert client.get("/v1/nowhere/at/all").status_code == 404
        assert client.get("/v1/stream").text == "ab"
        assert client.get("/healthz").status_code == 200
    item = "/v1/items/{item_id}"
    assert _requests(registry, item, 200) == 1
    assert _requests(registry, item, 400) == 1
    assert _requests(registry, item, 429) == 2
    assert _requests(registry, item, 503) == 1
    assert _requests(registry, item, 422) == 1
    assert _requests(registry, "/v1/boom", 500) == 1
    assert _requests(registry, UNMATCHED, 404) == 1
    assert seen["during"] == 0 and _requests(registry, "/v1/stream", 200) == 1
    text = generate_latest(registry).decode()
    assert "/healthz" not in text and "/v1/items/1" not in text  # templates only, /v1 only
    assert "_created" not in text


def test_a_turns_latencies_follow_from_its_clock() -> None:
    registry = CollectorRegistry()
    metrics = ServerMetrics(registry)
    clock = TurnClock(10.0, metrics)
    clock.admit(10.5)
    clock.admit(11.5)  # admitted again after a preemption: the queue ended at the first
    for at in (12.0, 12.25, 12.5, 13.0):
        clock.token(at)
    clock.ended()
    clock.ended()  # once only

    def value(name: str) -> float | None:
        return registry.get_sample_value(name)

    assert value("kvtier_server_request_queue_time_seconds_sum") == 0.5
    assert value("kvtier_server_e2e_request_latency_seconds_sum") == 3.0
    assert value("kvtier_server_time_per_output_token_seconds_sum") == pytest.approx(1 / 3)
    assert value("kvtier_server_inter_token_latency_seconds_count") == 3
    assert value("kvtier_server_inter_token_latency_seconds_sum") == 1.0
    for name in NEW[:3]:
        assert value(name + "_count") == 1

    # the server's own turn, a turn without a token, and a clock without metrics
    TurnClock.start(metrics, internal=True).token(1.0)
    TurnClock.start(None, internal=False).token(1.0)
    quiet = TurnClock.start(metrics, internal=False)
    quiet.admit(time.perf_counter())
    quiet.ended()
    assert value("kvtier_server_request_queue_time_seconds_count") == 2
    assert value("kvtier_server_e2e_request_latency_seconds_count") == 1


# ---- a real server ---------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["--batching", "--no-batching"])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    l3 = tmp_path_factory.mktemp("srv") / "l3"
    srv = Server(l3, "--max-concurrency", "2", request.param, *SMALL).start()
    yield srv
    assert srv.stop() == 0, srv.output()


def _scrape(url: str) -> tuple[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]]:
    text = httpx.get(url + "/metrics", timeout=10).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return text, samples


def _until(url: str, ready: Callable[[dict], bool]) -> tuple[str, dict]:
    """The scrape once `ready` holds: a response counts when it has ended, a turn's latencies
    once its end reached the event loop, both a moment after the client has its last byte (and
    a scrape runs beside the event loop: it may see one of a turn's latencies before the next)."""
    deadline = time.monotonic() + 10
    while True:
        text, samples = _scrape(url)
        if ready(samples) or time.monotonic() > deadline:
            return text, samples
        time.sleep(0.05)


def _req(samples: dict, endpoint: str, code: int) -> float:
    key = ("kvtier_server_requests_total", (("code", str(code)), ("endpoint", endpoint)))
    return float(samples.get(key, 0.0))


def _one(samples: dict, name: str) -> float:
    return float(samples.get((name, ()), 0.0))


def test_a_served_workload_adds_up_on_metrics(server: Server) -> None:
    url, chat = server.url, "/v1/chat/completions"
    _, base = _scrape(url)  # a module's server: start from what is there
    walls: list[float] = []

    def timed(path: str, body: dict, code: int = 200) -> httpx.Response:
        t0 = time.perf_counter()
        r = httpx.post(url + path, json=body, headers={"X-Session-ID": "m-1"}, timeout=60)
        walls.append(time.perf_counter() - t0)
        assert r.status_code == code, r.text
        return r

    msgs = [{"role": "user", "content": "count the tokens"}]
    for i in range(3):
        body = {"model": "default", "messages": msgs, "temperature": 0, "max_tokens": TOKENS}
        r = timed(chat, body)
        assert r.json()["usage"]["completion_tokens"] == TOKENS
        msgs = [*msgs, {"role": "assistant", "content": "ok"}, {"role": "user", "content": f"{i}"}]
    # ignore_eos: a sampled reply (temperature 1) that draws the end token still runs to TOKENS
    streamed = {
        "model": "default",
        "prompt": "abc",
        "max_tokens": TOKENS,
        "stream": True,
        "ignore_eos": True,
    }
    r = timed("/v1/completions", streamed)
    assert r.text.rstrip().endswith("data: [DONE]")
    timed(chat, {"model": "default"}, 400)  # no messages
    timed(chat, {"model": "nope", "messages": msgs}, 404)
    assert httpx.get(url + "/v1/models", timeout=10).status_code == 200
    assert httpx.get(url + "/v1/nowhere", timeout=10).status_code == 404

    def grew(samples: dict, endpoint: str, code: int) -> float:
        return _req(samples, endpoint, code) - _req(base, endpoint, code)

    def delta(samples: dict, name: str) -> float:
        return _one(samples, name) - _one(base, name)

    def settled(samples: dict) -> bool:
        done = grew(samples, "/v1/completions", 200) == 1
        return done and all(delta(samples, n + "_count") == 4 for n in NEW[:3])

    text, now = _until(url, settled)
    assert grew(now, chat, 200) == 3
    assert grew(now, "/v1/completions", 200) == 1  # the stream, counted once it ended
    assert grew(now, chat, 400) == 1 and grew(now, chat, 404) == 1
    assert grew(now, "/v1/models", 200) == 1 and grew(now, UNMATCHED, 404) == 1
    assert "_created" not in text
    turns = 4
    for name in NEW[:3]:
        assert delta(now, name + "_count") == turns, name
    generated = delta(now, "kvtier_server_completion_tokens_total")
    assert generated == turns * TOKENS
    assert delta(now, "kvtier_server_prompt_tokens_total") > 0
    # one gap per token after each turn's first, and their sum is each turn's first-to-last
    assert delta(now, NEW[3] + "_count") == generated - turns
    itl = delta(now, NEW[3] + "_sum")
    tpot = delta(now, NEW[2] + "_sum")
    assert itl == pytest.approx(tpot * (TOKENS - 1), rel=1e-6, abs=1e-9)
    e2e, queue = delta(now, NEW[0] + "_sum"), delta(now, NEW[1] + "_sum")
    assert 0 < itl < e2e <= sum(walls[:turns])  # the server's part of what the client waited
    assert 0 <= queue < e2e


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool missing")
def test_promtool_accepts_the_request_families(server: Server, tmp_path: Path) -> None:
    """The families of this module, as scraped, pass `promtool check metrics` (its lint)."""
    body = {"model": "default", "prompt": "x", "max_tokens": 2}
    assert httpx.post(server.url + "/v1/completions", json=body, timeout=60).status_code == 200
    text, _ = _scrape(server.url)
    ours = ("kvtier_server_requests", *NEW)
    kept = [
        line
        for line in text.splitlines()
        if any(line.split(" ")[2 if line.startswith("#") else 0].startswith(n) for n in ours)
    ]
    assert len(kept) > 20
    out = subprocess.run(
        ["promtool", "check", "metrics"],
        input="\n".join(kept) + "\n",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stdout + out.stderr
