"""The headline benchmark: an agent fleet on one GPU, kvtier vs the alternatives, in one run.

100 agent sessions share a 1,500-token system prompt and hold about 3,000 tokens of context
each; every turn appends 50-200 new tokens (the user or a tool result) and decodes a short
answer. Between two turns of one session every other session takes its turn (the think time is
the tool call). GPU memory is capped so that KV for only about 40 such sessions fits.

Configurations, each run on the same workload (same seeds):
  dynamic     all KV on the GPU (transformers DynamicCache kept per session)
  offloaded   transformers' own offloading cache kept per session (KV in host RAM)
  recompute   no cache kept between turns: every turn re-runs prefill of the whole context
  kvtier      kvtier TieredCache, codec native (L1 budget = the KV cap, L2 pinned, L3 on disk;
              the default l3_writer "auto": file writes from the writer process on a GPU)
  kvtier-int8 the same with the int8 cold-tier codec
  kvtier-wb   kvtier native with the write_back policy (a diagnostic: no write-through I/O)
  kvtier-threads  kvtier native with L3 file writes from threads of this process (a
              diagnostic: l3_writer "threads")

For every returning turn the bench also records the serving thread's on-CPU fraction (thread
CPU time / wall time). The decode loop is bound by this thread launching kernels and it spins
while it waits for the GPU, so the fraction stays near 1 unless the thread is kept off its core
(another process, or the interpreter lock held by a thread of this process): a slow turn with a
low fraction was slowed on the host, a slow turn with a fraction near 1 on the GPU or by a
slower core. For the last, each returning turn is followed by a fixed pure-Python loop, the
"probe" (about 0.5 ms): a core running slower (clock, or a hypervisor taking it) slows it too.

PyTorch's cuDNN attention is off for every configuration, as in `kvtier serve`: it builds a plan
for every new sequence length, which slowed every configuration for the first minutes of the
process (docs/benchmarks.md, run G); `--cudnn-attention` leaves it on.

The first turn of a session ingests its prompt (prefill only); returning turns are timed for
TTFT and decode steps.

    python3 bench/agent_fleet.py --out DIR            # on the GPU machine (< 10 minutes)
    python3 bench/agent_fleet.py --shape qwen2-mini --device cpu --sessions 12 --turns 2

`--concurrent` runs the other mode, bench/fleet_concurrent.py (its own options): N sessions with
think time served concurrently by one process, batched configurations included.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from models import build
from transformers import DynamicCache

from kvtier import CacheConfig, TieredCache
from kvtier.errors import L1BudgetExceeded
from kvtier.geometry import KVGeometry
from kvtier.integrations.hf import set_cudnn_attention
from kvtier.tiers.l3.io import isolate_caller


@dataclass
class Result:
    name: str
    turns: int = 0
    ooms: int = 0
    failed: int = 0
    ttft_return: list[float] = field(default_factory=list)  # returning sessions only
    ttft_first: list[float] = field(default_factory=list)
    steps: list[float] = field(default_factory=list)
    generated: int = 0
    wall: float = 0.0
    peak_bytes: int = 0
    memory: list[tuple[float, int]] = field(default_factory=list)
    decisions: dict[str, int] = field(default_factory=dict)
    phases: dict[str, float] = field(default_factory=dict)  # seconds spent per phase
    restore_s: list[float] = field(default_factory=list)  # returning turns: in restore()
    alloc_retries: int = 0
    device_mallocs: int = 0  # cudaMalloc + cudaFree calls during the run (each syncs the GPU)
    l1_oom: int = 0
    l3_written: int = 0  # bytes kvtier wrote to L3 during the run
    l3_lost: str = ""  # kvtier's shed writes and I/O errors
    turn_at: list[float] = field(default_factory=list)  # returning turns: seconds into the run
    on_cpu: list[float] = field(default_factory=list)  # returning turns: thread CPU / wall
    probe: list[float] = field(default_factory=list)  # returning turns: the probe, seconds
    oom_info: list[str] = field(default_factory=list)  # GPU memory at each OOM
    launch: list[float] = field(default_factory=list)  # per decode step: until forward returns
    gpu: list[tuple[float, ...]] = field(default_factory=list)  # GpuSampler samples


# NVML clock-event reasons that slow the SM clock under load (power cap, thermal, hardware)
_SLOWDOWN = 0x4 | 0x8 | 0x20 | 0x40 | 0x80


class GpuSampler:
    """NVML readings every `period` seconds from a thread: (seconds into the run, SM clock MHz,
    GPU utilization %, power W, clock-event reason bits). A window where every configuration's
    step slows can then be told apart: the GPU clocking down (reasons, clock), or busy with
    work not ours (utilization while we wait on the host)."""

    def __init__(self, period: float = 0.2) -> None:
        from ops.collectors.nvml import nvml_query

        self.query = nvml_query
        self.period = period
        self.handle = nvml_query("nvmlDeviceGetHandleByIndex", torch.cuda.current_device())
        # the clock-event reasons call, under its newer name where this pynvml has it
        self.reasons_fn = next(
            (
                fn
                for fn in (
                    "nvmlDeviceGetCurrentClocksEventReasons",
                    "nvmlDeviceGetCurrentClocksThrottleReasons",
                )
                if nvml_query(fn, self.handle, default=None) is not None
            ),
            None,
        )
        self.samples: list[tuple[float, ...]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def processes(self) -> int:
        """Compute processes NVML lists on this GPU (ours included; -1 where it cannot say)."""
        procs = self.query("nvmlDeviceGetComputeRunningProcesses", self.handle, default=None)
        return -1 if procs is None else len(procs)

    def _reasons(self) -> int:
        if self.reasons_fn is None:
            return -1
        value = self.query(self.reasons_fn, self.handle, default=None)
        return -1 if value is None else int(value)

    def _loop(self, t0: float) -> None:
        while not self._stop.wait(self.period):
            util = self.query("nvmlDeviceGetUtilizationRates", self.handle, default=None)
            power = self.query("nvmlDeviceGetPowerUsage", self.handle, default=None)
            self.samples.append(
                (
                    time.perf_counter() - t0,
                    float(self.query("nvmlDeviceGetClockInfo", self.handle, 1, default=-1)),
                    float(util.gpu) if util is not None else -1.0,
                    power / 1000 if power is not None else -1.0,
                    float(self._reasons()),
                )
            )

    def start(self, t0: float) -> None:
        self.samples = []
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, args=(t0,), daemon=True)
        self._thread.start()

    def stop(self) -> list[tuple[float, ...]]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        return self.samples


def probe(n: int = 20000) -> float:
    """Seconds a fixed pure-Python loop takes: this core's speed for the serving thread now."""
    t0 = time.perf_counter()
    x = 0
    for i in range(n):
        x += i
    return time.perf_counter() - t0


