"""The two ways to run one model's layers on two GPUs, compared on dense batched decode.

- *device map*: one process, the decoder layers split by `kvtier.placement.PlacedModel`, the
  hidden states hopping devices between stages (what `kvtier serve --devices` runs);
- *pipeline*: one process per GPU over torch.distributed (NCCL; gloo on the CPU), each holding
  half the layers; rank 0 embeds and runs the first half and sends the hidden states, rank 1
  runs the second half, the head and greedy sampling and sends the tokens back. With 2
  micro-batches the two stages work on different halves of the batch at once.

Every variant decodes the same batch (same weights, same prompts) with transformers'
DynamicCache, so only the placement differs; tokens/s are over the decode steps.

    python bench/pipeline_nccl.py [--quick]          # two GPUs
    python bench/pipeline_nccl.py --device cpu       # smoke run, two CPU processes (gloo)
"""

from __future__ import annotations

import argparse
import os
import socket
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SHAPES = {
    "full": dict(layers=32, hidden=4096, inter=14336, heads=32, kv_heads=8),
    "quick": dict(layers=16, hidden=2048, inter=5632, heads=16, kv_heads=4),
    "cpu": dict(layers=4, hidden=64, inter=128, heads=4, kv_heads=2),
}
RUNS = {  # batch, prompt tokens, decode steps
    "full": dict(batch=64, prompt=512, steps=64),
    "quick": dict(batch=32, prompt=256, steps=32),
    "cpu": dict(batch=4, prompt=16, steps=8),
}


def _model(shape: dict[str, int], device: torch.device) -> Any:
    from multi_gpu import build_model

    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    return build_model(shape, device, dtype, seed=0)


def _prompt(run: dict[str, int], device: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(5)
    return torch.randint(32, 127, (run["batch"], run["prompt"]), generator=g).to(device)


def _sync(devices: list[torch.device]) -> None:
    for d in devices:
        if d.type == "cuda":
            torch.cuda.synchronize(d)


def _layer(layer: Any, h: torch.Tensor, pos: torch.Tensor, emb: Any, cache: Any) -> torch.Tensor:
    out = layer(
        h,
        attention_mask=None,  # SDPA: causal for a prompt, nothing to mask for one new token
        position_ids=pos,
        past_key_values=cache,
        use_cache=True,
        cache_position=pos[0],
        position_embeddings=emb,
    )
    return out[0] if isinstance(out, tuple) else out


# ---- one process (1 device, or the device map) -------------------------------------------------


def in_process(shape: dict[str, int], run: dict[str, int], devices: list[torch.device]) -> dict:
    from transformers import DynamicCache

    from kvtier.placement import PlacedModel, Placement

    model = _model(shape, devices[0])
    if len(devices) > 1:
        PlacedModel(model, Placement.balanced(shape["layers"], devices))
    ids = _prompt(run, devices[0])
    cache = DynamicCache(config=model.config)
    tokens = []
    with torch.inference_mode():
        logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1]
        _sync(devices)
        t0 = time.perf_counter()
        for _ in range(run["steps"]):
            tok = logits.argmax(-1, keepdim=True)
            tokens.append(tok)
            logits = model(input_ids=tok, past_key_values=cache, use_cache=True).logits[:, -1]
        _sync(devices)
        dt = time.perf_counter() - t0
    return {
        "tok_s": run["batch"] * run["steps"] / dt,
        "tokens": torch.cat(tokens, 1).cpu().tolist(),
    }


# ---- two processes over torch.distributed ------------------------------------------------------


