"""The exporter's collectors on real inputs: exact values, no state between scrapes, missing
sources yield nothing, and the standalone `kvtier exporter` over a real L3 store."""

from __future__ import annotations

import hashlib
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from test_exporter_inputs import FIXTURE, GIB, fixture_host_snapshot, full_cache_snapshot, scrape

from kvtier.errors import ConfigError
from kvtier.kvbin import ChunkHeader
from kvtier.snapshot import CacheSnapshot, TierStats
from kvtier.tiers.l3 import L3Store, SessionRecord
from ops.collectors import sample
from ops.exporter import CacheCollector, HostCollector, make_registry
from ops.exporter.standalone import l3_snapshot_fn, parse_listen

REPO = Path(__file__).resolve().parents[2]


def value(registry: CollectorRegistry, sample_name: str, **labels: str) -> float | None:
    for _, _, samples in scrape(registry).values():
        for (name, lbl), v in samples.items():
            if name == sample_name and dict(lbl) == labels:
                return v
    return None


def test_cache_snapshot_values_are_exported_exactly() -> None:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(CacheCollector(full_cache_snapshot))
    assert value(reg, "kvtier_tier_used_bytes", tier="l2") == 31 * GIB
    assert value(reg, "kvtier_tier_evictions_total", tier="l2") == 120
    assert value(reg, "kvtier_transfer_seconds_total", src="l2", dst="l3") == 2.0
    assert value(reg, "kvtier_queue_depth", queue="l3_write") == 17
    assert value(reg, "kvtier_restore_decisions_total", src="recompute") == 2
    assert value(reg, "kvtier_restored_tokens_total", src="recompute") == 0  # filled in
    assert value(reg, "kvtier_checksum_failures_total") == 1
    assert value(reg, "kvtier_restore_duration_seconds_bucket", src="l3", le="0.1") == 0
    assert value(reg, "kvtier_restore_duration_seconds_bucket", src="l3", le="0.25") == 8
    assert value(reg, "kvtier_restore_duration_seconds_bucket", src="l3", le="+Inf") == 8
    assert value(reg, "kvtier_restore_duration_seconds_sum", src="l3") == 1.6


def test_idle_cache_still_has_every_session_state_and_source() -> None:
    empty = CacheSnapshot(taken_at=1.0, tiers=(TierStats("l1", 100, 0, 0),))
    reg = CollectorRegistry(auto_describe=False)
    reg.register(CacheCollector(lambda: empty))
    for state in ("active", "idle", "hibernated"):
        assert value(reg, "kvtier_sessions", state=state) == 0
    for src in ("l1", "l2", "l3", "recompute"):
        assert value(reg, "kvtier_restore_decisions_total", src=src) == 0


def test_each_scrape_reads_a_fresh_snapshot() -> None:
    calls: list[int] = []

    def snap() -> CacheSnapshot:
        calls.append(1)
        return CacheSnapshot(taken_at=1.0, tiers=(TierStats("l1", 100, len(calls), 0),))

    reg = CollectorRegistry(auto_describe=False)
    reg.register(CacheCollector(snap))
    assert value(reg, "kvtier_tier_used_bytes", tier="l1") == 1
    assert value(reg, "kvtier_tier_used_bytes", tier="l1") == 2


def test_host_fixture_values_are_exported_exactly(tmp_path: Path) -> None:
    host = fixture_host_snapshot()
    reg = CollectorRegistry(auto_describe=False)
    reg.register(HostCollector(tmp_path, sample_fn=lambda previous: host))
    page = os.sysconf("SC_PAGE_SIZE")
    # Worked by hand from tests/fixtures/gpu-h200/proc.
    meminfo = (FIXTURE / "proc" / "meminfo").read_text()
    avail_kb = int(re.search(r"MemAvailable:\s+(\d+) kB", meminfo).group(1))
    assert value(reg, "kvtier_memory_available_bytes") == avail_kb * 1024
    vmstat = (FIXTURE / "proc" / "vmstat").read_text()
    thresh = int(re.search(r"^nr_dirty_threshold (\d+)$", vmstat, re.M).group(1))
    assert value(reg, "kvtier_memory_dirty_threshold_bytes") == thresh * page
    oom = int(re.search(r"^oom_kill (\d+)$", vmstat, re.M).group(1))
    assert value(reg, "kvtier_vmstat_oom_kill_total") == oom
    line = next(
        x for x in (FIXTURE / "proc" / "buddyinfo").read_text().splitlines() if "Normal" in x
    )
    counts = line.split()[4:]
    assert value(reg, "kvtier_buddyinfo_blocks", node="0", zone="Normal", order="9") == int(
        counts[9]
    )
    assert value(reg, "kvtier_gpu_memory_total_bytes", gpu="0") == 150754820096
    assert value(reg, "kvtier_gpu_pcie_link_max_width", gpu="0") == 16
    # The fixture GPU at 0000:00:06.0 is NVML index 0: the topology label uses the index.
    assert value(reg, "kvtier_gpu_l3_pcie_proximity", gpu="0", device="vda") == 1
    st = os.statvfs(tmp_path)
    assert value(reg, "kvtier_l3_filesystem_size_bytes") == st.f_blocks * st.f_frsize


def test_missing_sources_yield_nothing_instead_of_raising(tmp_path: Path) -> None:
    empty_proc = tmp_path / "proc"
    empty_proc.mkdir()
    reg = CollectorRegistry(auto_describe=False)
    reg.register(
        HostCollector(
            None,
            sample_fn=lambda previous: sample(
                None, proc_root=str(empty_proc), sys_root=str(tmp_path), nvml=False
            ),
        )
    )
    assert scrape(reg) == {}


