"""Render the Prometheus alert and recording rules from `ops.thresholds`.

`python -m ops.exporter.rules dashboards/prometheus` rewrites `alerts.yml` and `recording.yml`;
a test renders them again and fails when the checked-in files differ, so a threshold changed in
`ops.thresholds` can never silently disagree with the rules Prometheus evaluates.
"""

from __future__ import annotations

import sys
from pathlib import Path

from ops import thresholds as th

RUNBOOK = "docs/runbook.md"

# Alert expressions. `{value}`, `{rate}`, `{window}`, `{horizon}`, `{floor}` come from the
# alert's Threshold (descriptions may also say `{for_}`, its `for` duration).
EXPRESSIONS: dict[str, str] = {
    th.MEMORY_PSI_FULL.alert: "rate(kvtier_pressure_memory_stalled_seconds_total[{window}]) > {value}",
    th.MEMORY_AVAILABLE.alert: (
        "kvtier:memory_available:ratio < {value}\n"
        "and\n"
        "predict_linear(kvtier_memory_available_bytes[{window}], {horizon}) <= 0"
    ),
    th.DIRECT_RECLAIM.alert: "rate(kvtier_vmstat_allocstall_total[{window}]) > {value}",
    th.HIGH_ORDER_BLOCKS.alert: (
        'sum without (order) (kvtier_buddyinfo_blocks{{zone="Normal", order=~"9|[1-9][0-9]"}})'
        " < {value}"
    ),
    th.HUGEPAGE_POOL.alert: (
        "(kvtier_hugepages_free - kvtier_hugepages_reserved) < {value}\nand\nkvtier_hugepages_pool > 0"
    ),
    th.GPU_HEADROOM.alert: "kvtier:gpu_memory_free:ratio < {value}",
    th.L1_EVICTION_STORM.alert: (
        'kvtier:tier_utilization:ratio{{tier="l1"}} > {value}\n'
        "and\n"
        'rate(kvtier_tier_evictions_total{{tier="l1"}}[{window}]) > {rate}'
    ),
    th.L2_SLOTS.alert: (
        'kvtier:tier_utilization:ratio{{tier="l2"}} > {value}\n'
        "and\n"
        'rate(kvtier_tier_evictions_total{{tier="l2"}}[{window}]) > {rate}'
    ),
    th.L3_FILESYSTEM.alert: (
        "kvtier:l3_filesystem_avail:ratio < {value}\n"
        "and\n"
        "predict_linear(kvtier_l3_filesystem_avail_bytes[{window}], {horizon}) < 0"
    ),
    th.L3_SHEDDING.alert: "rate(kvtier_shed_writes_total[{window}]) > {value}",
    th.CHECKSUM_FAILURE.alert: "increase(kvtier_checksum_failures_total[{window}]) > {value}",
    th.COMMIT_FAILURES.alert: (
        "sum without (reason) (increase(kvtier_commit_failures_total[{window}])) > {value}"
    ),
    th.DEVICE_LOST.alert: 'kvtier_server_devices{{state="lost"}} > {value}',
    th.DIRTY_PAGES.alert: (
        "(kvtier_memory_dirty_bytes + kvtier_memory_writeback_bytes)\n"
        "/ kvtier_memory_dirty_threshold_bytes > {value}"
    ),
    th.PCIE_DOWNGRADE.alert: (
        "kvtier_gpu_pcie_link_max_width - kvtier_gpu_pcie_link_width >= {value}\n"
        "or\n"
        "(\n"
        "  kvtier_gpu_pcie_link_max_generation - kvtier_gpu_pcie_link_generation >= {value}\n"
        "  and\n"
        "  kvtier_gpu_pcie_tx_bytes_per_second + kvtier_gpu_pcie_rx_bytes_per_second > {rate}\n"
        ")"
    ),
    th.OOM_KILL.alert: "increase(kvtier_vmstat_oom_kill_total[{window}]) > {value}",
    th.GPU_ALLOC_RETRIES.alert: "increase(kvtier_torch_alloc_retries_total[{window}]) > {value}",
    th.GPU_ALLOC_FRAGMENTED.alert: (
        "kvtier_torch_inactive_split_bytes / (kvtier_torch_reserved_bytes > 0) > {value}\n"
        "and\n"
        "kvtier_torch_inactive_split_bytes > {floor}"
    ),
    th.GPU_BUDGET.alert: (
        "kvtier_gpu_memory_process_bytes\n/ (kvtier_gpu_memory_budget_bytes > 0) > {value}"
    ),
    # `or` matches label sets without the metric name: one alert when both hold. The breaker
    # goes half open (1) between probes while Redis stays down; `up` keeps the alert held then.
    th.L4_DOWN.alert: "kvtier_l4_breaker_state >= {value}\nor\nkvtier_l4_up == 0",
    th.L4_ERRORS.alert: "rate(kvtier_l4_errors_total[{window}]) > {value}",
    th.L4_SHARD_NO_REPLICA.alert: "kvtier_l4_shard_replicas < {value}",
    th.SESSION_MOVES.alert: "rate(kvtier_moved_sessions_total[{window}]) > {value}",
}

