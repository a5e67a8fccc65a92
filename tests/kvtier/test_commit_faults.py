"""No fault of the cache costs a reply: a finished turn whose commit fails still delivers its
reply, the session keeps what was stored before (the rest is recomputed at its next turn), and
the failure is counted in kvtier_commit_failures_total by reason.

Each fault is raised where it starts: a device out-of-memory in the gather of a chunk from the
pages, a full or failing L3 in the store's write path, L4 down, a bug. The scheduler, the cache
and the model are real (a tiny random Llama on the CPU).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry
from test_batching import _build, _config, _greedy_alone, _job, _one, _run

from kvtier.errors import L4Unavailable, StoreFullError, StoreIOError
from kvtier.paged import PagePool
from kvtier.server.backend import TieredBackend
from kvtier.server.batch.batching import BatchScheduler
from kvtier.server.metrics import ServerMetrics

FAULTS: dict[str, BaseException] = {
    "device_oom": torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 172.00 MiB"),
    "l3_full": StoreFullError("L3 filesystem is full"),
    "l3_io": StoreIOError("write failed: Input/output error"),
    "l4": L4Unavailable("L4 (redis) is down"),
    "internal": RuntimeError("a bug"),
}


@pytest.mark.parametrize("reason", sorted(FAULTS))
def test_a_failed_commit_still_delivers_the_reply(
    reason: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ref, served = _build("llama"), _build("llama")
    config = _config(tmp_path)
    backend = TieredBackend(served.model, config, served.name)
    registry = CollectorRegistry()
    metrics = ServerMetrics(registry)
    prompt = [40 + i % 50 for i in range(100)]  # four chunks of 32
    fault = FAULTS[reason]
    gather = PagePool.gather

    def failing_gather(self: PagePool, *args: Any, **kw: Any) -> torch.Tensor:
        if kw.get("out") is not None or len(args) > 3:  # a commit's gather into its buffer
            raise fault
        return gather(self, *args, **kw)

    sched = BatchScheduler(served, backend, config, metrics=metrics)
    try:
        monkeypatch.setattr(PagePool, "gather", failing_gather)
        first = _run(sched, _one(sched, _job("f", prompt, 8)))[0]
        monkeypatch.setattr(PagePool, "gather", gather)
        assert first.finished.finish_reason == "length"
        assert first.text == _greedy_alone(ref, prompt, 8)  # the reply reached its client
        count = registry.get_sample_value("kvtier_commit_failures_total", {"reason": reason})
        assert count == 1
        # the next turn of the session recomputes what was not stored, and is exact
        again = prompt + [70] * 40
        second = _run(sched, _one(sched, _job("f", again, 8)))[0]
        assert second.text == _greedy_alone(ref, again, 8)
    finally:
        sched.close()
        backend.close()
    assert sched.pages.holding == 0  # every held page went back
