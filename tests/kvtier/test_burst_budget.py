"""A burst stays inside the memory plan: 64 sessions arrive at once and finish together.

Every prompt spans several chunks and L2 is tiny, so the commits queue behind L3 writes. A
ledger of the live bytes the serving threads create on the device (`device_ledger`) must stay
within the plan's parts for them: the copies in flight and the staging buffers, beside what one
step of the batch needs. A commit that gathered each finished turn's chunks onto the device at
once, as new tensors beside the pool, held every waiting commit's K/V there (the CUDA OOM of a
burst on an H100): this test fails on such a path.
"""

from __future__ import annotations

import random
from pathlib import Path

from device_ledger import DeviceLedger, armed
from test_batching import _build, _config, _greedy_alone, _job, _one, _run

from kvtier.server.backend import TieredBackend
from kvtier.server.batch.batching import BatchScheduler
from kvtier.server.devices.memplan import activation_estimate
from kvtier.server.devices.model import ServedModel

SESSIONS = 64
PROMPT = 300  # tokens: ten chunks of 32, the last one partial
REPLY = 4


def _deep() -> ServedModel:
    """A tiny Llama with many layers: a chunk of its K/V (64 KiB) outweighs one step's
    activations, as a 7B model's 3,000-token turn (172 MB) outweighs a decode step's."""
    return _build("llama", layers=8, kv_heads=4)


def test_a_burst_of_finishing_turns_stays_within_the_plan(tmp_path: Path) -> None:
    ref, served = _deep(), _deep()  # the same weights: the reference runs alone
    chunk_bytes = 32 * 8 * 2 * 4 * 16 * 4  # tokens * layers * k|v * kv heads * dim * fp32
    config = _config(
        tmp_path,
        max_concurrency=SESSIONS,
        batch_tokens=512,
        prefill_step=64,
        decoding_prompt_tokens=0,
        l2_bytes=16 * chunk_bytes,  # 16 slots for 640 chunks: commits wait for L3 writes
    )
    backend = TieredBackend(served.model, config, served.name)
    parts = backend.cache.device_bytes()
    rng = random.Random(7)
    prompts = [[rng.randrange(32, 250) for _ in range(PROMPT)] for _ in range(SESSIONS)]
    ledger = DeviceLedger("cpu")
    with armed(ledger):
        sched = BatchScheduler(served, backend, config)
        try:
            results = _run(
                sched, *(_one(sched, _job(f"b{i}", p, REPLY)) for i, p in enumerate(prompts))
            )
        finally:
            sched.close()
    try:
        assert all(r.finished.finish_reason in ("length", "stop") for r in results)
        print(
            f"burst: peak {ledger.peak / 2**20:.2f} MiB on the device by the serving threads, "
            f"in-flight bound {parts['inflight_max'] / 2**20:.2f} MiB, staging "
            f"{parts['staging'] / 2**20:.2f} MiB, backpressure waits "
            f"{backend.cache.stats().backpressure_waits}"
        )
        # one step's activations, as the plan estimates them offline (`kvtier plan`)
        step = activation_estimate(64, 128, 257, 512, SESSIONS, 4)
        bound = parts["inflight_max"] + parts["staging"] + step
        top = ", ".join(f"{b >> 10} KiB {op} on {th}" for b, op, th in ledger.largest)
        assert ledger.peak <= bound, (
            f"the serving threads held {ledger.peak / 2**20:.1f} MiB on the device at once, "
            f"over the plan's in-flight {parts['inflight_max'] / 2**20:.1f} MiB + staging "
            f"{parts['staging'] / 2**20:.1f} MiB + one step {step / 2**20:.1f} MiB; "
            f"largest: {top}"
        )
        assert backend.cache.engine.gather_bytes() <= parts["inflight_max"]
        for i in (0, SESSIONS - 1):  # exact replies, as alone
            assert results[i].text == _greedy_alone(ref, prompts[i], REPLY)
    finally:
        backend.close()