SUMMARIES: dict[str, str] = {
    th.MEMORY_PSI_FULL.alert: "Tasks on {{ $labels.instance }} are fully stalled on memory.",
    th.MEMORY_AVAILABLE.alert: "Available memory on {{ $labels.instance }} is running out.",
    th.DIRECT_RECLAIM.alert: "Allocations on {{ $labels.instance }} stall in direct reclaim.",
    th.HIGH_ORDER_BLOCKS.alert: (
        "No free order>=9 blocks in node {{ $labels.node }} zone {{ $labels.zone }}."
    ),
    th.HUGEPAGE_POOL.alert: "The hugepage pool on {{ $labels.instance }} is exhausted.",
    th.GPU_HEADROOM.alert: "GPU {{ $labels.gpu }} has little free framebuffer memory.",
    th.L1_EVICTION_STORM.alert: "L1 is full and evicting sessions in a storm.",
    th.L2_SLOTS.alert: "L2 has no free slot and evicts chunks at a high rate.",
    th.L3_FILESYSTEM.alert: "The L3 filesystem on {{ $labels.instance }} is filling up.",
    th.L3_SHEDDING.alert: "kvtier sheds write-through copies because a write queue is full.",
    th.CHECKSUM_FAILURE.alert: "A chunk failed its checksum and was quarantined.",
    th.COMMIT_FAILURES.alert: "Commits of finished turns failed; their replies were delivered.",
    th.DEVICE_LOST.alert: "A device of the model on {{ $labels.instance }} is lost; serving degraded.",
    th.DIRTY_PAGES.alert: "Dirty pages near the kernel's dirty threshold: writers will block.",
    th.PCIE_DOWNGRADE.alert: "GPU {{ $labels.gpu }} runs on a downgraded PCIe link.",
    th.OOM_KILL.alert: "The kernel OOM killer ran on {{ $labels.instance }}.",
    th.GPU_ALLOC_RETRIES.alert: (
        "cudaMalloc failed on GPU {{ $labels.gpu }} and the allocator flushed its cache to retry."
    ),
    th.GPU_ALLOC_FRAGMENTED.alert: (
        "The CUDA caching allocator on GPU {{ $labels.gpu }} is fragmented."
    ),
    th.GPU_BUDGET.alert: (
        "kvtier on {{ $labels.instance }} holds more GPU memory than its plan's budget."
    ),
    th.L4_DOWN.alert: "The shared L4 tier (Redis) of {{ $labels.instance }} is down.",
    th.L4_ERRORS.alert: "L4 (Redis) operations of {{ $labels.instance }} are failing.",
    th.L4_SHARD_NO_REPLICA.alert: "L4 shard {{ $labels.shard }} has no replica.",
    th.SESSION_MOVES.alert: "Sessions keep moving to {{ $labels.instance }}: a host is flapping.",
}

