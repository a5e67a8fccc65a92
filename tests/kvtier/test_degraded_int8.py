"""Degraded mode's int8 page pool (`degraded_kv = "int8"`), on the fake two-device layout of
test_multi_device.py (two logical CPU devices, float32): the quantization's error bound, the
int8 pool's writers and readers, and a failover that rebuilds the pool as int8 on the survivor
(more tokens in the same bytes), runs the next turns over it, and goes back to the native pool,
and exact replies, when the device is restored."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry
from test_batching import _build, _config, _greedy_alone, _job, _prompts, _run
from test_multi_device import _poison
from test_multi_device import _turn_stream as _turn

from kvtier.errors import ConfigError, KvtierError
from kvtier.geometry import KVGeometry
from kvtier.paged import BatchRunner, PagedSequence, PagePool, SeqInput
from kvtier.paged.quant import dequantize_kv, quantize_kv
from kvtier.paged.sharded import ShardedPagePool
from kvtier.placement import Placement
from kvtier.server.backend import TieredBackend
from kvtier.server.batch.batching import BatchScheduler
from kvtier.server.config import ServerConfig
from kvtier.server.devices.failover import DEGRADED, DRAINING, HEALTHY, RESTORING, place
from kvtier.server.http.devices_admin import DEGRADED_KV_HEADER, DegradedTurn
from kvtier.server.metrics import ServerMetrics

CPU = torch.device("cpu")
# Logits of one step over int8 pages vs the same step over native pages, on the tiny random
# Llama (2 layers): the largest difference, relative to the largest logit. Measured in float32
# on the CPU: 0.12 % (200-token prompt) and 0.27 % (60 tokens); bf16 on the CPU: 0.6 %.
LOGITS_TOLERANCE = 0.03


def test_quantize_round_trip_error_bound() -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 4, 64, generator=g) * torch.tensor([1e-3, 1.0, 30.0, 1e4])[None, :, None]
    x[0, 0] = 0.0  # an all-zero row stays zero (no division by a zero scale)
    x[1, 1, 5] = 500.0  # an outlier sets its row's scale
    q, scale = quantize_kv(x)
    assert q.dtype == torch.int8 and q.shape == x.shape and scale.shape == x.shape[:2]
    assert int(q.abs().max()) <= 127
    back = dequantize_kv(q, scale, torch.float32)
    bound = x.abs().amax(dim=-1, keepdim=True) / 254  # half a step of max|x| / 127
    assert bool(((back - x).abs() <= bound * (1 + 1e-5) + 1e-12).all())
    assert torch.equal(back[0, 0], torch.zeros(64))
    for dtype in (torch.float16, torch.bfloat16):
        assert dequantize_kv(q, scale, dtype).dtype == dtype
    bad = x.clone()
    bad[2, 3, 0] = float("inf")
    bad[3, 2, 7] = float("nan")
    q, scale = quantize_kv(bad)
    back = dequantize_kv(q, scale, torch.float32)
    assert bool(back[2, 3].isnan().all()) and bool(back[3, 2].isnan().all())  # never finite
    assert torch.equal(back[4], dequantize_kv(*quantize_kv(x[4]), torch.float32))


def _geometry() -> KVGeometry:
    return KVGeometry(4, 2, 16, 16, "float32", "gqa")


def test_int8_pool_holds_more_tokens_and_reads_back_within_the_bound() -> None:
    g = _geometry()
    budget = 64 * 4 * 2 * 2 * 16 * 4 * 16  # 64 native float32 pages of 16 tokens
    native = PagePool(g, budget, page_size=16)
    one = PagePool(g, budget, page_size=16, kv_dtype="int8")
    placement = Placement(devices=(CPU, CPU), layers=(0, 1, 1, 0))
    two = ShardedPagePool(g, budget, placement, page_size=16, kv_dtype="int8")
    assert native.num_pages == 64 and one.quantized and not native.quantized
    # a (token, head) row: 16 int8 values + a float32 scale = 20 bytes, where float32 takes 64
    assert one.page_bytes * 64 == native.page_bytes * 20 and one.native_page_bytes == budget // 64
    assert one.num_pages == two.num_pages == 204
    assert two.bytes_on(0) + two.bytes_on(1) <= budget
    src = torch.randn(4, 2, 40, 2, 16, generator=torch.Generator().manual_seed(0))
    bound = src.abs().amax(dim=-1, keepdim=True) / 254 * (1 + 1e-5)
    seqs = []
    for pool in (one, two):
        seq = PagedSequence()
        assert pool.reserve(seq, 40)
        pool.scatter(seq.pages, 0, src)
        seq.length = 40
        seqs.append(seq)
        back = pool.gather(seq.pages, 0, 40)
        assert back.dtype == torch.float32 and bool(((back - src).abs() <= bound).all())
        for layer in range(4):
            k, v = pool.gather_layer(seq.pages, 0, 40, layer)
            assert torch.equal(k, back[layer, 0]) and torch.equal(v, back[layer, 1])
        with pytest.raises(KvtierError, match="int8"):
            pool.layer_cache(0)
    assert torch.equal(one.gather(seqs[0].pages, 3, 37), two.gather(seqs[1].pages, 3, 37))
    # write_layer quantizes (the scheduler's copy-in); copy-on-write copies the scales too
    for pool, seq in zip((one, two), seqs, strict=True):
        fork = pool.fork(seq)
        assert pool.reserve(fork, 1) and fork.pages[-1] != seq.pages[-1]
        new = torch.full((1, 2, 16), 3.0)
        slot = torch.tensor([pool.slot(fork.pages, 40)])
        pool.write_layer(2, new, -new, slot)
        assert torch.equal(pool.gather(fork.pages, 0, 40), pool.gather(seq.pages, 0, 40))
        k, v = pool.gather_layer(fork.pages, 40, 41, 2)
        assert torch.equal(k, new) and torch.equal(v, -new)
    two.poison(1)  # a lost device's int8 pages read as NaN, never as numbers
    assert bool(two.gather_layer(seqs[1].pages, 0, 40, 1)[0].isnan().all())
    assert not bool(two.gather_layer(seqs[1].pages, 0, 40, 0)[0].isnan().any())
    with pytest.raises(ConfigError, match="kv_dtype"):
        PagePool(g, budget, kv_dtype="int4")


def _step_logits(model: Any, pool: PagePool, prompt: list[int]) -> torch.Tensor:
    """One prefill step over `pool` and one decode step; the decode step's logits."""
    runner = BatchRunner(model, pool, max_batch=4, max_tokens=512, max_seq_len=1024)
    seq = PagedSequence()
    try:
        runner.step([SeqInput(seq, prompt[:-1])])
        return runner.step([SeqInput(seq, prompt[-1:])])[0].float()
    finally:
        runner.release(seq)