def memory_at_oom(cache: object) -> str:
    """Where the GPU memory was when an allocation failed."""
    mib = 2**20
    line = (
        f"allocated {torch.cuda.memory_allocated() / mib:.0f} MiB, reserved "
        f"{torch.cuda.memory_reserved() / mib:.0f} MiB"
    )
    if cache is not None:
        l1 = cache.l1  # type: ignore[attr-defined]
        line += f", kvtier L1 {l1.used_bytes / mib:.0f} of {l1.budget_bytes / mib:.0f} MiB"
        line += f", kvtier pool reserved {l1.reserved_bytes() / mib:.0f} MiB"
    return line


def workload(n_sessions: int, turns: int, system_len: int, seed: int) -> list[list[list[int]]]:
    """Per session, per turn: the token ids appended at that turn (turn 0 includes the prompt)."""
    rng = random.Random(seed)
    system = [rng.randrange(100, 30000) for _ in range(system_len)]
    plan = []
    for _ in range(n_sessions):
        first = system + [rng.randrange(100, 30000) for _ in range(rng.randint(900, 1900))]
        rest = [
            [rng.randrange(100, 30000) for _ in range(rng.randint(50, 200))]
            for _ in range(turns - 1)
        ]
        plan.append([first, *rest])
    return plan


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    v = sorted(values)
    return v[min(len(v) - 1, round(q * (len(v) - 1)))]


