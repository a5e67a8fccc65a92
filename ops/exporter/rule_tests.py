"""promtool unit tests of the alert rules: one firing and one non-firing case for every alert.

The cases (input series, evaluation time, the labels of the alert expected to fire) are written
here by hand; `render()` adds the annotations the rules produce, which promtool compares
exactly, so the checked-in `dashboards/prometheus/tests/alerts_test.yml` stays in step with
`alerts.yml` (`python -m ops.exporter.rule_tests dashboards/prometheus/tests/alerts_test.yml`).
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ops import thresholds as th
from ops.exporter import rules

HOST = {"instance": "host1:9400", "job": "kvtier"}


@dataclass(frozen=True)
class Case:
    """Input series for one alert and, for a firing case, the labels of the expected alert."""

    alert: str
    name: str
    series: dict[str, str]
    eval_time: str
    fires: dict[str, str] | None = None  # None: the alert must not fire
    interval: str = "1m"
    extra: list[dict[str, str]] = field(default_factory=list)  # more alerts expected


def _s(metric: str, **labels: str) -> str:
    """A series selector with the host's labels plus `labels`."""
    body = ", ".join(f'{k}="{v}"' for k, v in {**HOST, **labels}.items())
    return f"{metric}{{{body}}}"


CASES: tuple[Case, ...] = (
    # -- memory PSI full: 6 s stalled per minute is 10% of wall time; 1 s is 1.7%.
    Case(
        th.MEMORY_PSI_FULL.alert,
        "firing: 10% of wall time fully stalled",
        {_s("kvtier_pressure_memory_stalled_seconds_total"): "0+6x30"},
        "20m",
        fires={},
    ),
    Case(
        th.MEMORY_PSI_FULL.alert,
        "quiet: 1.7% stalled",
        {_s("kvtier_pressure_memory_stalled_seconds_total"): "0+1x30"},
        "20m",
    ),
    # -- available memory: 64 GB RAM with a 16 GB hugetlb pool; 100 MB/min lost.
    Case(
        th.MEMORY_AVAILABLE.alert,
        "firing: low and falling",
        {
            _s("kvtier_memory_total_bytes"): "64000000000x60",
            _s("kvtier_memory_hugetlb_bytes"): "16000000000x60",
            _s("kvtier_memory_available_bytes"): "6000000000-100000000x60",
        },
        "40m",
        fires={},
    ),
    Case(
        th.MEMORY_AVAILABLE.alert,
        "quiet: low (4% of non-hugetlb RAM) but stable",
        {
            _s("kvtier_memory_total_bytes"): "64000000000x60",
            _s("kvtier_memory_hugetlb_bytes"): "16000000000x60",
            _s("kvtier_memory_available_bytes"): "2000000000x60",
        },
        "40m",
    ),
    # -- direct reclaim: 20 stalls/s against 1/s.
    Case(
        th.DIRECT_RECLAIM.alert,
        "firing: 20 direct reclaims per second",
        {_s("kvtier_vmstat_allocstall_total"): "0+1200x30"},
        "20m",
        fires={},
    ),
    Case(
        th.DIRECT_RECLAIM.alert,
        "quiet: 1 direct reclaim per second",
        {_s("kvtier_vmstat_allocstall_total"): "0+60x30"},
        "20m",
    ),
    # -- high-order blocks: orders 9 and 10 of Normal empty; order 8 does not count.
    Case(
        th.HIGH_ORDER_BLOCKS.alert,
        "firing: no order 9 or 10 block left in Normal",
        {
            _s("kvtier_buddyinfo_blocks", node="0", zone="Normal", order="8"): "50x30",
            _s("kvtier_buddyinfo_blocks", node="0", zone="Normal", order="9"): "0x30",
            _s("kvtier_buddyinfo_blocks", node="0", zone="Normal", order="10"): "0x30",
            _s("kvtier_buddyinfo_blocks", node="0", zone="DMA32", order="10"): "700x30",
        },
        "20m",
        fires={"node": "0", "zone": "Normal"},
    ),
    Case(
        th.HIGH_ORDER_BLOCKS.alert,
        "quiet: three order-10 blocks",
        {
            _s("kvtier_buddyinfo_blocks", node="0", zone="Normal", order="9"): "0x30",
            _s("kvtier_buddyinfo_blocks", node="0", zone="Normal", order="10"): "3x30",
        },
        "20m",
    ),
    # -- hugepage pool: all 1024 pages free are reserved; without a pool nothing fires.
    Case(
        th.HUGEPAGE_POOL.alert,
        "firing: every free page is reserved",
        {
            _s("kvtier_hugepages_pool"): "1024x20",
            _s("kvtier_hugepages_free"): "10x20",
            _s("kvtier_hugepages_reserved"): "10x20",
        },
        "10m",
        fires={},
    ),
    Case(
        th.HUGEPAGE_POOL.alert,
        "quiet: no pool configured",
        {
            _s("kvtier_hugepages_pool"): "0x20",
            _s("kvtier_hugepages_free"): "0x20",
            _s("kvtier_hugepages_reserved"): "0x20",
        },
        "10m",
    ),
    # -- GPU headroom: 2 of 80 GB free (2.5%) against 20 of 80 GB.
    Case(
        th.GPU_HEADROOM.alert,
        "firing: 2.5% free",
        {
            _s("kvtier_gpu_memory_free_bytes", gpu="0"): "2000000000x20",
            _s("kvtier_gpu_memory_total_bytes", gpu="0"): "80000000000x20",
        },
        "10m",
        fires={"gpu": "0"},
    ),
    Case(
        th.GPU_HEADROOM.alert,
        "quiet: 25% free",
        {
            _s("kvtier_gpu_memory_free_bytes", gpu="0"): "20000000000x20",
            _s("kvtier_gpu_memory_total_bytes", gpu="0"): "80000000000x20",
        },
        "10m",
    ),
    # -- L1: 97% full and 20 evictions/s; full with 1 eviction/s is normal cache life.
    Case(
        th.L1_EVICTION_STORM.alert,
        "firing: full and evicting 20 chunks/s",
        {
            _s("kvtier_tier_used_bytes", tier="l1"): "970000000x30",
            _s("kvtier_tier_capacity_bytes", tier="l1"): "1000000000x30",
            _s("kvtier_tier_evictions_total", tier="l1"): "0+1200x30",
        },
        "20m",
        fires={"tier": "l1"},
    ),
    Case(
        th.L1_EVICTION_STORM.alert,
        "quiet: full, 1 eviction/s",
        {
            _s("kvtier_tier_used_bytes", tier="l1"): "970000000x30",
            _s("kvtier_tier_capacity_bytes", tier="l1"): "1000000000x30",
            _s("kvtier_tier_evictions_total", tier="l1"): "0+60x30",
        },
        "20m",
    ),
    # -- L2: every slot used and 20 evictions/s; a busy L3 does not make L2 fire.
    Case(
        th.L2_SLOTS.alert,
        "firing: all slots used, 20 evictions/s",
        {
            _s("kvtier_tier_used_bytes", tier="l2"): "1000000000x30",
            _s("kvtier_tier_capacity_bytes", tier="l2"): "1000000000x30",
            _s("kvtier_tier_evictions_total", tier="l2"): "0+1200x30",
        },
        "25m",
        fires={"tier": "l2"},
    ),
    Case(
        th.L2_SLOTS.alert,
        "quiet: L2 at 80%, L3 full and evicting",
        {
            _s("kvtier_tier_used_bytes", tier="l2"): "800000000x30",
            _s("kvtier_tier_capacity_bytes", tier="l2"): "1000000000x30",
            _s("kvtier_tier_evictions_total", tier="l2"): "0+1200x30",
            _s("kvtier_tier_used_bytes", tier="l3"): "1000000000x30",
            _s("kvtier_tier_capacity_bytes", tier="l3"): "1000000000x30",
            _s("kvtier_tier_evictions_total", tier="l3"): "0+1200x30",
        },
        "25m",
    ),
    # -- L3 filesystem: 1 TB, losing 30 GB/h, against low but stable.
    Case(
        th.L3_FILESYSTEM.alert,
        "firing: 6% free and falling 30 GB/h",
        {
            _s("kvtier_l3_filesystem_size_bytes"): "1000000000000x600",
            _s("kvtier_l3_filesystem_avail_bytes"): "300000000000-500000000x600",
        },
        "8h",
        fires={},
    ),
    Case(
        th.L3_FILESYSTEM.alert,
        "quiet: 10% free, stable",
        {
            _s("kvtier_l3_filesystem_size_bytes"): "1000000000000x600",
            _s("kvtier_l3_filesystem_avail_bytes"): "100000000000x600",
        },
        "8h",
    ),
    # -- shed writes: one per second against none.
    Case(
        th.L3_SHEDDING.alert,
        "firing: one shed write per second",
        {_s("kvtier_shed_writes_total"): "0+60x20"},
        "15m",
        fires={},
    ),
    Case(
        th.L3_SHEDDING.alert,
        "quiet: nothing shed",
        {_s("kvtier_shed_writes_total"): "0x20"},
        "15m",
    ),
    # -- checksum: a single failure fires at once.
    Case(
        th.CHECKSUM_FAILURE.alert,
        "firing: one failure",
        {_s("kvtier_checksum_failures_total"): "0 0 0 1 1 1 1 1"},
        "5m",
        fires={},
    ),
    Case(
        th.CHECKSUM_FAILURE.alert,
        "quiet: no failure",
        {_s("kvtier_checksum_failures_total"): "0x20"},
        "5m",
    ),
    # -- commit failures: one in 15 minutes, of any reason, fires.
    Case(
        th.COMMIT_FAILURES.alert,
        "firing: one device OOM",
        {
            _s("kvtier_commit_failures_total", reason="device_oom"): "0 0 0 1 1 1 1 1",
            _s("kvtier_commit_failures_total", reason="l4"): "0x7",
        },
        "5m",
        fires={},
    ),
    Case(
        th.COMMIT_FAILURES.alert,
        "quiet: every commit stored",
        {_s("kvtier_commit_failures_total", reason="device_oom"): "0x20"},
        "5m",
    ),
    # -- a lost device fires at once; a placement with every device ok stays quiet.
    Case(
        th.DEVICE_LOST.alert,
        "firing: device 1 lost",
        {
            _s("kvtier_server_devices", state="lost"): "0 0 1 1 1 1",
            _s("kvtier_server_devices", state="ok"): "2 2 1 1 1 1",
        },
        "4m",
        fires={"state": "lost"},
    ),
    Case(
        th.DEVICE_LOST.alert,
        "quiet: every device ok",
        {
            _s("kvtier_server_devices", state="lost"): "0x10",
            _s("kvtier_server_devices", state="ok"): "2x10",
        },
        "5m",
    ),
    # -- dirty pages: 900 MB dirty+writeback of a 1 GB threshold against 300 MB.
    Case(
        th.DIRTY_PAGES.alert,
        "firing: 90% of the dirty threshold",
        {
            _s("kvtier_memory_dirty_bytes"): "800000000x30",
            _s("kvtier_memory_writeback_bytes"): "100000000x30",
            _s("kvtier_memory_dirty_threshold_bytes"): "1000000000x30",
        },
        "15m",
        fires={},
    ),
    Case(
        th.DIRTY_PAGES.alert,
        "quiet: 30% of the dirty threshold",
        {
            _s("kvtier_memory_dirty_bytes"): "300000000x30",
            _s("kvtier_memory_writeback_bytes"): "0x30",
            _s("kvtier_memory_dirty_threshold_bytes"): "1000000000x30",
        },
        "15m",
    ),
    # -- PCIe: GPU 0 at x8 of x16; GPU 1 busy at gen 4 of 5; GPU 2 idle at gen 1 (power saving).
    Case(
        th.PCIE_DOWNGRADE.alert,
        "firing: narrow link, and a slow link under load",
        {
            _s("kvtier_gpu_pcie_link_width", gpu="0"): "8x20",
            _s("kvtier_gpu_pcie_link_max_width", gpu="0"): "16x20",
            _s("kvtier_gpu_pcie_link_generation", gpu="0"): "5x20",
            _s("kvtier_gpu_pcie_link_max_generation", gpu="0"): "5x20",
            _s("kvtier_gpu_pcie_tx_bytes_per_second", gpu="0"): "0x20",
            _s("kvtier_gpu_pcie_rx_bytes_per_second", gpu="0"): "0x20",
            _s("kvtier_gpu_pcie_link_width", gpu="1"): "16x20",
            _s("kvtier_gpu_pcie_link_max_width", gpu="1"): "16x20",
            _s("kvtier_gpu_pcie_link_generation", gpu="1"): "4x20",
            _s("kvtier_gpu_pcie_link_max_generation", gpu="1"): "5x20",
            _s("kvtier_gpu_pcie_tx_bytes_per_second", gpu="1"): "3000000000x20",
            _s("kvtier_gpu_pcie_rx_bytes_per_second", gpu="1"): "2000000000x20",
        },
        "15m",
        fires={"gpu": "0"},
        extra=[{"gpu": "1"}],
    ),
    Case(
        th.PCIE_DOWNGRADE.alert,
        "quiet: idle GPU at gen 1 with a full-width link",
        {
            _s("kvtier_gpu_pcie_link_width", gpu="2"): "16x20",
            _s("kvtier_gpu_pcie_link_max_width", gpu="2"): "16x20",
            _s("kvtier_gpu_pcie_link_generation", gpu="2"): "1x20",
            _s("kvtier_gpu_pcie_link_max_generation", gpu="2"): "5x20",
            _s("kvtier_gpu_pcie_tx_bytes_per_second", gpu="2"): "10000000x20",
            _s("kvtier_gpu_pcie_rx_bytes_per_second", gpu="2"): "5000000x20",
        },
        "15m",
    ),
    # -- OOM kill: one kill fires at once.
    Case(
        th.OOM_KILL.alert,
        "firing: one OOM kill",
        {_s("kvtier_vmstat_oom_kill_total"): "0 0 0 1 1 1"},
        "5m",
        fires={},
    ),
    Case(
        th.OOM_KILL.alert,
        "quiet: no OOM kill",
        {_s("kvtier_vmstat_oom_kill_total"): "0x10"},
        "5m",
    ),
    # -- allocator retries: two retries fire at once; a total left from long ago stays quiet.
    Case(
        th.GPU_ALLOC_RETRIES.alert,
        "firing: two retries just now",
        {_s("kvtier_torch_alloc_retries_total", gpu="0"): "0 0 0 2 2 2"},
        "5m",
        fires={"gpu": "0"},
    ),
    Case(
        th.GPU_ALLOC_RETRIES.alert,
        "quiet: five retries, none in the last 15 minutes",
        {_s("kvtier_torch_alloc_retries_total", gpu="0"): "0 5x40"},
        "30m",
    ),
    # -- fragmentation: 16 of 40 GB stranded (40%) on GPU 0; GPU 1 is at 50% of a small pool
    # (0.5 GB, under the floor) and GPU 2 has 4 of 40 GB (10%).
    Case(
        th.GPU_ALLOC_FRAGMENTED.alert,
        "firing: 40% of 40 GB stranded in split blocks",
        {
            _s("kvtier_torch_reserved_bytes", gpu="0"): "40000000000x30",
            _s("kvtier_torch_inactive_split_bytes", gpu="0"): "16000000000x30",
            _s("kvtier_torch_reserved_bytes", gpu="1"): "1000000000x30",
            _s("kvtier_torch_inactive_split_bytes", gpu="1"): "500000000x30",
        },
        "20m",
        fires={"gpu": "0"},
    ),
    Case(
        th.GPU_ALLOC_FRAGMENTED.alert,
        "quiet: 10% stranded, or a large share of a small pool",
        {
            _s("kvtier_torch_reserved_bytes", gpu="1"): "1000000000x30",
            _s("kvtier_torch_inactive_split_bytes", gpu="1"): "500000000x30",
            _s("kvtier_torch_reserved_bytes", gpu="2"): "40000000000x30",
            _s("kvtier_torch_inactive_split_bytes", gpu="2"): "4000000000x30",
        },
        "20m",
    ),
    # -- GPU budget: 61 GB held against a 60 GB plan for 10 minutes; 59 GB held stays quiet,
    # and so does one minute over (the rule's `for`: pending at 1m, under again at 2m).
    Case(
        th.GPU_BUDGET.alert,
        "firing: 61 GB held, budget 60 GB",
        {
            _s("kvtier_gpu_memory_process_bytes"): "61000000000x20",
            _s("kvtier_gpu_memory_budget_bytes"): "60000000000x20",
        },
        "10m",
        fires={},
    ),
    Case(
        th.GPU_BUDGET.alert,
        "quiet: 59 GB held, budget 60 GB",
        {
            _s("kvtier_gpu_memory_process_bytes"): "59000000000x20",
            _s("kvtier_gpu_memory_budget_bytes"): "60000000000x20",
        },
        "10m",
    ),
    Case(
        th.GPU_BUDGET.alert,
        "quiet: over the budget for one minute only",
        {
            _s("kvtier_gpu_memory_process_bytes"): "59000000000 61000000000 59000000000x18",
            _s("kvtier_gpu_memory_budget_bytes"): "60000000000x20",
        },
        "1m",
    ),
    # -- L4 down: the breaker open and Redis unreachable for 10 minutes (one alert, not two);
    # probing between, the breaker half open while Redis stays down; a 2-minute blip is quiet.
    Case(
        th.L4_DOWN.alert,
        "firing: breaker open and Redis unreachable",
        {
            _s("kvtier_l4_breaker_state"): "0 0 2x18",
            _s("kvtier_l4_up"): "1 1 0x18",
        },
        "15m",
        fires={},
    ),
    Case(
        th.L4_DOWN.alert,
        "firing: breaker open and half open in turn, Redis down throughout",
        {
            _s("kvtier_l4_breaker_state"): "2 1 2 1 2 1 2 1 2 1 2 1 2 1 2 1",
            _s("kvtier_l4_up"): "0x15",
        },
        "10m",
        fires={},
    ),
    Case(
        th.L4_DOWN.alert,
        "quiet: the breaker opened for two minutes, then closed",
        {
            _s("kvtier_l4_breaker_state"): "0 0 2 2 0x16",
            _s("kvtier_l4_up"): "1 1 0 0 1x16",
        },
        "15m",
    ),
    # -- L4 errors: one failure per second against one per minute.
    Case(
        th.L4_ERRORS.alert,
        "firing: one failed operation per second",
        {_s("kvtier_l4_errors_total"): "0+60x30"},
        "20m",
        fires={},
    ),
    Case(
        th.L4_ERRORS.alert,
        "quiet: one failed operation per minute",
        {_s("kvtier_l4_errors_total"): "0+1x30"},
        "20m",
    ),
    # -- a shard without a replica: a failover whose old primary never came back fires after 5
    # minutes; one whose old primary rejoined as a replica within two is quiet.
    Case(
        th.L4_SHARD_NO_REPLICA.alert,
        "firing: the promoted replica has none of its own",
        {
            _s("kvtier_l4_shard_replicas", shard="10.0.0.2:7001", slots="5461-10922"): "1 1 0x10",
            _s("kvtier_l4_shard_replicas", shard="10.0.0.1:7000", slots="0-5460"): "1x12",
        },
        "10m",
        fires={"shard": "10.0.0.2:7001", "slots": "5461-10922"},
    ),
    Case(
        th.L4_SHARD_NO_REPLICA.alert,
        "quiet: the old primary rejoined as a replica within two minutes",
        {_s("kvtier_l4_shard_replicas", shard="10.0.0.2:7001", slots="5461-10922"): "1 1 0 0 1x10"},
        "10m",
    ),
    # -- moves: a flapping host sends 6 sessions a minute here for half an hour; a host that
    # died once moved 40 at one scrape, then none.
    Case(
        th.SESSION_MOVES.alert,
        "firing: sessions keep moving here",
        {_s("kvtier_moved_sessions_total"): "0+6x40"},
        "30m",
        fires={},
    ),
    Case(
        th.SESSION_MOVES.alert,
        "quiet: one host died, its sessions moved once",
        {_s("kvtier_moved_sessions_total"): "0 0 0 40x40"},
        "30m",
    ),
)


