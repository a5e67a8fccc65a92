"""Tables, targets, plot and JSON of `bench/fleet_concurrent.py` (the batched-serving benchmark)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from fleet_serve import Measure

from kvtier.humanize import size

GIB = 2**30


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    v = sorted(values)
    return v[min(len(v) - 1, round(q * (len(v) - 1)))]


def summary(m: Measure, ceiling: Measure | None) -> dict[str, Any]:
    rate = m.tokens / m.window if m.window > 0 else float("nan")
    ceil_rate = ceiling.tokens / ceiling.window if ceiling and ceiling.window > 0 else float("nan")
    return {
        "config": m.name,
        "tok_s": rate,
        "ceiling_tok_s": ceil_rate,
        "x_ceiling": rate / ceil_rate if ceil_rate and not math.isnan(ceil_rate) else float("nan"),
        "ttft_p50": pct(m.ttft, 0.5),
        "ttft_p99": pct(m.ttft, 0.99),
        "step_p50": pct(m.steps, 0.5),
        "step_p99": pct(m.steps, 0.99),
        "returning_turns": m.turns,
        "tokens": m.tokens,
        "window_s": m.window,
        "oom": m.ooms,
        "failed": m.failed,
        "errors": m.errors,
        "peak_allocated_gib": m.peak_allocated / GIB,
        "peak_reserved_gib": m.peak_reserved / GIB,
        "cuda_mallocs_after_warmup": m.mallocs,
        "segments_after_warmup": m.segments,
        "note": m.note,
        **{f"extra_{k}": v for k, v in m.extra.items()},
    }


def _ms(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{x * 1e3:.1f}"


def table(title: str, rows: list[dict[str, Any]]) -> str:
    head = (
        f"{'config':>14} {'tok/s':>8} {'ceiling':>8} {'ratio':>6} {'TTFT p50':>9} "
        f"{'TTFT p99':>9} {'step p50':>9} {'step p99':>9} {'OOM':>4} {'fail':>4} "
        f"{'alloc GiB':>9} {'resv GiB':>9} {'mallocs':>7}  note"
    )
    lines = [title, head]
    for r in rows:
        lines.append(
            f"{r['config']:>14} {r['tok_s']:8.1f} {r['ceiling_tok_s']:8.1f} {r['x_ceiling']:6.2f} "
            f"{_ms(r['ttft_p50']):>9} {_ms(r['ttft_p99']):>9} {_ms(r['step_p50']):>9} "
            f"{_ms(r['step_p99']):>9} {r['oom']:>4} {r['failed']:>4} "
            f"{r['peak_allocated_gib']:9.2f} {r['peak_reserved_gib']:9.2f} "
            f"{r['cuda_mallocs_after_warmup']:>7}  {r['note']}"
            + (
                "; errors " + ", ".join(f"{k} x{v}" for k, v in r["errors"].items())
                if r["errors"]
                else ""
            )
        )
    lines.append("(times in ms; mallocs: cudaMalloc calls inside the measured window, -1 off CUDA)")
    for r in rows:
        if "extra_device_budget_bytes" in r and r["config"].startswith("kvtier"):
            lines.append(f"{r['config']:>14}: {memory_text(r)}")
        if "extra_mixed_steps" in r:
            lines.append(
                f"{r['config']:>14}: {r['extra_decode_only_steps']} decode-only steps (P50 "
                f"{_ms(r['extra_step_p50_decode_only'])} ms), {r['extra_mixed_steps']} with prompt "
                f"chunks (P50 {_ms(r['extra_step_p50_mixed'])} ms, "
                f"{r.get('extra_mixed_prompt_tokens_p50', float('nan')):.0f} prompt tokens), "
                f"mean batch {r['extra_mean_batch']:.1f}, {r['extra_preemptions']} preemptions, "
                f"{r.get('extra_graph_steps', 0)} graph / {r.get('extra_eager_steps', 0)} eager "
                "forwards"
            )
        gaps = r.get("extra_gpu_gaps") or {}
        if gaps:
            lines.append(
                f"{'':>14}  the GPU idle between steps: P50 {gaps['p50_ms']} ms, P90 "
                f"{gaps['p90_ms']} ms, mean {gaps['mean_ms']} ms over {gaps['gaps']} gaps, "
                f"{gaps['over_0_3_ms']:.0%} of them over 0.3 ms (target: under 0.3 ms)"
            )
        tail = r.get("extra_step_tail") or {}
        if tail:
            lines.append(
                f"{'':>14}  steps above P90 against those at or below P50 (mean): "
                + "; ".join(
                    f"{name} {g['steps']} steps {g['mean_ms']} ms, batch {g['batch']}, "
                    f"{g['mixed']:.0%} with prompt chunks ({g['prompt_tokens']} tokens), "
                    f"{g['admissions']} admissions, {g['finished']} finished turns before it, "
                    f"the scheduler launching {g.get('launch_ms', float('nan'))} ms and waiting "
                    f"for the GPU {g.get('wait_ms', float('nan'))} ms"
                    for name, g in (("tail", tail["tail"]), ("body", tail["body"]))
                )
            )
        w = r.get("extra_stored")
        if w:
            lines.append(
                f"{'':>14}  stored: {w['chunks_per_s']:.0f} chunks/s to L2 ({w['l2_mb_per_s']:,.0f} "
                f"MB/s), of which {w['tails_per_s']:.0f} partial tails/s "
                f"({w['tail_l2_mb_per_s']:,.0f} MB/s, {w['tail_token_share']:.0%} of the tokens); "
                f"L3 wrote {w['l3_mb_per_s']:,.0f} MB/s, its writers busy "
                f"{w['l3_write_busy']:.2f} s per s"
            )
        if r.get("extra_ttft_phases_p50_ms"):
            phases = ", ".join(f"{k} {v}" for k, v in r["extra_ttft_phases_p50_ms"].items())
            src = ", ".join(f"{k} {v}" for k, v in r.get("extra_restore_sources", {}).items())
            lines.append(f"{'':>14}  server TTFT P50 by phase (ms): {phases}; restored from {src}")
        if r.get("extra_ttft_phases_slowest_ms"):
            phases = ", ".join(f"{k} {v}" for k, v in r["extra_ttft_phases_slowest_ms"].items())
            src = ", ".join(f"{k} {v}" for k, v in r.get("extra_slowest_sources", {}).items())
            lines.append(
                f"{'':>14}  the slowest 5% of turns, mean by phase (ms): {phases}; from {src}"
            )
    return "\n".join(lines)


def _gib(x: int | None) -> str:
    if x is None:
        return "n/a"
    return f"{x / GIB:.2f} GiB" if abs(x) >= GIB // 4 else size(x)  # a CPU run's: small


def _x(x: int | None, budget: int | None) -> str:
    return "n/a" if x is None or not budget else f"{x / budget:.2f}x"


def memory_text(r: dict[str, Any]) -> str:
    """A kvtier row's device bytes beyond the weights against its budget (steady: the median
    inside the window; peak: since the configuration started), the restore sources of its
    returning turns, and the sessions in its page pool at the window's end."""
    steady, peak = r.get("extra_device_steady_bytes"), r.get("extra_device_peak_bytes")
    budget = r.get("extra_device_budget_bytes")
    text = (
        f"device beyond the weights: steady {_gib(steady)} ({_x(steady, budget)} the budget), "
        f"peak {_gib(peak)} ({_x(peak, budget)}), budget {_gib(budget)}"
    )
    src = r.get("extra_returning_sources")
    if src is not None:
        total = sum(src.values())
        text += f"; {total} returning turns from " + ", ".join(f"{k} {v}" for k, v in src.items())
    resident = r.get("extra_resident_sessions")
    if resident is not None:
        text += f"; {resident} sessions in the pool at the window's end"
    return text