DESCRIPTIONS: dict[str, str] = {
    th.MEMORY_PSI_FULL.alert: (
        "All non-idle tasks were stalled on memory for more than {value} of the last {window}"
        " (PSI full); latency of every request suffers and the OOM killer is near."
    ),
    th.MEMORY_AVAILABLE.alert: (
        "MemAvailable is below {value} of the RAM outside the hugetlb pool and, at the trend of"
        " the last {window}, reaches zero within {horizon} seconds."
    ),
    th.DIRECT_RECLAIM.alert: (
        "More than {value} allocations per second entered direct reclaim over the last {window}:"
        " allocating threads (the decode loop included) do the kernel's reclaim work."
    ),
    th.HIGH_ORDER_BLOCKS.alert: (
        "The Normal zone has fewer than {value} free blocks of order 9 or more: memory is too"
        " fragmented for huge pages and large pinned or DMA buffers."
    ),
    th.HUGEPAGE_POOL.alert: (
        "Fewer than {value} hugepages of a configured pool are free and unreserved: a restart of"
        " kvtier (or any other hugetlb user) cannot get hugepage-backed L2 slabs."
    ),
    th.GPU_HEADROOM.alert: (
        "Free framebuffer memory of GPU {{{{ $labels.gpu }}}} is below {value} of its total:"
        " the next activation spike or model allocation may fail with CUDA OOM."
    ),
    th.L1_EVICTION_STORM.alert: (
        "L1 is above {value} of its budget and evicts more than {rate} chunks per second (over"
        " {window}): sessions are pushed out of the GPU as fast as they come back."
    ),
    th.L2_SLOTS.alert: (
        "L2 slots are above {value} in use and more than {rate} chunks per second are evicted"
        " (over {window}): hibernated sessions fall through to L3 or to recompute."
    ),
    th.L3_FILESYSTEM.alert: (
        "The L3 filesystem has less than {value} of its size free and, at the trend of the last"
        " {window}, fills up within {horizon} seconds."
    ),
    th.L3_SHEDDING.alert: (
        "Write-through copies are dropped (more than {value} per second over {window}) because a"
        " write queue is full: a GPU loss or restart would lose those chunks."
    ),
    th.CHECKSUM_FAILURE.alert: (
        "More than {value} chunks failed their checksum in the last {window}. They were"
        " quarantined and recomputed (never used), but the device may be failing."
    ),
    th.COMMIT_FAILURES.alert: (
        "More than {value} finished turns failed to store their K/V in the last {window}"
        " (kvtier_commit_failures_total by reason: device_oom, l3_full, l3_io, l4, internal)."
        " Their replies were delivered; the sessions recompute what was not stored."
    ),
    th.DEVICE_LOST.alert: (
        "More than {value} devices of the model's placement are lost: their layers run on the"
        " surviving devices, whose page pool holds fewer tokens, so fewer sessions run at once."
    ),
    th.DIRTY_PAGES.alert: (
        "Dirty plus writeback pages are above {value} of the kernel's dirty threshold: writers"
        " (L3 included) are about to be throttled in balance_dirty_pages."
    ),
    th.PCIE_DOWNGRADE.alert: (
        "GPU {{{{ $labels.gpu }}}} runs with {value} or more lanes below its maximum width, or a"
        " lower generation while it carries more than {rate} bytes per second."
    ),
    th.OOM_KILL.alert: ("The kernel OOM killer ran more than {value} times in the last {window}."),
    th.GPU_ALLOC_RETRIES.alert: (
        "The CUDA caching allocator of GPU {{{{ $labels.gpu }}}} retried more than {value}"
        " cudaMalloc calls in the last {window}: each retry freed every cached block and"
        " synchronized the device. The next such allocation may fail with CUDA OOM although"
        " nvidia-smi shows free memory."
    ),
    th.GPU_ALLOC_FRAGMENTED.alert: (
        "More than {value} of the memory the allocator reserved on GPU {{{{ $labels.gpu }}}}"
        " (and more than {floor} bytes) is free but stranded in split blocks: a large"
        " allocation cannot use it, so cudaMalloc can fail while memory looks free."
    ),
    th.GPU_BUDGET.alert: (
        "For {for_} the serving process has held more than {value}x the budget of its GPU"
        " memory plan (--gpu-memory-utilization) on its GPU: memory outside the plan (a"
        " transient peak the plan did not count, a leak, or another allocation in the"
        " process). The memory the plan left to others on the GPU is no longer free, and the"
        " process's next allocation may fail with CUDA OOM."
    ),
    th.L4_DOWN.alert: (
        "The L4 circuit breaker is open (state {value}) or Redis is unreachable. Serving goes on"
        " from L1-L3 or recompute, without errors to callers, but sessions hibernated on other"
        " hosts are recomputed here and this host's hibernations are not shared."
    ),
    th.L4_ERRORS.alert: (
        "More than {value} L4 operations per second failed over the last {window} (timeouts,"
        " refused connections, values that failed verification): each failure is a restore from"
        " a lower tier or a recompute, and the breaker may open next."
    ),
    th.L4_SHARD_NO_REPLICA.alert: (
        "For {for_} the Redis Cluster primary {{{{ $labels.shard }}}} (slots"
        " {{{{ $labels.slots }}}}) has had fewer than {value} replica attached. Serving goes on,"
        " but if that primary dies its slots have no one to take over: their chunks are lost"
        " (recomputed) and L4 writes to them fail until the cluster is mended."
    ),
    th.SESSION_MOVES.alert: (
        "For {for_} more than {value} sessions per second (over {window}) were moved to this host"
        " from other hosts (opened from the L4 record of the host that served them last). One"
        " host going away moves its sessions once; moves that go on mean a host keeps leaving"
        " and rejoining HAProxy's pool (failing /readyz checks, restarting), and each move"
        " costs the session a restore from L4 instead of a local one."
    ),
}

