"""What a new sequence length costs each SDPA backend: the host time of one attention call.

A served session meets a new key length at almost every call: each decode step adds a token, and
each returning turn adds its new tokens to a cached prefix of any length. PyTorch's cuDNN
attention backend builds an execution plan per distinct shape and caches it; flash and
memory-efficient attention need no plan. This bench times one decode-shaped call (one query
token, Qwen2-7B's 28 query / 4 KV heads of 128, bf16) per backend:

  new    at key lengths this process has not seen (first call of each length)
  seen   at the same lengths again (the plan, where there is one, is cached)

and prints the host time per call (until the call returns) and the wall time per call (until
the GPU is done), with the ratio new/seen. The ceiling is the fastest backend's "seen" wall time.

    python3 bench/attention_shapes.py               # on a CUDA GPU
    python3 bench/attention_shapes.py --lengths 64 --start 1500
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = {
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
}


def time_calls(backend: SDPBackend, lengths: list[int], heads: int, kv_heads: int, dim: int):
    """Per call: (host seconds until SDPA returns, wall seconds until the GPU is done)."""
    host, wall = [], []
    q = torch.randn(1, heads, 1, dim, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(2, 1, kv_heads, max(lengths), dim, device="cuda", dtype=torch.bfloat16)
    rep = heads // kv_heads
    with sdpa_kernel([backend]):
        for n in lengths:
            # transformers expands the KV heads for SDPA backends without GQA (repeat_kv)
            k = kv[0, :, :, :n].repeat_interleave(rep, dim=1)
            v = kv[1, :, :, :n].repeat_interleave(rep, dim=1)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            F.scaled_dot_product_attention(q, k, v)
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            host.append(t1 - t0)
            wall.append(time.perf_counter() - t0)
    return host, wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--lengths", type=int, default=200, help="distinct key lengths per backend")
    ap.add_argument("--start", type=int, default=2000, help="first key length")
    ap.add_argument("--heads", type=int, default=28)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("attention_shapes: needs a CUDA GPU (the backends compared are CUDA's)")
    rows = []
    for i, (name, backend) in enumerate(BACKENDS.items()):
        # each backend gets lengths no backend has used, so nothing is cached for it
        base = args.start + i * 10 * args.lengths
        lengths = list(range(base, base + args.lengths))
        warm = [base - 1]  # load the kernels once, at a length outside the measured ones
        try:
            time_calls(backend, warm, args.heads, args.kv_heads, args.head_dim)
        except RuntimeError as exc:
            print(f"{name}: not available here ({str(exc).splitlines()[0]})")
            continue
        new = time_calls(backend, lengths, args.heads, args.kv_heads, args.head_dim)
        seen = time_calls(backend, lengths, args.heads, args.kv_heads, args.head_dim)
        rows.append((name, [statistics.median(x) for x in (*new, *seen)]))
    if not rows:
        raise SystemExit("attention_shapes: no SDPA backend ran")
    ceiling = min(r[1][3] for r in rows)
    print(
        f"SDPA, 1 query token, {args.heads}/{args.kv_heads} heads of {args.head_dim}, bf16, "
        f"{args.lengths} key lengths from {args.start}, {torch.cuda.get_device_name()}; "
        "medians, microseconds"
    )
    print(
        f"{'backend':>10} {'host new':>9} {'host seen':>10} {'new/seen':>9} {'wall new':>9} "
        f"{'wall seen':>10} {'ceiling':>8} {'new/ceil':>9}"
    )
    for name, (hn, wn, hs, ws) in rows:
        print(
            f"{name:>10} {hn * 1e6:9.1f} {hs * 1e6:10.1f} {hn / hs:9.1f} {wn * 1e6:9.1f} "
            f"{ws * 1e6:10.1f} {ceiling * 1e6:8.1f} {wn / ceiling:9.1f}"
        )


if __name__ == "__main__":
    main()