def test_int8_runner_steps_close_to_native_and_refuses_graphs() -> None:
    served = _build("llama")
    g = KVGeometry.from_config(served.model.config)
    prompt = _prompts(5, [200])[0]
    native = _step_logits(served.model, PagePool(g, 2**22, page_size=16), prompt)
    pool = PagePool(g, 2**22, page_size=16, kv_dtype="int8")
    int8 = _step_logits(served.model, pool, prompt)
    assert float((int8 - native).abs().max()) <= LOGITS_TOLERANCE * float(native.abs().max())
    runner = BatchRunner(served.model, pool, max_batch=4, max_tokens=64, max_seq_len=256)
    with pytest.raises(ConfigError, match="eager"):
        runner.capture_graphs()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_int8_pages_on_cuda_bf16_close_to_native() -> None:
    """On a GPU in bf16, pages of 256 tokens: native pages run the fast kernels (varlen flash or
    Triton), int8 pages the dequantizing reference path (flash SDPA for the prompt chunk); one
    decode step's logits agree within the stated tolerance, and a batch of two sequences (the
    batched decode path) gives each the logits it gets alone."""
    model = _build("llama").model.to("cuda", torch.bfloat16)
    g = KVGeometry.from_config(model.config)
    prompt = _prompts(5, [300])[0]

    def pool(kv: str) -> PagePool:
        return PagePool(g, 2**24, page_size=256, device="cuda", dtype=torch.bfloat16, kv_dtype=kv)

    native = _step_logits(model, pool("native"), prompt)
    int8_pool = pool("int8")
    int8 = _step_logits(model, int8_pool, prompt)
    assert float((int8 - native).abs().max()) <= 2 * LOGITS_TOLERANCE * float(native.abs().max())
    runner = BatchRunner(model, int8_pool, max_batch=4, max_tokens=512, max_seq_len=1024)
    a, b = PagedSequence(), PagedSequence()
    runner.step([SeqInput(a, prompt[:-1])])
    runner.step([SeqInput(b, prompt[:100])])
    both = runner.step([SeqInput(a, prompt[-1:]), SeqInput(b, prompt[100:101])]).float()
    runner.release(a)
    runner.release(b)
    assert torch.allclose(both[0], int8, rtol=0, atol=0.02 * float(int8.abs().max()))
    alone = _step_logits(model, int8_pool, prompt[:101])
    assert torch.allclose(both[1], alone, rtol=0, atol=0.02 * float(alone.abs().max()))


