"""bench/stacks.py: the scheduler thread's stack samples and every thread's CPU, in cores."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from stacks import StackSampler

from kvtier.cache.restoreplan import common_prefix  # a kvtier frame for a helper thread


def _spin(stop: threading.Event) -> None:
    while not stop.is_set():
        sum(i * i for i in range(2000))


def _main_loop(stop: threading.Event) -> None:  # named like the scheduler's loop: "_main"
    def _iterate() -> None:
        _spin_once()

    def _spin_once() -> None:
        sum(i * i for i in range(2000))

    while not stop.is_set():
        _iterate()


def test_report_names_the_method_and_each_busy_threads_cores() -> None:
    stop = threading.Event()
    sched = threading.Thread(target=_main_loop, args=(stop,), name="kvtier-batch", daemon=True)
    other = threading.Thread(target=_spin, args=(stop,), name="kvtier-commit_0", daemon=True)
    sched.start()
    other.start()
    sampler = StackSampler()
    sampler.start()
    time.sleep(0.4)
    sampler.stop()
    stop.set()
    sched.join()
    other.join()
    report = sampler.report()
    assert sampler.samples > 5  # fewer than one per ms: the sampler waits for the GIL too
    assert "_spin_once" in report  # the innermost function, under the loop's method
    cpu = report.split("CPU by thread meanwhile, in cores", 1)[1]
    lines = {ln.split()[1]: float(ln.split()[0]) for ln in cpu.splitlines()[1:]}
    assert lines["kvtier-batch"] > 0.1 and lines["kvtier-commit_0"] > 0.1, report
    assert "stack-sampler" not in lines or lines["stack-sampler"] < lines["kvtier-batch"]


def _restore_like(stop: threading.Event) -> None:
    """A prompt that differs from the stored tokens only at its end: common_prefix bisects,
    so the thread spends its time (and yields the GIL) inside its loop, a kvtier frame. Equal
    lists would return after one comparison in C, and the thread would yield in this loop."""
    ids = list(range(20000))
    prompt = [*ids[:-1], -1]
    while not stop.is_set():
        common_prefix(ids, prompt)


def test_helper_pools_are_sampled_by_their_kvtier_frame_and_idle_threads_apart() -> None:
    import concurrent.futures

    stop = threading.Event()
    busy = threading.Thread(
        target=_restore_like, args=(stop,), name="kvtier-restore_0", daemon=True
    )
    idle = concurrent.futures.ThreadPoolExecutor(1, "kvtier-restore")
    idle.submit(lambda: None).result()  # a pool thread now waiting in the queue
    busy.start()
    sampler = StackSampler()
    sampler.start()
    time.sleep(0.3)
    sampler.stop()
    stop.set()
    busy.join()
    idle.shutdown()
    lines = sampler.helpers["kvtier-restore"]
    assert sampler.helper_samples["kvtier-restore"] > 5
    assert lines["idle"] > 0, lines  # the executor's thread, waiting for work
    top = [k for k in lines if k != "idle"]
    assert top and all("restoreplan.py" in k and "common_prefix" in k for k in top), lines
    assert "kvtier-restore threads" in sampler.report()


def test_tail_report_puts_each_sample_in_its_steps_interval() -> None:
    """Steps end at t = 1, 2, ..., 40; three of them (10, 20, 30) are slow. A line sampled
    only inside those three intervals is the tail's alone, in ms per step."""
    sampler = StackSampler()
    slow = (10, 20, 30)
    steps = [(float(t), 0.030 if t in slow else 0.015) for t in range(1, 41)]
    sampler.timeline = sorted(
        [(t + 0.5, "_step > everywhere") for t in range(40)]
        + [(t - 0.3, "_admit > only slow") for t in slow]  # inside (t - 1, t]
    )
    report = sampler.tail_report(steps)
    tail, body = report.split("    tail: ", 1)[1].split("    body: ", 1)
    assert "(above P90, 3 steps)" in report and "(at or below P50, 37 steps)" in report
    assert "1.00  _admit > only slow" in tail and "only slow" not in body
    assert "1.00  _step > everywhere" in tail
    assert sampler.tail_report(steps[:10]) == ""  # too few steps to have a tail


