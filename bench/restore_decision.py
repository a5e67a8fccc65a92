"""The restore decision of a stored session after a restart, against a fresh tenant's.

After a restart, a session's first turn asks the cache where its prefix is: its stored record,
every chunk's key hashed and looked up, the cost model. A fresh tenant's turn asks the same
question of an empty store. When the cost model picks recompute (as on a GPU, where a small
model prefills faster than L3 reads), everything after the decision is the same for both, so
this is the whole of the cache's own cost on the first request after a restart (the
core-hardening target: at most 1.05 x recompute). The model is a tiny random Qwen2 on the CPU:
the decision is host work and does not depend on the model's size, only on the prompt's length.

    PYTHONPATH=. python3 bench/restore_decision.py [--tokens 2048] [--repeat 5]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from models import build

from kvtier.server.backend import TieredBackend
from kvtier.server.config import ServerConfig
from kvtier.server.pages.pagecopy import append_kv


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2048, help="the stored session's length")
    ap.add_argument("--repeat", type=int, default=5, help="restarts (median reported)")
    args = ap.parse_args()
    model = build("qwen2-tiny", "cpu", torch.float32)
    layers, dim = model.config.num_hidden_layers, 16  # head_dim = 64 / 4
    rng = random.Random(0)
    ctx = [rng.randrange(32, 127) for _ in range(args.tokens)]
    with tempfile.TemporaryDirectory(prefix="kvtier-decision-") as tmp:
        settings = ServerConfig(l3_root=Path(tmp), l1_bytes=2**28, l2_bytes=2**28)
        backend = TieredBackend(model, settings, model_id="bench-decision")
        restored = backend.restore("stored", "t", torch.tensor([ctx]))
        n = len(ctx) - restored.covered
        append_kv(restored.kv, [(torch.randn(1, 2, n, dim), torch.randn(1, 2, n, dim))] * layers)
        backend.commit("stored", "t", torch.tensor(ctx))
        backend.close()  # the session is durable in L3 now: a restart finds it
        want = torch.tensor([[*ctx, 65, 66, 67]])
        stored_s, fresh_s, sources = [], [], set()
        for cycle in range(args.repeat):
            backend = TieredBackend(model, settings, model_id="bench-decision")
            # as on a GPU with a small model: a prefill is cheaper than an L3 read
            backend.cache.cost.observe_prefill(args.tokens, 0.0005)
            t0 = time.perf_counter()
            r = backend.restore("stored", "t", want)
            stored_s.append(time.perf_counter() - t0)
            sources.add(r.source)
            backend.abort("stored", "t")
            t0 = time.perf_counter()
            backend.restore(f"fresh-{cycle}", "u", want)
            fresh_s.append(time.perf_counter() - t0)
            backend.abort(f"fresh-{cycle}", "u")
            backend.close()
    s, f = statistics.median(stored_s), statistics.median(fresh_s)
    print(f"\nrestore decision, {args.tokens}-token prompt, first request after a restart, CPU")
    print(f"{'figure':<52}{'ms':>8}{'ceiling':>10}{'ratio':>8}")
    print(
        f"{'stored session (source: ' + ', '.join(sorted(sources)) + ')':<52}{s * 1e3:>8.2f}",
        end="",
    )
    print(f"{f * 1e3:>8.2f}ms{f / s:>8.2f}")
    print(f"{'fresh tenant (the ceiling: nothing to look up)':<52}{f * 1e3:>8.2f}")
    print(
        f"(medians of {args.repeat} restarts; the stored session pays {(s - f) * 1e3:.2f} ms more)"
    )


if __name__ == "__main__":
    main()
