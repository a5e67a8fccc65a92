"""Host time per streamed token of a reply (`kvtier.server.decoding.sampling.ReplyText`), by reply length.

The batch scheduler turns every sampled token of every sequence into text on its own thread, so
this cost is paid per sequence per step. The ceiling is one `tokenizer.decode` of one token, the
least a streaming detokenizer can do per token, measured in the same run.

    python3 bench/reply_text.py                       # the server's byte-level tokenizer
    python3 bench/reply_text.py --lengths 64,1024 --stop '</tool>'
"""

from __future__ import annotations

import argparse
import random
import time

from kvtier.server.decoding.sampling import ReplyText
from kvtier.server.devices.model import byte_tokenizer


def per_token(tok, ids: list[int], stop: tuple[str, ...]) -> float:
    """Seconds per `add` over the last quarter of a reply of len(ids) tokens (median of 3)."""
    runs = []
    tail = max(1, len(ids) // 4)
    for _ in range(3):
        reply = ReplyText(tok, {tok.eos_token_id}, stop)
        for t in ids[:-tail]:
            reply.add(t)
        t0 = time.perf_counter()
        for t in ids[-tail:]:
            reply.add(t)
        runs.append((time.perf_counter() - t0) / tail)
    return sorted(runs)[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--lengths", default="64,256,1024,4096", help="reply lengths, in tokens")
    ap.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    args = ap.parse_args()
    tok = byte_tokenizer()
    rng = random.Random(0)
    text_ids = [rng.randrange(32, 127) for _ in range(max(int(n) for n in args.lengths.split(",")))]
    n = 20000
    t0 = time.perf_counter()
    for i in range(n):
        tok.decode(text_ids[i % 100 : i % 100 + 1], skip_special_tokens=True)
    ceiling = (time.perf_counter() - t0) / n
    print(f"{'reply tokens':>12} {'us per token':>13} {'ceiling us':>11} {'ratio':>6}")
    for length in (int(x) for x in args.lengths.split(",")):
        sec = per_token(tok, text_ids[:length], tuple(args.stop))
        print(f"{length:12d} {sec * 1e6:13.1f} {ceiling * 1e6:11.1f} {sec / ceiling:6.2f}")
    print("(ceiling: one tokenizer.decode of one token; the per-token figure is the last quarter")
    print(" of the reply, where a decoder that grows with the reply is slowest)")


if __name__ == "__main__":
    main()