# Recording rules: (name, expression). Dashboards and alerts use these names.
RECORDING: tuple[tuple[str, str], ...] = (
    (
        "kvtier:tier_utilization:ratio",
        "kvtier_tier_used_bytes / (kvtier_tier_capacity_bytes > 0)",
    ),
    (
        "kvtier:tier_hit:ratio_rate5m",
        "rate(kvtier_tier_hits_total[5m])\n"
        "/ (rate(kvtier_tier_hits_total[5m]) + rate(kvtier_tier_misses_total[5m]))",
    ),
    ("kvtier:transfer_bytes:rate5m", "rate(kvtier_transfer_bytes_total[5m])"),
    (
        "kvtier:transfer_bandwidth_bytes_per_second:ratio_rate5m",
        "rate(kvtier_transfer_bytes_total[5m]) / rate(kvtier_transfer_seconds_total[5m])",
    ),
    ("kvtier:restore_decisions:rate5m", "rate(kvtier_restore_decisions_total[5m])"),
    (
        "kvtier:restore_duration_seconds:p99_rate5m",
        "histogram_quantile(0.99, rate(kvtier_restore_duration_seconds_bucket[5m]))",
    ),
    (
        "kvtier:memory_available:ratio",
        "kvtier_memory_available_bytes\n/ (kvtier_memory_total_bytes - kvtier_memory_hugetlb_bytes)",
    ),
    (
        "kvtier:pressure_memory_stalled:rate5m",
        "rate(kvtier_pressure_memory_stalled_seconds_total[5m])",
    ),
    ("kvtier:pressure_io_stalled:rate5m", "rate(kvtier_pressure_io_stalled_seconds_total[5m])"),
    ("kvtier:vmstat_allocstall:rate5m", "rate(kvtier_vmstat_allocstall_total[5m])"),
    (
        "kvtier:l3_filesystem_avail:ratio",
        "kvtier_l3_filesystem_avail_bytes / kvtier_l3_filesystem_size_bytes",
    ),
    (
        "kvtier:gpu_memory_free:ratio",
        "kvtier_gpu_memory_free_bytes / kvtier_gpu_memory_total_bytes",
    ),
)


def duration(seconds: int) -> str:
    """Seconds as the shortest exact Prometheus duration (`300` -> `5m`, `86400` -> `1d`)."""
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds and seconds % size == 0:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def number(x: float) -> str:
    """A threshold as a PromQL literal: `0.05`, `10`, `1e+09`."""
    return f"{x:g}"


def _fill(template: str, t: th.Threshold) -> str:
    return template.format(
        value=number(t.value),
        rate=number(t.rate),
        window=duration(t.window_s),
        horizon=number(t.horizon_s),
        floor=number(t.floor),
        for_=duration(t.for_s),
    )


def expression(t: th.Threshold) -> str:
    """The alert's PromQL with its threshold numbers filled in."""
    return _fill(EXPRESSIONS[t.alert], t)


def anchor(alert: str) -> str:
    """The runbook link of an alert: its own section, headed by its name."""
    return f"{RUNBOOK}#{alert.lower()}"


def _block(text: str, indent: str) -> str:
    if "\n" not in text:
        return " " + _quote(text)
    return " |-\n" + "\n".join(indent + line for line in text.splitlines())


def _quote(text: str) -> str:
    """YAML double-quoted scalar (JSON escaping is valid YAML)."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def render_alerts() -> str:
    lines = [
        "# Generated from ops/thresholds.py by `python -m ops.exporter.rules dashboards/prometheus`.",
        "# Edit the thresholds there, not here; a test fails when the two disagree.",
        "groups:",
        "  - name: kvtier.alerts",
        "    rules:",
    ]
    for t in th.ALL:
        lines.append(f"      - alert: {t.alert}")
        lines.append("        expr:" + _block(expression(t), " " * 10))
        if t.for_s:
            lines.append(f"        for: {duration(t.for_s)}")
        lines.append("        labels:")
        lines.append(f"          severity: {t.severity}")
        lines.append("        annotations:")
        lines.append(f"          summary: {_quote(SUMMARIES[t.alert])}")
        lines.append(f"          description: {_quote(_fill(DESCRIPTIONS[t.alert], t))}")
        lines.append(f"          runbook_url: {_quote(anchor(t.alert))}")
    return "\n".join(lines) + "\n"


def render_recording() -> str:
    lines = [
        "# Generated by `python -m ops.exporter.rules dashboards/prometheus`; see docs/metrics.md.",
        "groups:",
        "  - name: kvtier.recording",
        "    rules:",
    ]
    for name, expr in RECORDING:
        lines.append(f"      - record: {name}")
        lines.append("        expr:" + _block(expr, " " * 10))
    return "\n".join(lines) + "\n"


def write(directory: Path) -> list[Path]:
    """Write both rule files into `directory`; returns their paths."""
    written = []
    for name, text in (("alerts.yml", render_alerts()), ("recording.yml", render_recording())):
        path = directory / name
        path.write_text(text)
        written.append(path)
    return written


if __name__ == "__main__":
    for p in write(Path(sys.argv[1] if len(sys.argv) > 1 else "dashboards/prometheus")):
        print(p)