def hibernated(r: dict[str, Any]) -> tuple[bool | None, int, int]:
    """Whether a kvtier row hibernated: (most of its returning turns restored from L2/L3 (or
    L4), those turns, all returning turns with a known source). None where its sessions' K/V
    fits where they stay between turns (its pool, or the cache's L1): nothing had to go."""
    src = r.get("extra_returning_sources") or {}
    total = sum(v for k, v in src.items() if k != "?")
    cold = sum(src.get(k, 0) for k in ("l2", "l3", "l4"))
    need, home = r.get("extra_sessions_kv_bytes"), r.get("extra_home_bytes")
    if need is not None and home and need <= home:
        return None, cold, total
    return (total > 0 and 2 * cold > total), cold, total


def hibernation_text(rows: list[dict[str, Any]]) -> str:
    """The hibernate scenario's verdict per kvtier row: HIBERNATED: yes/no."""
    lines = []
    for r in rows:
        if not r["config"].startswith("kvtier") or "extra_returning_sources" not in r:
            continue
        ok, cold, total = hibernated(r)
        need, home = r.get("extra_sessions_kv_bytes"), r.get("extra_home_bytes")
        fit = f"the sessions' K/V {_gib(need)} against {_gib(home)} kept between turns"
        verdict = "n/a (it all fits)" if ok is None else ("yes" if ok else "no")
        lines.append(
            f"{r['config']:>14}: HIBERNATED: {verdict} ({cold} of {total} returning turns "
            f"from l2/l3; {fit})"
        )
    return "\n".join(lines)


