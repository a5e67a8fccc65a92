"""What `kvtier replay` adds to loadgen's report: the trace's figures.

- Hit ratio: the ideal of the replayed slice (an unbounded prefix cache over exactly the turns
  sent, kvtier.trace), the achieved one from the usage's `cached_tokens` over the same prompt
  tokens (a failed turn cached nothing), and their ratio.
- Latency: TTFT, TPOT (the reply's time after its first token, per later token) and end to end,
  at P50 and P99, over the turns that succeeded.
- Throughput (reply and prompt tokens a second), the restore mix (turns by the tier the server
  restored them from), the failed turns, the prompts cut to the context, and how late turns
  started behind the trace (a conversation waiting for its previous reply).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvtier.humanize import plural
from kvtier.loadgen_metrics import _source_key
from kvtier.loadgen_report import format_report, ms, percentile
from kvtier.trace import Slice, Turn


def _p(values: list[float]) -> dict[str, float | None]:
    v = [x * 1000 for x in values]
    return {"p50": percentile(v, 50), "p99": percentile(v, 99)}


def replay_summary(
    turns: Sequence[Turn], samples: Sequence[Any], wall: float, max_model_len: int, sl: Slice
) -> dict[str, Any]:
    """The trace's figures of a replay (see the module's docstring); `samples` are TurnSamples."""
    ok = [s for s in samples if s.error is None and s.ttft is not None]
    prompt = sum(t.input_tokens for t in turns)
    ideal = sum(t.ideal_cached for t in turns) / prompt if prompt else 0.0
    achieved = sum(s.cached_tokens for s in ok) / prompt if prompt else 0.0
    tpot = [
        (s.e2e - s.ttft) / (s.completion_tokens - 1)
        for s in ok
        if s.e2e is not None and s.completion_tokens > 1
    ]
    failed = [s for s in samples if s not in ok]
    return {
        "slice": {
            "sample": sl.sample,
            "seed": sl.seed,
            "speed": sl.speed,
            "duration": sl.duration,
            "max_input": sl.max_input,
            "max_output": sl.max_output,
        },
        "max_model_len": max_model_len,
        "turns": len(turns),
        "conversations": len({t.request.session for t in turns}),
        "prompt_tokens": prompt,
        "hit_ratio": {
            "ideal": ideal,
            "achieved": achieved,
            "of_ideal": achieved / ideal if ideal else None,
        },
        "ttft_ms": _p([s.ttft for s in ok]),
        "tpot_ms": _p(tpot),
        "e2e_ms": _p([s.e2e for s in ok if s.e2e is not None]),
        "tokens_per_s": sum(s.completion_tokens for s in ok) / wall if wall else 0.0,
        "prompt_tokens_per_s": sum(s.prompt_tokens for s in ok) / wall if wall else 0.0,
        "restore_mix": dict(
            sorted(Counter(s.source for s in ok).items(), key=lambda kv: _source_key(kv[0]))
        ),
        "failed_turns": len(failed),
        "failures": dict(Counter((s.error or "no tokens").split(":")[0] for s in failed)),
        "cut_prompts": sum(1 for t in turns if t.cut),
        "cut_tokens": sum(t.cut for t in turns),
        "late_start_ms": _p([max(0.0, s.start - s.due) for s in samples]),
    }


def prefetch_summary(samples: Sequence[Any], ahead: float) -> dict[str, Any]:
    """The prefetches sent ahead of returning turns (`--prefetch-ahead`): how many, how they
    were answered, and where the turns after the answered ones restored from."""
    sent = [s for s in samples if s.prefetch is not None]
    done = [s for s in sent if s.prefetch == "ok"]
    return {
        "ahead_s": ahead,
        "sent": len(sent),
        "ok": len(done),
        "failed": dict(Counter(s.prefetch for s in sent if s.prefetch != "ok")),
        "restore_mix": dict(
            sorted(Counter(s.source for s in done).items(), key=lambda kv: _source_key(kv[0]))
        ),
    }


def format_replay(result: dict[str, Any]) -> str:
    """loadgen's summary, then the trace's figures."""
    r = result["replay"]
    h = r["hit_ratio"]
    of = f" = {h['of_ideal']:.2f} of ideal" if h["of_ideal"] is not None else ""
    lines = [
        format_report(result),
        "",
        f"trace replay: {plural(r['turns'], 'turn')} of {plural(r['conversations'], 'conversation')},"
        f" {plural(r['prompt_tokens'], 'prompt token')}",
        f"  hit ratio: ideal {h['ideal']:.1%}, achieved {h['achieved']:.1%}{of}",
        f"  {'':<6}{'p50':>10}{'p99':>10}",
    ]
    for name, key in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("e2e", "e2e_ms")):
        lines.append(f"  {name:<6}{ms(r[key]['p50']):>10}{ms(r[key]['p99']):>10}")
    mix = ", ".join(f"{src} {n}" for src, n in r["restore_mix"].items()) or "none"
    lines += [
        f"  {r['tokens_per_s']:.1f} reply tokens/s, {r['prompt_tokens_per_s']:.0f} prompt tokens/s",
        f"  restore mix: {mix}",
        f"  failed turns: {r['failed_turns']}"
        + (
            f" ({', '.join(f'{n} {k}' for k, n in r['failures'].items())})" if r["failures"] else ""
        ),
        f"  prompts cut to the context ({r['max_model_len']} tokens or --max-input): "
        f"{r['cut_prompts']} ({plural(r['cut_tokens'], 'token')} left out)",
        f"  start behind the trace: p50 {ms(r['late_start_ms']['p50'])}, "
        f"p99 {ms(r['late_start_ms']['p99'])}",
    ]
    pf = r.get("prefetch") or {}
    if pf.get("sent"):
        after = ", ".join(f"{src} {n}" for src, n in pf["restore_mix"].items()) or "none"
        failed = ", ".join(f"{n} {why}" for why, n in pf["failed"].items())
        lines.append(
            f"  prefetched {pf['ahead_s']:g} s ahead: {pf['ok']} of {pf['sent']}"
            + (f" ({failed} failed)" if failed else "")
            + f"; those turns restored from: {after}"
        )
    return "\n".join(lines)


def plot_replay(result: dict[str, Any], path: str | Path) -> None:
    """TTFT over the replay by restore source, and the hit ratio over it: achieved (from the
    usage's cached tokens) against the ideal, cumulative by turn start."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = sorted(result["samples"], key=lambda s: s["start"])
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    by_src: dict[str, list[dict[str, Any]]] = {}
    for s in samples:
        if s["error"] is None and s["ttft"] is not None:
            by_src.setdefault(s["source"], []).append(s)
    for src, rows in sorted(by_src.items(), key=lambda kv: _source_key(kv[0])):
        ax1.scatter(
            [r["start"] for r in rows],
            [r["ttft"] * 1000 for r in rows],
            s=8,
            label=f"{src} ({plural(len(rows), 'turn')})",
        )
    ax1.set(xlabel="turn start (s)", ylabel="TTFT (ms)", title="TTFT over the replay")
    ax1.set_yscale("log")
    xs, achieved, ideal = [], [], []
    cached = best = total = 0
    for s in samples:
        ok = s["error"] is None and s["ttft"] is not None
        cached += s["cached_tokens"] if ok else 0
        best += s["ideal_cached"]
        total += s["sent_tokens"]
        xs.append(s["start"])
        achieved.append(cached / max(1, total))
        ideal.append(best / max(1, total))
    ax2.plot(xs, ideal, label="ideal (unbounded cache)", linestyle="--")
    ax2.plot(xs, achieved, label="achieved (usage's cached tokens)")
    ax2.set(xlabel="turn start (s)", ylabel="hit ratio, cumulative", title="Hit ratio over time")
    ax2.set_ylim(0, 1)
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    h = result["replay"]["hit_ratio"]
    fig.suptitle(
        f"trace replay: hit ratio {h['achieved']:.1%} of an ideal {h['ideal']:.1%}, "
        f"TTFT p50 {ms(result['replay']['ttft_ms']['p50'])}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
