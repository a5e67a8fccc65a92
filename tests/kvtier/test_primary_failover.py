"""Losing the primary device (embeddings, LM head, the batch's buffers, the session L1) on the
fake two-device layout (CPU, float32), and getting it back.

As in test_multi_device.py, a lost device is a fault injected in the middle of a batch, with
everything the device held poisoned (NaN) at that moment: its decoder layer, the embeddings,
the final norm, the LM head and the rotary tables, the sampler's mask, its pages, and every
session's L1 buffers. A result that read any of them could not match the greedy reply of the
same model alone on one device (transformers' DynamicCache).
"""

from __future__ import annotations

import asyncio
import functools
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest
from test_batching import _build, _config, _greedy_alone, _job, _prompts
from test_multi_device import _turn

from kvtier import CacheConfig, TieredCache
from kvtier.placement import DeviceLost
from kvtier.server.backend import TieredBackend
from kvtier.server.batch.batching import BatchScheduler
from kvtier.server.batch.jobs import Finished
from kvtier.server.devices.failover import DEGRADED, DRAINING, FAILED, HEALTHY, RESTORING, place
from kvtier.server.devices.model import cache_kwarg
from kvtier.server.http.devices_admin import device_readiness
from kvtier.server.metrics import ServerMetrics
from kvtier.types import SessionState

CPU = torch.device("cpu")
NAN = float("nan")
Reply = tuple[str, Finished | None]


def _run(sched: BatchScheduler, *calls: Any) -> list[Reply]:
    """Run turns (`_turn`) together; their (text, Finished) in order."""

    async def main() -> list[Reply]:
        return list(await asyncio.gather(*calls))

    return asyncio.run(asyncio.wait_for(main(), 120))


def _poison_weights(placed: Any) -> None:
    """Device 0's layers and every weight outside the layers (embeddings, norm, LM head,
    rotary buffers) become NaN."""
    with torch.no_grad():
        for i in placed.placement.layers_on(0):
            for p in placed.layers[i].parameters():
                p.fill_(NAN)
        for module, name, is_param, _ in placed.host.rest:
            t = module._parameters[name] if is_param else module._buffers[name]
            if t is not None and t.is_floating_point():
                t.fill_(NAN)


def _poison_primary(served: Any, sched: BatchScheduler, backend: TieredBackend) -> None:
    """What the lost primary's memory is worth: NaN (False for the sampler's mask)."""
    placed = served.devices.placed
    _poison_weights(placed)
    with torch.no_grad():
        if served.allowed is not None:
            served.allowed.fill_(False)
        for s in backend.cache.sessions():
            if s.bufs is not None:
                for k, v in s.bufs.layers:
                    k.fill_(NAN)
                    v.fill_(NAN)
    pool: Any = sched.pool  # a ShardedPagePool
    pool.poison(0)


def _next(prompts: list[list[int]], replies: list[Any], *more: int) -> list[list[int]]:
    return [p + list(r[0].encode()) + list(more) for p, r in zip(prompts, replies, strict=True)]


