"""TTFT of a returning session restored from L1, L2, L3, or recomputed (issue: TieredCache).

For each context length it runs one session's turn, then measures the next turn's time to
first token with the prefix in each tier (forced: cost model off), and once more with the cost
model on (what kvtier actually does). The ceiling is recompute: restore must win against it.

    python3 bench/ttft.py --device cuda --shape qwen2-7b --contexts 2048,8192
    python3 bench/ttft.py --device cpu --shape qwen2-mini --contexts 2048
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from models import build, sync

from kvtier import CacheConfig, TieredCache

SPLIT: dict[str, list[float]] = {}  # "ctx/source" -> seconds in restore() (synced), per turn


def first_token(model, session, ids, device) -> tuple[float, int, str]:
    """Seconds from restore() to the first generated token id on the host."""
    sync(device)
    t0 = time.perf_counter()
    pkv = session.restore(ids)
    restored = pkv.get_seq_length()
    sync(device)  # (the forward would wait for the restore's copies anyway)
    SPLIT.setdefault(f"{ids.shape[1]}/{session.restore_source}", []).append(
        time.perf_counter() - t0
    )
    with torch.no_grad():
        logits = model(ids[:, restored:], past_key_values=pkv, logits_to_keep=1).logits
    tok = int(logits[0, -1].argmax())
    dt = time.perf_counter() - t0
    session.commit(torch.cat([ids[0], torch.tensor([tok], device=ids.device)]))
    return dt, restored, session.restore_source


def drop_page_cache(root: Path) -> None:
    for f in root.rglob("*.kvbin"):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def measure(model, ctx: int, device: str, root: Path, cost_model: bool, reps: int) -> dict:
    geometry_bytes = None
    out: dict[str, list[float]] = {"l1": [], "l2": [], "l3": [], "recompute": []}
    chosen: dict[str, list[str]] = {"l1": [], "l2": [], "l3": []}
    for rep in range(reps):
        cfg = CacheConfig(
            l3_root=root / f"c{ctx}-{rep}-{int(cost_model)}",
            l1_bytes=None,
            l2_bytes=max(2 << 30, 3 * ctx * 60_000),
            chunk_tokens=256,
            cost_model=cost_model,
        )
        cache = TieredCache(cfg, model)
        geometry_bytes = cache.geometry.bytes_per_token
        g = torch.Generator().manual_seed(rep)
        ids = torch.randint(10, 30000, (1, ctx), generator=g).to(device)
        s = cache.session("bench", tenant="t")
        dt, _, _ = first_token(model, s, ids, device)
        out["recompute"].append(dt)
        nxt = torch.randint(10, 30000, (1, 1), generator=g).to(device)
        ids = torch.cat([ids, nxt], dim=1)
        # L1: the session is still resident.
        dt, _, src = first_token(model, s, ids, device)
        out["l1"].append(dt)
        chosen["l1"].append(src)
        for tier in ("l2", "l3"):
            s.hibernate()
            if tier == "l3":
                cache.evict_l2()
                drop_page_cache(Path(cfg.l3_root))
            ids = torch.cat([ids, torch.randint(10, 30000, (1, 1), generator=g).to(device)], 1)
            dt, _restored, src = first_token(model, s, ids, device)
            out[tier].append(dt)
            chosen[tier].append(src)
        cache.close()
    res = {k: statistics.median(v) for k, v in out.items()}
    return {"ctx": ctx, "ttft": res, "chosen": chosen, "bytes": geometry_bytes * ctx}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shape", default=None)
    ap.add_argument("--contexts", default="2048,8192")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=None, help="L3 directory (default: a temp dir)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    device = args.device
    shape = args.shape or ("qwen2-7b" if device.startswith("cuda") else "qwen2-mini")
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model = build(shape, device, dtype)
    root = Path(args.dir or tempfile.mkdtemp(prefix="kvtier-ttft-"))
    # warm-up (kernels, allocator)
    measure(model, 512, device, root / "warm", False, 1)
    rows = []
    for ctx in [int(c) for c in args.contexts.split(",")]:
        forced = measure(model, ctx, device, root, False, args.reps)
        auto = measure(model, ctx, device, root, True, args.reps)
        rows.append({"ctx": ctx, "forced": forced, "auto": auto})
    name = torch.cuda.get_device_name() if device.startswith("cuda") else "CPU"
    print(f"\nTTFT of a returning session — {shape}, {dtype}, {name}")
    print(
        f"{'ctx':>6} {'source':>10} {'TTFT ms':>9} {'recompute ms':>13} {'ratio':>7}  cost model chose"
    )
    for r in rows:
        f, a = r["forced"], r["auto"]
        rec = f["ttft"]["recompute"]
        for src in ("l1", "l2", "l3"):
            t = f["ttft"][src]
            print(
                f"{r['ctx']:>6} {src:>10} {t * 1e3:9.1f} {rec * 1e3:13.1f} {t / rec:7.3f}  "
                f"{a['ttft'][src] * 1e3:7.1f} ms via {','.join(sorted(set(a['chosen'][src])))} "
                f"({a['ttft'][src] / a['ttft']['recompute']:.3f} x recompute)"
            )
    print("\ntime inside restore() (median ms), by context and restore source:")
    for key, values in sorted(SPLIT.items(), key=lambda kv: (int(kv[0].split("/")[0]), kv[0])):
        print(f"  {key:>16}: {statistics.median(values) * 1e3:7.1f} ms over {len(values)} turns")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
