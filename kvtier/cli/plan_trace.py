"""`kvtier plan --trace`: the L2 and L3 sizes a host needs for a recorded workload.

The tiers are simulated over the trace (kvtier.tracesim) at a sweep of sizes: L2 alone (no
L3), then L3 behind the given L2. Each row gives the hit ratio each tier serves and the bytes it
reads and writes; the last lines name the smallest sizes whose hit ratio reaches 95 % of the
ideal (an unbounded cache on the same hosts).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from kvtier import trace, tracesim
from kvtier.geometry import KVGeometry
from kvtier.humanize import plural
from kvtier.humanize import size as _fmt

TARGET = 0.95  # of the ideal hit ratio


@dataclass(frozen=True)
class TraceInputs:
    path: Path
    hosts: int
    sample: float
    pool_bytes: int  # L1: the page pool of one host
    l2_bytes: int  # the L2 behind which L3 is swept
    chunk_tokens: int
    l2_read_gbps: float
    l3_read_gbps: float
    prefill_tflops: float
    json_out: Path | None


def prefill_s_per_token(config: dict[str, object], tflops: float) -> float:
    """A prompt token's compute time: 2 FLOPs a weight of the decoder layers (the attention's
    own FLOPs, which grow with the context, left out) at `tflops` TFLOP/s."""

    def num(key: str, default: int = 0) -> int:
        return int(str(config.get(key) or default))

    hidden, layers = num("hidden_size"), num("num_hidden_layers")
    heads = num("num_attention_heads", 1)
    head_dim = num("head_dim") or hidden // max(1, heads)
    kv = num("num_key_value_heads", heads) * head_dim
    attn = hidden * (heads * head_dim + 2 * kv) + heads * head_dim * hidden
    mlp = 3 * hidden * num("intermediate_size", 4 * hidden)
    return 2.0 * layers * (attn + mlp) / (tflops * 1e12)


def _grid(top: int, floor: int = 2**30) -> list[int]:
    """Powers of two from `floor`, or from 1/128 of `top` when that is larger (a cache of
    less holds too little to matter), up to the first at or past `top`."""
    out = [floor]
    while out[-1] * 128 < top:
        out[-1] *= 2
    while out[-1] < top:
        out.append(out[-1] * 2)
    return out


@contextmanager
def _progress(total: int) -> Iterator[Callable[[], None]]:
    """A rich progress bar on stderr over the sizes (none when stderr is not a terminal)."""
    if not sys.stderr.isatty():
        yield lambda: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    cols = ("simulating sizes", BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*cols, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("sizes", total=total)
        yield lambda: bar.advance(task)


def run(config: dict[str, object], g: KVGeometry, opts: TraceInputs) -> dict[str, Any]:
    """Simulate the sweep and print it; returns what --json writes."""
    try:
        requests = trace.load(opts.path)
        turns = trace.select(requests, trace.Slice(sample=opts.sample))
    except (trace.TraceError, ValueError) as exc:
        raise click.UsageError(str(exc)) from exc
    except OSError as exc:
        raise click.UsageError(f"cannot read the trace: {exc}") from exc
    bpt = g.bytes_per_token
    chunk_bytes = bpt * opts.chunk_tokens
    distinct = {k for t in turns for k in tracesim.chunk_keys(t, opts.chunk_tokens)[0]}
    per_host = len(distinct) * chunk_bytes // opts.hosts
    costs = tracesim.Costs(
        bandwidth={
            "l1": tracesim.DEFAULT_BANDWIDTH["l1"],
            "l2": opts.l2_read_gbps * 1e9,
            "l3": opts.l3_read_gbps * 1e9,
        },
        prefill_s_per_token=prefill_s_per_token(config, opts.prefill_tflops),
    )
    l2_grid = [tracesim.Sizes(opts.pool_bytes, s, 0) for s in _grid(per_host)]
    # L3 holds all that L2 does (written through): below L2's size it adds nothing
    l3_grid = [
        tracesim.Sizes(opts.pool_bytes, opts.l2_bytes, s)
        for s in _grid(per_host, floor=max(2**30, opts.l2_bytes * 2))
    ]
    results: list[tracesim.Result] = []
    with _progress(len(l2_grid) + len(l3_grid)) as step:
        for sizes in (*l2_grid, *l3_grid):
            results.append(
                tracesim.simulate(turns, sizes, bpt, opts.chunk_tokens, opts.hosts, costs)
            )
            step()
    by_l2, by_l3 = results[: len(l2_grid)], results[len(l2_grid) :]
    ideal = by_l2[0].ratio(by_l2[0].ideal_tokens)
    target = TARGET * ideal
    best_l2 = tracesim.smallest(by_l2, target, "l2")
    best_l3 = tracesim.smallest(by_l3, target, "l3")
    n_conv = len({t.request.session for t in turns})
    click.echo(
        f"trace: {plural(len(turns), 'request')} of {plural(n_conv, 'conversation')}, "
        f"{plural(sum(t.input_tokens for t in turns), 'prompt token')}; "
        f"{_fmt(len(distinct) * chunk_bytes)} of distinct K/V "
        f"({_fmt(per_host)} a host over {plural(opts.hosts, 'host')})"
    )
    click.echo(
        f"ideal hit ratio (unbounded tiers on {plural(opts.hosts, 'host')}): {ideal:.1%}; "
        f"target {TARGET:.0%} of it: {target:.1%}"
    )
    click.echo(
        f"cost model: L2 {opts.l2_read_gbps:g} GB/s, L3 {opts.l3_read_gbps:g} GB/s, prefill "
        f"{costs.prefill_s_per_token * 1e6:.1f} us/token ({opts.prefill_tflops:g} TFLOP/s); "
        f"L1 (page pool) {_fmt(opts.pool_bytes)} a host"
    )
    click.echo(_table(by_l2, "L2 alone (no L3), per host:"))
    click.echo(_table(by_l3, f"L3 behind L2 of {_fmt(opts.l2_bytes)}, per host:"))
    click.echo(_verdict("L2 alone", best_l2, "l2", by_l2))
    click.echo(_verdict(f"L3 behind {_fmt(opts.l2_bytes)} of L2", best_l3, "l3", by_l3))
    out = {
        "trace": str(opts.path),
        "requests": len(turns),
        "conversations": n_conv,
        "hosts": opts.hosts,
        "bytes_per_token": bpt,
        "distinct_bytes": len(distinct) * chunk_bytes,
        "ideal_hit_ratio": ideal,
        "target_hit_ratio": target,
        "prefill_s_per_token": costs.prefill_s_per_token,
        "bandwidth": costs.bandwidth,
        "l2_alone": [r.as_dict() for r in by_l2],
        "l3_behind_l2": [r.as_dict() for r in by_l3],
        "l2_bytes_for_target": best_l2.sizes.l2 if best_l2 else None,
        "l3_bytes_for_target": best_l3.sizes.l3 if best_l3 else None,
    }
    if opts.json_out is not None:
        opts.json_out.write_text(json.dumps(out, indent=1))
    return out


def _table(rows: list[tracesim.Result], title: str) -> str:
    head = (
        f"{'L2':>10}{'L3':>10}{'hit':>7}{'L1':>7}{'L2':>7}{'L3':>7}"
        f"{'L2 read':>11}{'L2 write':>11}{'L3 read':>11}{'L3 write':>11}"
    )
    lines = ["", title, head]
    for r in rows:
        t = r.tiers
        l3 = "none" if r.sizes.l3 == 0 else ("no cap" if r.sizes.l3 is None else _fmt(r.sizes.l3))
        lines.append(
            f"{_fmt(r.sizes.l2):>10}{l3:>10}{r.ratio(r.hit_tokens):>7.1%}"
            + "".join(f"{r.ratio(t[k].hit_tokens):>7.1%}" for k in tracesim.TIERS)
            + "".join(
                f"{_fmt(v):>11}"
                for v in (
                    t["l2"].read_bytes,
                    t["l2"].written_bytes,
                    t["l3"].read_bytes,
                    t["l3"].written_bytes,
                )
            )
        )
    lines.append("  hit: prompt tokens restored, by the tier they came from; bytes over the trace")
    return "\n".join(lines)


def _verdict(
    what: str, best: tracesim.Result | None, tier: str, rows: list[tracesim.Result]
) -> str:
    if best is not None:
        got = best.ratio(best.hit_tokens)
        return f"{what}: {_fmt(getattr(best.sizes, tier))} a host reaches {got:.1%}"
    top = rows[-1]
    why = (
        " (the cost model recomputes rather than load: a faster read or a slower prefill "
        "changes that)"
        if top.found_tokens > top.hit_tokens * 1.05
        else ""
    )
    return f"{what}: no size tried reaches the target; the largest gives {top.ratio(top.hit_tokens):.1%}{why}"
