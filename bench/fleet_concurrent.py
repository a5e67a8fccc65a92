"""`bench/agent_fleet.py --concurrent`: N agent sessions with think time, served by one process.

The batched-serving benchmark, in-process (no HTTP). Every session runs turns: a turn appends 50-200
tokens (the user or a tool result) to its context, decodes `--decode-tokens` tokens, then the
session thinks (`--think` seconds, uniform) and returns. A conversation that grew by more than
`--max-growth` tokens starts over from its initial context as a new session (its first turn is
not a *returning* turn), so contexts stay near `--context`.

Two scenarios, each run with every configuration:
  fit        `--sessions` sessions (64), all decoding at once, all KV fits in L1
  hibernate  `--hibernate-sessions` sessions (256) with an L1 budget and a batch for
             `--l1-sessions` (64): the rest hibernate in L2/L3 and return after their think time
             (by default long enough that about `--l1-sessions` are active at a time, if
             each turn took as long as in the fit scenario: `--think-from`)

Configurations:
  ceiling      (a) batched eager DynamicCache, all KV resident, every session in lockstep (equal
               lengths, so no padding; no think time): the upper bound. In `hibernate`, the
               ceiling at batch `--l1-sessions` (reused from `fit` when that ran at that batch)
  generate     (b) transformers' `model.generate_batch` (its continuous batching), one call per
               round over every session's whole context (it keeps no KV between calls); skipped
               with a note where the installed transformers lacks it; `fit` only by default
  kvtier-seq   (c) kvtier TieredCache, one session per forward (the engine without batching)
  kvtier       (d) kvtier's BatchScheduler (the server's) over the paged pool, codec native,
               the pool as the sessions' L1 (`paged_l1`, the server's default): restores land
               in the pool straight from L2, so the cache's L1 keeps two contexts (its
               staging buffers and a margin) and the rest of the L1 budget goes to the pool,
               where finished turns park their pages; the server's fused kernels on
               (`fused_kernels`, `fused_attention`)
  kvtier-int8  (e) the same with the int8 codec
  kvtier-eager (d) without CUDA graphs: every step eager (what graphs add, in the same run)
  kvtier-unfused (d) without `fused_kernels`: the model's own norms, MLPs and attention
               (what the fused kernels add, in the same run: every configuration starts from
               the unfused model, and only those with the kernels on fuse it)
  kvtier-nodg  (d) without `decode_graphs` (the server's default since they measured +22 %
               here): every step replays the batched graph, none the decode-only graph of the
               one-row attention kernel (what they add, in the same run; `kvtier-dg` forces
               them on)
  kvtier-sync  (d) without overlapped steps: each step's tokens read back before the next
               step starts (what the overlap adds, in the same run)
  kvtier-gil5  (d) with Python's default GIL switch interval, 5 ms, instead of the
               scheduler's 0.5 ms (what the shorter interval adds, in the same run)
  kvtier-gil01 (d) with a 0.1 ms switch interval (whether the GIL paces the slow steps)
  kvtier-admit1 (d) admitting at most one turn per step (`admissions_per_step` 1: whether
               admissions bunched into one step make the slow steps)
  kvtier-nogc  (d) with Python's cyclic garbage collector off for the configuration's run
               (whether collections make the slow steps)
  kvtier-gc10k (d) with young collections every 10,000 net allocations instead of 700 (the
               serving makes no reference cycles on an H200, `--gc-garbage`, so a collection
               only walks live objects: fewer of them, the same garbage freed)
  kvtier-park  (d) as kvtier-copy, with `park_pages`: a finished turn's pages stay in the
               pool as its session's, and its next turn (restored from L1) starts from them
  kvtier-copy  (d) without `paged_l1`: sessions live in the cache's L1 buffers (the whole L1
               budget) between turns; each turn copies its prefix into pages and its new K/V
               back out
  kvtier-pN    (d) with N prompt tokens in a step that also decodes (`decoding_prompt_tokens`;
               the default is the server's, 192)
  kvtier-bN    (d) with N batch slots (`max_concurrency`) over the same L1 budget: the pool's
               pages, not a slot count, bound the batch (in `hibernate` the budget is for
               `--l1-sessions` contexts of the largest size a session reaches, and sessions
               share the system prompt's pages, so more running turns fit in it); skipped
               where every session has a slot already (`fit`). The two combine:
               `kvtier-b128-p256`
  kvtier-...-shortest  with the prompts a decoding step takes whole shortest first, not
               oldest first (kvtier.server.batch.promptorder; the order before)
  kvtier-...-nodg, kvtier-...-unfused  the two switches above on any variant:
               `kvtier-b96-p256-nodg`

Each session's initial context (a shared `--system`-token system prompt, then its own tokens)
is prefilled once per scenario, batched; its K/V is kept on the host (the "bank") and copied
into every configuration (kvtier: committed as its first turn), so no configuration pays for
ingest inside its time. Sessions arrive spread over the think time (the first think time is
uniform(0, hi)). Figures per configuration, all inside its measured window (after `--warmup`
seconds, in `hibernate` plus the mean think time, and `--time-limit` seconds long less the
warm-up): aggregate decode tok/s (tokens decoded in the window
/ window), TTFT P50/P99 of returning turns (from the end of the think time, queueing
included), step P50/P99 (one forward), OOM count (CUDA OOM, kvtier's L1BudgetExceeded,
PoolExhausted), peak GPU memory (`torch.cuda.max_memory_allocated` / `max_memory_reserved`
since the configuration started), and cudaMalloc calls inside the window:
`torch.cuda.memory_stats()["num_device_alloc"]` (the caching allocator's count of cudaMalloc
calls; `segment.all.allocated`, the segments it created, is kept in the JSON as a cross-check).
Every kvtier row adds its device bytes beyond the weights, steady (the median of
`torch.cuda.memory_allocated` sampled every 0.2 s inside the window) and peak (since the
configuration started), against its budget: with paged L1 the L1 budget itself (page pool, the
cache's L1 buffers and staging together), without it the cache's L1 and the pool beside it; where
its returning turns were restored from (l1 / l2 / l3 / recompute); and the sessions with K/V in
the page pool when the window closes. The hibernate scenario says per kvtier row whether it
hibernated (`HIBERNATED: yes/no`: most returning turns from L2/L3 where the sessions' K/V, at
their mean length, exceeds what keeps them between turns), one of its targets.
`--gpu-memory-gb N` caps the process at N GiB of the GPU before the model is built, to run as a
smaller GPU would.

    python3 bench/agent_fleet.py --concurrent --out DIR              # H200: about 6 minutes
    python3 bench/agent_fleet.py --concurrent --shape qwen2-mini --device cpu --sessions 8 \\
        --context 256 --time-limit 4 --warmup 1                      # CPU smoke run
"""

