"""200 concurrent agent sessions against a live server: no errors, RSS flat after warm-up."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import psutil
import pytest
from server_proc import Server

from kvtier.loadgen import LoadConfig, run


@pytest.mark.slow
def test_200_sessions_no_errors_rss_flat(tmp_path: Path) -> None:
    # A small L1 so sessions really move down to L2 and L3 while the fleet runs.
    srv = Server(
        tmp_path / "l3", "--l1-bytes", "4MiB", "--l2-bytes", "16MiB", "--queue-timeout", "300"
    ).start()
    try:
        proc = psutil.Process(srv.proc.pid)  # type: ignore[union-attr]
        base = LoadConfig(
            url=srv.url,
            sessions=200,
            turns=2,
            think_ms=300,
            max_tokens=4,
            system_chars=600,
            user_chars=60,
            tool_chars=60,
            compare=0,
            run_id="warm",
        )
        rss: list[int] = []
        for round_ in range(3):
            result = run(dataclasses.replace(base, run_id=f"r{round_}"))
            assert result["ok"] == result["requests"] == 400, result["errors"]
            assert result["errors"] == {}
            rss.append(proc.memory_info().rss)
        sources = set(result["ttft_ms"]["by_source"])
        assert sources & {"l2", "l3"}, sources  # eviction really happened
        # Round 0 warms up allocators, the L2 slab and per-thread state; after that, 400 more
        # requests and 200 more sessions each must not grow the process by more than 5%.
        assert rss[2] - rss[1] < 0.05 * rss[1], [r // 2**20 for r in rss]
    finally:
        assert srv.stop() == 0, srv.output()
