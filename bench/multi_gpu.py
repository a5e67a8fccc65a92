"""Layers across GPUs: transfer bandwidth, batched decode and device failover, 2 devices vs 1.

In one run, on a host with two GPUs (`--devices 0,1`):

1. *transfer*: the KV page pool's offload (pages -> pinned host, chunk layout) and restore
   (pinned host -> pages) in GB/s, with every layer on one device and with the layers split
   over two (each device moves its own layers over its own link, on its own stream);
2. *decode*: the batch scheduler (the server's) decoding a fleet of sessions, tokens/s with the
   model on one device and with its layers across two; the replies must be the same;
3. *failover*: sessions through the tiered cache on the two devices; in the middle of a batched
   turn a fault is injected on device 1 (its weights are overwritten with NaN at that moment, as
   a lost GPU's memory is worth nothing). Measured: the time from the fault to the first token
   served again, the failover itself (drain, reload the layers from host memory, rebuild the
   page pool), sessions lost, and whether the resumed turns' tokens equal those of the same
   conversations run without a fault; then device 1 is restored and the next turns compared.

Runs with torch and transformers (no server packages: no fastapi/uvicorn). The model is a
Llama of the given shape with seeded random weights, built on the GPU (no download).

    python bench/multi_gpu.py                    # Llama-3-8B shape, about 3 minutes on 2 H200s
    python bench/multi_gpu.py --quick            # a smaller model and fleet, under a minute
    python bench/multi_gpu.py --device cpu --quick   # CPU smoke run on two logical devices
    python bench/multi_gpu.py --layout replicas      # only the replicas section

With `--layout replicas` or `both` (the default) it first measures data-parallel replicas (one
engine per device, sharing L2/L3; bench/multi_gpu_replicas.py): the batched fleet on one device
vs two replicas with twice the sessions, and losing replica 0 mid-turn.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import multi_gpu_replicas as replicas
import torch

from kvtier.geometry import KVGeometry
from kvtier.paged import PagedSequence
from kvtier.paged.sharded import ShardedPagePool
from kvtier.placement import Placement, parse_devices
from kvtier.server.backend import RecomputeBackend, TieredBackend
from kvtier.server.batch.batching import BatchScheduler
from kvtier.server.batch.jobs import Delta, Finished, Job, Stream
from kvtier.server.config import ServerConfig
from kvtier.server.devices.failover import place
from kvtier.server.devices.memplan import page_size
from kvtier.server.devices.model import ServedModel, byte_tokenizer

SHAPES: dict[str, dict[str, int]] = {
    "full": dict(layers=32, hidden=4096, inter=14336, heads=32, kv_heads=8),  # Llama-3-8B
    "quick": dict(layers=16, hidden=2048, inter=5632, heads=16, kv_heads=4),
    "cpu": dict(layers=4, hidden=64, inter=128, heads=4, kv_heads=2),
}
FLEETS: dict[str, dict[str, int]] = {  # sessions, prompt tokens, reply tokens, transfer tokens
    "full": dict(sessions=64, prompt=1024, tokens=128, xfer=16384, fo_sessions=16),
    "quick": dict(sessions=32, prompt=512, tokens=64, xfer=8192, fo_sessions=8),
    "cpu": dict(sessions=4, prompt=48, tokens=8, xfer=512, fo_sessions=3),
}
CONTEXT = 4096


def build_model(shape: dict[str, int], device: torch.device, dtype: torch.dtype, seed: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=257,
        hidden_size=shape["hidden"],
        intermediate_size=shape["inter"],
        num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"],
        max_position_embeddings=CONTEXT,
        bos_token_id=None,
        eos_token_id=256,
        pad_token_id=256,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    return model.eval()


def served_model(model: Any) -> ServedModel:
    """The server's view: byte tokenizer, sampling kept to printable ASCII (a reply's text gives
    back its ids, so a next turn extends the committed tokens)."""
    allowed = torch.zeros(257, dtype=torch.bool)
    allowed[32:127] = True
    allowed[10] = True
    device = next(model.parameters()).device
    return ServedModel(
        model, byte_tokenizer(), CONTEXT, frozenset(), allowed.to(device), "bench-multi-gpu"
    )


def sync(devices: list[torch.device]) -> None:
    for d in devices:
        if d.type == "cuda":
            torch.cuda.synchronize(d)


# ---- 1. transfer --------------------------------------------------------------------------------


def transfer(geo: KVGeometry, devices: list[torch.device], tokens: int, reps: int) -> dict:
    """Offload and restore GB/s of `tokens` tokens (every layer) over `devices`."""
    dtype = geo.torch_dtype()
    size = page_size(devices[0], dtype)
    element = torch.empty((), dtype=dtype).element_size()
    per_token = geo.num_layers * 2 * geo.num_kv_heads * geo.head_dim * element
    pool = ShardedPagePool(
        geo,
        (tokens + size) * per_token,
        Placement.balanced(geo.num_layers, devices),
        page_size=size,
        dtype=dtype,
    )
    seq = PagedSequence()
    assert pool.reserve(seq, tokens)
    seq.length = tokens
    pin = devices[0].type == "cuda"
    host = torch.empty(
        (geo.num_layers, 2, tokens, geo.num_kv_heads, geo.head_dim), dtype=dtype, pin_memory=pin
    )
    host.fill_(0.5)
    out: dict[str, float] = {}
    for name in ("restore", "offload"):
        times = []
        for _ in range(reps + 1):  # the first one warms up
            sync(devices)
            t0 = time.perf_counter()
            if name == "offload":
                pool.gather(seq.pages, 0, tokens, out=host, non_blocking=True)
            else:
                pool.scatter(seq.pages, 0, host, non_blocking=True)
            pool.synchronize()
            sync(devices)
            times.append(time.perf_counter() - t0)
        out[f"{name}_gbps"] = tokens * per_token / statistics.median(times[1:]) / 1e9
    out["bytes"] = tokens * per_token
    del pool, host
    return out


# ---- 2. the batched fleet ----------------------------------------------------------------------


class Steps:
    """The scheduler's metrics hook: decode-only steps' sequences and seconds."""

    def __init__(self) -> None:
        self.decode_tokens = 0
        self.decode_s = 0.0
        self.decode_only = False

    def watch(self, sched: BatchScheduler) -> None:
        runner = sched.runner
        step = runner.step

        def observed(batch: Any, *feed: Any) -> Any:
            self.decode_only = all(len(item.tokens) == 1 for item in batch)
            return step(batch, *feed)

        runner.step = observed

    def count(self, name: str, n: int = 1) -> None:
        return None

    def ttft(self, source: str, seconds: float) -> None:
        return None

    def step(self, batch_size: int, seconds: float) -> None:
        if self.decode_only:
            self.decode_tokens += batch_size
            self.decode_s += seconds


def config(root: Path, sessions: int, kv_bytes: int, **over: Any) -> ServerConfig:
    base = ServerConfig(
        l3_root=root,
        isolate_cpus=False,
        max_concurrency=sessions,
        batch_tokens=4096,
        prefill_step=1024,
        batch_kv_bytes=kv_bytes,
        queue_timeout=600.0,
    )
    return dataclasses.replace(base, **over)


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(32, 127, (length,), generator=g).tolist() for _ in range(n)]


async def turn(
    sched: BatchScheduler, sid: str, prompt: list[int], tokens: int, on_token: Any = None
) -> tuple[str, str]:
    """One greedy turn; (reply text, how it ended: the finish reason or the error)."""
    stream = Stream(asyncio.get_running_loop())
    job = Job(sid, "bench", tuple(prompt), tokens, temperature=0.0)
    done = asyncio.wrap_future(sched.submit(job, stream, time.perf_counter()))
    text, end = "", "none"
    try:
        async for event in stream.events():
            if isinstance(event, Delta):
                text += event.text
                if on_token is not None:
                    on_token(sid, text)
            elif isinstance(event, Finished):
                end = event.finish_reason
    except Exception as exc:  # a lost session
        end = f"{type(exc).__name__}: {exc}"
    await done
    return text, end


def fleet(sched: BatchScheduler, jobs: list[tuple[str, list[int]]], tokens: int, **kw: Any) -> list:
    async def main() -> list:
        return list(await asyncio.gather(*[turn(sched, s, p, tokens, **kw) for s, p in jobs]))

    return asyncio.run(main())


def decode(served: ServedModel, fl: dict[str, int], kv_bytes: int, root: Path) -> dict:
    steps = Steps()
    cfg = config(root, fl["sessions"], kv_bytes)
    sched = BatchScheduler(served, RecomputeBackend(served.model), cfg, steps)
    try:
        # warm-up: kernels, the pool, the Triton decode kernel's compilation
        fleet(sched, [(f"w{i}", p) for i, p in enumerate(prompts(2, fl["prompt"], 9))], 4)
        steps.watch(sched)
        jobs = [(f"d{i}", p) for i, p in enumerate(prompts(fl["sessions"], fl["prompt"], 1))]
        t0 = time.perf_counter()
        replies = fleet(sched, jobs, fl["tokens"])
        wall = time.perf_counter() - t0
    finally:
        sched.close()
        if served.devices is not None:
            served.devices.scheduler = None  # let its page pool go before the next one
    return {
        "decode_tok_s": steps.decode_tokens / max(steps.decode_s, 1e-9),
        "wall_s": wall,
        "texts": [t for t, _ in replies],
        "pool_pages": sched.pool.num_pages,
    }


# ---- 3. failover -------------------------------------------------------------------------------


def failover(served: ServedModel, fl: dict[str, int], root: Path) -> dict:
    fo = served.devices
    n, tokens = fl["fo_sessions"], fl["tokens"]
    # room for 2n conversations of three turns in L1, L2 and the page pool
    geo = KVGeometry.from_config(served.model.config)
    element = next(served.model.parameters()).element_size()
    per_token = geo.num_layers * 2 * geo.num_kv_heads * geo.head_dim * element
    kv_bytes = 3 * n * (fl["prompt"] + 4 * tokens + 512) * per_token
    cfg = config(root, 2 * n, kv_bytes, l1_bytes=kv_bytes, l2_bytes=kv_bytes, chunk_tokens=256)
    backend = TieredBackend(served.model, cfg, served.name)
    sched = BatchScheduler(served, backend, cfg)
    try:
        first = prompts(n, fl["prompt"], 2)
        # R (reference) and F (failover) sessions hold the same conversations
        t1 = fleet(sched, [(f"{k}{i}", p) for k in "RF" for i, p in enumerate(first)], tokens)
        replies1 = [t for t, _ in t1]
        second = [
            p + list(r.encode()) + [10] + list(b"go on")
            for p, r in zip(first, replies1[:n], strict=True)
        ]
        ref2 = fleet(sched, [(f"R{i}", p) for i, p in enumerate(second)], tokens)

        marks: dict[str, float] = {}

        def on_fault() -> None:  # on the scheduler thread, as the fault is raised
            marks["fault"] = time.perf_counter()
            with torch.no_grad():
                for i in fo.placed.placement.layers_on(1):
                    for p in fo.placed.layers[i].parameters():
                        p.fill_(float("nan"))

        def on_token(sid: str, text: str) -> None:
            if "fault" not in marks and len(text) >= tokens // 4 and not fo.placed._faults:
                fo.placed.inject_fault(1, "bench fault", before=on_fault)
            elif "fault" in marks and "served" not in marks and fo.failovers:
                now = time.perf_counter()
                # a token of a step after the failover (not one queued before the fault)
                if now - marks["fault"] > (fo.last_failover_s or 0.0):
                    marks["served"] = now

        got2 = fleet(sched, [(f"F{i}", p) for i, p in enumerate(second)], tokens, on_token=on_token)
        degraded_pages = sched.pool.num_pages
        lost = sum(1 for _, end in got2 if end not in ("length", "stop"))
        equal2 = sum(1 for (a, _), (b, _) in zip(got2, ref2, strict=True) if a == b)
        t0 = time.perf_counter()
        fo.restore(1).result(timeout=600)
        restore_s = time.perf_counter() - t0
        third = [p + list(r.encode()) + [10] for p, (r, _) in zip(second, ref2, strict=True)]
        t3 = fleet(sched, [(f"{k}{i}", p) for k in "RF" for i, p in enumerate(third)], tokens)
        lost += sum(1 for _, end in t3 if end not in ("length", "stop"))
        equal3 = sum(1 for i in range(n) if t3[i][0] == t3[n + i][0])
    finally:
        sched.close()
        backend.close()
    return {
        "fault_to_token_s": marks.get("served", float("nan")) - marks.get("fault", float("nan")),
        "failover_s": fo.last_failover_s,
        "restore_s": restore_s,
        "sessions": n,
        "sessions_lost": lost,
        "resumed_equal": equal2,
        "next_turn_equal": equal3,
        "history": fo.history,
        "degraded_pages": degraded_pages,
        "pages": sched.pool.num_pages,
        "host_weights_gb": fo.placed.host.nbytes / 1e9,
    }


# ---- the run ------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--devices", default=None, help="two devices (default 0,1; cpu,cpu on CPU)")
    ap.add_argument("--quick", action="store_true", help="a smaller model and fleet")
    ap.add_argument("--reps", type=int, default=5, help="transfer repetitions")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    ap.add_argument(
        "--layout",
        choices=["replicas", "pipeline", "both"],
        default="both",
        help="replicas: one engine per device sharing L2/L3; pipeline: the layers across the "
        "devices (transfer, decode, failover); both (default)",
    )
    args = ap.parse_args()
    cpu = args.device == "cpu"
    devices = parse_devices(args.devices or ("cpu,cpu" if cpu else "0,1"))
    if len(devices) != 2:
        raise SystemExit("--devices: name exactly two devices")
    size = "cpu" if cpu else ("quick" if args.quick else "full")
    shape, fl = SHAPES[size], dict(FLEETS[size])
    if cpu and not args.quick:
        fl["sessions"] *= 2
    dtype = torch.float32 if cpu else torch.bfloat16
    t0 = time.perf_counter()
    model = build_model(shape, devices[0], dtype, seed=0)
    load_s = time.perf_counter() - t0
    geo = KVGeometry.from_config(model.config, dtype=str(dtype).removeprefix("torch."))
    per_token = geo.num_layers * 2 * geo.num_kv_heads * geo.head_dim * (4 if cpu else 2)
    kv_bytes = fl["sessions"] * (fl["prompt"] + 2 * fl["tokens"] + 512) * per_token * 2
    print(f"model: {shape} {dtype}, built in {load_s:.1f} s; devices {devices}", flush=True)

    res: dict[str, Any] = {"shape": shape, "fleet": fl, "devices": [str(d) for d in devices]}
    root = Path(tempfile.mkdtemp(prefix="kvtier-multi-gpu-"))
    served = served_model(model)
    if args.layout in ("replicas", "both"):  # before the layers are placed across the devices
        res["replicas"] = replicas_section(served, devices, fl, per_token, root / "r")
        print("replicas done", flush=True)
    if args.layout == "replicas":
        replicas.report(res["replicas"])
        _write(args.out, res)
        return
    res["xfer1"] = transfer(geo, devices[:1], fl["xfer"], args.reps)
    res["xfer2"] = transfer(geo, devices, fl["xfer"], args.reps)
    print("transfer done", flush=True)
    res["dec1"] = decode(served, fl, kv_bytes, root / "d1")
    t0 = time.perf_counter()
    place(served, devices)
    res["place_s"] = time.perf_counter() - t0
    res["dec2"] = decode(served, fl, kv_bytes, root / "d2")
    res["decode_equal"] = sum(
        a == b for a, b in zip(res["dec1"]["texts"], res["dec2"]["texts"], strict=True)
    )
    print("decode done", flush=True)
    res["fo"] = failover(served, fl, root / "fo")
    if dtype != torch.float32:
        # bf16 replies of a random model flip at near-ties whenever the batch's kernels round
        # differently (CUDA graphs pad the batch on one device; a resumed turn re-prefills what
        # the decode path computed), so exactness is judged on a float32 model of the quick
        # shape, with the same decode and failover runs.
        del served, model
        gc.collect()
        torch.cuda.empty_cache()
        res["exact"] = exactness(devices, root / "exact")
    report(res)
    if "replicas" in res:
        replicas.report(res["replicas"])
    _write(args.out, res)


def _write(out: Path | None, res: dict[str, Any]) -> None:
    if out is not None:
        for r in (res, res.get("exact", {})):
            for k in ("dec1", "dec2"):
                if k in r:
                    r[k].pop("texts")
        out.write_text(json.dumps(res, indent=2, default=str))


def replicas_section(
    served: ServedModel, devices: list[torch.device], fl: dict[str, int], per_token: int, root: Path
) -> dict[str, Any]:
    """Data-parallel replicas (bench/multi_gpu_replicas.py): the batched fleet on one device
    vs two replicas with twice the sessions, and replica 0 lost mid-turn."""
    n, m = fl["sessions"], 2 * fl["fo_sessions"]
    session = (fl["prompt"] + 4 * fl["tokens"] + 512) * per_token
    kv = n * session * 2  # each device's page pool
    host = 2 * max(n, 2 * m) * session * 2  # L2: every session's turns, with room to spare
    out: dict[str, Any] = {}
    cfg = config(root / "t", n, kv, l2_bytes=host, chunk_tokens=256)
    jobs = prompts(n, fl["prompt"], 1)
    out["throughput"] = replicas.throughput(served, devices, cfg, jobs, fl["tokens"])
    cfg = config(root / "f", 2 * m, kv, l2_bytes=host, chunk_tokens=256)
    jobs = prompts(m, fl["prompt"], 2)
    out["failover"] = replicas.failover(served, devices, cfg, jobs, fl["tokens"])
    return out


def exactness(devices: list[torch.device], root: Path) -> dict[str, Any]:
    """The decode fleet on one device and on two, and the failover, with float32 weights."""
    fl = dict(FLEETS["quick"])
    model = build_model(SHAPES["quick"], devices[0], torch.float32, seed=0)
    served = served_model(model)
    geo = KVGeometry.from_config(model.config, dtype="float32")
    per_token = geo.num_layers * 2 * geo.num_kv_heads * geo.head_dim * 4
    kv_bytes = fl["sessions"] * (fl["prompt"] + 2 * fl["tokens"] + 512) * per_token * 2
    out: dict[str, Any] = {"shape": SHAPES["quick"], "fleet": fl}
    out["dec1"] = decode(served, fl, kv_bytes, root / "d1")
    place(served, devices)
    out["dec2"] = decode(served, fl, kv_bytes, root / "d2")
    out["decode_equal"] = sum(
        a == b for a, b in zip(out["dec1"]["texts"], out["dec2"]["texts"], strict=True)
    )
    out["fo"] = failover(served, fl, root / "fo")
    print("float32 exactness runs done", flush=True)
    return out


def report(r: dict[str, Any]) -> None:
    x1, x2, d1, d2, fo = r["xfer1"], r["xfer2"], r["dec1"], r["dec2"], r["fo"]
    rows = [
        ("offload GB/s (pages -> pinned)", x1["offload_gbps"], x2["offload_gbps"], ">= 1.8x"),
        ("restore GB/s (pinned -> pages)", x1["restore_gbps"], x2["restore_gbps"], ">= 1.8x"),
    ]
    sessions = r["fleet"]["sessions"]
    rows.append((f"decode tok/s ({sessions} sessions)", d1["decode_tok_s"], d2["decode_tok_s"], ""))
    print(f"\n{'metric':40} {'1 device':>12} {'2 devices':>12} {'ratio':>7}  target")
    for name, a, b, target in rows:
        print(f"{name:40} {a:12.2f} {b:12.2f} {b / a:6.2f}x  {target}")
    n = fo["sessions"]
    print(f"{'replies equal, 2 devices vs 1':40} {'':12} {r['decode_equal']:>9}/{len(d1['texts'])}")
    print(f"\nfailover on 2 devices ({n} sessions mid-turn; fault on device 1):")
    print(f"  fault -> first token served again   {fo['fault_to_token_s']:8.3f} s   (target < 5 s)")
    print(f"  failover (drain, reload, pool)      {fo['failover_s']:8.3f} s")
    print(f"  sessions lost                       {fo['sessions_lost']:8d}     (target 0)")
    print(f"  resumed turns equal to no-fault run {fo['resumed_equal']:5d}/{n}")
    print(f"  next turns equal after restore      {fo['next_turn_equal']:5d}/{n}")
    print(f"  device restore (layers back)        {fo['restore_s']:8.3f} s")
    print(f"  page pool pages healthy / degraded  {fo['pages']} / {fo['degraded_pages']}")
    print(f"  states: {' -> '.join(fo['history'])}")
    print(
        f"  placing the model took {r['place_s']:.2f} s; host weight copy {fo['host_weights_gb']:.1f} GB"
    )
    ex = r.get("exact")
    if ex:
        efo, n = ex["fo"], ex["fo"]["sessions"]
        print(
            f"\nexactness, float32 weights ({ex['shape']['layers']} layers, "
            f"{ex['shape']['hidden']} hidden; the bf16 counts above flip at near-ties):"
        )
        print(
            f"  replies equal, 2 devices vs 1       {ex['decode_equal']:5d}/{len(ex['dec1']['texts'])}"
        )
        print(f"  sessions lost in the failover       {efo['sessions_lost']:5d}     (target 0)")
        print(f"  resumed turns equal to no-fault run {efo['resumed_equal']:5d}/{n}")
        print(f"  next turns equal after restore      {efo['next_turn_equal']:5d}/{n}")
        print(f"  fault -> first token served again   {efo['fault_to_token_s']:8.3f} s")


if __name__ == "__main__":
    main()