from __future__ import annotations

import argparse
import gc
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import fleet_batched as batched
import fleet_report as report
import fleet_serve as serve
from models import build
from transformers import DynamicCache

from kvtier.geometry import KVGeometry
from kvtier.integrations.hf import set_cudnn_attention
from kvtier.server.config import ServerConfig

CONFIGS = "ceiling,generate,kvtier-seq,kvtier,kvtier-int8"


def contexts(n: int, length: int, system: int, seed: int) -> list[list[int]]:
    """`n` contexts of `length` tokens: a shared system prompt, then each session's own."""
    import random

    rng = random.Random(f"contexts-{seed}")
    shared = [rng.randrange(100, 30000) for _ in range(system)]
    return [shared + [rng.randrange(100, 30000) for _ in range(length - system)] for _ in range(n)]


def build_bank(model, ctxs, system: int, device: str, group: int, chunk: int):
    """Every context's K/V, computed in batched prefills (the system prompt once), kept on the
    host as per-layer `[sessions, kv_heads, tokens, dim]` tensors."""
    n = len(ctxs)
    bank: list[tuple[torch.Tensor, torch.Tensor]] = []
    with torch.no_grad():
        pre: Any = DynamicCache(config=model.config)
        model(
            torch.tensor([ctxs[0][:system]], device=device), past_key_values=pre, logits_to_keep=1
        )
        for g0 in range(0, n, group):
            ids = torch.tensor(ctxs[g0 : g0 + group], device=device)
            b = ids.shape[0]
            cache: Any = DynamicCache(config=model.config)
            for i, layer in enumerate(pre.layers):
                k = layer.keys.expand(b, -1, -1, -1).contiguous()
                cache.update(k, layer.values.expand(b, -1, -1, -1).contiguous(), i)
            for c0 in range(system, ids.shape[1], chunk):
                model(ids[:, c0 : c0 + chunk], past_key_values=cache, logits_to_keep=1)
            for i, layer in enumerate(cache.layers):
                if not bank or len(bank) <= i:
                    shape = (n, *layer.keys.shape[1:])
                    # pageable: 256 sessions of 3,000 tokens are 44 GB, too much to pin
                    bank.append(
                        (
                            torch.empty(shape, dtype=layer.keys.dtype),
                            torch.empty(shape, dtype=layer.keys.dtype),
                        )
                    )
                bank[i][0][g0 : g0 + b].copy_(layer.keys)
                bank[i][1][g0 : g0 + b].copy_(layer.values)
            del cache
    serve.sync(device)
    return bank


