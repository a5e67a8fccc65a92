"""What `kvtier loadgen` reports: latency by restore source, client-side and server-side, the
like-for-like restore vs recompute comparison, and the cache tiers after the run.

Client-side TTFT is what an agent waited: from sending the request to its first token. It
includes the wait for one of the server's generation slots (`kvtier serve --max-concurrency`),
which under load dwarfs the restore itself. The server times the part it controls, from slot
admission to the first token, in the `kvtier_server_ttft_seconds` histogram by source; the load
generator scrapes /metrics before and after the fleet and reports the difference, so the two
figures stand side by side and their gap reads as the queue wait.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvtier.humanize import plural, size
from kvtier.loadgen_hosts import host_lines
from kvtier.loadgen_metrics import (
    _source_key,
    parse_metrics,
)

RESTORED = ("l1", "l2", "l3", "l4")
TIER_NAMES = {"l1": "L1 buffers"}  # the cache's own L1 tier; the others by their names: L2, L3
L4_COUNTS = ("hits", "misses", "errors")  # kvtier_l4_*_total, when the server has an L4


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def summarize(values: list[float]) -> dict[str, Any]:
    ms = [v * 1000 for v in values]
    return {
        "n": len(ms),
        "p50": percentile(ms, 50),
        "p95": percentile(ms, 95),
        "p99": percentile(ms, 99),
        "mean": sum(ms) / len(ms) if ms else None,
    }


POOL_STATES = ("parked", "running", "free")


def tiers_now(text: str) -> dict[str, Any]:
    """The cache's tiers, sessions and restore decisions from one /metrics text."""
    samples = parse_metrics(text)

    def by(name: str, label: str) -> dict[str, float]:
        return {labels.get(label, "?"): v for labels, v in samples.get(name, [])}

    used, cap = by("kvtier_tier_used_bytes", "tier"), by("kvtier_tier_capacity_bytes", "tier")
    chunks, hits = by("kvtier_tier_chunks", "tier"), by("kvtier_tier_hits_total", "tier")
    l4 = None
    if samples.get("kvtier_l4_up"):  # the shared tier, when the server has one
        moved = by("kvtier_l4_bytes_total", "direction")
        l4 = {k: int(sum(v for _, v in samples.get(f"kvtier_l4_{k}_total", []))) for k in L4_COUNTS}
        l4 |= {"up": samples["kvtier_l4_up"][0][1] > 0, "bytes_read": int(moved.get("read", 0))}
        hits = {**hits, "l4": hits.get("l4", l4["hits"])}
    # the batch's page pool by state, in bytes (kvtier serve with batching): with paged L1 its
    # parked pages are the sessions' L1, which the L1 tier's bytes no longer count
    pages, page_bytes = (
        by("kvtier_server_kv_pages", "state"),
        samples.get("kvtier_server_kv_page_bytes"),
    )
    pool = {k: int(v * page_bytes[0][1]) for k, v in pages.items()} if page_bytes else None
    return {
        "hits_by_tier": {t: int(hits[t]) for t in sorted(hits)},
        "l4": l4,
        "pool": pool,
        "tiers": {
            tier: {
                "used_bytes": int(used[tier]),
                "capacity_bytes": int(cap[tier]) if tier in cap else None,
                "chunks": int(chunks.get(tier, 0)),
                "hits": int(hits.get(tier, 0)),
            }
            for tier in sorted(used)
        },
        "sessions": {k: int(v) for k, v in by("kvtier_sessions", "state").items()},
        "restore_decisions": {
            k: int(v)
            for k, v in sorted(
                by("kvtier_restore_decisions_total", "src").items(),
                key=lambda kv: _source_key(kv[0]),
            )
        },
    }