def _expand(template: str, labels: dict[str, str]) -> str:
    """Expand the `{{ $labels.x }}` references of an annotation as Prometheus does."""
    return re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: labels.get(m.group(1), ""), template)


def _expected(alert: str, labels: dict[str, str]) -> list[str]:
    t = th.BY_ALERT[alert]
    every = {**HOST, **labels}
    out = ["          - exp_labels:"]
    for k, v in sorted({**every, "severity": t.severity}.items()):
        out.append(f"              {k}: {rules._quote(v)}")
    out.append("            exp_annotations:")
    annotations = {
        "summary": _expand(rules.SUMMARIES[alert], every),
        "description": _expand(rules._fill(rules.DESCRIPTIONS[alert], t), every),
        "runbook_url": rules.anchor(alert),
    }
    for k, v in annotations.items():
        out.append(f"              {k}: {rules._quote(v)}")
    return out


def render() -> str:
    lines = [
        "# Generated by `python -m ops.exporter.rule_tests`: cases in ops/exporter/rule_tests.py,",
        "# annotations from the rules. Run: promtool test rules dashboards/prometheus/tests/*.yml",
        "rule_files:",
        "  - ../alerts.yml",
        "  - ../recording.yml",
        "evaluation_interval: 1m",
        "tests:",
    ]
    for case in CASES:
        lines.append(f"  - name: {rules._quote(case.alert + ' ' + case.name)}")
        lines.append(f"    interval: {case.interval}")
        lines.append("    input_series:")
        for series, values in case.series.items():
            lines.append(f"      - series: {rules._quote(series)}")
            lines.append(f"        values: {rules._quote(values)}")
        lines.append("    alert_rule_test:")
        lines.append(f"      - eval_time: {case.eval_time}")
        lines.append(f"        alertname: {case.alert}")
        if case.fires is None:
            lines.append("        exp_alerts: []")
        else:
            lines.append("        exp_alerts:")
            for labels in (case.fires, *case.extra):
                lines.extend(_expected(case.alert, labels))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    target = Path(
        sys.argv[1] if len(sys.argv) > 1 else "dashboards/prometheus/tests/alerts_test.yml"
    )
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(render())
    print(target)