def test_primary_lost_mid_batch_loses_no_session_and_restores(tmp_path: Path) -> None:
    ref = _build("llama")
    registry = CollectorRegistry()
    metrics = ServerMetrics(registry)
    served = place(_build("llama"), [CPU, CPU], metrics)
    failover = served.devices
    backend = TieredBackend(served.model, _config(tmp_path), served.name)
    sched = BatchScheduler(served, backend, _config(tmp_path))
    pages_before = sched.pool.num_pages
    old_l1 = backend.cache.l1
    prompts = _prompts(5, [5, 60, 130, 17, 90])
    try:
        # turn 1, healthy: every session commits (write-through stores its full chunks in L2)
        first = _run(sched, *[_turn(sched, _job(f"s{i}", p, 16)) for i, p in enumerate(prompts)])
        for (text, _), p in zip(first, prompts, strict=True):
            assert text == _greedy_alone(ref, p, 16)
        # turn 2 of s0-s3; the primary is lost while they decode. s4 stays idle in L1.
        seconds = _next(prompts[:4], first[:4], 10, 65)

        def trigger(text: str) -> None:
            if len(text) >= 4 and failover.state == HEALTHY and not failover.placed._faults:
                poison = lambda: _poison_primary(served, sched, backend)  # noqa: E731
                failover.placed.inject_fault(0, "test fault", before=poison)

        async def second() -> list[Reply]:
            calls = [_turn(sched, _job(f"s{i}", p, 24), trigger if i == 1 else None)
                     for i, p in enumerate(seconds)]  # fmt: skip
            return list(await asyncio.gather(*calls))

        replies = asyncio.run(asyncio.wait_for(second(), 120))
        assert failover.history == [HEALTHY, DRAINING, DEGRADED]
        assert failover.state == DEGRADED and "device 0 lost" in failover.reason
        assert failover.placed.placement.layers == (1, 1) and failover.placed.lost == {0}
        assert failover.placed.placement.primary == 1
        assert sched.pool.num_pages == pages_before // 2  # the survivor holds the same bytes
        assert backend.cache.l1 is not old_l1  # a new, empty L1 (old one: poisoned, unread)
        assert failover.last_failover_s is not None and failover.last_failover_s < 5
        for (text, fin), p in zip(replies, seconds, strict=True):
            assert fin is not None and fin.finish_reason in ("length", "stop")  # none lost
            assert text == _greedy_alone(ref, p, 24)
        # /readyz and the metrics say degraded, with the reason
        ready = device_readiness(failover, "m")
        assert ready is not None and ready.status_code == 200
        body = json.loads(bytes(ready.body))
        assert body["status"] == "degraded" and "device 0 lost" in body["reason"]
        scraped = generate_latest(registry)
        assert b'kvtier_server_devices{state="lost"} 1.0' in scraped
        assert b"kvtier_server_degraded 1.0" in scraped
        # turn 3, degraded: exact; s4's prefix comes from L2 (its L1 copy was on device 0)
        s4 = backend.cache.session("s4", tenant="t")
        assert s4.state is SessionState.HIBERNATED and not s4.resident
        stored = len(s4.tokens)
        assert stored == stored // 32 * 32 > 0  # the tail only L1 held is gone
        thirds = _next(seconds, replies, 10) + _next(prompts[4:], first[4:], 10, 66)
        again = _run(sched, *[_turn(sched, _job(f"s{i}", p, 10)) for i, p in enumerate(thirds)])
        for (text, fin), p in zip(again, thirds, strict=True):
            assert fin is not None and fin.cached_tokens > 0
            assert text == _greedy_alone(ref, p, 10)
        fin4 = again[4][1]
        assert fin4 is not None and fin4.source == "l2" and fin4.cached_tokens == stored
        # device 0 is back: primary home again, the pool at its first size, turns exact
        status = failover.restore(0).result(timeout=30)
        assert status["state"] == HEALTHY and failover.history[-2:] == [RESTORING, HEALTHY]
        assert failover.placed.placement.layers == (0, 1) and failover.placed.primary_device == CPU
        assert sched.pool.num_pages == pages_before
        assert device_readiness(failover, "m") is None
        assert b"kvtier_server_degraded 0.0" in generate_latest(registry)
        fourths = _next(thirds, again, 10)
        last = _run(sched, *[_turn(sched, _job(f"s{i}", p, 8)) for i, p in enumerate(fourths)])
        for (text, fin), p in zip(last, fourths, strict=True):
            assert fin is not None and fin.cached_tokens > 0  # hibernated whole before moving
            assert text == _greedy_alone(ref, p, 8)
    finally:
        sched.close()
        backend.close()