def tiers_during(before: str | None, after: str) -> dict[str, Any]:
    """`tiers_now` of `after` with its counters (hits, restores, L4 reads) less those of
    `before`: what the run did, not everything since the server started. Bytes, chunks and
    sessions are as they are after it. Without `before` (its scrape failed), the totals."""
    now = tiers_now(after)
    if before is None:
        return now | {"counted": "since the server started"}
    then = tiers_now(before)

    def less(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
        return {k: max(0, v - b.get(k, 0)) for k, v in a.items()}  # 0: the server restarted

    now["hits_by_tier"] = less(now["hits_by_tier"], then["hits_by_tier"])
    now["restore_decisions"] = less(now["restore_decisions"], then["restore_decisions"])
    for tier, v in now["tiers"].items():
        v["hits"] = max(0, v["hits"] - then["tiers"].get(tier, {}).get("hits", 0))
    if now["l4"] and then["l4"]:
        now["l4"] |= less({k: now["l4"][k] for k in (*L4_COUNTS, "bytes_read")}, then["l4"])
    return now | {"counted": "during the run"}


# ---- the result ----------------------------------------------------------------------------


def compare_pairs(pairs: list[dict[str, Any]]) -> dict[str, Any]:
    """The restore vs recompute probes, like for like.

    Each pair is one prompt sent twice, one at a time: under its own session (`source` says
    where the server restored it from) and under a fresh tenant (nothing cached). A pair whose
    restore was itself a recompute compares recompute with recompute; it is counted, not mixed
    into the cache's figure. The headline (`speedup_p50`) is over the pairs restored from a
    cache tier; `by_source` splits it per tier."""

    def side(rows: list[dict[str, Any]]) -> dict[str, Any]:
        restore = summarize([r["restore_s"] for r in rows])
        recompute = summarize([r["recompute_s"] for r in rows])
        r, c = restore["p50"], recompute["p50"]
        return {
            "n": len(rows),
            "restore_ttft_ms": restore,
            "recompute_ttft_ms": recompute,
            "speedup_p50": (c / r) if r and c else None,
        }

    cached = [p for p in pairs if p["source"] in RESTORED]
    sources = Counter(p["source"] for p in pairs)
    return {
        **side(cached),  # its "n" is the cached pairs': the next line restores all pairs'
        "n": len(pairs),
        "n_cached": len(cached),
        "restore_sources": dict(sorted(sources.items(), key=lambda kv: _source_key(kv[0]))),
        "prompt_tokens_p50": percentile([float(p["prompt_tokens"]) for p in pairs], 50),
        "by_source": {
            src: side([p for p in cached if p["source"] == src])
            for src in sorted({p["source"] for p in cached}, key=_source_key)
        },
        "pairs": pairs,
    }


def report(
    cfg: Any,
    samples: list[Any],
    wall: float,
    compare: dict[str, Any] | None,
    server: dict[str, Any] | None = None,
    tiers: dict[str, Any] | None = None,
    metrics_error: str | None = None,
) -> dict[str, Any]:
    """The JSON result: client-side latency by source, server-side TTFT, queue wait, probes."""
    ok = [s for s in samples if s.error is None and s.ttft is not None]
    errors = Counter((s.error or "no tokens").split(":")[0] for s in samples if s not in ok)
    sources = sorted({s.source for s in ok}, key=_source_key)
    tokens = sum(s.completion_tokens for s in ok)
    client = {
        "overall": summarize([s.ttft for s in ok if s.ttft is not None]),
        "by_source": {
            src: summarize([s.ttft for s in ok if s.source == src and s.ttft is not None])
            for src in sources
        },
    }
    queue: dict[str, float] = {}
    for src, srv in (server or {}).items():
        mine = client["overall"] if src == "overall" else client["by_source"].get(src)
        if mine and mine["mean"] is not None and srv["mean"] is not None:
            queue[src] = max(0.0, mine["mean"] - srv["mean"])
    return {
        "config": asdict(cfg),
        "wall_seconds": wall,
        "requests": len(samples),
        "ok": len(ok),
        "errors": dict(errors),
        "throughput": {
            "requests_per_s": len(ok) / wall if wall else 0.0,
            "completion_tokens_per_s": tokens / wall if wall else 0.0,
        },
        "ttft_ms": client,
        "server_ttft_ms": server,
        "queue_wait_ms": queue,
        "metrics_error": metrics_error,
        "itl_ms": {
            "overall": summarize([x for s in ok for x in s.itl]),
            "by_source": {
                src: summarize([x for s in ok if s.source == src for x in s.itl]) for src in sources
            },
        },
        "prompt_tokens_p50_by_source": {
            src: percentile([float(s.prompt_tokens) for s in ok if s.source == src], 50)
            for src in sources
        },
        "compare": compare,
        "tiers": tiers,
        "samples": [asdict(s) for s in samples],
    }


# ---- text ----------------------------------------------------------------------------------


def ms(v: float | None) -> str:
    """A duration given in ms, in the unit a person reads: '850 µs', '85.3 ms', '2.13 s'."""
    if v is None:
        return "-"
    if v == 0:
        return "0 ms"
    if v < 1:
        return f"{v * 1000:.0f} µs"
    if v < 1000:
        return f"{v:.1f} ms"
    return f"{v / 1000:.2f} s"


def _counts(counts: dict[str, int], verb: str = "restored ") -> str:
    """{'l3': 4, 'recompute': 2} -> '4 restored from l3, 2 recomputed'."""
    return ", ".join(
        f"{n} recomputed" if src == "recompute" else f"{n} {verb}from {src}"
        for src, n in counts.items()
    )


def _errors(errors: dict[str, int]) -> str:
    if not errors:
        return "no errors"
    total = sum(errors.values())
    return plural(total, "error") + " (" + ", ".join(f"{n} {k}" for k, n in errors.items()) + ")"


def format_report(result: dict[str, Any]) -> str:
    """The human-readable summary printed after a run."""
    tp = result["throughput"]
    lines = [
        f"{plural(result['requests'], 'request')}, {result['ok']} ok, "
        f"{_errors(result['errors'])}; wall {result['wall_seconds']:.1f} s",
        f"throughput {tp['requests_per_s']:.2f} requests/s, "
        f"{tp['completion_tokens_per_s']:.1f} tokens/s",
        *_context_lines(result.get("context")),
        "",
        *_ttft_table(result),
        "",
        f"{'ITL':<12}{'n':>7}{'p50':>11}{'p95':>10}{'p99':>10}",
    ]
    itl = result["itl_ms"]
    for name, s in [("overall", itl["overall"]), *itl["by_source"].items()]:
        lines.append(f"{name:<12}{s['n']:>7}{ms(s['p50']):>11}{ms(s['p95']):>10}{ms(s['p99']):>10}")
    lines += _compare_lines(result.get("compare"))
    lines += _tier_lines(result.get("tiers"))
    return "\n".join([*lines, *host_lines(result.get("hosts"))])


def _context_lines(c: dict[str, Any] | None) -> list[str]:
    """How often agents started their conversation over at the servers' context limit."""
    if not c or not c.get("restarts"):
        return []
    return [
        f"context: {plural(c['restarts'], 'conversation')} started over at the servers' "
        f"max_model_len of {c['max_model_len']:,} tokens ({c['sessions_restarted']} of the "
        "agents), as an agent framework does when the next turn would not fit"
    ]


def _ttft_table(result: dict[str, Any]) -> list[str]:
    client, server = result["ttft_ms"], result.get("server_ttft_ms")
    queue = result.get("queue_wait_ms") or {}
    lines = [
        f"{'':<19}{'client-side (agents)':^31}{'server-side':^22}",
        f"{'TTFT':<12}{'n':>7}{'p50':>11}{'p95':>10}{'p99':>10}"
        f"{'p50':>12}{'mean':>10}{'queue wait':>12}",
    ]
    rows = [("overall", client["overall"]), *client["by_source"].items()]
    for name, s in rows:
        srv = (server or {}).get(name) or {}
        wait = queue.get(name)
        lines.append(
            f"{name:<12}{s['n']:>7}{ms(s['p50']):>11}{ms(s['p95']):>10}{ms(s['p99']):>10}"
            f"{ms(srv.get('p50')):>12}{ms(srv.get('mean')):>10}{ms(wait):>12}"
        )
    lines += [
        "  client: request sent to first token, as the agents saw it: it includes the wait for",
        "    a generation slot (kvtier serve --max-concurrency).",
        "  server: slot admission to first token (kvtier_server_ttft_seconds, the p50 within its",
        "    buckets); the restore or recompute itself.",
        "  queue wait: client mean minus server mean, the time spent waiting for a slot.",
    ]
    if server is None:
        why = result.get("metrics_error") or "the server's /metrics could not be read"
        lines.append(f"  (no server-side figures: {why})")
    return lines


def _compare_lines(c: dict[str, Any] | None) -> list[str]:
    if not c or not c["n"]:
        return []
    lines = [
        "",
        "restore vs recompute: the same prompts, sent one at a time (no queue), under the",
        "session (restore) and under a fresh tenant (recompute)",
        f"  {plural(c['n'], 'probe')}, median {plural(int(c['prompt_tokens_p50'] or 0), 'token')};"
        f" the session's request: {_counts(c['restore_sources'])}",
    ]
    lines += _probe_tenant_lines(c.get("probe_tenants"))
    if not c["n_cached"]:
        lines.append(
            "  no probe was served from the cache, so there is nothing to compare: is the "
            "server's cache off (--cache none)?"
        )
        return lines
    r, p = c["restore_ttft_ms"], c["recompute_ttft_ms"]
    left_out = c["n"] - c["n_cached"]
    lines.append(
        f"  from the cache ({plural(c['n_cached'], 'probe')}): TTFT p50 {ms(r['p50'])}, "
        f"recomputed {ms(p['p50'])} -> restore is {c['speedup_p50']:.2f}x "
        + ("faster" if (c["speedup_p50"] or 0) > 1 else "NOT faster")
    )
    if len(c["by_source"]) > 1:
        for src, s in c["by_source"].items():
            lines.append(
                f"    {src}: {plural(s['n'], 'probe')}, {ms(s['restore_ttft_ms']['p50'])} vs "
                f"{ms(s['recompute_ttft_ms']['p50'])}, {s['speedup_p50']:.2f}x"
            )
    if left_out:
        lines.append(
            f"  left out: {plural(left_out, 'probe')} whose session the server recomputed "
            "(evicted, or cheaper to recompute)"
        )
    return lines


def _probe_tenant_lines(p: dict[str, Any] | None) -> list[str]:
    """Whether the probes' fresh tenants (their chunks) were deleted after the comparison."""
    if not p:
        return []
    if p["deleted"] == p["tenants"]:
        return [
            f"  probe tenants deleted after: {p['deleted']} "
            f"({plural(p['chunks'], 'chunk')} removed from the cache)"
        ]
    return [
        f"  probe tenants left in the cache: {p['tenants'] - p['deleted']} of {p['tenants']} "
        f"({p['error']}; an admin deletes them: DELETE /v1/tenants/{{tenant}})"
    ]


def _tier_lines(t: dict[str, Any] | None) -> list[str]:
    if not t or not t["tiers"]:
        return []  # a server without the cache's metrics on /metrics
    lines = ["", "cache tiers after the run (from /metrics):"]
    if t.get("counted") == "during the run":
        lines.append("  (hits and restores: during the run, the counters' change over it)")
    elif t.get("counted"):
        lines.append(f"  (hits and restores: {t['counted']}; no scrape before the run)")
    pool = t.get("pool")
    # With paged L1 (the server's default) the sessions' L1 is the batch's page pool, "pool (L1)",
    # and the cache's own L1 tier, its "L1 buffers", holds no chunk: the L1 hits are the pool's.
    # The names are kvtier plan's and kvtop's.
    paged = (
        pool is not None
        and pool.get("parked", 0) > 0
        and not t["tiers"].get("l1", {}).get("chunks")
    )
    for tier, v in t["tiers"].items():
        cap = v["capacity_bytes"]
        of = f" of {size(cap)} ({v['used_bytes'] / cap:.0%})" if cap else ""
        hits = "" if paged and tier == "l1" else f", {plural(v['hits'], 'hit')}"
        lines.append(
            f"  {TIER_NAMES.get(tier, tier.upper()):<10} {size(v['used_bytes'])}{of}, "
            f"{plural(v['chunks'], 'chunk')}{hits}"
        )
    if pool:
        by_state = ", ".join(f"{k} {size(pool[k])}" for k in POOL_STATES if k in pool)
        if paged:
            l1_hits = plural(t["tiers"]["l1"]["hits"], "hit") if "l1" in t["tiers"] else ""
            lines.append(f"  pool (L1)  {by_state}" + (f"; {l1_hits}" if l1_hits else ""))
        else:
            lines.append(f"  page pool  {by_state}")
    l4 = t.get("l4")
    if l4:
        lines.append(
            f"  Redis (L4) {'up' if l4['up'] else 'DOWN'}: {plural(l4['hits'], 'hit')}, "
            f"{plural(l4['misses'], 'miss', 'misses')}, {plural(l4['errors'], 'error')}, "
            f"{size(l4['bytes_read'])} read"
        )
    if t.get("hits_by_tier"):
        lines.append(
            "  hits by tier: " + ", ".join(f"{k} {n}" for k, n in t["hits_by_tier"].items())
        )
    if t["sessions"]:
        lines.append("  sessions: " + ", ".join(f"{n} {k}" for k, n in t["sessions"].items()))
    if t["restore_decisions"]:
        lines.append("  restores: " + _counts(t["restore_decisions"], verb=""))
    return lines


# ---- the plot ------------------------------------------------------------------------------


def plot(result: dict[str, Any], path: str | Path) -> None:
    """Client-side TTFT over time and its distribution by restore source, and per source the
    client-side p50 beside the server-side one (the difference is the queue wait)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    human = FuncFormatter(lambda v, _pos: _tick(v))
    samples = [s for s in result["samples"] if s["ttft"] is not None and s["error"] is None]
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(16, 4.8))
    by_src: dict[str, list[dict[str, Any]]] = {}
    for s in samples:
        by_src.setdefault(s["source"], []).append(s)
    for src, rows in sorted(by_src.items(), key=lambda kv: _source_key(kv[0])):
        label = f"{src} ({plural(len(rows), 'request')})"
        ttfts = sorted(r["ttft"] * 1000 for r in rows)
        ax1.scatter([r["start"] for r in rows], [r["ttft"] * 1000 for r in rows], s=8, label=label)
        ax2.plot(ttfts, [(k + 1) / len(ttfts) for k in range(len(ttfts))], label=label)
    ax1.set(xlabel="request start (s)", ylabel="TTFT", title="Client-side TTFT (includes queue)")
    ax1.set_yscale("log")
    ax2.set(xlabel="TTFT", ylabel="fraction of requests", title="Client-side TTFT distribution")
    ax2.set_xscale("log")
    for axis in (ax1.yaxis, ax2.xaxis):
        axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        axis.set_major_formatter(human)
        axis.set_minor_formatter(NullFormatter())
    _plot_client_vs_server(ax3, result)
    ax3.yaxis.set_major_formatter(human)
    for ax in (ax1, ax2, ax3):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    c = result.get("compare")
    if c and c.get("n_cached") and c.get("speedup_p50"):
        fig.suptitle(
            f"Same prompts one at a time: restore from the cache is {c['speedup_p50']:.1f}x "
            f"faster than recompute ({plural(c['n_cached'], 'probe')})"
        )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _tick(v: float) -> str:
    """An axis label in ms: '50 ms', '2 s'."""
    if v <= 0:
        return "0"
    return f"{v:g} ms" if v < 1000 else f"{v / 1000:g} s"


def _plot_client_vs_server(ax: Any, result: dict[str, Any]) -> None:
    """Mean TTFT per source, client-side beside server-side: the gap is the queue wait."""
    client = result["ttft_ms"]["by_source"]
    server = result.get("server_ttft_ms") or {}
    names = list(client)
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], [client[n]["mean"] or 0 for n in names], 0.4, label="client")
    if server:
        heights = [(server.get(n) or {}).get("mean") or 0 for n in names]
        ax.bar([x + 0.2 for x in xs], heights, 0.4, label="server (no queue wait)")
    ax.set_xticks(list(xs), names)
    ax.set(ylabel="mean TTFT", title="Mean TTFT by source: client vs server")
