"""The seed's A10 table: a 7B model on a GPU capped at 24 GB, all-on-GPU against kvtier.

The process's CUDA allocator is capped at N GiB (`torch.cuda.set_per_process_memory_fraction`,
as `--gpu-memory-gb` does for bench/agent_fleet.py), so it runs as a smaller GPU would: 24 GiB
(an A10's class) by default, then 48 GiB and the whole device (`--caps 24,48,0`, 0 uncapped).
The model is a Qwen2-7B shape in bf16 (random weights, about 15.2 GB); every session has a
3,000-token context (a shared 1,536-token system prompt, then its own tokens) and each turn
appends 50-200 tokens and decodes 64, as in `bench/agent_fleet.py --concurrent`.

At every cap:
  all-GPU B=N   (a) transformers' DynamicCache with every session's K/V on the GPU, N sessions
                batched in lockstep (equal lengths, no padding): every round appends each
                session's tokens in one batched forward (its TTFT, for every session in the
                batch) and decodes in one forward per token. The contexts' K/V comes from the
                host (computed once, outside every figure); after `--search-time` seconds of
                rounds, the batch grows to the longest a conversation of the fleet gets
                (context + `--max-growth` + a turn's longest append and its reply: 4,288
                tokens) and decodes one token there: a batch that does not hold its sessions
                at their longest is an OOM. The search tries `--first` (32, the seed's
                batch), then the larger sizes of `--batches` until one runs out of memory (or the
                smaller ones, down, until one fits); an OOM is caught, everything freed, and the
                search goes on.
  kvtier N      (b) the batched fleet in-process, as `agent_fleet.py --concurrent` serves it
                (bench/fleet_batched.py): kvtier's BatchScheduler with the page pool as the
                sessions' L1 (`paged_l1`, CUDA graphs), restoring from and committing to a
                TieredCache with L2 in pinned host RAM and L3 on disk in a temporary directory.
                The page pool is sized by the server's GPU memory plan
                (kvtier.server.devices.memplan: weights, measured activations, CUDA graphs, staging, the
                cache's L1, copies in flight, headroom; the pool gets what is left of
                `--gpu-memory-utilization` of the cap). `--sessions 32,128`: 32 sessions with a
                short think time (`--think`), and 128 with a think time that keeps about as many
                sessions in a turn as the pool holds (from the 32-session run's step at the same
                cap; `--think-many` sets it).

Figures per configuration: OOMs (CUDA out-of-memory, kvtier's L1BudgetExceeded and
PoolExhausted), sessions and sessions decoding at once (kvtier: the mean batch of the window's
steps), peak GPU memory (`torch.cuda.max_memory_allocated` since the configuration started,
weights included) against the cap, aggregate decode tok/s, TTFT P50/P99 of returning turns
(kvtier: from the end of the think time, queueing included), and the elapsed time. kvtier rows
add their device bytes beyond the weights (steady: the median of a 0.2 s sampler inside the
window; peak) against the plan's budget less the weights, where their returning turns were
restored from (l1 / l2 / l3 / recompute) and the sessions in the pool at the window's end.
Each table's ceiling is all-on-GPU's best tok/s at the same cap, with the ratio.

Targets (per cap; the seed's are at 24 GiB): kvtier 0 OOM at 128 sessions with its peak under
the cap; at 0 OOM kvtier serves >= 2x the sessions all-on-GPU can hold, with >= 48 decoding at
once; kvtier's tok/s >= all-on-GPU's best (stretch 1.5x). The KV memory kvtier saves against
all-on-GPU at equal sessions (N x 3,000 tokens on the GPU against kvtier's page pool) is
printed as a percentage.

All-on-GPU runs first at every cap, then kvtier at every cap: kvtier's L1 allocator pool keeps
its device memory for the life of the process, which would otherwise count against the next
cap's all-on-GPU batches.

    python3 bench/small_gpu.py --out DIR                    # H200: the three caps, ~8 minutes
    python3 bench/small_gpu.py --caps 24 --out DIR           # the seed's table alone (~3 min)
    python3 bench/small_gpu.py --device cpu --shape qwen2-mini --caps 24,0 --sessions 4,8 \\
        --batches 2,4 --first 4 --oom-above 2 --context 128 --system 64 --decode-tokens 4 \\
        --max-growth 256 --time-limit 2 --warmup 0.5 --search-time 2 --search-warmup 0 \\
        --slots 4                                            # CPU smoke run (caps ignored)
"""

from __future__ import annotations

import argparse
import gc
import inspect
import math
import shutil
import sys
import tempfile
import time
import traceback
import types
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import fleet_batched as batched
import fleet_concurrent as fc
import fleet_report as report
import fleet_serve as serve
from models import build
from transformers import DynamicCache