def test_requested_failover_of_the_primary_while_idle(tmp_path: Path) -> None:
    ref = _build("llama")
    served = place(_build("llama"), [CPU, CPU])
    failover = served.devices
    backend = TieredBackend(served.model, _config(tmp_path), served.name)
    sched = BatchScheduler(served, backend, _config(tmp_path))
    prompt = _prompts(9, [70])[0]
    try:
        ((text, _),) = _run(sched, _turn(sched, _job("a", prompt, 12)))
        status = failover.fail(0, "operator").result(timeout=30)  # the scheduler is idle
        assert status["state"] == DEGRADED and status["devices"][0]["state"] == "lost"
        assert status["devices"][1]["layers"] == [0, 1]
        assert status["devices"][0]["home_layers"] == [0]
        with pytest.raises(DeviceLost, match="last device"):
            failover.fail(1)
        nxt = prompt + list(text.encode()) + [10]
        ((again, fin),) = _run(sched, _turn(sched, _job("a", nxt, 12)))
        assert fin is not None and fin.source == "l2"  # its L1 copy was on device 0
        assert fin.cached_tokens > 0 and fin.cached_tokens % 32 == 0  # full chunks only
        assert again == _greedy_alone(ref, nxt, 12)
        assert failover.restore(0).result(timeout=30)["state"] == HEALTHY
        third = nxt + list(again.encode()) + [10]
        ((last, fin),) = _run(sched, _turn(sched, _job("a", third, 12)))
        assert fin is not None and fin.source == "l2"  # hibernated whole from device 1's L1
        assert fin.cached_tokens > len(nxt) // 32 * 32  # with its tail this time
        assert last == _greedy_alone(ref, third, 12)
    finally:
        sched.close()
        backend.close()


def test_move_l1_keeps_only_what_l2_holds(tmp_path: Path) -> None:
    """The cache alone: after `move_l1`, an idle session resumes from the chunks L2 holds, with
    the K/V they had; the tail only L1 held is recomputed; a running request reloads."""
    served = _build("llama")
    cache = TieredCache(CacheConfig(l3_root=tmp_path / "l3", chunk_tokens=32), served.model)
    try:
        ids = _prompts(3, [100])[0]
        s = cache.session("x")
        kv = s.restore(ids)
        with torch.inference_mode():
            kwargs = {cache_kwarg(served.model): kv}
            served.model(input_ids=torch.tensor([ids]), use_cache=True, **kwargs)
        s.commit(ids)
        assert s.bufs is not None
        want = [(k[:, :, :96].clone(), v[:, :, :96].clone()) for k, v in s.bufs.layers]
        busy = cache.session("y")
        other = _prompts(4, [40])[0]
        busy.restore(other)  # a request running on it (ACTIVE, nothing committed)
        for k, v in s.bufs.layers:
            k.fill_(NAN)
            v.fill_(NAN)
        before = cache.l1.budget_bytes
        assert cache.move_l1(CPU) == before and cache.l1.used_bytes == 0
        assert s.state is SessionState.HIBERNATED and list(s.tokens) == ids[:96]
        assert busy.state is SessionState.ACTIVE and not busy.resident
        kv = s.restore([*ids, 5])
        assert kv.get_seq_length() == 96 and s.restore_source == "l2" and s.bufs is not None
        for (k, v), (wk, wv) in zip(s.bufs.layers, want, strict=True):
            assert torch.equal(k[:, :, :96], wk) and torch.equal(v[:, :, :96], wv)
        s.abort()
        kv = cache.reload_session(busy, other)
        assert kv.get_seq_length() == 0 and busy.resident  # it had nothing stored
        busy.abort()
        with pytest.raises(Exception, match="reload"):
            cache.reload_session(s, ids)
    finally:
        cache.close()