def test_fault_mid_batch_int8_pool_then_restore_is_native_and_exact(tmp_path: Path) -> None:
    ref = _build("llama")
    served = place(_build("llama"), [CPU, CPU])
    failover = served.devices
    config = _config(tmp_path, degraded_kv="int8")
    backend = TieredBackend(served.model, config, served.name)
    sched = BatchScheduler(served, backend, config)
    pages_before = sched.pool.num_pages
    assert not sched.pool.quantized
    prompts = _prompts(7, [5, 60, 130, 17])
    tokens = 24
    try:

        def fault(text: str) -> None:
            if len(text) >= 6 and failover.state == HEALTHY and not failover.placed._faults:
                failover.placed.inject_fault(
                    1, "test fault", before=lambda: _poison(served, sched, 1)
                )

        first = _run(
            sched,
            *[
                _turn(sched, _job(f"s{i}", p, tokens), fault if i == 1 else None)
                for i, p in enumerate(prompts)
            ],
        )
        assert failover.history == [HEALTHY, DRAINING, DEGRADED]
        assert sched.pool.quantized and sched.pool.kv_dtype == "int8"
        # the survivor holds the bytes of half the native pool: int8 rows of 16 values + a
        # float32 scale (20 bytes) where float32 takes 64, so 3.2x the native degraded pages
        native_degraded = pages_before // 2
        assert sched.pool.num_pages >= 3 * native_degraded
        used = sched.pool.num_pages * sched.pool.page_bytes
        assert used <= native_degraded * sched.pool.native_page_bytes  # no more bytes
        for text, fin, stream in first:
            assert fin is not None and fin.finish_reason in ("length", "stop")  # none lost
            assert fin.completion_tokens > 0 and text
            assert stream.degraded_kv == "int8"  # each ran on after the fault, over int8 pages
        # one step over the int8 pages, the scheduler idle: close to full precision
        g = KVGeometry.from_config(ref.model.config)
        full = _step_logits(_build("llama").model, PagePool(g, 2**22, page_size=16), prompts[1])
        seq = PagedSequence()
        try:
            sched.runner.step([SeqInput(seq, prompts[1][:-1])])
            step = sched.runner.step([SeqInput(seq, prompts[1][-1:])])[0].float()
        finally:
            sched.runner.release(seq)
        assert float((step - full).abs().max()) <= LOGITS_TOLERANCE * float(full.abs().max())
        # the headers and metrics of a turn that starts now
        metrics = ServerMetrics(CollectorRegistry())
        turn = DegradedTurn(failover, None, metrics, first[0][2])
        assert turn.headers()[DEGRADED_KV_HEADER] == "int8" and turn.kv == "int8"
        turn.finished()
        assert metrics.int8_kv_turns._value.get() == 1.0
        # next turns, degraded over int8 pages; the device returns in the middle of them: the
        # running sequences leave the int8 pool without writing their sessions' KV, and go on
        # over native pages (recomputing what the int8 pages held)
        seconds = [
            p + list(text.encode()) + [10, 65, 66]
            for p, (text, _, _) in zip(prompts, first, strict=True)
        ]

        def back(text: str) -> None:
            if len(text) >= 4 and failover.state == DEGRADED and not failover.pending:
                failover.restore(1)

        again = _run(
            sched,
            *[
                _turn(sched, _job(f"s{i}", p, 12), back if i == 0 else None)
                for i, p in enumerate(seconds)
            ],
        )
        assert failover.history[-2:] == [RESTORING, HEALTHY]
        assert not sched.pool.quantized and sched.pool.num_pages == pages_before
        for text, fin, _ in again:
            assert fin is not None and fin.finish_reason in ("length", "stop") and text
            # each first turn ran on over int8 pages after the fault: it committed only what it
            # had restored (nothing), as no value read from int8 pages may be stored
            assert fin.cached_tokens == 0
        assert again[0][2].degraded_kv == "int8"  # its first tokens came from int8 pages
        # healthy again: exact replies, as the sessions' stored KV holds no value read from int8
        # pages: a turn that ran wholly over them committed only its exact restored prefix (none
        # here), and s0, running as the device came back, went on over native pages, whose K/V
        # (its whole conversation, recomputed) it committed
        thirds = [
            p + list(text.encode()) + [10] for p, (text, _, _) in zip(seconds, again, strict=True)
        ]
        last = _run(sched, *[_turn(sched, _job(f"s{i}", p, 8)) for i, p in enumerate(thirds)])
        for (text, fin, stream), p in zip(last, thirds, strict=True):
            assert text == _greedy_alone(ref, p, 8)
            assert fin is not None and stream.degraded_kv == "native"
        assert last[0][1].cached_tokens > len(thirds[0]) // 2
    finally:
        sched.close()
        backend.close()


