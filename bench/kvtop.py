"""CPU per kvtop frame with 1,000 sessions (target: under 30 ms), by stage.

    .venv/bin/python bench/kvtop.py [--frames 200] [--png out.png]

One frame is what the refresh loop does each interval: parse the /metrics text (the recorded
live exporter text, tests/fixtures/metrics), parse a /v1/sessions JSON of 1,000 sessions, build
the model (rates, sparklines over a full minute of history, alerts, sort) and render the screen
at 200x60 and 80x24 into a null console. CPU time is process time (time.process_time), so
waiting is not counted. The ceiling column is the 30 ms budget; the floor row is rich drawing
an empty 200x60 layout, the least any rich screen costs.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import statistics
import time
from pathlib import Path

from rich.console import Console
from rich.layout import Layout

from ops.kvtop import metrics
from ops.kvtop.history import History
from ops.kvtop.model import Options, build, parse_sessions
from ops.kvtop.render import screen
from ops.kvtop.sources import dump_sessions

FIX = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "metrics"
BUDGET_MS = 30.0


def sessions_json(n: int) -> str:
    base = parse_sessions((FIX / "exporter-live-sessions.json").read_text()).sessions[0]
    states = ("active", "idle", "hibernated")
    rows = [
        dataclasses.replace(
            base,
            session_id=f"agent-{i:05d}",
            tenant=f"tenant-{i % 17}",
            state=states[i % 3],
            pinned=i % 50 == 0,
            tokens=1000 + (i * 7919) % 30000,
            bytes=(1000 + (i * 7919) % 30000) * 57344,
            chunks_l1=i % 5,
            chunks_l2=i % 7,
            chunks_l3=i % 11,
            last_active=time.time() - i,
        )
        for i in range(n)
    ]
    return dump_sessions(rows)


def cpu_ms(fn, frames: int) -> list[float]:  # type: ignore[no-untyped-def]
    out = []
    for _ in range(frames):
        t = time.process_time()
        fn()
        out.append((time.process_time() - t) * 1e3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--frames", type=int, default=200)
    ap.add_argument("--sessions", type=int, default=1000)
    ap.add_argument("--png", type=Path)
    args = ap.parse_args()

    text = (FIX / "exporter-live-2.txt").read_text()
    first = (FIX / "exporter-live-1.txt").read_text()
    listing = sessions_json(args.sessions)
    history = History()
    for i in range(61):  # a full minute of history: sparklines at their widest
        history.add(metrics.parse(first if i % 2 else text, float(i)))
    sessions = parse_sessions(listing)
    options = Options()
    model = build(history, sessions, options, source="bench", interval=1.0)
    wide = Console(file=io.StringIO(), width=200, height=60, force_terminal=True)
    narrow = Console(file=io.StringIO(), width=80, height=24, force_terminal=True)

    def reset_consoles() -> None:
        for c in (wide, narrow):
            c.file = io.StringIO()

    clock = [61.0]

    def parse_metrics() -> None:
        clock[0] += 1
        history.add(metrics.parse(text, clock[0]))

    stages = {
        "parse /metrics": parse_metrics,
        f"parse {args.sessions} sessions JSON": lambda: parse_sessions(listing),
        "build model (rates, alerts, sort)": lambda: build(
            history, sessions, options, source="bench", interval=1.0
        ),
        "render 200x60": lambda: (wide.print(screen(model, 200, 60)), reset_consoles()),
        "render 80x24": lambda: (narrow.print(screen(model, 80, 24)), reset_consoles()),
    }

    def frame() -> None:
        parse_metrics()
        s = parse_sessions(listing)
        m = build(history, s, options, source="bench", interval=1.0)
        wide.print(screen(m, 200, 60))
        reset_consoles()

    def floor() -> None:
        wide.print(Layout())
        reset_consoles()

    for fn in (*stages.values(), frame):  # warm caches (rich's cell widths, regexes)
        fn()
    results = {name: cpu_ms(fn, args.frames) for name, fn in stages.items()}
    results["whole frame at 200x60"] = cpu_ms(frame, args.frames)
    results["floor: empty rich 200x60 layout"] = cpu_ms(floor, args.frames)

    print(f"kvtop CPU per frame, {args.sessions} sessions, {args.frames} frames (process time)")
    print(f"{'figure':<40} {'median ms':>10} {'p95 ms':>8} {'ceiling ms':>11} {'ratio':>6}")
    for name, xs in results.items():
        med = statistics.median(xs)
        p95 = sorted(xs)[int(0.95 * (len(xs) - 1))]
        print(f"{name:<40} {med:>10.2f} {p95:>8.2f} {BUDGET_MS:>11.1f} {med / BUDGET_MS:>6.2f}")

    if args.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        names = list(results)
        meds = [statistics.median(results[n]) for n in names]
        fig, ax = plt.subplots(figsize=(8, 3.5))
        ax.barh(names, meds)
        ax.axvline(BUDGET_MS, color="red", linestyle="--", label="30 ms budget")
        ax.set_xlabel("CPU ms per frame (median)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.png)


if __name__ == "__main__":
    main()