def unfused(model: torch.nn.Module) -> None:
    """Every configuration starts from the model's own modules: the ceiling and `generate`
    as eager PyTorch, the kvtier rows fused again by their scheduler where `fused_kernels`
    is on (a fused model would otherwise stay fused for every configuration after it)."""
    fused = sys.modules.get("kvtier.paged.fused")  # not imported: nothing was fused
    if fused is not None:
        fused.unfuse_model(model)


def is_fused(model: torch.nn.Module) -> bool:
    """Whether the scheduler fused the model (kvtier.paged.fused)."""
    fused = sys.modules.get("kvtier.paged.fused")
    return fused is not None and bool(fused.fused_modules(model))


def fresh(device: str) -> None:
    # as `kvtier serve` does at the end of its start-up: what lives now (the model, the bank)
    # is out of the collector's reach, so no full collection walks it inside the window
    gc.collect()
    gc.freeze()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def run_scenario(args, model, dev: str, scen: str, n: int, fleet_ceiling, fit_step, tmp: Path):
    """Every configuration on one scenario; returns (rows, the ceiling Measure, the step P50 of
    the `kvtier` configuration or None). `fit_step`: that step in the fit scenario, for the
    hibernate scenario's think time."""
    geo = KVGeometry.from_config(model.config, dtype=str(model.dtype).split(".")[-1])
    per_token = geo.bytes_per_token
    batch = args.sessions if scen == "fit" else args.l1_sessions
    max_ctx = args.context + args.max_growth + 256 + args.decode_tokens
    l1_bytes = batch * max_ctx * per_token  # the L1 budget: `batch` contexts of the longest
    weights = serve.weight_bytes(model)
    l2_bytes = max(int(l1_bytes * args.l2_factor), per_token * 256)
    sched_config = SimpleNamespace(
        **ServerConfig(cuda_graphs=False).as_dict()  # the server's settings, but for these
        | dict(
            max_concurrency=batch,
            batch_tokens=args.batch_tokens,
            decoding_prompt_tokens=args.decoding_prompt_tokens,
            prefill_step=args.prefill_step,
            batch_kv_bytes=l1_bytes,  # the pool of a configuration without paged L1
            isolate_cpus=False,
            stacks=args.stacks,
            gc_garbage=args.gc_garbage,
            helper_threads=args.helper_threads,
        )
    )
    system = min(args.system, args.context // 2)
    ctxs = contexts(n, args.context, system, args.seed)
    # the sessions' K/V at their mean length (the initial context and half the growth before
    # a conversation starts over), the system prompt's once (the pages share it)
    sessions_kv = (system + n * (args.context - system + args.max_growth // 2)) * per_token
    t0 = time.perf_counter()
    bank = build_bank(model, ctxs, system, dev, group=min(batch, 64), chunk=args.prefill_chunk)
    print(f"[{scen}] {n} contexts prefilled in {time.perf_counter() - t0:.1f}s", flush=True)
    think = args.think
    if scen == "hibernate":
        think = hibernate_think(args, n, batch, fleet_ceiling, fit_step)
    fleet = serve.Fleet(ctxs, system, args.decode_tokens, think, args.max_growth, args.seed)
    # the window opens once the first arrivals (spread over the think time) have settled
    warmup = args.warmup + (sum(think) / 2 if scen == "hibernate" else 0.0)
    limit = args.time_limit + (warmup - args.warmup)
    print(
        f"[{scen}] think time {think[0]:.2f}-{think[1]:.2f}s, L1 {l1_bytes / 2**30:.2f} GiB, "
        f"L2 {l2_bytes / 2**30:.2f} GiB, batch {batch}",
        flush=True,
    )
    if scen == "hibernate":
        # what the sessions could ask for at most: every turn served at once, no queueing
        offered = n * args.decode_tokens / (sum(think) / 2)
        print(f"[{scen}] offered at most {offered:,.0f} tok/s (turns taking no time)", flush=True)
    chosen = args.hibernate_configs if scen == "hibernate" and args.hibernate_configs else None
    names = [c for c in (chosen or args.configs).split(",") if c]
    measures: list[serve.Measure] = []
    ceiling = None
    for name in names:
        if name == "generate" and scen == "hibernate" and not args.generate_hibernate:
            continue
        if name == "kvtier-seq" and scen == "hibernate" and not args.seq_hibernate:
            continue
        if "b" in report.variant(name) and n <= batch:  # slots for every session already
            continue
        reuse = fleet_ceiling is not None and fleet_ceiling.extra.get("batch") == batch
        if name == "ceiling" and scen == "hibernate" and reuse:
            ceiling = fleet_ceiling
            continue
        fresh(dev)
        unfused(model)
        model.set_attn_implementation("sdpa")
        backend = None
        root = tmp / f"{scen}-{name}"
        budget: int | None = None  # kvtier's device bytes beyond the weights, all of them
        home = 0  # kvtier: the bytes that keep sessions' K/V between turns (pool or L1)
        sampler = serve.MemorySampler(dev).start()
        t1 = time.perf_counter()
        try:
            if name == "ceiling":
                sub = serve.Fleet(ctxs[:batch], system, fleet.decode, think, args.max_growth)
                m = serve.run_ceiling(model, sub, bank_rows(bank, batch), dev, warmup, limit)
                ceiling = m
            elif name == "generate":
                if not serve.has_generate_batch(model):
                    m = serve.Measure("generate_batch", note="skipped: no model.generate_batch")
                else:
                    m = serve.run_generate(model, fleet, dev, limit)
            elif name.startswith("kvtier"):
                codec = "int8" if name.endswith("int8") else "native"
                # paged L1: restores go from L2 straight into the pages, so the cache's L1
                # holds the transfer engine's staging buffers and little else: two contexts
                # (one of a budget of two), and the page pool the rest of the L1 budget
                paged = codec == "native" and name not in (
                    "kvtier-seq",
                    "kvtier-copy",
                    "kvtier-park",
                )
                l1, pool = split_l1(l1_bytes, max_ctx * per_token) if paged else (l1_bytes, 0)
                backend = serve.tiered_backend(model, root, codec, l1, l2_bytes, args.write_policy)
                budget, home = l1, l1
                if name == "kvtier-seq":
                    m = serve.run_sequential(model, fleet, bank, dev, warmup, limit, backend)
                else:
                    cfg = SimpleNamespace(**vars(sched_config))
                    cfg.cuda_graphs = name != "kvtier-eager"
                    cfg.overlap_steps = name != "kvtier-sync"
                    settings = report.variant(name)
                    # the server's defaults unless the name switches them
                    cfg.decode_graphs = ServerConfig.decode_graphs
                    if "dg" in settings or "nodg" in settings:
                        cfg.decode_graphs = "dg" in settings
                    cfg.fused_kernels = ServerConfig.fused_kernels and "unfused" not in settings
                    if name == "kvtier-gil5":  # the interpreter's default GIL switch interval
                        cfg.switch_interval_s = 0.005
                    if name == "kvtier-gil01":  # a 0.1 ms switch interval (the default 0.5)
                        cfg.switch_interval_s = 0.0001
                    if name == "kvtier-admit1":  # at most one turn admitted per step
                        cfg.admissions_per_step = 1
                    if name == "kvtier-park":  # finished turns' pages parked in the pool
                        cfg.park_pages = True
                    cfg.paged_l1 = paged
                    if paged:  # the pool is L1: with the cache's L1, the L1 budget once
                        cfg.batch_kv_bytes = pool
                    # without paged L1 the pool is the running turns' working copy beside the
                    # cache's L1 (which keeps the sessions): the budget is both
                    budget = l1 + cfg.batch_kv_bytes
                    home = pool if paged else l1
                    if "p" in settings:  # prompt tokens of a decoding step
                        cfg.decoding_prompt_tokens = settings["p"]
                    if "b" in settings:  # batch slots, the same K/V bytes
                        cfg.max_concurrency = settings["b"]
                    if "shortest" in settings:  # short prompts shortest first
                        cfg.prompt_order = "shortest"
                    thresholds = gc.get_threshold()
                    if name == "kvtier-nogc":
                        gc.disable()
                    if name == "kvtier-gc10k":
                        gc.set_threshold(10_000, *thresholds[1:])
                    try:
                        m = batched.run_batched(
                            name, model, fleet, bank, dev, warmup, limit, backend, cfg
                        )
                    finally:
                        gc.enable()
                        gc.set_threshold(*thresholds)
                    # what the row ran, in its JSON and its line (a name says only what it
                    # changes); graphs are CUDA's
                    fused = is_fused(model)
                    graphs = dev.startswith("cuda") and cfg.cuda_graphs and cfg.decode_graphs
                    m.extra["fused_kernels"] = fused
                    m.extra["decode_graphs"] = graphs
                    ran = f"fused {'on' if fused else 'off'}, decode graphs {'on' if graphs else 'off'}"
                    m.note = f"{m.note}; {ran}" if m.note else ran
            else:
                print(f"unknown configuration {name}", flush=True)
                continue
        except Exception as exc:  # reported; the other configurations go on
            traceback.print_exc()
            m = serve.Measure(name, note=f"failed: {type(exc).__name__}: {str(exc)[:120]}")
        finally:
            sampler.stop()
            t2 = time.perf_counter()
            if backend is not None:
                try:
                    backend.close()
                except Exception as exc:
                    print(f"{name}: closing the cache failed: {exc!r}", flush=True)
            shutil.rmtree(root, ignore_errors=True)
            closed = time.perf_counter() - t2
        if dev.startswith("cuda"):
            m.peak_allocated = torch.cuda.max_memory_allocated()
            m.peak_reserved = torch.cuda.max_memory_reserved()
        serve.device_memory(m, sampler, weights, budget)
        if name.startswith("kvtier"):
            m.extra["sessions_kv_bytes"] = sessions_kv
            m.extra["home_bytes"] = home  # where sessions stay between turns: pool or L1
        measures.append(m)
        print(
            f"[{scen}] {m.name}: {m.tokens} tokens in a {m.window:.1f}s window, "
            f"{m.turns} returning turns, {m.ooms} OOM, {m.failed} failed "
            f"({time.perf_counter() - t1:.0f}s{spent(m, closed)}) {m.note}",
            flush=True,
        )
        if "stacks" in m.extra:
            print(m.extra.pop("stacks"), flush=True)
    model.set_attn_implementation("sdpa")
    del bank
    rows = [
        report.summary(m, ceiling)
        for m in ([ceiling] if ceiling and ceiling not in measures else []) + measures
    ]
    if ceiling is not None and ceiling not in measures:
        rows[0]["note"] = f"ceiling at batch {batch}, measured in the fit scenario of this run"
    ours = next((m for m in measures if m.name == "kvtier" and m.steps), None)
    return rows, ceiling, report.pct(ours.steps, 0.5) if ours is not None else None


def split_l1(l1_bytes: int, session_bytes: int) -> tuple[int, int]:
    """A paged configuration's L1 budget, split once: (the cache's L1 with its staging, the page
    pool). The cache keeps two sessions' worth (its staging buffers and a margin; one of a
    budget of two), the pool the rest."""
    l1 = min(2 * session_bytes, l1_bytes // 2)
    return l1, l1_bytes - l1


def bank_rows(bank, n: int):
    return [(k[:n], v[:n]) for k, v in bank]


def hibernate_think(args, n: int, batch: int, ceiling, fit_step=None) -> tuple[float, float]:
    """Think time that keeps about `batch` of the `n` sessions in a turn: (n/batch - 1) turn
    times, uniform within +-25 %. The turn time is `--decode-tokens` steps of (`--think-from`):

    kvtier   the `kvtier` configuration's step P50 in the fit scenario of this run (the
             default): the load the server itself could carry with a full batch. A server
             slower in this scenario than in fit queues returning turns, which TTFT shows.
    ceiling  the eager ceiling's step. It is 1.5-2 x kvtier's on an H200 and varies with the
             instance (26-35 ms), so the load offered follows the instance: at a 35 ms step
             the 256 sessions ask for at most about 2,400 tok/s, less than the target.

    Without the chosen step, the other one, else `--step-guess`."""
    if args.think_hibernate:
        return args.think_hibernate
    eager = report.pct(ceiling.steps, 0.5) if ceiling is not None and ceiling.steps else None
    first, second = (fit_step, eager) if args.think_from == "kvtier" else (eager, fit_step)
    step = first or second or args.step_guess
    turn = args.decode_tokens * step
    mean = max(n / batch - 1, 0.0) * turn
    return (0.75 * mean, 1.25 * mean)


def spent(m: serve.Measure, closed: float) -> str:
    """Where a configuration's time went besides its warm-up and window, for those that
    seed a cache: committing the bank, capturing CUDA graphs, closing the cache and deleting
    its L3 (its writers drain first)."""
    if "seed_s" not in m.extra:
        return ""
    graphs = m.extra.get("graph_capture_s", 0.0)
    return f": seeding {m.extra['seed_s']:.0f}s, graphs {graphs:.0f}s, closing {closed:.0f}s"


def pair(text: str) -> tuple[float, float]:
    lo, _, hi = text.partition(",")
    return float(lo), float(hi or lo)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--concurrent", action="store_true", help="(this mode; accepted and ignored)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shape", default=None, help="bench/models.py shape (qwen2-7b on CUDA)")
    ap.add_argument("--sessions", type=int, default=64, help="fit scenario: sessions")
    ap.add_argument(
        "--hibernate-sessions",
        type=int,
        default=None,
        help="hibernate scenario: sessions (default 4x --sessions; 0 skips it)",
    )
    ap.add_argument(
        "--l1-sessions",
        type=int,
        default=None,
        help="hibernate scenario: L1 budget and batch, in sessions (default --sessions)",
    )
    ap.add_argument("--context", type=int, default=3000, help="initial context tokens")
    ap.add_argument("--system", type=int, default=1536, help="shared system prompt tokens")
    ap.add_argument("--decode-tokens", type=int, default=64, help="tokens decoded per turn")
    ap.add_argument("--max-growth", type=int, default=1024)
    ap.add_argument("--think", type=pair, default=(0.02, 0.1), help="fit: think seconds lo,hi")
    ap.add_argument(
        "--think-hibernate",
        type=pair,
        default=None,
        help="hibernate: think seconds lo,hi (default: from a step, --think-from)",
    )
    ap.add_argument(
        "--think-from",
        choices=("kvtier", "ceiling"),
        default="kvtier",
        help="hibernate think time from the fit scenario's kvtier step or the ceiling's step",
    )
    ap.add_argument(
        "--step-guess",
        type=float,
        default=0.02,
        help="seconds per step for the hibernate think time without a ceiling run",
    )
    ap.add_argument("--configs", default=CONFIGS)
    ap.add_argument(
        "--hibernate-configs",
        default=None,
        help="the hibernate scenario's configurations (default: --configs), e.g. "
        "ceiling,kvtier,kvtier-b128-p256 while fit runs all five",
    )
    ap.add_argument(
        "--generate-hibernate",
        action="store_true",
        help="also run generate_batch in the hibernate scenario (slow: it "
        "prefills every context every round)",
    )
    ap.add_argument(
        "--seq-hibernate",
        action="store_true",
        help="also run kvtier-seq (one session per forward) in the hibernate scenario (its "
        "window then takes about 90 s on an H200 for about 30 tok/s; the targets of that "
        "scenario do not compare with it)",
    )
    ap.add_argument(
        "--stacks",
        action="store_true",
        help="sample the batch scheduler thread's Python stack every millisecond inside the "
        "window and print where its time went (bench/stacks.py)",
    )
    ap.add_argument(
        "--gc-garbage",
        action="store_true",
        help="with --stacks: keep what the window's garbage collections find and count it by "
        "type (the reference cycles the serving makes)",
    )
    ap.add_argument("--time-limit", type=float, default=20.0, help="seconds per configuration")
    ap.add_argument("--warmup", type=float, default=4.0, help="seconds before the window opens")
    ap.add_argument(
        "--write-policy", default="write_through", help="kvtier write policy (as kvtier serve)"
    )
    ap.add_argument("--l2-factor", type=float, default=1.5, help="L2 bytes = this x L1 bytes")
    ap.add_argument("--batch-tokens", type=int, default=1024, help="scheduler token budget")
    ap.add_argument("--prefill-step", type=int, default=512, help="scheduler prompt chunk")
    ap.add_argument(
        "--decoding-prompt-tokens",
        type=int,
        default=ServerConfig.decoding_prompt_tokens,
        help="prompt tokens in a step that also decodes (0: up to --batch-tokens)",
    )
    ap.add_argument("--prefill-chunk", type=int, default=512, help="bank prefill chunk")
    ap.add_argument(
        "--helper-threads",
        type=int,
        default=0,
        help="the scheduler's restore threads, and as many commit threads (0: its default)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--gpu-memory-gb",
        type=float,
        default=0.0,
        help="cap the process at this many GiB of the GPU before anything is allocated, to run "
        "as a smaller GPU would (torch's per-process memory fraction; 0: uncapped; ignored "
        "with a note off CUDA)",
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.hibernate_sessions is None:
        args.hibernate_sessions = 4 * args.sessions
    if args.l1_sessions is None:
        args.l1_sessions = args.sessions
    dev = args.device
    cuda = dev.startswith("cuda")
    set_cudnn_attention(False)  # as kvtier serve: cuDNN plans per new length slow every config
    cap = serve.cap_gpu_memory(args.gpu_memory_gb, dev) if args.gpu_memory_gb else ""
    shape = args.shape or ("qwen2-7b" if cuda else "qwen2-mini")
    dtype = torch.bfloat16 if cuda else torch.float32
    model = build(shape, dev, dtype)
    model.set_attn_implementation("sdpa")
    machine = torch.cuda.get_device_name() if cuda else "CPU"
    print(f"{shape} {dtype} on {machine}, torch {torch.__version__}", flush=True)
    weights = serve.weight_bytes(model)
    print(f"weights {weights / 2**30:.2f} GiB" + (f"; {cap}" if cap else ""), flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="kvtier-fleet-conc-"))
    results: dict[str, list[dict]] = {}
    checks: dict[str, list[dict]] = {}
    texts = []
    ceiling = fit_step = None
    try:
        for scen, n in (("fit", args.sessions), ("hibernate", args.hibernate_sessions)):
            if n <= 0:
                continue
            rows, c, step = run_scenario(args, model, dev, scen, n, ceiling, fit_step, tmp)
            ceiling = ceiling or c
            fit_step = fit_step or step
            results[scen] = rows
            checks[scen] = report.targets(scen, rows)
            title = (
                f"\n{scen}: {n} sessions, {args.context}-token contexts, "
                f"{args.decode_tokens} tokens per turn, {shape} {dtype}, {machine}"
            )
            if scen == "hibernate":
                title += f", L1 and batch for {args.l1_sessions}"
            if cap:
                title += f"; {cap}"
            summary = report.table(title, rows)
            if scen == "hibernate":
                summary += "\n" + report.hibernation_text(rows)
            texts.append(summary + "\ntargets:\n" + report.targets_text(checks[scen]))
            print(texts[-1], flush=True)
            if args.out:
                save(args, args.out, machine, shape, dtype, results, checks, texts)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print("\n".join(texts))
    if args.out:
        print(report.plot(results, Path(args.out) / "fleet_concurrent.png"))


def save(args, out_dir: str, machine: str, shape: str, dtype, results, checks, texts) -> None:
    """JSON and text of what ran so far (after each scenario: a run cut short keeps them)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    report.write_json(
        out / "fleet_concurrent.json",
        {
            "machine": machine,
            "torch": torch.__version__,
            "shape": shape,
            "dtype": str(dtype),
            "args": dict(vars(args)),
            "results": results,
            "targets": checks,
        },
    )
    (out / "fleet_concurrent.txt").write_text("\n".join(texts) + "\n")


if __name__ == "__main__":
    main()