class Runner:
    """Runs the fleet with one way of keeping KV between turns."""

    def __init__(
        self,
        name,
        model,
        device,
        decode_tokens,
        kv_budget,
        tmp,
        codec="native",
        policy="write_through",
        writer="auto",
        sync_stream=False,
        sampler=None,
    ):
        self.name, self.model, self.device = name, model, device
        self.sync_stream = sync_stream  # time the model's stream only (--sync stream)
        self.sampler = sampler  # GpuSampler, or None (CPU)
        self.decode_tokens = decode_tokens
        self.kv_budget = kv_budget
        self.caches: dict[int, object] = {}
        self.cache = None
        if name.startswith("kvtier"):
            self.cache = TieredCache(
                CacheConfig(
                    l3_root=Path(tmp) / name,
                    l1_bytes=kv_budget,
                    l2_bytes=kv_budget * 3,
                    chunk_tokens=256,
                    codec=codec,
                    write_policy=policy,
                    l3_writer=writer,
                ),
                model,
            )
            # l1_bytes is all of kvtier's GPU memory (its staging buffers come out of it), so
            # every configuration has the same KV cap

    def turn(self, sid: int, ids: torch.Tensor, res: Result) -> None:
        model = self.model
        returning = self._returning(sid)
        self.sync()
        t0 = time.perf_counter()
        cpu0 = time.thread_time()
        if self.cache is not None:
            s = self.cache.session(f"agent-{sid}", tenant="fleet")
            try:
                pkv = s.restore(ids)
            except L1BudgetExceeded:  # kvtier's typed out-of-memory: counted like an OOM
                res.ooms += 1
                res.failed += 1
                self.history.pop(sid, None)
                return
            past = pkv.get_seq_length()
            self.sync()
            spent = time.perf_counter() - t0
            res.phases["restore"] = res.phases.get("restore", 0.0) + spent

        elif self.name == "recompute":
            pkv, past = DynamicCache(), 0
        else:
            pkv = self.caches.get(sid)
            if pkv is None:
                pkv = DynamicCache(config=model.config, offloading=self.name == "offloaded")
            past = pkv.get_seq_length()
        try:
            with torch.no_grad():
                logits = model(ids[:, past:], past_key_values=pkv, logits_to_keep=1).logits
                tok = logits[:, -1:].argmax(-1)
                self.sync()
                ttft = time.perf_counter() - t0
                out = [tok]
                # the first turn ingests the agent's prompt; returning turns answer
                for _ in range(self.decode_tokens - 1 if returning else 0):
                    t1 = time.perf_counter()
                    logits = model(tok, past_key_values=pkv, logits_to_keep=1).logits
                    tok = logits[:, -1:].argmax(-1)
                    res.launch.append(time.perf_counter() - t1)
                    self.sync()
                    res.steps.append(time.perf_counter() - t1)
                    out.append(tok)
        except torch.cuda.OutOfMemoryError:
            res.oom_info.append(memory_at_oom(self.cache))
            res.ooms += 1
            res.failed += 1
            if self.cache is not None:
                s.abort()
            self.caches.pop(sid, None)  # the service must drop this conversation's KV
            del pkv
            gc.collect()
            torch.cuda.empty_cache()
            return
        new = torch.cat([ids, *out], dim=1)
        res.phases["ttft"] = res.phases.get("ttft", 0.0) + ttft
        res.phases["turn"] = res.phases.get("turn", 0.0) + time.perf_counter() - t0
        if self.cache is not None:
            t2 = time.perf_counter()
            s.commit(new[0, :-1])  # the last token's KV is not computed yet
            self.sync()
            res.phases["commit"] = res.phases.get("commit", 0.0) + time.perf_counter() - t2
        elif self.name != "recompute":
            self.caches[sid] = pkv
        (res.ttft_return if returning else res.ttft_first).append(ttft)
        if returning and self.cache is not None:
            res.restore_s.append(spent)
        if returning:
            now = time.perf_counter()
            res.turn_at.append(now - self.t_start)
            res.on_cpu.append((time.thread_time() - cpu0) / max(now - t0, 1e-9))
            res.probe.append(probe())
        res.turns += 1
        res.generated += len(out)
        self.history[sid] = new

    def sync(self) -> None:
        """Wait for the GPU before reading a clock: the whole device (every stream, kvtier's
        background copies included; the default) or only the model's stream, which is what a
        server waits on when it reads the token (--sync stream)."""
        if not self.device.startswith("cuda"):
            return
        if self.sync_stream:
            torch.cuda.current_stream().synchronize()
        else:
            torch.cuda.synchronize()

    def _returning(self, sid: int) -> bool:
        return sid in self.seen

    def run(self, plan, res: Result, time_limit: float) -> None:
        self.history: dict[int, torch.Tensor] = {}
        self.seen: set[int] = set()
        if self.device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
            torch.cuda.reset_accumulated_memory_stats()
        t_start = self.t_start = time.perf_counter()
        if self.sampler is not None:
            self.sampler.start(t_start)
        order_rng = random.Random(1)
        for turn in range(len(plan[0])):
            order = list(range(len(plan)))
            order_rng.shuffle(order)
            for sid in order:
                if time.perf_counter() - t_start > time_limit:
                    break
                prev = self.history.get(sid)
                add = torch.tensor([plan[sid][turn]], device=self.device)
                if turn and prev is None:  # an earlier turn of this session failed
                    res.failed += 1
                    continue
                ids = add if prev is None else torch.cat([prev, add], dim=1)
                self.turn(sid, ids, res)
                self.seen.add(sid)
                if self.device.startswith("cuda"):
                    res.memory.append(
                        (time.perf_counter() - t_start, torch.cuda.memory_allocated())
                    )
        res.wall = time.perf_counter() - t_start
        if self.sampler is not None:
            res.gpu = list(self.sampler.stop())
        if self.device.startswith("cuda"):
            res.peak_bytes = torch.cuda.max_memory_allocated()
            stats = torch.cuda.memory_stats()
            res.alloc_retries = stats.get("num_alloc_retries", 0)
            res.device_mallocs = stats.get("num_device_alloc", 0) + stats.get("num_device_free", 0)
        if self.cache is not None:
            snap = self.cache.stats()
            res.decisions = dict(snap.restore_decisions)
            res.l1_oom = snap.oom_retries
            res.l3_written = sum(t.bytes for t in snap.transfers if (t.src, t.dst) == ("l2", "l3"))
            res.l3_lost = f"shed={snap.shed_writes} io_errors={snap.io_errors}"

    def profile_turn(self, plan, decode_tokens: int) -> str:
        """One more returning turn, after the measured run, under torch.profiler: the ops that
        took the serving thread's time, and the device's. Its samples are not kept."""
        sid = next((s for s in sorted(self.history) if s in self.seen), None)
        if sid is None:
            return "(no returning session to profile)\n"
        from torch.profiler import ProfilerActivity, profile

        add = torch.tensor([plan[sid][-1][:64]], device=self.device)
        ids = torch.cat([self.history[sid], add], dim=1)
        activities = [ProfilerActivity.CPU]
        if self.device.startswith("cuda"):
            activities.append(ProfilerActivity.CUDA)
        scratch = Result(self.name)
        measured, self.decode_tokens = self.decode_tokens, decode_tokens
        try:
            with profile(activities=activities) as prof:
                self.turn(sid, ids, scratch)
        finally:
            self.decode_tokens = measured
        table = prof.key_averages()
        cpu = table.table(sort_by="self_cpu_time_total", row_limit=12)
        text = f"{self.name}: one turn of session {sid}, {len(scratch.steps)} decode steps\n{cpu}"
        if self.device.startswith("cuda"):
            text += table.table(sort_by="self_cuda_time_total", row_limit=8)
        return text

    def close(self) -> None:
        if self.cache is not None:
            self.cache.close()
            # every configuration starts with the same free disk
            shutil.rmtree(self.cache.config.l3_root, ignore_errors=True)
        self.caches.clear()
        gc.collect()
        if self.device.startswith("cuda"):
            torch.cuda.empty_cache()