from kvtier.errors import ConfigError
from kvtier.geometry import KVGeometry
from kvtier.integrations.hf import set_cudnn_attention
from kvtier.server.config import ServerConfig
from kvtier.server.devices import memplan

GIB = 2**30
# the fleet's token ids (fleet_concurrent.contexts, Fleet.append) go up to this
TOKEN_IDS = 30000


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def cap_label(cap: float) -> str:
    return f"{cap:g} GiB" if cap > 0 else "uncapped"


def cap_bytes(cap: float, device: str) -> int | None:
    """The bytes the process may hold on the device under `cap` GiB (None off CUDA)."""
    if not device.startswith("cuda"):
        return None
    total = int(torch.cuda.get_device_properties(torch.device(device)).total_memory)
    return total if cap <= 0 else min(total, int(cap * GIB))


def release(device: str) -> None:
    """Free what the last configuration left (its cache, its graphs) before the next."""
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# ---- (a) all-on-GPU: DynamicCache, B sessions batched -----------------------------------------


def grow_to(model, cache, rows: int, longest: int, device: str, vocab: int) -> None:
    """Append tokens to every row, at most 200 per forward (the longest turn's append), until
    the cache holds `longest` tokens, then decode one token there."""
    gen = torch.Generator().manual_seed(longest)
    with torch.no_grad():
        have = int(cache.get_seq_length())
        tok = None
        while have < longest:
            k = min(200, longest - have)
            ids = torch.randint(100, vocab, (rows, k), generator=gen).to(device)
            tok = model(ids, past_key_values=cache, logits_to_keep=1).logits[:, -1:].argmax(-1)
            have += k
        if tok is not None:
            model(tok, past_key_values=cache, logits_to_keep=1)
    serve.sync(device)