def test_tail_report_gives_collections_and_blind_spots_per_step() -> None:
    """A 20 ms collection ending inside a slow step's interval, and a 6 ms blind spot inside a
    typical one, each counted once, in the group of the step it ended in."""
    sampler = StackSampler()
    steps = [(float(t), 0.030 if t in (10, 20, 30) else 0.015) for t in range(1, 41)]
    sampler.timeline = [(t + 0.5, "_step > everywhere") for t in range(40)]
    sampler.collections = [(9.5, 9.52, 2)]  # ends in (9, 10]: step 10, a slow one
    sampler.gaps = [(4.7, 0.006)]  # ends in (4, 5]: step 5, a typical one
    tail, body = sampler.tail_report(steps).split("    tail: ", 1)[1].split("    body: ", 1)
    # 20 ms over the 3 slow steps; 6 ms over the 37 typical ones
    assert "garbage collection 6.67 ms per step" in tail and "blind" in tail
    assert "waits past 4 ms) 0.00 ms" in tail
    assert "garbage collection 0.00 ms per step" in body
    assert "waits past 4 ms) 0.16 ms" in body


def _hold_gil(stop: threading.Event) -> None:
    """Pure Python that never waits: it gives the GIL up only at the switch interval."""
    while not stop.is_set():
        sum(i * i for i in range(200))


def test_collections_are_timed_and_the_samplers_long_waits_charged_to_the_busy_lines() -> None:
    import gc

    stop = threading.Event()
    old = sys.getswitchinterval()
    sys.setswitchinterval(0.02)  # a 20 ms hold: the sampler's waits for the GIL pass GAP
    busy = threading.Thread(target=_hold_gil, args=(stop,), name="kvtier-commit_3", daemon=True)
    sampler = StackSampler()
    try:
        busy.start()
        sampler.start()
        time.sleep(0.2)
        gc.collect()  # this thread's: a generation-2 collection, timed by the callback
        time.sleep(0.2)
        sampler.stop()
    finally:
        sys.setswitchinterval(old)
        stop.set()
        busy.join()
    assert sampler._on_gc not in gc.callbacks  # stop() took its callback back
    assert any(gen == 2 and end > start for start, end, gen in sampler.collections)
    report = sampler.report()
    assert "generation 2: " in report
    assert sampler.gaps, "a thread that holds the GIL for 20 ms blinds the sampler"
    assert "kvtier-commit: test_stacks.py" in report, report


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def test_garbage_mode_counts_the_cycles_the_windows_collections_find() -> None:
    import gc

    sampler = StackSampler(garbage=True)
    sampler.start()
    for _ in range(5):  # five two-node cycles, unreachable once the loop moves on
        a, b = _Node(), _Node()
        a.other, b.other = b, a
    del a, b
    gc.collect()
    sampler.stop()
    assert gc.get_debug() == 0 and not gc.garbage  # the collector as it was, nothing kept
    assert sampler.garbage_types[f"{__name__}._Node"] == 10
    assert "cyclic garbage the window's collections found" in sampler.report()


def test_census_counts_what_a_full_collection_walks() -> None:
    """A list of ids stays in the collector's walk with every id a reference; the same ids in
    a tuple leave it at the first collection (the census collects before it counts)."""
    from stacks import census

    held = [list(range(1000, 101000))]  # 100,000 ids in one tracked list
    before = census()
    lists = {name: refs for name, _, refs in before.by_type}["builtins.list"]
    assert lists >= 100_000 and before.references >= lists and before.full_ms > 0
    assert "builtins.list" in before.report(5)
    held[0] = tuple(held[0])
    after = census()
    lists_after = {name: refs for name, _, refs in after.by_type}.get("builtins.list", 0)
    assert lists - lists_after >= 95_000, (lists, lists_after)  # a few lists come and go
    import gc

    assert not gc.is_tracked(held[0])