DIAGNOSTICS_HELP = """per configuration, over its returning turns:
  host   the serving thread's on-CPU fraction P50/P10, the probe P50, and the slow turns
         (TTFT > 2x the median): how many, their on-CPU fraction and probe, when (s)
  launch decode steps: host time until forward returns P50/P99 ms, against the step P50/P99
  gpu    NVML every 0.2 s: SM clock P50/P10/min MHz, utilization P50 %, power P50 W, samples
         with a power/thermal/hardware clock slowdown, SM clock at the slow turns"""


def diagnostics(r: Result) -> list[str]:
    """Where one configuration's time went, on the host and on the GPU (DIAGNOSTICS_HELP)."""
    lines = []
    slow = [i for i, t in enumerate(r.ttft_return) if t > 2 * pct(r.ttft_return, 0.5)]
    if r.on_cpu:
        when = ",".join(f"{r.turn_at[i]:.0f}" for i in slow[:12])
        lines.append(
            f"{r.name:>12} host   on-CPU {pct(r.on_cpu, 0.5):.2f}/{pct(r.on_cpu, 0.1):.2f}  "
            f"probe {pct(r.probe, 0.5) * 1e3:.2f} ms  slow {len(slow)}: on-CPU "
            f"{pct([r.on_cpu[i] for i in slow], 0.5):.2f} probe "
            f"{pct([r.probe[i] for i in slow], 0.5) * 1e3:.2f} ms at {when}"
        )
    if r.launch:
        lines.append(
            f"{r.name:>12} launch {pct(r.launch, 0.5) * 1e3:.1f}/{pct(r.launch, 0.99) * 1e3:.1f}"
            f"  step {pct(r.steps, 0.5) * 1e3:.1f}/{pct(r.steps, 0.99) * 1e3:.1f}"
        )
    if r.gpu:
        clock = [g[1] for g in r.gpu]
        slowed = sum(1 for g in r.gpu if g[4] >= 0 and int(g[4]) & _SLOWDOWN)
        at_slow = [min(r.gpu, key=lambda g, i=i: abs(g[0] - r.turn_at[i]))[1] for i in slow]
        lines.append(
            f"{r.name:>12} gpu    SM {pct(clock, 0.5):.0f}/{pct(clock, 0.1):.0f}/{min(clock):.0f}"
            f"  util {pct([g[2] for g in r.gpu], 0.5):.0f}  power "
            f"{pct([g[3] for g in r.gpu], 0.5):.0f}  slowdown {slowed}/{len(r.gpu)}  "
            f"slow turns' SM {pct(at_slow, 0.5):.0f}"
        )
    return lines


