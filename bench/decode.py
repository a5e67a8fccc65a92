"""Steady decode step time: kvtier's L1 cache vs plain DynamicCache vs transformers' offloading.

The ceiling is plain `DynamicCache` (all KV on the GPU): kvtier's attention reads the same
kind of buffers, so its step must be within a few percent of it.

    python3 bench/decode.py --device cuda --shape qwen2-7b --context 2048 --steps 128
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from models import build, sync
from transformers import DynamicCache

from kvtier import CacheConfig, TieredCache


def decode_steps(model, pkv, ids, steps: int, device: str) -> list[float]:
    with torch.no_grad():
        logits = model(ids, past_key_values=pkv, logits_to_keep=1).logits
        tok = logits[:, -1:].argmax(-1)
        times = []
        for _ in range(steps):
            sync(device)
            t0 = time.perf_counter()
            logits = model(tok, past_key_values=pkv, logits_to_keep=1).logits
            tok = logits[:, -1:].argmax(-1)
            sync(device)
            times.append(time.perf_counter() - t0)
    return times


def offloaded_cache(model):
    try:
        return DynamicCache(config=model.config, offloading=True)
    except TypeError:  # older transformers
        from transformers.cache_utils import OffloadedCache

        return OffloadedCache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shape", default=None)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    device = args.device
    shape = args.shape or ("qwen2-7b" if device.startswith("cuda") else "qwen2-mini")
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model = build(shape, device, dtype)
    ids = torch.randint(10, 30000, (1, args.context)).to(device)
    root = Path(tempfile.mkdtemp(prefix="kvtier-decode-"))
    cache = TieredCache(CacheConfig(l3_root=root, l2_bytes=1 << 30), model)
    results: dict[str, list[float]] = {"dynamic": [], "kvtier": [], "offloaded": []}
    for r in range(args.rounds):  # interleave to share any drift fairly
        results["dynamic"] += decode_steps(model, DynamicCache(), ids, args.steps, device)
        s = cache.session(f"d{r}", tenant="t")
        pkv = s.restore(ids)
        results["kvtier"] += decode_steps(
            model, pkv, ids[:, pkv.get_seq_length() :], args.steps, device
        )
        s.abort()
        s.close()
        if device.startswith("cuda"):  # transformers' offloading needs CUDA streams
            results["offloaded"] += decode_steps(
                model, offloaded_cache(model), ids, args.steps, device
            )
    cache.close()
    base = statistics.median(results["dynamic"])
    name = torch.cuda.get_device_name() if device.startswith("cuda") else "CPU"
    print(f"\nDecode step, {shape} {dtype}, context {args.context}, {name}")
    print(f"{'cache':>12} {'median ms':>10} {'p99 ms':>8} {'speed vs DynamicCache':>22}")
    for k, v in results.items():
        if not v:
            continue
        med = statistics.median(v)
        p99 = sorted(v)[int(0.99 * (len(v) - 1))]
        print(f"{k:>12} {med * 1e3:10.2f} {p99 * 1e3:8.2f} {base / med:22.3f}")


if __name__ == "__main__":
    main()
