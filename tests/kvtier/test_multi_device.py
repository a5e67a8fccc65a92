"""Layers across devices and device failover, on a fake two-device layout (CPU, float32).

Two *logical* devices that are both the CPU: the placement, the sharded page pool, the hops
between stages and the failover state machine run as on two GPUs; a lost device is simulated by
a fault injected in the middle of a batch, its weights and pages poisoned (NaN) at that moment,
so a result that read them could not match. Every reply is compared with the greedy reply of
the same model alone on one device (transformers' DynamicCache).
"""

from __future__ import annotations

import asyncio
import functools
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from test_batching import _build, _config, _greedy_alone, _job, _prompts, _run

from kvtier.errors import ConfigError
from kvtier.geometry import KVGeometry
from kvtier.paged import PagedSequence, PagePool
from kvtier.paged.sharded import ShardedPagePool
from kvtier.placement import DeviceLost, Placement, parse_devices
from kvtier.server.backend import TieredBackend
from kvtier.server.batch.batching import BatchScheduler
from kvtier.server.batch.jobs import Delta, Finished, Stream
from kvtier.server.devices.failover import DEGRADED, DRAINING, HEALTHY, RESTORING, place

CPU = torch.device("cpu")


def _layers(n: int, *devices: int) -> tuple[int, ...]:
    return Placement.balanced(n, [CPU] * len(devices)).layers


def test_balanced_ranges_and_replacement() -> None:
    assert Placement.balanced(32, [CPU, CPU]).ranges() == {0: (0, 15), 1: (16, 31)}
    assert _layers(5, 0, 1, 2) == (0, 0, 1, 1, 2)
    p = Placement.balanced(8, [CPU] * 4)
    assert p.layers == (0, 0, 1, 1, 2, 2, 3, 3)
    lost = p.without(2)  # its two layers go to two of the survivors, counts stay balanced
    assert sorted(lost.layers.count(d) for d in (0, 1, 3)) == [2, 3, 3]
    assert 2 not in lost.layers
    assert Placement.balanced(4, [CPU, CPU]).without(1).layers == (0, 0, 0, 0)
    with pytest.raises(DeviceLost):
        Placement.balanced(4, [CPU]).without(0)
    with pytest.raises(ConfigError, match="at most 2"):
        Placement.balanced(2, [CPU] * 3)