def test_http_fail_and_restore_the_primary(tmp_path: Path) -> None:
    """Through the real server on two logical CPU devices: `POST /v1/admin/devices/0/fail`
    moves the primary to device 1, /readyz and the metrics say degraded with the reason, a
    session's next turn restores its stored chunks from L2 and equals a new session's reply;
    device 1, now the last one, cannot be failed; `restore` brings device 0 back as primary."""
    import httpx
    from server_proc import Server
    from server_proc import chat as server_chat
    from server_proc import reply_text as text

    args = ("--devices", "cpu,cpu", "--max-concurrency", "4", "--chunk-tokens", "32")
    srv = Server(tmp_path / "l3", *args).start()
    try:
        url = srv.url
        chat = functools.partial(server_chat, url, max_tokens=16)  # chat(session, messages)

        def cached(r: httpx.Response) -> int:
            return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])

        talk = [{"role": "user", "content": "hello there, " * 12}]
        first = chat("s1", talk)
        talk += [{"role": "assistant", "content": text(first)}, {"role": "user", "content": "so?"}]

        r = httpx.post(url + "/v1/admin/devices/0/fail", timeout=60)
        assert r.status_code == 200, r.text
        status = r.json()
        assert status["state"] == DEGRADED and status["devices"][0]["state"] == "lost"
        assert [d["layers"] for d in status["devices"]] == [[], [0, 1]]
        last = httpx.post(url + "/v1/admin/devices/1/fail", timeout=60)
        assert last.status_code == 409 and "last device" in last.text
        ready = httpx.get(url + "/readyz", timeout=10)
        assert ready.status_code == 200 and ready.json()["status"] == "degraded"
        assert "device 0 lost" in ready.json()["reason"]
        metrics = httpx.get(url + "/metrics", timeout=10).text
        assert 'kvtier_server_devices{state="lost"} 1.0' in metrics
        assert "kvtier_server_degraded 1.0" in metrics

        second = chat("s1", talk)  # its L1 copy was on device 0: full chunks from L2
        assert second.headers["X-Kvtier-Degraded"] == "1"
        assert cached(second) > 0 and cached(second) % 32 == 0
        assert text(second) == text(chat("n1", talk))

        r = httpx.post(url + "/v1/admin/devices/0/restore", timeout=60)
        assert r.status_code == 200 and r.json()["state"] == HEALTHY, r.text
        assert [d["layers"] for d in r.json()["devices"]] == [[0], [1]]
        assert httpx.get(url + "/readyz", timeout=10).json()["status"] == "ready"
        talk += [{"role": "assistant", "content": text(second)}, {"role": "user", "content": "ok"}]
        third = chat("s1", talk)
        assert third.headers["X-Kvtier-Degraded"] == "0" and cached(third) > cached(second)
        assert text(third) == text(chat("n2", talk))
    finally:
        assert srv.stop() == 0, srv.output()


def test_losing_the_last_device_is_failed(tmp_path: Path) -> None:
    """Device 1 lost, then device 0 (the last one) mid-batch: nothing is left to fail over to;
    the step's request fails with the device error (never hangs), /readyz answers 503."""
    served = place(_build("llama"), [CPU, CPU])
    failover = served.devices
    backend = TieredBackend(served.model, _config(tmp_path), served.name)
    sched = BatchScheduler(served, backend, _config(tmp_path))
    try:
        assert failover.fail(1).result(timeout=30)["state"] == DEGRADED
        failover.placed.inject_fault(0, "the last one")
        with pytest.raises(DeviceLost, match="the last one"):
            asyncio.run(asyncio.wait_for(_turn(sched, _job("z", [65, 66, 67], 4)), 60))
        assert failover.state == FAILED and failover.history[-1] == FAILED
        assert "last device" in failover.reason
        ready = device_readiness(failover, "m")
        assert ready is not None and ready.status_code == 503
        assert json.loads(bytes(ready.body))["status"] == "failed"
    finally:
        sched.close()
        backend.close()


def test_replacing_the_primary_reloads_the_rest_tied_weights_stay_tied() -> None:
    """`PlacedModel.replace(primary)` loads the embeddings, norm, head and rotary tables from
    the host copy (their device copy poisoned), keeps tied weights one Parameter, and the
    model's logits equal the unplaced model's; `restore` brings them home."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvtier.placement import PlacedModel, Placement

    def build() -> Any:
        torch.manual_seed(3)
        cfg = LlamaConfig(
            vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
        )  # fmt: skip
        return LlamaForCausalLM(cfg).eval()

    ref, model = build(), build()
    placed = PlacedModel(model, Placement.balanced(3, [CPU, CPU]))
    assert placed.placement.layers == (0, 0, 1)
    tied = model.lm_head.weight
    assert tied is model.model.embed_tokens.weight
    _poison_weights(placed)
    placed.replace(0)
    assert placed.placement.layers == (1, 1, 1) and placed.placement.primary == 1
    assert model.lm_head.weight is tied and model.model.embed_tokens.weight is tied
    ids = torch.tensor([[5, 9, 11, 40, 2]])
    with torch.inference_mode():
        want = ref(input_ids=ids).logits
        assert torch.equal(model(input_ids=ids).logits, want)
        placed.restore(0)
        assert placed.placement.layers == (0, 0, 1) and placed.placement.primary == 0
        assert torch.equal(model(input_ids=ids).logits, want)
