"""`kvtier loadgen --url A --url B`: one fleet over several servers, each session's turns going
round the hosts in turn (turn t of session i to host (i + t) mod n), the way a load balancer
without affinity spreads an agent's turns over a fleet. A turn that lands on another host than
the last finds its session only in a tier the hosts share (L4), or recomputes it.

The server-side figures are summed over the hosts (the TTFT histograms' increases, the tiers'
counters), and the result also keeps each host's own: requests by restore source, hits by tier.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from kvtier.humanize import plural
from kvtier.loadgen_metrics import _source_key, ttft_deltas, ttft_summary


def host_of(session: int, turn: int, hosts: int) -> int:
    """The index of the host that serves `turn` of `session`: round robin, per session."""
    return (session + turn) % hosts


def fleet_ttft(scrapes: list[tuple[str | None, str | None]]) -> dict[str, Any]:
    """Server-side TTFT over every host: (before, after) /metrics texts per host, their
    histogram increases summed by source. A host whose `after` is missing is left out."""
    total: dict[str, dict[str, Any]] = {}
    for before, after in scrapes:
        if after is None:
            continue
        for src, d in ttft_deltas(before, after).items():
            t = total.setdefault(src, {"buckets": {}, "count": 0.0, "sum": 0.0})
            for le, c in d["buckets"].items():
                t["buckets"][le] = t["buckets"].get(le, 0.0) + c
            t["count"] += d["count"]
            t["sum"] += d["sum"]
    return ttft_summary(total)


def merge_tiers(per_host: list[dict[str, Any]]) -> dict[str, Any]:
    """`tiers_now` of several hosts as one: bytes, chunks, hits, sessions and restores summed;
    except the l4 tier's bytes, which every host reports for the one Redis they share."""
    tiers: dict[str, dict[str, Any]] = {}
    hits: Counter[str] = Counter()
    sessions: Counter[str] = Counter()
    decisions: Counter[str] = Counter()
    l4: dict[str, Any] | None = None
    for t in per_host:
        for name, v in t["tiers"].items():
            into = tiers.setdefault(
                name, {"used_bytes": 0, "capacity_bytes": None, "chunks": 0, "hits": 0}
            )
            shared = name == "l4"  # one Redis seen from every host: its memory counted once
            for key in ("used_bytes", "chunks", "hits"):
                into[key] = (
                    max(into[key], v[key]) if shared and key != "hits" else into[key] + v[key]
                )
            if v["capacity_bytes"] is not None:
                cap = into["capacity_bytes"] or 0
                into["capacity_bytes"] = (
                    max(cap, v["capacity_bytes"]) if shared else cap + v["capacity_bytes"]
                )
        hits.update(t.get("hits_by_tier") or {})
        sessions.update(t["sessions"])
        decisions.update(t["restore_decisions"])
        if t.get("l4"):
            l4 = dict(t["l4"]) if l4 is None else _add_l4(l4, t["l4"])
    return {
        "tiers": dict(sorted(tiers.items())),
        "hits_by_tier": dict(sorted(hits.items())),
        "l4": l4,
        "sessions": dict(sessions),
        "restore_decisions": dict(sorted(decisions.items(), key=lambda kv: _source_key(kv[0]))),
        # "during the run" only when every host's counters are their change over the run
        "counted": _counted({str(t["counted"]) for t in per_host if t.get("counted")}),
    }


def _counted(kinds: set[str]) -> str | None:
    if not kinds:
        return None
    return kinds.pop() if len(kinds) == 1 else "since the server started (on some hosts)"


def _add_l4(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = {k: a[k] + b[k] for k in a if k != "up"}
    out["up"] = a["up"] and b["up"]
    return out


def by_host(
    samples: list[Any], hosts: tuple[str, ...], tiers: list[dict[str, Any] | None]
) -> dict[str, Any]:
    """Per host: requests, and the answered ones by restore source; its hits by tier."""
    out: dict[str, Any] = {}
    for url, t in zip(hosts, tiers, strict=True):
        mine = [s for s in samples if s.host == url]
        ok = Counter(s.source for s in mine if s.error is None and s.ttft is not None)
        out[url] = {
            "requests": len(mine),
            "by_source": dict(sorted(ok.items(), key=lambda kv: _source_key(kv[0]))),
            "hits_by_tier": (t or {}).get("hits_by_tier"),
        }
    return out


def host_lines(hosts: dict[str, Any] | None) -> list[str]:
    """The per-host part of the text report (nothing for a single host)."""
    if not hosts or len(hosts) < 2:
        return []
    lines = ["", f"per host (each session's turns went round the {len(hosts)} hosts):"]
    for url, h in hosts.items():
        sources = ", ".join(f"{n} {src}" for src, n in h["by_source"].items()) or "none answered"
        lines.append(f"  {url}: {plural(h['requests'], 'request')} ({sources})")
        if h.get("hits_by_tier"):
            lines.append(
                "    hits by tier: " + ", ".join(f"{k} {n}" for k, n in h["hits_by_tier"].items())
            )
    return lines
