"""A cache that commits turns through a page pool, then idles until killed (for the crash test).

Run as `python cache_crash_proc.py ROOT SESSIONS [BOUND_S]`. Every session commits two turns
(each turn's chunks go from the pool to L2, their L3 writes queued, and its record saved); the
L3 write queue holds one write, so most writes are shed. Prints `committed` once every turn is
in, then sleeps: the parent kills it with SIGKILL once the bound has passed.
"""

from __future__ import annotations

import sys
import time

import torch
from conftest import tiny_llama

from kvtier import CacheConfig, TieredCache
from kvtier.geometry import KVGeometry
from kvtier.integrations.hf import cache_kwarg
from kvtier.paged import PagePool


def main() -> None:
    root, sessions = sys.argv[1], int(sys.argv[2])
    extra = {"l3_write_bound_s": float(sys.argv[3])} if len(sys.argv) > 3 else {}
    model = tiny_llama()
    cache = TieredCache(
        CacheConfig(
            l3_root=root,
            l1_bytes=8 << 20,
            l2_bytes=16 << 20,
            chunk_tokens=16,
            cost_model=False,
            pin_memory=False,
            l3_writer="threads",
            l3_write_queue=1,  # one write queued: the rest of a turn's writes are shed
            **extra,
        ),
        model,
    )
    g = KVGeometry.from_config(model.config)
    pool = PagePool(g, 4096 * g.bytes_per_token, page_size=4, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    for turn in range(2):
        for i in range(sessions):
            ids = torch.randint(1, 250, (1, 60 * (turn + 1) + i), generator=gen)
            s = cache.session(f"s{i}", tenant="t")
            pkv = s.restore(ids, pool=pool)
            with torch.no_grad():
                model(ids[:, pkv.get_seq_length() :], **{cache_kwarg(model): pkv})
            s.commit(ids)
    print("committed", flush=True)
    time.sleep(3600)


if __name__ == "__main__":
    main()