def test_degraded_kv_setting(tmp_path: Path) -> None:
    assert ServerConfig().degraded_kv == "native"
    toml = tmp_path / "kvtier.toml"
    toml.write_text('[serve]\ndegraded_kv = "int8"\n')
    assert ServerConfig.load(env={}, file=toml).degraded_kv == "int8"
    env = {"KVTIER_DEGRADED_KV": "native"}
    assert ServerConfig.load(env=env, file=toml).degraded_kv == "native"
    assert ServerConfig.load(flags={"degraded_kv": "int8"}, env=env).degraded_kv == "int8"
    with pytest.raises(ConfigError, match=r"'native'.*'int8'"):
        ServerConfig.load(flags={"degraded_kv": "fp4"}, env={})
    import click
    from click.testing import CliRunner

    from kvtier.server.run import options

    @click.command()
    @options
    def show(**kw: Any) -> None:
        click.echo(kw["degraded_kv"])

    assert CliRunner().invoke(show, ["--degraded-kv", "int8"]).output.strip() == "int8"
    assert CliRunner().invoke(show, ["--degraded-kv", "int4"]).exit_code != 0


def test_http_degraded_kv_int8_headers_usage_and_metrics(tmp_path: Path) -> None:
    """Through the real server on two logical CPU devices with --degraded-kv int8: a turn while
    degraded says its K/V was int8 (header, usage, metric); after the restore a session's turn
    is native again and equals a new session's reply (no int8 value reached its stored KV)."""
    import httpx
    from server_proc import Server
    from server_proc import chat as server_chat
    from server_proc import reply_text as reply

    args = ("--devices", "cpu,cpu", "--max-concurrency", "4", "--degraded-kv", "int8")
    srv = Server(tmp_path / "l3", *args).start()
    try:
        url = srv.url
        chat = functools.partial(server_chat, url, max_tokens=12)  # chat(session, messages)

        talk = [{"role": "user", "content": "hello there, " * 6}]
        first = chat("s1", talk)
        assert DEGRADED_KV_HEADER not in first.headers
        assert first.json()["usage"]["kvtier"]["degraded_kv"] == "native"
        r = httpx.post(url + "/v1/admin/devices/1/fail", timeout=60)
        assert r.status_code == 200 and r.json()["state"] == DEGRADED
        talk += [
            {"role": "assistant", "content": reply(first)},
            {"role": "user", "content": "and?"},
        ]
        second = chat("s1", talk)
        assert second.headers["X-Kvtier-Degraded"] == "1"
        assert second.headers[DEGRADED_KV_HEADER] == "int8"
        usage = second.json()["usage"]["kvtier"]
        assert usage["degraded"] is True and usage["degraded_kv"] == "int8"
        metrics = httpx.get(url + "/metrics", timeout=10).text
        assert "kvtier_server_int8_kv_turns_total 1.0" in metrics
        r = httpx.post(url + "/v1/admin/devices/1/restore", timeout=60)
        assert r.status_code == 200 and r.json()["state"] == HEALTHY
        talk += [{"role": "assistant", "content": reply(second)}, {"role": "user", "content": "ok"}]
        third = chat("s1", talk)
        assert DEGRADED_KV_HEADER not in third.headers
        assert third.json()["usage"]["kvtier"]["degraded_kv"] == "native"
        assert third.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # turn one
        assert reply(third) == reply(chat("s2", talk))
    finally:
        assert srv.stop() == 0, srv.output()
