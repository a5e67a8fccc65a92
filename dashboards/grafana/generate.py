"""Generate kvtier.json, the Grafana dashboard, from the panel list below.

Run from the repository root: `python3 dashboards/grafana/generate.py`. A test regenerates it
and fails when the checked-in JSON differs, and the end-to-end test runs every `expr` below
against a real Prometheus scraping a real exporter. Standard library only.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

DS = {"type": "prometheus", "uid": "${datasource}"}
SEL = 'instance=~"$instance"'


def _quantiles(histogram: str, by: str = "", qs: tuple[float, ...] = (0.5, 0.99)) -> list:
    """histogram_quantile targets of a histogram over the selected instances: (expr, legend)."""
    rate = f"rate({histogram}_bucket{{{SEL}}}[$__rate_interval])"
    labels = "le" + (f", {by}" if by else "")
    legend = " {{" + by + "}}" if by else ""
    return [
        (f"histogram_quantile({q}, sum by ({labels}) ({rate}))", f"p{round(q * 100)}{legend}")
        for q in qs
    ]


# each L4 cluster shard's reads per second, over the selected hosts
_SHARD_HITS = f"sum by (shard) (rate(kvtier_l4_shard_hits_total{{{SEL}}}[$__rate_interval]))"
_SHARD_MISSES = f"sum by (shard) (rate(kvtier_l4_shard_misses_total{{{SEL}}}[$__rate_interval]))"

# (row title, [(panel title, unit, description, [(expr, legend), ...]), ...])
# Units are Grafana's names for base units: bytes, Bps, s, percentunit (ratio 0..1), ops.
ROWS: list[tuple[str, list[tuple[str, str, str, list[tuple[str, str]]]]]] = [
    (
        "Serving (kvtier serve)",
        [
            (
                "Requests by status code",
                "ops",
                "Responses of the /v1 endpoints per second, by route and HTTP status code (429: "
                "no generation slot in time, 503: loading or draining). A stream counts when it "
                "ends.",
                [
                    (
                        "sum by (endpoint, code) "
                        f"(rate(kvtier_server_requests_total{{{SEL}}}[$__rate_interval]))",
                        "{{code}} {{endpoint}}",
                    )
                ],
            ),
            (
                "Tokens",
                "ops",
                "Prompt tokens (cached ones included) and generated tokens per second, counted "
                "as each turn ends.",
                [
                    (
                        f"sum(rate(kvtier_server_prompt_tokens_total{{{SEL}}}[$__rate_interval]))",
                        "prompt",
                    ),
                    (
                        "sum(rate(kvtier_server_completion_tokens_total"
                        f"{{{SEL}}}[$__rate_interval]))",
                        "generated",
                    ),
                ],
            ),
            (
                "End-to-end request latency",
                "s",
                "A completion request's arrival to its last token.",
                _quantiles("kvtier_server_e2e_request_latency_seconds", qs=(0.5, 0.9, 0.99)),
            ),
            (
                "Queue time",
                "s",
                "Arrival to the turn's admission into the batch: the wait for a slot, the "
                "session's earlier request and the restore.",
                _quantiles("kvtier_server_request_queue_time_seconds"),
            ),
            (
                "Time to first token by restore source",
                "s",
                "From the request's generation slot to its first token, by where the prompt's "
                "K/V came from.",
                _quantiles("kvtier_server_ttft_seconds", by="src"),
            ),
            (
                "Time per output token",
                "s",
                "A request's first token to its last, over its tokens after the first.",
                _quantiles("kvtier_server_time_per_output_token_seconds"),
            ),
            (
                "Inter-token latency",
                "s",
                "Time between two consecutive tokens of a turn.",
                _quantiles("kvtier_server_inter_token_latency_seconds"),
            ),
        ],
    ),
    (
        "Tiers",
        [
            (
                "Bytes held per tier",
                "bytes",
                "Used bytes against each tier's budget.",
                [
                    (f"kvtier_tier_used_bytes{{{SEL}}}", "{{tier}} used"),
                    (f"kvtier_tier_capacity_bytes{{{SEL}}}", "{{tier}} capacity"),
                ],
            ),
            (
                "Tier utilization",
                "percentunit",
                "Used bytes over capacity (alerts: L1 eviction storm, L2 slots exhausted).",
                [(f"kvtier:tier_utilization:ratio{{{SEL}}}", "{{tier}}")],
            ),
            (
                "Chunks per tier",
                "short",
                "",
                [(f"kvtier_tier_chunks{{{SEL}}}", "{{tier}}")],
            ),
            (
                "Hit ratio",
                "percentunit",
                "Chunks found over chunks looked up, per tier (5m).",
                [(f"kvtier:tier_hit:ratio_rate5m{{{SEL}}}", "{{tier}}")],
            ),
            (
                "Evictions",
                "ops",
                "Chunks evicted per second.",
                [
                    (
                        f"rate(kvtier_tier_evictions_total{{{SEL}}}[$__rate_interval])",
                        "{{tier}}",
                    )
                ],
            ),
        ],
    ),
    (
        "Sessions",
        [
            (
                "Sessions by state",
                "short",
                "",
                [(f"kvtier_sessions{{{SEL}}}", "{{state}}")],
            ),
            (
                "Transfer queues",
                "short",
                "Jobs waiting per queue; a full write queue sheds write-through copies.",
                [(f"kvtier_queue_depth{{{SEL}}}", "{{queue}}")],
            ),
        ],
    ),
    (
        "Transfers",
        [
            (
                "Throughput between tiers",
                "Bps",
                "",
                [
                    (
                        f"rate(kvtier_transfer_bytes_total{{{SEL}}}[$__rate_interval])",
                        "{{src}} to {{dst}}",
                    )
                ],
            ),
            (
                "Bandwidth while copying",
                "Bps",
                "Bytes over seconds spent copying: what the restore cost model measures.",
                [
                    (
                        f"kvtier:transfer_bandwidth_bytes_per_second:ratio_rate5m{{{SEL}}}",
                        "{{src}} to {{dst}}",
                    )
                ],
            ),
            (
                "Shed writes, I/O errors, checksum failures",
                "ops",
                "Any checksum failure or shed write has its own alert.",
                [
                    (f"rate(kvtier_shed_writes_total{{{SEL}}}[$__rate_interval])", "shed"),
                    (f"rate(kvtier_io_errors_total{{{SEL}}}[$__rate_interval])", "I/O errors"),
                    (
                        f"rate(kvtier_checksum_failures_total{{{SEL}}}[$__rate_interval])",
                        "checksum",
                    ),
                ],
            ),
        ],
    ),
    (
        "Restore decisions",
        [
            (
                "Restores by source",
                "ops",
                "A tier, or recompute where loading would be slower than prefill.",
                [
                    (
                        f"rate(kvtier_restore_decisions_total{{{SEL}}}[$__rate_interval])",
                        "{{src}}",
                    )
                ],
            ),
            (
                "Tokens restored by source",
                "short",
                "Tokens per second.",
                [
                    (
                        f"rate(kvtier_restored_tokens_total{{{SEL}}}[$__rate_interval])",
                        "{{src}}",
                    )
                ],
            ),
            (
                "Restore latency p99",
                "s",
                "",
                [(f"kvtier:restore_duration_seconds:p99_rate5m{{{SEL}}}", "{{src}}")],
            ),
        ],
    ),
    (
        "Host memory and fragmentation",
        [
            (
                "Available memory outside hugetlb",
                "percentunit",
                "MemAvailable over MemTotal minus the hugetlb pool.",
                [(f"kvtier:memory_available:ratio{{{SEL}}}", "available")],
            ),
            (
                "Memory",
                "bytes",
                "",
                [
                    (f"kvtier_memory_available_bytes{{{SEL}}}", "available"),
                    (f"kvtier_memory_hugetlb_bytes{{{SEL}}}", "hugetlb"),
                    (f"kvtier_memory_mlocked_bytes{{{SEL}}}", "mlocked"),
                ],
            ),
            (
                "Pressure stalls",
                "percentunit",
                "Share of time stalled (PSI): full = all non-idle tasks.",
                [
                    (f"kvtier:pressure_memory_stalled:rate5m{{{SEL}}}", "memory full"),
                    (
                        f"rate(kvtier_pressure_memory_waiting_seconds_total{{{SEL}}}[$__rate_interval])",
                        "memory some",
                    ),
                    (f"kvtier:pressure_io_stalled:rate5m{{{SEL}}}", "io full"),
                ],
            ),
            (
                "Reclaim and compaction stalls",
                "ops",
                "",
                [
                    (f"kvtier:vmstat_allocstall:rate5m{{{SEL}}}", "direct reclaim"),
                    (
                        f"rate(kvtier_vmstat_compact_stall_total{{{SEL}}}[$__rate_interval])",
                        "compaction",
                    ),
                    (
                        f"rate(kvtier_vmstat_oom_kill_total{{{SEL}}}[$__rate_interval])",
                        "OOM kills",
                    ),
                ],
            ),
            (
                "Free blocks of order 9 and up",
                "short",
                "2 MiB-and-larger free blocks per zone.",
                [
                    (
                        "sum by (instance, node, zone) "
                        f'(kvtier_buddyinfo_blocks{{{SEL}, order=~"9|[1-9][0-9]"}})',
                        "node {{node}} {{zone}}",
                    )
                ],
            ),
            (
                "Fragmentation index (2 MiB)",
                "short",
                "Near 1: a 2 MiB allocation fails for fragmentation; -1: it succeeds.",
                [(f"kvtier_buddyinfo_fragmentation_index{{{SEL}}}", "node {{node}} {{zone}}")],
            ),
            (
                "Hugepage pool",
                "short",
                "",
                [
                    (f"kvtier_hugepages_pool{{{SEL}}}", "total"),
                    (f"kvtier_hugepages_free{{{SEL}}}", "free"),
                    (f"kvtier_hugepages_reserved{{{SEL}}}", "reserved"),
                ],
            ),
        ],
    ),
    (
        "Page cache",
        [
            (
                "Dirty pages against the threshold",
                "bytes",
                "Writers are throttled as dirty+writeback nears the threshold.",
                [
                    (f"kvtier_memory_dirty_bytes{{{SEL}}}", "dirty"),
                    (f"kvtier_memory_writeback_bytes{{{SEL}}}", "writeback"),
                    (f"kvtier_memory_dirty_threshold_bytes{{{SEL}}}", "threshold"),
                    (
                        f"kvtier_memory_dirty_background_threshold_bytes{{{SEL}}}",
                        "background threshold",
                    ),
                ],
            ),
            (
                "Page cache size",
                "bytes",
                "",
                [(f"kvtier_memory_cached_bytes{{{SEL}}}", "cached")],
            ),
            (
                "Refaults and major faults",
                "ops",
                "Refaults: the page cache is too small for its working set.",
                [
                    (
                        f"rate(kvtier_vmstat_workingset_refault_total{{{SEL}}}[$__rate_interval])",
                        "refaults",
                    ),
                    (
                        f"rate(kvtier_vmstat_pgmajfault_total{{{SEL}}}[$__rate_interval])",
                        "major faults",
                    ),
                ],
            ),
        ],
    ),
    (
        "NVMe",
        [
            (
                "IOPS",
                "iops",
                "",
                [
                    (
                        f"rate(kvtier_disk_reads_completed_total{{{SEL}}}[$__rate_interval])",
                        "{{device}} r/s",
                    ),
                    (
                        f"rate(kvtier_disk_writes_completed_total{{{SEL}}}[$__rate_interval])",
                        "{{device}} w/s",
                    ),
                ],
            ),
            (
                "Disk throughput",
                "Bps",
                "",
                [
                    (
                        f"rate(kvtier_disk_read_bytes_total{{{SEL}}}[$__rate_interval])",
                        "{{device}} read",
                    ),
                    (
                        f"rate(kvtier_disk_written_bytes_total{{{SEL}}}[$__rate_interval])",
                        "{{device}} written",
                    ),
                ],
            ),
            (
                "Queue size (aqu-sz)",
                "short",
                "Mean requests in flight; %util is misleading on NVMe.",
                [
                    (
                        f"rate(kvtier_disk_io_time_weighted_seconds_total{{{SEL}}}[$__rate_interval])",
                        "{{device}}",
                    )
                ],
            ),
            (
                "L3 filesystem free",
                "percentunit",
                "",
                [(f"kvtier:l3_filesystem_avail:ratio{{{SEL}}}", "free")],
            ),
        ],
    ),
    (
        "PCIe and GPUs",
        [
            (
                "GPU memory",
                "bytes",
                "",
                [
                    (f"kvtier_gpu_memory_used_bytes{{{SEL}}}", "GPU {{gpu}} used"),
                    (f"kvtier_gpu_memory_total_bytes{{{SEL}}}", "GPU {{gpu}} total"),
                ],
            ),
            (
                "GPU memory plan",
                "bytes",
                "kvtier serve's one GPU memory budget (--gpu-memory-utilization): its parts "
                "stacked, in plan order, with the budget and the bytes the process holds as lines "
                "(alert KvtierGpuBudgetExceeded when they pass the budget). Pick one instance: "
                "stacks of several add up. Empty without a plan (the CPU, a model across devices).",
                [
                    (f"kvtier_gpu_memory_bytes{{{SEL}}}", "{{part}} {{instance}}"),
                    (f"kvtier_gpu_memory_budget_bytes{{{SEL}}}", "budget {{instance}}"),
                    (f"kvtier_gpu_memory_process_bytes{{{SEL}}}", "used {{instance}}"),
                ],
            ),
            (
                "GPU free framebuffer",
                "percentunit",
                "",
                [(f"kvtier:gpu_memory_free:ratio{{{SEL}}}", "GPU {{gpu}}")],
            ),
            (
                "PCIe throughput",
                "Bps",
                "",
                [
                    (f"kvtier_gpu_pcie_rx_bytes_per_second{{{SEL}}}", "GPU {{gpu}} to GPU"),
                    (f"kvtier_gpu_pcie_tx_bytes_per_second{{{SEL}}}", "GPU {{gpu}} from GPU"),
                ],
            ),
            (
                "PCIe link",
                "short",
                "Generation and width against their maximum.",
                [
                    (f"kvtier_gpu_pcie_link_generation{{{SEL}}}", "GPU {{gpu}} gen"),
                    (f"kvtier_gpu_pcie_link_max_generation{{{SEL}}}", "GPU {{gpu}} max gen"),
                    (f"kvtier_gpu_pcie_link_width{{{SEL}}}", "GPU {{gpu}} width"),
                    (f"kvtier_gpu_pcie_link_max_width{{{SEL}}}", "GPU {{gpu}} max width"),
                ],
            ),
            (
                "PCIe replays",
                "ops",
                "Link-level retransmissions: a bad riser, slot or cable.",
                [
                    (
                        f"rate(kvtier_gpu_pcie_replay_total{{{SEL}}}[$__rate_interval])",
                        "GPU {{gpu}}",
                    )
                ],
            ),
        ],
    ),
    (
        "Shared tier (L4, Redis): empty without an L4",
        [
            (
                "L4 up and breaker",
                "short",
                "kvtier_l4_up: 1 Redis reachable. Breaker: 0 closed, 1 half open, 2 open "
                "(L4 bypassed; alert KvtierL4Down).",
                [
                    (f"kvtier_l4_up{{{SEL}}}", "up {{instance}}"),
                    (f"kvtier_l4_breaker_state{{{SEL}}}", "breaker {{instance}}"),
                ],
            ),
            (
                "L4 hit ratio",
                "percentunit",
                "Chunks found in Redis over chunks looked up there; misses include chunks "
                "Redis evicted under maxmemory or expired.",
                [
                    (
                        f"rate(kvtier_l4_hits_total{{{SEL}}}[$__rate_interval])\n/ "
                        f"(rate(kvtier_l4_hits_total{{{SEL}}}[$__rate_interval])"
                        f" + rate(kvtier_l4_misses_total{{{SEL}}}[$__rate_interval]))",
                        "{{instance}}",
                    )
                ],
            ),
            (
                "L4 bytes",
                "Bps",
                "Bytes per second read from and written to Redis.",
                [
                    (
                        f"rate(kvtier_l4_bytes_total{{{SEL}}}[$__rate_interval])",
                        "{{direction}} {{instance}}",
                    )
                ],
            ),
            (
                "L4 latency",
                "s",
                "Mean time of a get and of a put (sum over count).",
                [
                    (
                        f"rate(kvtier_l4_operation_seconds_sum{{{SEL}}}[$__rate_interval])\n/ "
                        f"rate(kvtier_l4_operation_seconds_count{{{SEL}}}[$__rate_interval])",
                        "{{op}} {{instance}}",
                    )
                ],
            ),
            (
                "L4 errors and shed writes",
                "ops",
                "Failed L4 operations (alert KvtierL4Errors) and write-behind copies dropped.",
                [
                    (
                        f"rate(kvtier_l4_errors_total{{{SEL}}}[$__rate_interval])",
                        "errors {{instance}}",
                    ),
                    (
                        f"rate(kvtier_l4_writes_shed_total{{{SEL}}}[$__rate_interval])",
                        "shed {{instance}}",
                    ),
                ],
            ),
        ],
    ),
    (
        # One dashboard for the fleet: every host is a scrape target, told apart by the
        # `instance` label Prometheus gives its series (docs/deploy.md).
        "Fleet (hosts behind HAProxy, L4 on a Redis Cluster)",
        [
            (
                "Sessions per host",
                "short",
                "Sessions each host holds in memory (active and idle: running, or between turns "
                "with their K/V in L1), by instance. With HAProxy's consistent hash on "
                "X-Session-ID they stay level; a host that leaves gives its sessions to the "
                "others.",
                [
                    (
                        f'sum by (instance) (kvtier_sessions{{{SEL}, state=~"active|idle"}})',
                        "{{instance}}",
                    )
                ],
            ),
            (
                "Moves",
                "ops",
                "Sessions per second moved to each host: opened from the L4 record of another "
                "host that served them last. A burst when a host leaves or rejoins; moves that "
                "go on are a host flapping (alert KvtierSessionMoves).",
                [
                    (
                        "sum by (instance) "
                        f"(rate(kvtier_moved_sessions_total{{{SEL}}}[$__rate_interval]))",
                        "moved to {{instance}}",
                    )
                ],
            ),
            (
                "L4 hit ratio per shard",
                "percentunit",
                "Chunk reads found over chunks looked up, by Redis Cluster primary (summed over "
                "the selected hosts). One shard far below the others holds evicted or lost "
                "slots; after a failover its ratio returns within seconds. A shard without a "
                "replica fires KvtierL4ShardNoReplica.",
                [
                    (
                        f"{_SHARD_HITS}\n/ ({_SHARD_HITS} + {_SHARD_MISSES})",
                        "{{shard}}",
                    )
                ],
            ),
        ],
    ),
]


# Panels whose series stack (title -> legends matched by this regex stay unstacked lines).
STACKED: dict[str, str] = {"GPU memory plan": "^(budget|used) .*"}


def _field_config(title: str, unit: str) -> dict:
    if title not in STACKED:
        return {"defaults": {"unit": unit}, "overrides": []}
    line = [
        {"id": "custom.stacking", "value": {"mode": "none", "group": "A"}},
        {"id": "custom.fillOpacity", "value": 0},
        {"id": "custom.lineWidth", "value": 2},
    ]
    return {
        "defaults": {
            "unit": unit,
            "custom": {"stacking": {"mode": "normal", "group": "A"}, "fillOpacity": 40},
        },
        "overrides": [
            {"matcher": {"id": "byRegexp", "options": STACKED[title]}, "properties": line}
        ],
    }


def _panel(pid: int, x: int, y: int, title: str, unit: str, desc: str, targets: list) -> dict:
    return {
        "id": pid,
        "type": "timeseries",
        "title": title,
        "description": desc,
        "datasource": DS,
        "gridPos": {"h": 8, "w": 8, "x": x, "y": y},
        "fieldConfig": _field_config(title, unit),
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
        "targets": [
            {"datasource": DS, "expr": expr, "legendFormat": legend, "refId": chr(ord("A") + i)}
            for i, (expr, legend) in enumerate(targets)
        ],
    }


def dashboard() -> dict:
    panels: list[dict] = []
    pid, y = 1, 0
    for row_title, row_panels in ROWS:
        panels.append(
            {
                "id": pid,
                "type": "row",
                "title": row_title,
                "collapsed": False,
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
                "panels": [],
            }
        )
        pid, y = pid + 1, y + 1
        for i, (title, unit, desc, targets) in enumerate(row_panels):
            x = (i % 3) * 8
            if i and i % 3 == 0:
                y += 8
            panels.append(_panel(pid, x, y, title, unit, desc, targets))
            pid += 1
        y += 8
    return {
        "uid": "kvtier",
        "title": "kvtier",
        "description": "Tiered KV cache and the host signals that precede an OOM or I/O stall.",
        "tags": ["kvtier"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "refresh": "30s",
        "time": {"from": "now-6h", "to": "now"},
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Data source",
                    "type": "datasource",
                    "query": "prometheus",
                    "current": {},
                    "hide": 0,
                },
                {
                    "name": "instance",
                    "label": "Instance",
                    "type": "query",
                    "datasource": DS,
                    "query": {
                        "query": "label_values(kvtier_snapshot_timestamp_seconds, instance)",
                        "refId": "instance",
                    },
                    "definition": "label_values(kvtier_snapshot_timestamp_seconds, instance)",
                    "refresh": 2,
                    "includeAll": True,
                    "multi": True,
                    "allValue": ".+",
                    "current": {},
                    "hide": 0,
                },
            ]
        },
        "annotations": {"list": []},
        "panels": panels,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


if __name__ == "__main__":
    if sys.argv[1:] == ["-"]:  # print instead of writing
        sys.stdout.write(render())
    else:
        out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).with_name("kvtier.json")
        out.write_text(render())
        print(out)
