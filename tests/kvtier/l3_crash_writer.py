"""Writer process for the crash test: puts chunks forever, printing each one once durable.

Run as `python l3_crash_writer.py ROOT SEED`. Lines: `P <key hex> <size>` after put returned,
`S <session id> <key hex>,...` after save_session returned. Every third seed also runs two
threads that `put` concurrently, so kills land inside shared (group) commits too.
"""

from __future__ import annotations

import random
import sys
import threading
import time

from l3_helpers import FP, header, payload_for

from kvtier.tiers.l3 import L3Store, SessionRecord

_out = threading.Lock()


def say(line: str) -> None:
    """Print one whole line (writer threads share stdout)."""
    with _out:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def main() -> None:
    root, seed = sys.argv[1], int(sys.argv[2])
    rng = random.Random(seed)
    store = L3Store(root, checksum="crc32" if seed % 2 else "crc32c")
    recent: list[str] = []
    n = 0
    if seed % 3 == 2:
        for t in range(2):
            threading.Thread(target=putter, args=(store, seed * 10 + t), daemon=True).start()
    while True:
        batch = [
            header(key=rng.randbytes(16), size=rng.randint(1, 400_000))
            for _ in range(rng.choice((1, 1, 3)))
        ]
        store.put_many([(h, payload_for(h.key, h.payload_len)) for h in batch])
        for h in batch:
            say(f"P {h.key.hex()} {h.payload_len}")
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
            say(f"S {sid} {','.join(recent[-5:])}")


def putter(store: L3Store, seed: int) -> None:
    """One concurrent writer: single-chunk puts, as the transfer engine's writer threads do."""
    rng = random.Random(seed)
    while True:
        h = header(key=rng.randbytes(16), size=rng.randint(1, 400_000))
        store.put(h, payload_for(h.key, h.payload_len))
        say(f"P {h.key.hex()} {h.payload_len}")


if __name__ == "__main__":
    main()