def _check(label: str, ok: bool | None, figure: str) -> dict[str, Any]:
    state = "n/a" if ok is None else ("met" if ok else "missed")
    return {"target": label, "figure": figure, "state": state}


def variant(name: str) -> dict[str, int]:
    """The settings a `kvtier-bN-pM-shortest-nodg-unfused` configuration name changes: {"b": N
    batch slots, "p": M prompt tokens of a decoding step, "shortest": 1 (short prompts
    shortest first, not oldest first), "dg": 1 / "nodg": 1 (`decode_graphs` on / off),
    "unfused": 1 (`fused_kernels` off)}, any of them; {} for any other name."""
    flags = ("shortest", "dg", "nodg", "unfused")
    m = re.fullmatch(r"kvtier((?:-(?:[bp]\d+|" + "|".join(flags) + r"))+)", name)
    if not m:
        return {}
    out = {}
    for part in m.group(1).split("-")[1:]:
        if part in flags:
            out[part] = 1
        else:
            out[part[0]] = int(part[1:])
    return out


# aggregate decode tok/s a kvtier row is to reach: fit (64 sessions, all in L1) and hibernate
# (256 sessions with L1 for 64); the plot marks them too
TOK_S_TARGET = {"fit": 6000, "hibernate": 3000}


def targets(scenario: str, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The batched-serving targets for the kvtier batched rows of a scenario: the default,
    int8, and the default with other slots or prompt tokens (`kvtier-b128-p256`)."""
    by = {r["config"]: r for r in rows}
    out = []
    for name, r in by.items():
        if name not in ("kvtier", "kvtier-int8") and not variant(name):
            continue
        rate = r["tok_s"]
        if scenario == "fit":
            goal = TOK_S_TARGET["fit"]
            out.append(_check(f"{name}: >= {goal:,} tok/s", rate >= goal, f"{rate:.0f}"))
            x = r["x_ceiling"]
            out.append(
                _check(
                    f"{name}: >= 0.85x ceiling", None if math.isnan(x) else x >= 0.85, f"{x:.2f}"
                )
            )
            g = by.get("generate_batch")
            gr = g["tok_s"] if g else float("nan")
            out.append(
                _check(
                    f"{name}: ahead of generate_batch",
                    None if math.isnan(gr) else rate > gr,
                    f"{rate:.0f} vs {gr:.0f}",
                )
            )
        else:
            out.append(_check(f"{name}: 0 OOM", r["oom"] == 0, str(r["oom"])))
            if "extra_returning_sources" in r:
                ok, cold, total = hibernated(r)
                out.append(
                    _check(
                        f"{name}: hibernated (most returning turns from L2/L3)",
                        ok,
                        f"{cold} of {total}",
                    )
                )
            goal = TOK_S_TARGET["hibernate"]
            out.append(_check(f"{name}: >= {goal:,} tok/s", rate >= goal, f"{rate:.0f}"))
            p50, p99 = r["ttft_p50"], r["ttft_p99"]
            bad = math.isnan(p50) or math.isnan(p99)
            out.append(
                _check(
                    f"{name}: TTFT p99 <= 2x p50",
                    None if bad else p99 <= 2 * p50,
                    f"{p99 / p50:.2f}x" if not bad else "n/a",
                )
            )
            s50, s99 = r["step_p50"], r["step_p99"]
            bad = math.isnan(s50) or math.isnan(s99)
            out.append(
                _check(
                    f"{name}: step p99 <= 1.25x p50",
                    None if bad else s99 <= 1.25 * s50,
                    f"{s99 / s50:.2f}x" if not bad else "n/a",
                )
            )
    return out


def targets_text(checks: list[dict[str, Any]]) -> str:
    return "\n".join(f"  [{c['state']:>6}] {c['target']} ({c['figure']})" for c in checks)


def plot(results: dict[str, list[dict[str, Any]]], path: Path) -> str:
    """Per scenario: aggregate tok/s per configuration (ceiling and target marked), TTFT
    P50/P99, and the tails as P99 / P50 of the TTFT and of the step (the hibernate scenario's
    targets marked). Returns what it did (matplotlib may be missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plot skipped: matplotlib is not installed"
    scen = [s for s in results if results[s]]
    fig, axes = plt.subplots(len(scen), 3, figsize=(18, 4 * len(scen)), squeeze=False)
    target = TOK_S_TARGET
    for row, s in enumerate(scen):
        rows = results[s]
        names = [r["config"] for r in rows]
        ax = axes[row][0]
        ax.bar(names, [_num(r["tok_s"]) for r in rows])
        ceil = rows[0]["ceiling_tok_s"]
        if not math.isnan(ceil):
            ax.axhline(ceil, color="k", ls="--", label=f"ceiling {ceil:.0f}")
        ax.axhline(target[s], color="r", ls=":", label=f"target {target[s]}")
        ax.set_ylabel("aggregate decode tok/s")
        ax.set_title(f"{s}: throughput")
        ax.legend()
        ax.tick_params(axis="x", rotation=20)
        ax = axes[row][1]
        x = range(len(rows))
        p50 = [_num(r["ttft_p50"]) * 1e3 for r in rows]
        p99 = [_num(r["ttft_p99"]) * 1e3 for r in rows]
        ax.bar([i - 0.2 for i in x], p50, 0.4, label="P50")
        ax.bar([i + 0.2 for i in x], p99, 0.4, label="P99")
        ax.set_xticks(list(x), names, rotation=20)
        shown = [v for v in p50 + p99 if v > 0]
        if shown:
            ax.set_yscale("log")
            # a decade below the shortest bar (with one configuration, matplotlib's own limits
            # start just under its P50, which then shows as a sliver) and room for the legend
            ax.set_ylim(min(shown) / 10, max(shown) * 5)
        ax.set_ylabel("TTFT of returning turns (ms, log)")
        ax.set_title(f"{s}: TTFT")
        ax.legend()
        ax = axes[row][2]
        ttft = [_ratio(r["ttft_p99"], r["ttft_p50"]) for r in rows]
        step = [_ratio(r["step_p99"], r["step_p50"]) for r in rows]
        ax.bar([i - 0.2 for i in x], ttft, 0.4, label="TTFT P99 / P50", color="C1")
        ax.bar([i + 0.2 for i in x], step, 0.4, label="step P99 / P50", color="C2")
        if s == "hibernate":
            ax.axhline(2.0, color="C1", ls=":", label="TTFT target 2x")
            ax.axhline(1.25, color="C2", ls=":", label="step target 1.25x")
        ax.set_xticks(list(x), names, rotation=20)
        ax.set_ylabel("P99 / P50")
        ax.set_ylim(0, 1.5 * max([2.0, *ttft, *step]))  # room for the legend above the bars
        ax.set_title(f"{s}: tails")
        ax.legend(ncol=2, fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return f"plot: {path}"


def _num(x: float) -> float:
    return 0.0 if math.isnan(x) else x


def _ratio(p99: float, p50: float) -> float:
    """P99 / P50, 0 where either is missing (a configuration with no returning turn)."""
    return 0.0 if math.isnan(p99) or math.isnan(p50) or p50 <= 0 else p99 / p50


def write_json(path: Path, payload: dict[str, Any]) -> None:
    def clean(x: Any) -> Any:
        if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
            return None
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, list):
            return [clean(v) for v in x]
        return x

    path.write_text(json.dumps(clean(payload), indent=1, default=str))