def test_host_collector_passes_the_previous_snapshot(tmp_path: Path) -> None:
    seen = []

    def sample_fn(previous):
        seen.append(previous)
        return sample(str(tmp_path), previous=previous, nvml=False)

    reg = CollectorRegistry(auto_describe=False)
    reg.register(HostCollector(tmp_path, sample_fn=sample_fn))
    scrape(reg)
    scrape(reg)
    assert seen[0] is None and seen[1] is not None


def test_make_registry_on_this_host(tmp_path: Path) -> None:
    reg = make_registry(full_cache_snapshot, tmp_path, nvml=False)
    got = scrape(reg)
    assert "kvtier_tier_used_bytes" in got
    assert "kvtier_memory_available_bytes" in got  # this machine's /proc
    assert "kvtier_l3_filesystem_avail_bytes" in got


# ---- the standalone exporter over a real L3 store --------------------------------------------


def fill_store(root: Path, chunks: int, sessions: int) -> None:
    """A real store: `chunks` chunk files (fsynced) and `sessions` session records."""
    fp = hashlib.blake2b(b"model", digest_size=16).digest()
    keys = [
        hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).digest() for i in range(chunks)
    ]
    payload = bytes(4096)
    with L3Store(root) as store:
        for start in range(0, chunks, 1000):
            store.put_many(
                [
                    (
                        ChunkHeader(
                            key=k,
                            parent=bytes(16),
                            fingerprint=fp,
                            tenant="t",
                            tokens=16,
                            layers=1,
                            kv_heads=1,
                            head_dim=64,
                            dtype="float32",
                            codec="native",
                            codec_params=b"",
                            payload_len=len(payload),
                            created=time.time(),
                        ),
                        payload,
                    )
                    for k in keys[start : start + 1000]
                ]
            )
        per = max(1, chunks // max(sessions, 1))
        for i in range(sessions):
            store.save_session(
                SessionRecord(
                    session_id=f"s{i}",
                    tenant="t",
                    fingerprint=fp,
                    token_ids=bytes(4 * 16 * per),
                    chunk_keys=tuple(keys[(i * per) % chunks : (i * per) % chunks + per]),
                    pinned=False,
                    ttl_s=None,
                    last_active=time.time(),
                    state="hibernated" if i % 3 else "idle",
                )
            )


def test_l3_snapshot_reads_the_index(tmp_path: Path) -> None:
    fill_store(tmp_path, chunks=30, sessions=6)
    with L3Store(tmp_path, read_only=True) as store:
        snap = l3_snapshot_fn(store)()
    l3 = snap.tier("l3")
    assert l3 is not None and l3.chunks == 30 and l3.used_bytes == 30 * 8192
    assert snap.sessions_in("hibernated") == 4 and snap.sessions_in("idle") == 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scrape(url: str, timeout: float = 60.0) -> str:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return urllib.request.urlopen(url, timeout=5).read().decode()
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def test_kvtier_exporter_command_serves_the_store(tmp_path: Path) -> None:
    fill_store(tmp_path, chunks=12, sessions=3)
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ops.cli",
            "exporter",
            "--l3-root",
            str(tmp_path),
            "--no-gpu",
            "--listen",
            f"127.0.0.1:{port}",
        ],
        cwd=REPO,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        body = _scrape(f"http://127.0.0.1:{port}/metrics")  # waits for the exporter to listen
        assert 'kvtier_tier_chunks{tier="l3"} 12.0' in body
        assert 'kvtier_sessions{state="hibernated"} 2.0' in body
        assert "kvtier_memory_available_bytes" in body
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err
    assert f"http://127.0.0.1:{port}/metrics" in err


def test_exporter_binds_loopback_by_default() -> None:
    from ops.commands.exporter import command

    listen = next(p for p in command.params if p.name == "listen")
    assert parse_listen(listen.default)[0] == "127.0.0.1"


@pytest.mark.parametrize("bad", ["9400", "host:", ":9400", "127.0.0.1:99999", "127.0.0.1:x"])
def test_bad_listen_is_a_clear_error(bad: str) -> None:
    with pytest.raises(ConfigError, match="HOST:PORT"):
        parse_listen(bad)


def test_exporter_starts_before_the_store_and_picks_it_up(tmp_path: Path) -> None:
    root = tmp_path / "l3"
    root.mkdir(mode=0o700)  # empty: the cache has never run here
    port = free_port()
    cmd = [sys.executable, "-m", "ops.cli", "exporter", "--l3-root", str(root), "--no-gpu"]
    proc = subprocess.Popen(
        [*cmd, "--listen", f"127.0.0.1:{port}"], cwd=REPO, stderr=subprocess.PIPE, text=True
    )
    try:
        url = f"http://127.0.0.1:{port}/metrics"
        body = _scrape(url)
        assert "kvtier_l3_up 0.0" in body
        assert "kvtier_tier_chunks" not in body  # no made-up zeros for a store that is not there
        assert "kvtier_memory_available_bytes" in body  # the host half works meanwhile
        fill_store(root, chunks=5, sessions=2)  # the cache starts and writes its store
        body = _scrape(url)
        assert "kvtier_l3_up 1.0" in body
        assert 'kvtier_tier_chunks{tier="l3"} 5.0' in body
        assert 'kvtier_sessions{state="hibernated"} 1.0' in body
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err
    assert "no L3 store" in err and "kvtier_l3_up 0" in err


def test_exporter_refuses_a_missing_root(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "ops.cli", "exporter", "--l3-root", str(tmp_path / "nope")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "is not a directory" in result.stderr
