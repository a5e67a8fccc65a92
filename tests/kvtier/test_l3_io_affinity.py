"""`l3_io.isolate_caller`: the serving thread gets a core of its own and L3 pool threads the
other CPUs (Linux thread affinities, checked on real threads)."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvtier.tiers.l3 import io as l3_io


def test_parse_cpu_list() -> None:
    assert l3_io.parse_cpu_list("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert l3_io.parse_cpu_list("5") == {5}
    assert l3_io.parse_cpu_list("") == set()


def test_siblings_include_the_cpu_itself() -> None:
    cpu = min(os.sched_getaffinity(0))
    assert cpu in l3_io.core_siblings(cpu)


def test_too_few_cpus_changes_nothing() -> None:
    before = os.sched_getaffinity(0)
    assert l3_io.isolate_caller(min_cpus=len(before) + 1) is None
    assert os.sched_getaffinity(0) == before
    assert l3_io.background_cpus() is None


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_caller_and_pool_threads_are_kept_apart() -> None:
    seen: dict[str, set[int]] = {}

    def serving() -> None:  # a thread of its own: the test process keeps its affinity
        got = l3_io.isolate_caller(min_cpus=2)
        assert got is not None
        mine, rest = got
        seen["mine"], seen["rest"] = mine, rest
        seen["caller"] = os.sched_getaffinity(0)
        with ThreadPoolExecutor(1, initializer=l3_io.background_thread) as pool:
            seen["pool"] = pool.submit(os.sched_getaffinity, 0).result()

    t = threading.Thread(target=serving)
    try:
        t.start()
        t.join()
    finally:
        l3_io.forget_isolation()
    assert seen["caller"] == seen["mine"]
    assert seen["pool"] == seen["rest"]
    assert not seen["mine"] & seen["rest"]
    assert seen["mine"] | seen["rest"] == os.sched_getaffinity(0)