def plot(results: list[Result], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in results:
        if r.ttft_return:
            v = sorted(r.ttft_return)
            ax[0].plot(
                [x * 1e3 for x in v], [i / len(v) for i in range(1, len(v) + 1)], label=r.name
            )
        if r.memory:
            ax[1].plot([t for t, _ in r.memory], [b / 2**30 for _, b in r.memory], label=r.name)
    ax[0].set_xscale("log")
    ax[0].set_xlabel("TTFT of a returning session (ms, log)")
    ax[0].set_ylabel("fraction of turns")
    ax[0].set_title("TTFT CDF by configuration")
    ax[0].legend()
    ax[1].set_xlabel("time (s)")
    ax[1].set_ylabel("GPU memory allocated (GiB)")
    ax[1].set_title("GPU memory over time")
    ax[1].legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    if "--concurrent" in sys.argv[1:]:
        import fleet_concurrent

        fleet_concurrent.main(sys.argv[1:])
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shape", default=None)
    ap.add_argument("--sessions", type=int, default=100)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--system", type=int, default=1500)
    ap.add_argument("--decode-tokens", type=int, default=6)
    ap.add_argument(
        "--fit-sessions", type=int, default=40, help="sessions of 3,000 tokens the KV cap holds"
    )
    ap.add_argument("--configs", default="dynamic,offloaded,recompute,kvtier,kvtier-int8")
    ap.add_argument("--time-limit", type=float, default=75.0, help="seconds per configuration")
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--sync",
        choices=["device", "stream"],
        default="device",
        help="what a timing waits for: the whole GPU (default; every figure in "
        "docs/benchmarks.md) or the model's stream only, as a server reading its token does",
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="after each configuration's run, one more turn (32 decode steps) under "
        "torch.profiler; its top ops go to DIR/profiles.txt (or stdout without --out)",
    )
    ap.add_argument(
        "--cudnn-attention",
        action="store_true",
        help="leave PyTorch's cuDNN SDPA backend on (default: off, as in kvtier serve; it builds "
        "a plan per new sequence length, which slows every configuration until warm)",
    )
    ap.add_argument(
        "--gpu-memory-gb",
        type=float,
        default=0.0,
        help="cap the process at this many GiB of the GPU before anything is allocated, to run "
        "as a smaller GPU would (0: uncapped; the KV cap below then applies inside it; "
        "ignored with a note off CUDA). With --concurrent: the same option of that mode",
    )
    ap.add_argument(
        "--no-isolate",
        action="store_true",
        help="leave the decode thread unpinned (default: a core of its own, L3 threads elsewhere)",
    )
    args = ap.parse_args()
    if not args.no_isolate and args.device.startswith("cuda"):  # same for every configuration
        cpus = isolate_caller()
        print(f"decode thread on CPUs {sorted(cpus[0])}" if cpus else "decode thread unpinned")
    dev = args.device
    set_cudnn_attention(args.cudnn_attention)
    gpu_cap = ""
    if args.gpu_memory_gb:  # before anything is allocated: the process runs as that GPU would
        from fleet_serve import cap_gpu_memory

        gpu_cap = cap_gpu_memory(args.gpu_memory_gb, dev)
        print(gpu_cap, flush=True)
    shape = args.shape or ("qwen2-7b" if dev.startswith("cuda") else "qwen2-mini")
    dtype = torch.bfloat16 if dev.startswith("cuda") else torch.float32
    model = build(shape, dev, dtype)
    geo = KVGeometry.from_config(model.config, dtype=str(dtype).split(".")[-1])
    kv_budget = args.fit_sessions * 3000 * geo.bytes_per_token
    plan = workload(args.sessions, args.turns, args.system, seed=0)
    tmp = tempfile.mkdtemp(prefix="kvtier-fleet-")
    longest = max(len(p[0]) for p in plan) + args.decode_tokens
    if dev.startswith("cuda"):
        weights = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        with torch.no_grad():  # the activation peak of the longest prefill, measured
            model(torch.randint(100, 30000, (1, longest), device=dev), logits_to_keep=1)
        activations = torch.cuda.max_memory_allocated() - weights
        slack = 2 << 30  # allocator rounding and caching
        total = torch.cuda.get_device_properties(0).total_memory
        cap = weights + activations + slack + kv_budget
        parts = (
            f"weights {weights / 2**30:.1f} + activations {activations / 2**30:.1f} + slack "
            f"{slack / 2**30:.1f} + KV {kv_budget / 2**30:.1f}"
        )
        if args.gpu_memory_gb and args.gpu_memory_gb * 2**30 < min(cap, total):
            cap = int(args.gpu_memory_gb * 2**30)  # the smaller GPU's memory is the cap
            print(f"GPU cap {cap / 2**30:.1f} GiB (--gpu-memory-gb), less than {parts}")
        else:
            print(f"GPU cap {cap / 2**30:.1f} GiB = {parts}")
        torch.cuda.set_per_process_memory_fraction(min(cap / total, 1.0))
    # warm-up: kernels and allocator, outside every measurement
    with torch.no_grad():
        model(torch.tensor([plan[0][0][:512]], device=dev), logits_to_keep=1)
    sampler = GpuSampler() if dev.startswith("cuda") else None
    if sampler is not None:
        print(f"compute processes on this GPU (ours included): {sampler.processes()}")
    results = []
    profiles: list[str] = []
    names = args.configs.split(",")
    first_kvtier = next((i for i, n in enumerate(names) if n.startswith("kvtier")), len(names))
    if any(not n.startswith("kvtier") for n in names[first_kvtier:]):
        print(
            "warning: kvtier's L1 pool keeps its GPU memory after its cache closes (it lives as "
            "long as the process); configurations after the first kvtier one have less. List "
            "the kvtier configurations last.",
            flush=True,
        )
    for name in names:
        if name == "offloaded" and not dev.startswith("cuda"):
            print("offloaded: skipped (transformers' offloading needs CUDA streams)")
            continue
        res = Result(name)
        free = shutil.disk_usage(tmp).free
        print(f"{name}: {free / 1e9:.0f} GB free in the L3 directory's file system", flush=True)
        codec = "int8" if name.endswith("int8") else "native"
        policy = "write_back" if name.endswith("-wb") else "write_through"
        writer = "threads" if name.endswith("-threads") else "auto"
        try:
            runner = Runner(
                name,
                model,
                dev,
                args.decode_tokens,
                kv_budget,
                tmp,
                codec,
                policy,
                writer,
                sync_stream=args.sync == "stream",
                sampler=sampler,
            )
        except Exception as exc:  # report it and go on with the other configurations
            print(f"{name}: could not start: {type(exc).__name__}: {exc}", flush=True)
            continue
        try:
            runner.run(plan, res, args.time_limit)
            if args.profile:
                profiles.append(runner.profile_turn(plan, 32))
                if args.out:  # as it goes: a run cut short keeps what it has
                    Path(args.out).mkdir(parents=True, exist_ok=True)
                    (Path(args.out) / "profiles.txt").write_text("\n".join(profiles))
        finally:
            runner.close()
        results.append(res)
        l3 = f", L3 {res.l3_written / 1e9:.2f} GB written, {res.l3_lost}" if res.l3_lost else ""
        print(
            f"{name}: {res.turns} turns in {res.wall:.1f}s, {res.ooms} OOM, step P50 "
            f"{pct(res.steps, 0.5) * 1e3:.1f} ms{l3}",
            flush=True,
        )
        print("\n".join(diagnostics(res)), flush=True)

    attempted = args.sessions * args.turns
    print(
        f"\nAgent fleet — {shape} {dtype}, {args.sessions} sessions x {args.turns} turns "
        f"({attempted} turns), KV cap for {args.fit_sessions} sessions "
        f"({kv_budget / 2**30:.1f} GiB), {torch.cuda.get_device_name() if dev.startswith('cuda') else 'CPU'}"
        + (f"; {gpu_cap}" if gpu_cap else "")
    )
    hdr = (
        f"{'config':>12} {'turns':>6} {'OOM':>4} {'TTFT p50':>9} {'TTFT p99':>9} "
        f"{'step p50':>9} {'step p99':>9} {'peak GiB':>9} {'tok/s':>7}  restores"
    )
    print(hdr)
    for r in results:
        dec = ",".join(f"{k}={v}" for k, v in sorted(r.decisions.items()) if v)
        print(
            f"{r.name:>12} {r.turns:>6} {r.ooms:>4} {pct(r.ttft_return, 0.5) * 1e3:9.1f} "
            f"{pct(r.ttft_return, 0.99) * 1e3:9.1f} {pct(r.steps, 0.5) * 1e3:9.2f} "
            f"{pct(r.steps, 0.99) * 1e3:9.2f} {r.peak_bytes / 2**30:9.2f} "
            f"{r.generated / max(r.wall, 1e-9):7.1f}  {dec}"
        )
    print("returning turns: time inside restore() P50/P99 ms, TTFT minus restore P50/P99 ms:")
    for r in results:
        if r.restore_s:
            rest = [t - s for t, s in zip(r.ttft_return, r.restore_s, strict=False)]
            print(
                f"{r.name:>12} restore {pct(r.restore_s, 0.5) * 1e3:.1f}/"
                f"{pct(r.restore_s, 0.99) * 1e3:.1f}  forward {pct(rest, 0.5) * 1e3:.1f}/"
                f"{pct(rest, 0.99) * 1e3:.1f}"
            )
    print("seconds per phase, allocator retries and cudaMalloc+cudaFree calls (torch), L1 OOM")
    print("retries (kvtier):")
    for r in results:
        ph = " ".join(f"{k}={v:.1f}" for k, v in r.phases.items())
        print(
            f"{r.name:>12} wall={r.wall:.1f} {ph} alloc_retries={r.alloc_retries} "
            f"mallocs={r.device_mallocs} l1_oom={r.l1_oom}"
            + (f" l3_GB={r.l3_written / 1e9:.2f} {r.l3_lost}" if r.l3_lost else "")
        )
    print(DIAGNOSTICS_HELP)
    for r in results:
        print("\n".join(diagnostics(r)))
    for r in results:
        for line in r.oom_info[:3]:
            print(f"{r.name:>12} OOM at: {line}")
    base = {r.name: r for r in results if not r.name.startswith("kvtier")}
    if "recompute" in base and "dynamic" in base and base["dynamic"].ttft_return:
        # all KV on the GPU restores nothing: its TTFT is the forward alone, the floor for any cache
        ratio = pct(base["recompute"].ttft_return, 0.99) / pct(base["dynamic"].ttft_return, 0.99)
        print(f"TTFT p99 recompute / dynamic = {ratio:.2f} (about the most a cache can reach)")
    for i, r in enumerate(results):  # every kvtier row, a configuration run twice included
        if not r.name.startswith("kvtier"):
            continue
        if "recompute" in base:
            ratio = pct(base["recompute"].ttft_return, 0.99) / pct(r.ttft_return, 0.99)
            print(f"TTFT p99 recompute / {r.name} (row {i + 1}) = {ratio:.2f} (target >= 3)")
        if "dynamic" in base:
            ratio = pct(r.steps, 0.99) / pct(base["dynamic"].steps, 0.99)
            print(f"step p99 {r.name} (row {i + 1}) / dynamic = {ratio:.3f} (target <= 1.1)")
    if profiles and not args.out:
        print("\n".join(profiles))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        if profiles:
            (out / "profiles.txt").write_text("\n".join(profiles))
        plot(results, out / "agent_fleet.png")
        (out / "agent_fleet.json").write_text(
            json.dumps(
                [
                    {k: v for k, v in r.__dict__.items() if k not in ("memory",)}
                    | {
                        "ttft_return_p50": pct(r.ttft_return, 0.5),
                        "ttft_return_p99": pct(r.ttft_return, 0.99),
                        "step_p50": pct(r.steps, 0.5),
                        "step_p99": pct(r.steps, 0.99),
                    }
                    for r in results
                ],
                default=str,
            )
        )


if __name__ == "__main__":
    main()
