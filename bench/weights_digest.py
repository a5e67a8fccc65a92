"""Time `kvtier.weights.weights_digest` on a 7B-shaped model against the device's read ceiling.

The digest joins the model fingerprint once per cache start, so it must stay cheap: the target is
under 1 s for a 7B model on a GPU. The ceiling is one plain `sum` over every weight in the same
run (the least work that reads each byte once).

    python bench/weights_digest.py                  # qwen2-7b on cuda, bf16
    python bench/weights_digest.py --shape qwen2-mini --device cpu
"""

from __future__ import annotations

import argparse
import time

import torch
from models import build, sync

from kvtier.weights import weights_digest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--shape", default="qwen2-7b")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    model = build(args.shape, args.device, dtype)
    weights = list(model.state_dict().values())
    nbytes = sum(t.numel() * t.element_size() for t in weights)

    def ceiling() -> None:
        parts = [t.float().sum() if t.is_floating_point() else t.sum() for t in weights]
        torch.stack([p.float() for p in parts]).cpu()

    digests = set()
    times: dict[str, list[float]] = {"digest": [], "ceiling": []}
    for _ in range(args.reps + 1):  # the first round warms the allocator and kernels
        for name, fn in (
            ("digest", lambda: digests.add(weights_digest(model))),
            ("ceiling", ceiling),
        ):
            sync(args.device)
            t0 = time.perf_counter()
            fn()
            sync(args.device)
            times[name].append(time.perf_counter() - t0)
    digest_s = min(times["digest"][1:])
    ceiling_s = min(times["ceiling"][1:])
    print(
        f"model {args.shape} on {args.device}: {nbytes / 1e9:.2f} GB of weights in {len(weights)} tensors"
    )
    print(f"{'figure':<28}{'seconds':>10}{'GB/s':>10}")
    print(f"{'weights_digest':<28}{digest_s:>10.3f}{nbytes / digest_s / 1e9:>10.1f}")
    print(f"{'ceiling: one sum per tensor':<28}{ceiling_s:>10.3f}{nbytes / ceiling_s / 1e9:>10.1f}")
    print(
        f"ratio digest / ceiling: {digest_s / ceiling_s:.2f}x; target: digest under 1 s -> "
        f"{'met' if digest_s < 1.0 else 'MISSED'}; stable across runs: {len(digests) == 1}"
    )


if __name__ == "__main__":
    main()