def test_parse_devices() -> None:
    assert parse_devices("auto", cuda_count=2) == [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert parse_devices("0,1", cuda_count=2) == [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert parse_devices("cuda:1", cuda_count=2) == [torch.device("cuda", 1)]
    assert parse_devices("cpu,cpu", cuda_count=0) == [CPU, CPU]
    assert parse_devices("", cuda_count=2) == []
    for bad, why in (("auto", "no GPU"), ("2", "not visible"), ("0,0", "twice"), ("gpu", "not")):
        with pytest.raises(ConfigError, match=why):
            parse_devices(bad, cuda_count=1 if bad != "auto" else 0)


def test_sharded_pool_pages_and_chunks_equal_one_pool() -> None:
    g = KVGeometry(4, 2, 8, 8, "float32", "gqa")
    placement = Placement(devices=(CPU, CPU), layers=(0, 1, 1, 0))  # not contiguous on purpose
    one = PagePool(g, 64 * 4 * 2 * 2 * 8 * 4 * 16, page_size=16)
    two = ShardedPagePool(g, 64 * 4 * 2 * 2 * 8 * 4 * 16, placement, page_size=16)
    assert one.num_pages == two.num_pages == 64
    assert two.bytes_on(0) == two.bytes_on(1) == one.kv.numel() * 4 // 2
    seq1, seq2 = PagedSequence(), PagedSequence()
    for pool, seq in ((one, seq1), (two, seq2)):
        assert pool.reserve(seq, 40)
        src = torch.arange(4 * 2 * 40 * 2 * 8, dtype=torch.float32).view(4, 2, 40, 2, 8)
        pool.scatter(seq.pages, 0, src)
        seq.length = 40
    assert torch.equal(one.gather(seq1.pages, 3, 37), two.gather(seq2.pages, 3, 37))
    for layer in range(4):
        assert torch.equal(one.gather_layer(seq1.pages, 0, 40, layer)[1],
                           two.gather_layer(seq2.pages, 0, 40, layer)[1])  # fmt: skip
    # copy-on-write of a shared, partial tail copies every device's layers
    fork1, fork2 = one.fork(seq1), two.fork(seq2)
    assert one.reserve(fork1, 1) and two.reserve(fork2, 1)
    assert fork2.pages[-1] != seq2.pages[-1]
    assert torch.equal(one.gather(fork1.pages, 0, 40), two.gather(fork2.pages, 0, 40))


async def _turn_stream(
    sched: BatchScheduler, job: Any, on_delta: Any = None
) -> tuple[str, Finished | None, Stream]:
    """One turn through the scheduler: its text, its Finished event and its stream;
    `on_delta(text so far)` after each delta."""
    stream = Stream(asyncio.get_running_loop())
    done = asyncio.wrap_future(sched.submit(job, stream, time.perf_counter()))
    text, finished = "", None
    async for event in stream.events():
        if isinstance(event, Delta):
            text += event.text
            if on_delta is not None:
                on_delta(text)
        elif isinstance(event, Finished):
            finished = event
    await done
    return text, finished, stream


async def _turn(
    sched: BatchScheduler, job: Any, on_delta: Any = None
) -> tuple[str, Finished | None]:
    text, finished, _ = await _turn_stream(sched, job, on_delta)
    return text, finished


def _poison(served: Any, sched: BatchScheduler, device: int) -> None:
    """What a lost device's memory is worth: its layers' weights and its pages become NaN."""
    placed = served.devices.placed
    with torch.no_grad():
        for i in placed.placement.layers_on(device):
            for p in placed.layers[i].parameters():
                p.fill_(float("nan"))
    assert isinstance(sched.pool, ShardedPagePool), "layers across devices shard the pool"
    sched.pool.poison(device)


def test_fault_mid_batch_loses_no_session_and_next_turns_are_exact(tmp_path: Path) -> None:
    ref = _build("llama")
    served = place(_build("llama"), [CPU, CPU])
    failover = served.devices
    backend = TieredBackend(served.model, _config(tmp_path), served.name)
    sched = BatchScheduler(served, backend, _config(tmp_path))
    pages_before = sched.pool.num_pages
    prompts = _prompts(7, [5, 60, 130, 17])
    tokens = 24
    try:

        def trigger(text: str) -> None:
            if len(text) >= 6 and failover.state == HEALTHY and not failover.placed._faults:
                failover.placed.inject_fault(
                    1, "test fault", before=lambda: _poison(served, sched, 1)
                )

        async def first() -> list[tuple[str, Finished | None]]:
            calls = [_turn(sched, _job(f"s{i}", p, tokens), trigger if i == 1 else None)
                     for i, p in enumerate(prompts)]  # fmt: skip
            return list(await asyncio.gather(*calls))

        replies = asyncio.run(asyncio.wait_for(first(), 120))
        assert failover.history == [HEALTHY, DRAINING, DEGRADED]
        assert "device 1 lost" in failover.reason and failover.state == DEGRADED
        assert failover.placed.placement.layers == (0, 0)
        assert sched.pool.num_pages == pages_before // 2  # the survivor holds the same bytes
        assert failover.last_failover_s is not None and failover.last_failover_s < 5
        for (text, fin), p in zip(replies, prompts, strict=True):
            assert fin is not None and fin.finish_reason in ("length", "stop")  # none lost
            assert text == _greedy_alone(ref, p, tokens)
        # next turns, degraded: every session restores what it committed, exactly
        seconds = [
            p + list(text.encode()) + [10, 65, 66]
            for p, (text, _) in zip(prompts, replies, strict=True)
        ]
        again = _run(sched, *[_turn(sched, _job(f"s{i}", p, 10)) for i, p in enumerate(seconds)])
        for (text, fin), p in zip(again, seconds, strict=True):
            assert fin is not None and fin.cached_tokens > 0
            assert text == _greedy_alone(ref, p, 10)
        # the device comes back: layers go home, the pool regains its size, turns stay exact
        status = failover.restore(1).result(timeout=30)
        assert status["state"] == HEALTHY and failover.history[-2:] == [RESTORING, HEALTHY]
        assert failover.placed.placement.layers == (0, 1) and sched.pool.num_pages == pages_before
        thirds = [
            p + list(text.encode()) + [10] for p, (text, _) in zip(seconds, again, strict=True)
        ]
        last = _run(sched, *[_turn(sched, _job(f"s{i}", p, 8)) for i, p in enumerate(thirds)])
        for (text, _), p in zip(last, thirds, strict=True):
            assert text == _greedy_alone(ref, p, 8)
    finally:
        sched.close()
        backend.close()


def test_requested_failover_while_idle_and_errors(tmp_path: Path) -> None:
    served = place(_build("llama"), [CPU, CPU])
    failover = served.devices
    backend = TieredBackend(served.model, _config(tmp_path), served.name)
    sched = BatchScheduler(served, backend, _config(tmp_path))
    try:
        with pytest.raises(ConfigError, match="no device 5"):
            failover.fail(5)
        with pytest.raises(ConfigError, match="not lost"):
            failover.restore(1)
        status = failover.fail(1, "operator").result(timeout=30)  # the scheduler is idle
        assert status["state"] == DEGRADED and status["devices"][1]["state"] == "lost"
        assert status["devices"][0]["layers"] == [0, 1]
        with pytest.raises(ConfigError, match="already lost"):
            failover.fail(1)
        with pytest.raises(DeviceLost, match="primary"):
            failover.fail(0)
        assert failover.restore(1).result(timeout=30)["state"] == HEALTHY
    finally:
        sched.close()
        backend.close()


def test_http_fail_and_restore_a_device(tmp_path: Path) -> None:
    """Through the real server on two logical CPU devices, degraded mode on: the admin routes,
    /readyz, the degraded and streaming headers and usage fields, the metrics; a short session
    runs exact while degraded, a long one over sinks + window, and its next turn after the
    restore is exact (its stored KV was never written from the approximate turn)."""
    import httpx
    from server_proc import Server
    from server_proc import chat as server_chat
    from server_proc import reply_text as text

    args = ("--devices", "cpu,cpu", "--max-concurrency", "4", "--degraded-window", "48")
    srv = Server(tmp_path / "l3", *args).start()
    try:
        url = srv.url
        chat = functools.partial(server_chat, url, max_tokens=16)  # chat(session, messages)

        status = httpx.get(url + "/v1/admin/devices", timeout=10).json()
        assert status["state"] == HEALTHY
        assert [d["layers"] for d in status["devices"]] == [[0], [1]]
        long = [{"role": "user", "content": "hello there, " * 20}]
        first = chat("s1", long)
        assert first.headers["X-Kvtier-Degraded"] == "0"
        long += [{"role": "assistant", "content": text(first)}, {"role": "user", "content": "so?"}]
        short = [{"role": "user", "content": "hi"}]
        healthy_short = text(chat("h1", short))

        r = httpx.post(url + "/v1/admin/devices/1/fail", timeout=60)
        assert r.status_code == 200 and r.json()["state"] == DEGRADED
        assert httpx.post(url + "/v1/admin/devices/1/fail", timeout=60).status_code == 409
        assert httpx.post(url + "/v1/admin/devices/0/fail", timeout=60).status_code == 409
        ready = httpx.get(url + "/readyz", timeout=10)
        assert ready.status_code == 200 and ready.json()["status"] == "degraded"
        assert "device 1 lost" in ready.json()["reason"]
        degraded_short = chat("h2", short)  # shorter than sinks + window: full attention, exact
        assert degraded_short.headers["X-Kvtier-Degraded"] == "1"
        assert "X-Kvtier-Streaming-Attention" not in degraded_short.headers
        assert text(degraded_short) == healthy_short
        second = chat("s1", long)  # longer: over 4 sinks + the last 48 tokens
        assert second.headers["X-Kvtier-Streaming-Attention"] == "sinks=4, window=48"
        usage = second.json()["usage"]
        assert usage["kvtier"]["degraded"] is True and usage["kvtier"]["windowed_attention"] is True
        assert usage["prompt_tokens"] == 52
        metrics = httpx.get(url + "/metrics", timeout=10).text
        assert 'kvtier_server_devices{state="lost"} 1.0' in metrics
        assert "kvtier_server_degraded 1.0" in metrics
        assert "kvtier_server_degraded_turns_total 2.0" in metrics
        assert "kvtier_server_streaming_turns_total 1.0" in metrics

        r = httpx.post(url + "/v1/admin/devices/1/restore", timeout=60)
        assert r.status_code == 200 and r.json()["state"] == HEALTHY
        assert httpx.get(url + "/readyz", timeout=10).json()["status"] == "ready"
        # s1's next turn restores its exact first turn and equals a new session's reply
        long += [{"role": "assistant", "content": text(second)}, {"role": "user", "content": "ok"}]
        third = chat("s1", long)
        assert third.headers["X-Kvtier-Degraded"] == "0"
        assert third.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert text(third) == text(chat("s2", long))
    finally:
        assert srv.stop() == 0, srv.output()


def test_devices_settings_from_flags_environment_and_toml(tmp_path: Path) -> None:
    from kvtier.placement import devices_setting
    from kvtier.server.config import ServerConfig
    from kvtier.server.devices.failover import place_configured

    toml = tmp_path / "kvtier.toml"
    toml.write_text("[serve]\ndevices = [0, 1]\ndegraded_window = 512\n")
    cfg = ServerConfig.load(env={}, file=toml)
    assert cfg.devices == "0,1" and cfg.degraded_window == 512 and cfg.degraded_sinks == 4
    cfg = ServerConfig.load(env={"KVTIER_DEVICES": "auto"}, file=toml)
    assert cfg.devices == "auto"
    cfg = ServerConfig.load(flags={"devices": "cpu,cpu"}, env={"KVTIER_DEVICES": "auto"})
    assert devices_setting(cfg.devices) == "cpu,cpu"
    assert devices_setting("", env={"KVTIER_DEVICES": "0,1"}) == "0,1"
    with pytest.raises(ConfigError, match="negative"):
        ServerConfig.load(flags={"degraded_window": -1}, env={})
    with pytest.raises(ConfigError, match="batching"):
        place_configured(_build("llama"), ServerConfig(devices="cpu,cpu", batching=False))
    one = _build("llama")
    assert place_configured(one, ServerConfig(devices="cpu")).devices is None


def test_an_error_that_loses_no_device_fails_its_step_only(tmp_path: Path) -> None:
    """A forward error after which every device still computes (the probe) is the step's own:
    its requests fail as on one device, and the placement stays healthy."""
    served = place(_build("llama"), [CPU, CPU])
    failover = served.devices
    backend = TieredBackend(served.model, _config(tmp_path), served.name)
    sched = BatchScheduler(served, backend, _config(tmp_path))
    step = sched.runner.step
    calls: list[int] = []

    def once(batch: Any, feed: Any = None) -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("CUDA error: unspecified launch failure")
        return step(batch, feed)

    sched.runner.step = once  # type: ignore[method-assign]
    try:
        with pytest.raises(RuntimeError, match="unspecified launch failure"):
            asyncio.run(_turn(sched, _job("e1", [65, 66, 67], 4)))
        assert failover.history == [HEALTHY] and not failover.placed.lost
        text, fin = asyncio.run(_turn(sched, _job("e2", [65, 66, 67], 4)))
        assert fin is not None and fin.finish_reason in ("length", "stop") and text
    finally:
        sched.close()
        backend.close()
