"""The start-up warm-up through the cache fits a small L1 instead of failing on it.

The warm-up prefills a 2,048-token prompt and stores and restores a 1,024-token one on a
throwaway session whose K/V must fit the cache's L1. An L1 that cannot hold them (a model with
a large K/V per token, a small `l1_bytes`) used to fail a pass of it with L1BudgetExceeded, and
the server started with no measured prefill rate and no L3 path set up. Each pass now runs again
at a length that fits: the same paths are warmed and measured on shorter prompts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.errors import L1BudgetExceeded
from kvtier.server.backend import make_backend
from kvtier.server.batch.engine import Engine
from kvtier.server.config import ServerConfig
from kvtier.server.devices.model import build_default

# The built-in model's K/V: 2 layers x (K, V) x 2 heads x 16 x 4 bytes = 512 bytes a token, held
# in L1 by 256-token chunks of 128 KiB
CHUNK_BYTES = 256 * 512


@contextlib.contextmanager
def _engine(tmp_path: Path, l1_bytes: int) -> Iterator[Engine]:
    config = ServerConfig(
        l3_root=tmp_path / "l3",
        device="cpu",
        l1_bytes=l1_bytes,
        l2_bytes=32 * 2**20,
        l3_writer="threads",
    )
    served = build_default("cpu")
    engine = Engine(served, make_backend(served, config), config)
    try:
        yield engine
    finally:
        asyncio.run(engine.drain())


def test_a_small_l1_shrinks_the_warm_up_to_what_fits(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kvtier.server")
    # two chunks: neither the 2,049-token prefill nor the 1,057-token returning turn fits
    with _engine(tmp_path, 2 * CHUNK_BYTES) as engine:
        engine.warm_up()
        again = [r.getMessage() for r in caplog.records if "again with" in r.getMessage()]
        assert len(again) >= 2 and "L1 budget" in again[0], again
        backend = engine.backend
        assert backend.prefill_estimate().samples >= 1  # a measured prefill rate
        snap = backend.snapshot()
        assert snap is not None and snap.sessions == ()  # the throwaway session is gone
        assert dict(snap.restore_decisions).get("l3", 0) >= 1  # the L3 path ran


def test_an_l1_that_holds_no_chunk_still_says_so(tmp_path: Path) -> None:
    """Not a loop: with no length that fits, the warm-up fails (the server logs it and serves)."""
    with _engine(tmp_path, CHUNK_BYTES // 2) as engine, pytest.raises(L1BudgetExceeded):
        engine.warm_up()