def _stage(rank: int, port: int, shape: dict, run: dict, micro: int, cpu: bool, out: Any) -> None:
    from transformers import DynamicCache

    backend = "gloo" if cpu else "nccl"
    dev = torch.device("cpu") if cpu else torch.device("cuda", rank)
    if not cpu:
        torch.cuda.set_device(dev)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(backend, rank=rank, world_size=2)
    # one group per direction: each has its own NCCL stream, so a send of hidden states never
    # waits behind a token's receive (one communicator would deadlock with 2 micro-batches)
    fwd, bwd = dist.new_group([0, 1]), dist.new_group([0, 1])
    pending: list[Any] = []  # sends in flight (their tensors must live until done)
    try:
        model = _model(shape, dev)
        base = model.model
        half = shape["layers"] // 2
        mine = list(base.layers)[:half] if rank == 0 else list(base.layers)[half:]
        base.layers = torch.nn.ModuleList(mine)  # the other half's weights are freed
        if not cpu:
            torch.cuda.empty_cache()
        ids = _prompt(run, dev)
        size = run["batch"] // micro
        caches = [DynamicCache(config=model.config) for _ in range(micro)]
        hidden = shape["hidden"]
        dtype = next(model.parameters()).dtype
        toks: list[list[torch.Tensor]] = [[] for _ in range(micro)]

        def step(m: int, x: torch.Tensor | None, n: int, start: int) -> None:
            pos = torch.arange(start, start + n, device=dev).unsqueeze(0)
            h = torch.empty(size, n, hidden, dtype=dtype, device=dev)
            if rank == 0:
                assert x is not None
                h = base.embed_tokens(x)
            else:
                dist.recv(h, src=0, group=fwd)
            emb = base.rotary_emb(h, pos)
            for layer in base.layers:
                h = _layer(layer, h, pos, emb, caches[m])
            if rank == 0:
                h = h.contiguous()
                pending.append((h, dist.isend(h, dst=1, group=fwd)))
            else:
                tok = model.lm_head(base.norm(h[:, -1:])).argmax(-1).contiguous()
                pending.append((tok, dist.isend(tok, dst=0, group=bwd)))

        def token(m: int) -> torch.Tensor:
            tok = torch.empty(size, 1, dtype=torch.long, device=dev)
            dist.recv(tok, src=1, group=bwd)
            toks[m].append(tok)
            return tok

        with torch.inference_mode():
            p = run["prompt"]
            for m in range(micro):  # the prompts
                step(m, ids[m * size : (m + 1) * size] if rank == 0 else None, p, 0)
            first = [token(m) for m in range(micro)] if rank == 0 else []
            _sync([dev])
            dist.barrier()
            t0 = time.perf_counter()
            for s in range(run["steps"]):
                for m in range(micro):  # rank 0 runs one micro-batch while rank 1 runs the other
                    x = (first[m] if s == 0 else token(m)) if rank == 0 else None
                    step(m, x, 1, p + s)
            if rank == 0:
                for m in range(micro):
                    token(m)
            for _, work in pending:
                work.wait()
            _sync([dev])
            dt = time.perf_counter() - t0
        if rank == 0:
            got = [torch.cat(t[: run["steps"]], 1) for t in toks]
            out.put({"tok_s": run["batch"] * run["steps"] / dt,
                     "tokens": torch.cat(got, 0).cpu().tolist()})  # fmt: skip
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pipeline(shape: dict, run: dict, micro: int, cpu: bool) -> dict:
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    mp.spawn(_stage, args=(_free_port(), shape, run, micro, cpu, out), nprocs=2, join=True)
    result: dict = out.get()
    return result


def compare(size: str, devices: list[torch.device]) -> dict[str, dict]:
    shape, run = SHAPES[size], RUNS[size]
    cpu = devices[0].type == "cpu"
    res = {"1 device": in_process(shape, run, devices[:1])}
    _release(devices)
    res["device map, 2 devices"] = in_process(shape, run, devices)
    _release(devices)  # the children need the GPUs' memory
    res["pipeline, 2 processes"] = pipeline(shape, run, 1, cpu)
    res["pipeline, 2 micro-batches"] = pipeline(shape, run, 2, cpu)
    return res


def _release(devices: list[torch.device]) -> None:
    """Free the last variant's model (its placement hooks make a reference cycle)."""
    import gc

    gc.collect()
    if devices[0].type == "cuda":
        torch.cuda.empty_cache()


def report(res: dict[str, dict], run: dict) -> None:
    base = res["1 device"]
    print(
        f"\ndense decode, batch {run['batch']}, {run['prompt']}-token prompts, {run['steps']} steps"
    )
    print(f"{'variant':28} {'tok/s':>10} {'vs 1 device':>12}  tokens = 1 device")
    for name, r in res.items():
        same = sum(a == b for a, b in zip(r["tokens"], base["tokens"], strict=True))
        print(f"{name:28} {r['tok_s']:10.1f} {r['tok_s'] / base['tok_s']:11.2f}x  "
              f"{same}/{len(base['tokens'])} rows")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.device == "cpu":
        size, devices = "cpu", [torch.device("cpu")] * 2
    else:
        size, devices = (
            ("quick" if args.quick else "full"),
            [torch.device("cuda", i) for i in (0, 1)],
        )
    res = compare(size, devices)
    report(res, RUNS[size])


if __name__ == "__main__":
    main()
