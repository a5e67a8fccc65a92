"""Writer process for the crash test: puts chunks forever, printing each one once durable.

Run as `python l3_crash_writer.py ROOT SEED`. Lines: `P <key hex> <size>` after put returned,
`S <session id> <key hex>,...` after save_session returned.
"""

from __future__ import annotations

import random
import sys
import time

from l3_helpers import FP, header, payload_for

from kvtier.tiers.l3 import L3Store, SessionRecord


def main() -> None:
    root, seed = sys.argv[1], int(sys.argv[2])
    rng = random.Random(seed)
    store = L3Store(root, checksum="crc32" if seed % 2 else "crc32c")
    recent: list[str] = []
    n = 0
    while True:
        batch = [
            header(key=rng.randbytes(16), size=rng.randint(1, 400_000))
            for _ in range(rng.choice((1, 1, 3)))
        ]
        store.put_many([(h, payload_for(h.key, h.payload_len)) for h in batch])
        for h in batch:
            print(f"P {h.key.hex()} {h.payload_len}", flush=True)
            recent.append(h.key.hex())
        n += 1
        if n % 4 == 0:
            sid = f"s/{seed}/{n}"
            keys = tuple(bytes.fromhex(k) for k in recent[-5:])
            store.save_session(
                SessionRecord(
                    sid, "tenant", FP, b"\x00" * 8, keys, False, None, time.time(), "hibernated"
                )
            )
            print(f"S {sid} {','.join(recent[-5:])}", flush=True)


if __name__ == "__main__":
    main()