def run_all_gpu(model, ctxs, bank, b: int, args, device: str, stage: list[str]) -> serve.Measure:
    """B sessions in one batched DynamicCache: their contexts' K/V loaded from the host, rounds
    in lockstep for `--search-time` seconds, then grown to the longest conversation. `stage`
    names the part running (for an OOM's report)."""
    if args.oom_above and b > args.oom_above:  # testing: the search's path past an OOM
        raise torch.OutOfMemoryError(f"simulated (--oom-above {args.oom_above}): batch {b}")
    cache: Any = DynamicCache(config=model.config)
    with torch.no_grad():
        for i, (k, v) in enumerate(fc.bank_rows(bank, b)):
            cache.update(k.to(device), v.to(device), i)
    stage[0] = "serving"
    system = min(args.system, args.context // 2)
    fleet = serve.Fleet(ctxs[:b], system, args.decode_tokens, (0.0, 0.0), args.max_growth)
    m = serve.run_ceiling(
        model,
        fleet,
        None,
        device,
        args.search_warmup,
        args.search_time,
        cache=cache,
        name=f"all-GPU B={b}",
    )
    stage[0] = f"growing to {longest(args)} tokens"
    vocab = min(int(model.config.vocab_size), TOKEN_IDS)
    grow_to(model, cache, b, longest(args) - 1, device, vocab)
    return m


def longest(args) -> int:
    """The longest a conversation of the fleet gets: grown by `--max-growth` (the last turn
    before it starts over), then a turn's longest append and its reply."""
    return args.context + args.max_growth + 200 + args.decode_tokens


def all_gpu_row(model, ctxs, bank, b: int, args, device: str, per_token: int, cap: float):
    """One batch size of (a): its figures, or its OOM (everything freed after it)."""
    fc.fresh(device)
    t0 = time.perf_counter()
    stage = ["loading the contexts' K/V"]
    m: serve.Measure | None = None
    oom = failed = ""
    try:
        m = run_all_gpu(model, ctxs, bank, b, args, device, stage)
    except torch.OutOfMemoryError as exc:
        oom = f"OOM {stage[0]}: {str(exc).splitlines()[0][:140]}"
    except Exception as exc:  # reported; the search stops there as at an OOM
        traceback.print_exc()
        failed = f"failed {stage[0]}: {type(exc).__name__}: {str(exc)[:140]}"
    cuda = device.startswith("cuda")
    peak = int(torch.cuda.max_memory_allocated()) if cuda else None
    release(device)
    elapsed = time.perf_counter() - t0
    rate = m.tokens / m.window if m is not None and m.window > 0 else float("nan")
    row = {
        "config": f"all-GPU B={b}",
        "kind": "all_gpu",
        "sessions": b,
        "decoding": float(b),
        "oom": 1 if oom else 0,
        "failed": 1 if failed else 0,
        "peak_bytes": peak,
        "cap_bytes": cap_bytes(cap, device),
        "tok_s": float("nan") if oom or failed else rate,
        "ttft_p50": report.pct(m.ttft, 0.5) if m else float("nan"),
        "ttft_p99": report.pct(m.ttft, 0.99) if m else float("nan"),
        "step_p50": report.pct(m.steps, 0.5) if m else float("nan"),
        "kv_bytes": b * args.context * per_token,
        "elapsed_s": elapsed,
        "note": oom or failed or f"held {b} sessions at {longest(args)} tokens",
    }
    print(
        f"[{cap_label(cap)}] {row['config']}: "
        + (oom or failed or f"{rate:,.0f} tok/s, peak {gib(peak)}")
        + f" ({elapsed:.0f}s)",
        flush=True,
    )
    return row


def search(model, ctxs, bank, args, device: str, per_token: int, cap: float) -> list[dict]:
    """`--first`, then the larger sizes until one runs out of memory; if `--first` did, the
    smaller ones, down, until one fits."""
    sizes = sorted(set(args.batches) | {args.first})
    rows = []
    for b in [s for s in sizes if s >= args.first]:
        rows.append(all_gpu_row(model, ctxs, bank, b, args, device, per_token, cap))
        if rows[-1]["oom"] or rows[-1]["failed"]:
            break
    if rows and rows[0]["oom"]:
        for b in reversed([s for s in sizes if s < args.first]):
            rows.append(all_gpu_row(model, ctxs, bank, b, args, device, per_token, cap))
            if not rows[-1]["oom"]:
                break
    return sorted(rows, key=lambda r: r["sessions"])


# ---- (b) kvtier: the batched fleet, the pool sized by the GPU memory plan -------------------


def _profile(model, tokens: int, rows: int, device: str) -> int:
    """memplan.profile_activations, with or without its logits-rows argument."""
    fn: Any = memplan.profile_activations
    dev = torch.device(device)
    if "logits_rows" in inspect.signature(fn).parameters:
        return int(fn(model, tokens, rows, dev))
    return int(fn(model, tokens, dev))


def _plan(**kw: Any) -> memplan.DeviceMemoryPlan:
    """memplan.plan_memory with the arguments its signature takes."""
    params = inspect.signature(memplan.plan_memory).parameters
    return memplan.plan_memory(**{k: v for k, v in kw.items() if k in params})


def make_plan(model, args, device: str, cap: float, slots: int, per_token: int, max_ctx: int):
    """The GPU memory plan of a kvtier configuration under the cap, as the server builds it
    (kvtier.server.devices.memplan.build_plan) with the cap as the device's memory: the weights
    resident now, the activations of the batch's largest step and of a prefill chunk
    measured, the CUDA graphs and the staging estimated. The cache's L1 holds, besides its
    staging, one initial context: the bench seeds every session through it (its first turn,
    committed from the host), where the server's warm-up needs less. Off CUDA the activations
    are the offline estimate and the "device" is sized so that the pool holds
    `--cpu-pool-sessions` of the longest contexts."""

    cfg = model.config
    dtype = next(model.parameters()).dtype
    element = torch.empty((), dtype=dtype).element_size()
    vocab = int(model.get_input_embeddings().num_embeddings)
    batch_tokens = max(args.batch_tokens, slots)
    geo = KVGeometry.from_config(cfg, dtype=str(dtype).split(".")[-1])
    staging = memplan.staging_estimate(geo.chunk_bytes(args.chunk_tokens), lossless=True)
    l1 = staging + per_token * (args.context + 4 * args.chunk_tokens)
    if device.startswith("cuda"):
        release(device)
        weights = int(torch.cuda.memory_allocated())
        batch = _profile(model, batch_tokens, slots, device)
        activations = max(batch, _profile(model, args.prefill_step, 1, device))
        # measured as the server measures them: the step captured once over a tiny pool
        shape = types.SimpleNamespace(max_concurrency=slots, batch_tokens=batch_tokens)
        graphs, eager = memplan.profile_graphs(model, geo, dtype, shape, max_ctx)
        activations = max(activations, eager)
        release(device)
        total = cap_bytes(cap, device)
        context = memplan.context_bytes(torch.device(device))
    else:
        weights = serve.weight_bytes(model)
        hidden, inter = int(cfg.hidden_size), int(cfg.intermediate_size)
        activations = max(
            memplan.activation_estimate(hidden, inter, vocab, batch_tokens, slots, element),
            memplan.activation_estimate(
                hidden, inter, vocab, args.prefill_step, args.prefill_step, element
            ),
        )
        graphs = 0
        context = 0  # no CUDA context off CUDA
        # the budget that leaves the pool `--cpu-pool-sessions` contexts after the parts (the
        # copies in flight as much as the staging) and the plan's headroom
        need = weights + activations + l1 + staging + args.cpu_pool_sessions * max_ctx * per_token
        budget = need / (1 - memplan.HEADROOM_SHARE)
        if budget * memplan.HEADROOM_SHARE > memplan.HEADROOM_BYTES:
            budget = need + memplan.HEADROOM_BYTES
        total = math.ceil(budget / args.gpu_memory_utilization) + 1
    return _plan(
        device=device,
        total_bytes=total,
        utilization=args.gpu_memory_utilization,
        weights=weights,
        activations=activations,
        graphs=graphs,
        staging=staging,
        per_token=per_token,
        context_tokens=max_ctx,
        l1_bytes=l1,
        context=context,
    )


def run_kvtier(model, ctxs, bank, n: int, think, args, device: str, tmp: Path, cap: float, geo):
    """`n` sessions served by kvtier's BatchScheduler under the cap; its row and its Measure."""
    per_token = geo.bytes_per_token
    system = min(args.system, args.context // 2)
    max_ctx = args.context + args.max_growth + 256 + args.decode_tokens
    slots = min(n, args.slots)
    name = f"kvtier {n}" + (" think" if n != min(args.sessions) else "")
    t0 = time.perf_counter()
    row: dict[str, Any] = {"config": name, "kind": "kvtier", "sessions": n, "slots": slots}
    row["cap_bytes"] = cap_bytes(cap, device)
    try:
        plan = make_plan(model, args, device, cap, slots, per_token, max_ctx)
    except (ConfigError, torch.OutOfMemoryError) as exc:  # the plan refuses this cap
        row.update(oom=1, note=f"no plan: {type(exc).__name__}: {str(exc)[:300]}")
        row["elapsed_s"] = time.perf_counter() - t0
        print(f"[{cap_label(cap)}] {name}: {row['note']}", flush=True)
        release(device)
        return row, None
    print(f"[{cap_label(cap)}] {name}: {plan.describe()}", flush=True)
    row["plan"] = plan.parts()
    row["plan_text"] = plan.describe()
    row["pool_bytes"] = plan.pool
    # L2: the sessions' K/V at their longest, 1.5 times over, within --l2-gb; L3 takes the rest
    l2 = min(int(args.l2_gb * GIB), int(1.5 * n * max_ctx * per_token))
    l2 = max(l2, per_token * 256)
    row["l2_bytes"] = l2
    fleet = serve.Fleet(ctxs[:n], system, args.decode_tokens, think, args.max_growth, args.seed)
    warmup = args.warmup + sum(think) / 2  # the first arrivals (spread over a think) settle
    limit = args.time_limit + (warmup - args.warmup)
    cfg = SimpleNamespace(
        **ServerConfig().as_dict()  # the server's settings, but for these
        | dict(
            max_concurrency=slots,
            batch_tokens=args.batch_tokens,
            decoding_prompt_tokens=ServerConfig.decoding_prompt_tokens,
            prefill_step=args.prefill_step,
            batch_kv_bytes=plan.pool,
            isolate_cpus=False,
            stacks=False,
            gc_garbage=False,
            helper_threads=0,
            cuda_graphs=True,
            overlap_steps=True,
            paged_l1=True,
            chunk_tokens=args.chunk_tokens,
        )
    )
    fc.fresh(device)
    model.set_attn_implementation("sdpa")
    root = tmp / f"{cap:g}-{n}"
    backend = None
    sampler = serve.MemorySampler(device).start()
    m: serve.Measure
    try:
        backend = serve.tiered_backend(model, root, "native", plan.l1_bytes, l2, args.write_policy)
        m = batched.run_batched(name, model, fleet, bank, device, warmup, limit, backend, cfg)
    except Exception as exc:  # reported; the other configurations go on
        traceback.print_exc()
        m = serve.Measure(name, note=f"failed: {type(exc).__name__}: {str(exc)[:160]}")
        m.fail(exc)
    finally:
        sampler.stop()
        t_close = time.perf_counter()
        if backend is not None:
            try:
                backend.close()
            except Exception as exc:
                print(f"{name}: closing the cache failed: {exc!r}", flush=True)
        shutil.rmtree(root, ignore_errors=True)
        closing = time.perf_counter() - t_close  # its writers drain, its sessions hibernate
    weights = serve.weight_bytes(model)
    serve.device_memory(m, sampler, weights, plan.budget_bytes - weights)
    peak = int(torch.cuda.max_memory_allocated()) if device.startswith("cuda") else None
    release(device)
    elapsed = time.perf_counter() - t0
    rate = m.tokens / m.window if m.window > 0 else float("nan")
    row.update(
        {
            "decoding": m.extra.get("mean_batch", float("nan")),
            "max_decoding": m.extra.get("max_batch", 0),
            "oom": m.ooms,
            "failed": m.failed,
            "errors": m.errors,
            "peak_bytes": peak,
            "tok_s": rate,
            "ttft_p50": report.pct(m.ttft, 0.5),
            "ttft_p99": report.pct(m.ttft, 0.99),
            "step_p50": report.pct(m.steps, 0.5),
            "returning_turns": m.turns,
            "think_s": list(think),
            "closing_s": closing,
            "elapsed_s": elapsed,
            "note": m.note,
            **{f"extra_{k}": v for k, v in m.extra.items() if k.startswith(SHOWN)},
        }
    )
    print(
        f"[{cap_label(cap)}] {name}: {rate:,.0f} tok/s, {m.ooms} OOM, {m.failed} failed, mean "
        f"batch {row['decoding']:.1f}, peak {gib(peak)}, seeding "
        f"{m.extra.get('seed_s', 0):.0f}s, graphs {m.extra.get('graph_capture_s', 0):.0f}s, "
        f"closing {closing:.0f}s ({elapsed:.0f}s in all) {m.note}",
        flush=True,
    )
    return row, m


# extras of a kvtier Measure kept in its row (report.memory_text reads the first four)
SHOWN = (
    "device_",
    "returning_sources",
    "resident_sessions",
    "seed_s",
    "graph_capture_s",
    "preemptions",
    "stored",
    "ttft_phases_p50_ms",
)


def many_think(args, n: int, slots: int, plan_pool: int | None, per_token: int, step: float):
    """Think time for `n` sessions: about as many in a turn as the pool holds at once (at
    most `slots`), each turn `--decode-tokens` steps of `step` seconds: (n / active - 1) turn
    times, uniform within +-25 %."""
    if args.think_many:
        return args.think_many
    system = min(args.system, args.context // 2)
    own = (args.context - system + args.max_growth // 2) * per_token
    held = (plan_pool - system * per_token) // own if plan_pool else slots
    active = max(1, min(slots, int(held)))
    mean = max(n / active - 1, 0.25) * args.decode_tokens * step
    return (0.75 * mean, 1.25 * mean)


# ---- the table, targets, plot ------------------------------------------------------------------


def gib(x: int | None) -> str:
    return "n/a" if x is None else f"{x / GIB:.2f} GiB"


def _ms(x: float) -> str:
    return "n/a" if x is None or math.isnan(x) else f"{x * 1e3:.0f}"


def table(title: str, rows: list[dict]) -> str:
    best = best_all_gpu(rows)
    head = (
        f"{'config':>18} | {'sessions':>8} | {'decoding at once':>16} | {'OOM':>3} | "
        f"{'peak GiB / cap':>15} | {'tok/s':>7} | {'x all-GPU best':>14} | "
        f"{'TTFT P50 / P99 ms':>17} | {'time s':>6}"
    )
    lines = [title, head, "-" * len(head)]
    for r in rows:
        peak, cap = r.get("peak_bytes"), r.get("cap_bytes")
        mem = "n/a" if peak is None else f"{peak / GIB:.1f} / {(cap or 0) / GIB:.0f}"
        rate = r.get("tok_s", float("nan"))
        ratio = rate / best if best and not math.isnan(rate) else float("nan")
        decoding = r.get("decoding", float("nan"))
        lines.append(
            f"{r['config']:>18} | {r['sessions']:>8} | "
            f"{'n/a' if math.isnan(decoding) else f'{decoding:.1f}':>16} | {r['oom']:>3} | "
            f"{mem:>15} | {'OOM' if math.isnan(rate) else f'{rate:,.0f}':>7} | "
            f"{'n/a' if math.isnan(ratio) else f'{ratio:.2f}':>14} | "
            f"{_ms(r.get('ttft_p50', float('nan'))) + ' / ' + _ms(r.get('ttft_p99', float('nan'))):>17} | "
            f"{r.get('elapsed_s', 0):6.0f}"
        )
    lines.append(
        (
            f"(ceiling: all-on-GPU's best tok/s at this cap, {best:,.0f}"
            if best
            else "(no all-on-GPU rate at this cap: no ceiling"
        )
        + "; peak: max_memory_allocated since the configuration started, weights included; "
        "all-GPU TTFT: a round's batched forward of every session's appended tokens; kvtier's "
        "TTFT: from the end of the think time, queueing included; kvtier's decoding at once: "
        "the mean batch of its steps)"
    )
    for r in rows:
        if r["kind"] == "kvtier":
            if "plan_text" in r:
                lines.append(f"{r['config']:>18}: {r['plan_text']}")
            if "extra_device_budget_bytes" in r:
                lines.append(f"{'':>18}  {report.memory_text(r)}")
        if r.get("note") and (r["kind"] == "kvtier" or r["oom"]):
            lines.append(f"{r['config']:>18}: {r['note']}")
    return "\n".join(lines)


def best_all_gpu(rows: list[dict]) -> float:
    rates = [r["tok_s"] for r in rows if r["kind"] == "all_gpu" and not r["oom"]]
    rates = [x for x in rates if x is not None]
    rates = [x for x in rates if not math.isnan(x)]
    return max(rates, default=0.0)


def kv_saved(rows: list[dict], args, per_token: int) -> list[dict]:
    """At equal sessions: the K/V all-on-GPU keeps on the GPU (N x context tokens) against
    kvtier's page pool."""
    out = []
    for r in rows:
        if r["kind"] != "kvtier" or "pool_bytes" not in r:
            continue
        n = r["sessions"]
        dense = n * args.context * per_token
        out.append(
            {
                "sessions": n,
                "all_gpu_kv_bytes": dense,
                "kvtier_pool_bytes": r["pool_bytes"],
                "saved": 1 - r["pool_bytes"] / dense,
            }
        )
    return out


def kv_saved_text(saved: list[dict]) -> str:
    lines = []
    for s in saved:
        lines.append(
            f"  KV on the GPU for {s['sessions']} sessions: all-on-GPU "
            f"{report._gib(s['all_gpu_kv_bytes'])}, kvtier's page pool "
            f"{report._gib(s['kvtier_pool_bytes'])}: {s['saved']:.0%} saved"
            + (
                " (the plan gives the pool all the budget leaves: nothing saved at this cap)"
                if s["saved"] < 0
                else ""
            )
        )
    return "\n".join(lines)


def targets(rows: list[dict], many: int) -> list[dict]:
    """The seed's targets at one cap."""
    fits = [
        r["sessions"] for r in rows if r["kind"] == "all_gpu" and not r["oom"] and not r["failed"]
    ]
    tried = [r["sessions"] for r in rows if r["kind"] == "all_gpu"]
    hit_oom = any(r["oom"] for r in rows if r["kind"] == "all_gpu")
    largest = max(fits, default=0)
    kv = [r for r in rows if r["kind"] == "kvtier"]
    big = next((r for r in kv if r["sessions"] == many), None)
    out = []
    if big is not None:
        peak, cap = big.get("peak_bytes"), big.get("cap_bytes")
        under = None if peak is None or not cap else peak < cap
        out.append(
            report._check(
                f"kvtier: 0 OOM at {many} sessions, peak under the cap",
                big["oom"] == 0 and big.get("failed", 0) == 0 and under is not False,
                f"{big['oom']} OOM, {big.get('failed', 0)} failed, peak {gib(peak)} of {gib(cap)}",
            )
        )
    served = max((r["sessions"] for r in kv if r["oom"] == 0 and not r.get("failed")), default=0)
    if hit_oom or not tried:
        ok: bool | None = served >= 2 * largest if largest else served > 0
        figure = f"{served} vs {largest}"
    else:  # all-on-GPU fit every batch tried: only a lower bound of what it holds
        ok = None if served < 2 * max(tried) else True
        figure = f"{served} vs >= {max(tried)} (no all-on-GPU OOM up to the largest tried)"
    out.append(
        report._check("kvtier at 0 OOM serves >= 2x the sessions all-on-GPU can", ok, figure)
    )
    if big is not None:
        d = big.get("decoding", float("nan"))
        out.append(
            report._check(
                f"kvtier {many}: >= 48 decoding at once",
                None if math.isnan(d) else d >= 48,
                f"{d:.1f} (max {big.get('max_decoding', 0)})",
            )
        )
    best = best_all_gpu(rows)
    rate = max((r["tok_s"] for r in kv if not math.isnan(r.get("tok_s", float("nan")))), default=0)
    for x, label in ((1.0, ""), (1.5, " (stretch)")):
        out.append(
            report._check(
                f"kvtier tok/s >= {x:g}x all-on-GPU's best{label}",
                None if not best else rate >= x * best,
                f"{rate:,.0f} vs {best:,.0f}",
            )
        )
    return out


def plot(results: list[dict], path: Path) -> str:
    """Per cap: tok/s of each configuration (OOMs marked) and its peak against the cap."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plot skipped: matplotlib is not installed"
    fig, axes = plt.subplots(2, len(results), figsize=(6 * len(results), 8), squeeze=False)
    for col, res in enumerate(results):
        rows = res["rows"]
        names = [r["config"] for r in rows]
        rates = [0.0 if math.isnan(r.get("tok_s", float("nan"))) else r["tok_s"] for r in rows]
        colors = ["C3" if r["oom"] else ("C0" if r["kind"] == "all_gpu" else "C2") for r in rows]
        ax = axes[0][col]
        ax.bar(names, rates, color=colors)
        ax.set_title(f"{res['cap_label']}: decode tok/s (red: OOM)")
        ax.tick_params(axis="x", rotation=30)
        ax = axes[1][col]
        peaks = [(r.get("peak_bytes") or 0) / GIB for r in rows]
        ax.bar(names, peaks, color=colors)
        if res.get("cap_bytes"):
            ax.axhline(res["cap_bytes"] / GIB, color="k", ls="--", label="cap")
            ax.legend()
        ax.set_ylabel("peak GiB allocated")
        ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return f"plot: {path}"


# ---- main --------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shape", default=None, help="bench/models.py shape (qwen2-7b on CUDA)")
    ap.add_argument("--caps", type=floats, default=[24.0, 48.0, 0.0], help="GiB; 0: uncapped")
    ap.add_argument(
        "--gpu-memory-gb",
        type=float,
        default=None,
        help="one cap only, in GiB (the same as --caps N; 0: uncapped)",
    )
    ap.add_argument("--sessions", type=ints, default=[32, 128], help="kvtier fleets")
    ap.add_argument(
        "--batches",
        type=ints,
        default=[8, 16, 24, 32, 48, 64, 96, 128],
        help="all-on-GPU batch sizes the search may try",
    )
    ap.add_argument("--first", type=int, default=32, help="the batch the search tries first")
    ap.add_argument("--context", type=int, default=3000, help="initial context tokens")
    ap.add_argument("--system", type=int, default=1536, help="shared system prompt tokens")
    ap.add_argument("--decode-tokens", type=int, default=64, help="tokens decoded per turn")
    ap.add_argument("--max-growth", type=int, default=1024)
    ap.add_argument("--think", type=fc.pair, default=(0.02, 0.1), help="the small fleet's think")
    ap.add_argument(
        "--think-many",
        type=fc.pair,
        default=None,
        help="the larger fleets' think seconds lo,hi (default: from the small fleet's step)",
    )
    ap.add_argument("--step-guess", type=float, default=0.03, help="seconds per step, if unknown")
    ap.add_argument("--slots", type=int, default=64, help="kvtier's batch slots (at most)")
    ap.add_argument("--time-limit", type=float, default=16.0, help="seconds per kvtier config")
    ap.add_argument("--warmup", type=float, default=3.0, help="seconds before its window opens")
    ap.add_argument("--search-time", type=float, default=5.0, help="seconds per all-GPU batch")
    ap.add_argument("--search-warmup", type=float, default=2.0)
    ap.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=ServerConfig.gpu_memory_utilization,
        help="kvtier's plan: the fraction of the cap it budgets (the server's default)",
    )
    ap.add_argument("--l2-gb", type=float, default=16.0, help="kvtier's L2 (pinned host RAM) cap")
    ap.add_argument("--write-policy", default="write_through")
    ap.add_argument("--batch-tokens", type=int, default=1024, help="scheduler token budget")
    ap.add_argument("--prefill-step", type=int, default=512, help="scheduler prompt chunk")
    ap.add_argument("--chunk-tokens", type=int, default=ServerConfig.chunk_tokens)
    ap.add_argument("--bank-group", type=int, default=32, help="contexts prefilled at once")
    ap.add_argument(
        "--cpu-pool-sessions",
        type=int,
        default=2,
        help="off CUDA: the plan's pool holds this many of the longest contexts",
    )
    ap.add_argument(
        "--oom-above",
        type=int,
        default=0,
        help="testing: an all-on-GPU batch above this size raises out-of-memory at once (the "
        "CPU smoke run's path through the search)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="DIR for small_gpu.json, .txt and .png")
    args = ap.parse_args(argv)
    if args.gpu_memory_gb is not None:
        args.caps = [args.gpu_memory_gb]
    dev = args.device
    cuda = dev.startswith("cuda")
    started = time.perf_counter()
    set_cudnn_attention(False)  # as kvtier serve
    shape = args.shape or ("qwen2-7b" if cuda else "qwen2-mini")
    dtype = torch.bfloat16 if cuda else torch.float32
    model = build(shape, dev, dtype)
    if int(model.config.vocab_size) <= TOKEN_IDS:
        sys.exit(
            f"shape {shape}: a vocabulary of {model.config.vocab_size} tokens; the fleet's token "
            f"ids go up to {TOKEN_IDS}: use qwen2-mini (or qwen2-7b)"
        )
    model.set_attn_implementation("sdpa")
    machine = torch.cuda.get_device_name() if cuda else "CPU"
    weights = serve.weight_bytes(model)
    geo = KVGeometry.from_config(model.config, dtype=str(dtype).split(".")[-1])
    per_token = geo.bytes_per_token
    print(
        f"{shape} {dtype} on {machine}, torch {torch.__version__}: weights {gib(weights)}, "
        f"K/V {per_token:,} bytes per token, caps "
        + ", ".join(cap_label(c) for c in args.caps)
        + ("" if cuda else " (ignored off CUDA: every cap runs uncapped)"),
        flush=True,
    )
    n_bank = max([*args.sessions, *args.batches, args.first])
    system = min(args.system, args.context // 2)
    ctxs = fc.contexts(n_bank, args.context, system, args.seed)
    t0 = time.perf_counter()
    bank = fc.build_bank(model, ctxs, system, dev, group=args.bank_group, chunk=512)
    release(dev)
    print(f"{n_bank} contexts prefilled in {time.perf_counter() - t0:.1f}s (host)", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="kvtier-small-gpu-"))
    results: list[dict] = []
    texts: list[str] = []
    try:
        for cap in args.caps:  # all-on-GPU first at every cap (kvtier's L1 pool stays)
            line = serve.cap_gpu_memory(cap, dev)
            print(f"\n[{cap_label(cap)}] {line}: all-on-GPU", flush=True)
            c0 = time.perf_counter()
            rows = search(model, ctxs, bank, args, dev, per_token, cap)
            results.append(
                {
                    "cap_gib": cap,
                    "cap_label": cap_label(cap),
                    "cap_line": line,
                    "cap_bytes": cap_bytes(cap, dev),
                    "rows": rows,
                    "elapsed_s": time.perf_counter() - c0,
                }
            )
        for res in results:
            cap = res["cap_gib"]
            print(f"\n[{cap_label(cap)}] {serve.cap_gpu_memory(cap, dev)}: kvtier", flush=True)
            c0 = time.perf_counter()
            step = None
            for n in sorted(args.sessions):
                slots = min(n, args.slots)
                if n == min(args.sessions):
                    think = args.think
                else:
                    pool = next(
                        (r.get("pool_bytes") for r in res["rows"] if r["kind"] == "kvtier"), None
                    )
                    think = many_think(args, n, slots, pool, per_token, step or args.step_guess)
                row, m = run_kvtier(model, ctxs, bank, n, think, args, dev, tmp, cap, geo)
                res["rows"].append(row)
                if m is not None and m.steps and step is None:
                    step = report.pct(m.steps, 0.5)
            res["elapsed_s"] += time.perf_counter() - c0
            many = max(args.sessions)
            res["targets"] = targets(res["rows"], many)
            res["kv_saved"] = kv_saved(res["rows"], args, per_token)
            title = (
                f"\n{res['cap_label']} ({res['cap_line']}): {shape} {dtype}, {machine}, "
                f"{args.context}-token contexts, {args.decode_tokens} tokens per turn"
            )
            texts.append(
                table(title, res["rows"])
                + "\nKV memory saved against all-on-GPU at equal sessions:\n"
                + kv_saved_text(res["kv_saved"])
                + "\ntargets:\n"
                + report.targets_text(res["targets"])
                + f"\n({res['cap_label']}: {res['elapsed_s']:.0f}s)"
            )
            print(texts[-1], flush=True)
            if args.out:
                save(args, machine, shape, dtype, weights, per_token, results, texts, started)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if cuda:
            serve.cap_gpu_memory(0, dev)
    print("\n".join(texts))
    print(f"\nsmall_gpu: {time.perf_counter() - started:.0f}s in all", flush=True)
    if args.out:
        save(args, machine, shape, dtype, weights, per_token, results, texts, started)
        print(plot(results, Path(args.out) / "small_gpu.png"))


def save(args, machine, shape, dtype, weights, per_token, results, texts, started) -> None:
    """JSON and text of what ran so far (after each cap: a run cut short keeps them)."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report.write_json(
        out / "small_gpu.json",
        {
            "machine": machine,
            "torch": torch.__version__,
            "shape": shape,
            "dtype": str(dtype),
            "weights_bytes": weights,
            "kv_bytes_per_token": per_token,
            "args": dict(vars(args)),
            "caps": results,
            "elapsed_s": time.perf_counter() - started,
        },
    )
    (out / "small_gpu.txt").write_text("\n".join(texts) + "\n")


if __name__ == "__main__":
    main()
