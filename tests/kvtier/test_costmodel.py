"""The restore cost model: load only what is faster to load than to recompute."""

from __future__ import annotations

import pytest

from kvtier.cache.costmodel import CostModel

MB = 1_000_000


def model(**bw: float) -> CostModel:
    return CostModel({"l1": 100e9, "l2": 10e9, "l3": 1e9, **bw}, prefill_s_per_token=1e-4)


def test_loads_everything_when_loading_is_cheap() -> None:
    # 4 chunks of 256 tokens, 1 MB each from L2: 0.1 ms each vs 25.6 ms of prefill each
    assert model().plan([("l2", MB, 256)] * 4) == 4


def test_recomputes_when_the_disk_is_slow() -> None:
    # 14.7 MB per chunk at 1 MB/s = 14.7 s, against 25.6 ms of prefill: recompute
    m = model(l3=1 * MB)
    assert m.plan([("l3", 14_700_000, 256)] * 4) == 0


def test_stops_at_the_first_segment_that_does_not_pay() -> None:
    # two cheap L2 chunks followed by two hopeless L3 chunks: load the L2 part only
    m = model(l3=1 * MB)
    assert m.plan([("l2", MB, 256)] * 2 + [("l3", 50 * MB, 256)] * 2) == 2


def test_measurements_move_the_decision() -> None:
    m = model()
    seg = [("l3", 10 * MB, 256)]
    assert m.plan(seg) == 1  # 10 ms of load vs 25.6 ms of prefill
    for _ in range(40):  # the disk turned out to do 10 MB/s (each sample moves it <= 4 x)
        m.observe_load("l3", 10 * MB, 1.0)
    assert m.bandwidth["l3"] == pytest.approx(10 * MB, rel=0.01)
    assert m.plan(seg) == 0
    for _ in range(40):  # prefill turned out to be slow too: 39 ms/token
        m.observe_prefill(256, 10.0)
    assert m.plan(seg) == 1


def test_ema_and_ignores_nonsense() -> None:
    m = model()
    m.observe_load("l2", MB, 0.0)  # zero-duration samples say nothing
    m.observe_load("l2", 0, 1.0)
    assert m.bandwidth["l2"] == 10e9
    m.observe_load("l2", 8e9, 1.0)  # the first sample replaces the prior (within 4 x)
    assert m.bandwidth["l2"] == pytest.approx(8e9)
    m.observe_load("l2", 12e9, 1.0)  # later ones move it half way, in log space
    assert m.bandwidth["l2"] == pytest.approx((8e9 * 12e9) ** 0.5)


def test_margin_makes_loading_stricter() -> None:
    m = CostModel({"l2": 1e9}, 1e-4, margin=10.0)
    # 2.56 MB at 1 GB/s = 2.56 ms, x10 margin = 25.6 ms == prefill of 256 tokens: no gain
    assert m.plan([("l2", 2_560_000, 256)]) == 0


def test_one_outlier_moves_the_estimate_at_most_4x() -> None:
    m = model()
    m.observe_load("l2", MB, 1.0)  # a 1 MB/s first sample (a cold first restore, say)
    assert m.bandwidth["l2"] == pytest.approx(10e9 / 4)
    # 14.7 MB at 2.5 GB/s = 5.9 ms, still far below the 25.6 ms prefill: the tier stays in use
    assert m.plan([("l2", 14_700_000, 256)]) == 1


def test_a_turned_down_tier_is_probed_again() -> None:
    m = CostModel({"l3": 1 * MB}, 1e-4, probe_every=5)
    seg = [("l3", 14_700_000, 256)]
    plans = [m.plan(seg) for _ in range(10)]
    assert plans == [0, 0, 0, 0, 1, 0, 0, 0, 0, 1] and m.probes == 2
    for _ in range(10):  # the probes found a fast disk after all: 2.9 GB/s
        m.observe_load("l3", 14_700_000, 0.005)
    assert m.plan(seg) == 1


def test_the_first_prefill_sample_replaces_the_guess() -> None:
    # the H200 case: the default 1 ms/token guess, a 7B prefill of 2,048 tokens in 55 ms
    m = CostModel({"l2": 10e9, "l3": 1e9}, prefill_s_per_token=1e-3)
    m.observe_prefill(2048, 0.055)
    assert m.prefill_s_per_token == pytest.approx(0.055 / 2048)
    # 8 chunks of 14.7 MB from L3 at 1 GB/s (118 ms) against 55 ms of prefill: recompute
    assert m.plan([("l3", 14_700_000, 256)] * 8) == 0
    assert m.plan([("l2", 14_700_000, 256)] * 8) == 8  # 12 ms from L2: load


def test_short_forwards_do_not_move_the_prefill_estimate() -> None:
    m = CostModel({"l3": 1e9}, prefill_s_per_token=1e-3)
    m.observe_prefill(2048, 0.055)
    for _ in range(30):  # returning turns: 100 tokens in 20 ms, bound by launching kernels
        m.observe_prefill(100, 0.020)
    assert m.prefill_s_per_token == pytest.approx(0.055 / 2048)
    assert m.plan([("l3", 14_700_000, 256)] * 8) == 0
    for _ in range(30):  # long prefills that really got slower do move it
        m.observe_prefill(2048, 0.5)
    assert m.prefill_s_per_token == pytest.approx(0.5 / 2048, rel=0.01)


def test_calibrating_replaces_a_bounded_first_sample_and_loads_everything() -> None:
    """The first L3 sample of a process is bounded (it pays lazy set-up), which left the
    built-in model's L3 estimate 8x too fast on a GPU host: the first request after a restart
    loaded where recomputing was faster. A calibrating read (the warm-up's second) replaces it."""
    cm = CostModel({"l3": 1e9}, prefill_s_per_token=5e-6)
    cm.observe_load("l3", 250_000, 8e-3)  # 31 MB/s, bounded to 4x below the guess
    assert cm.bandwidth["l3"] == pytest.approx(250e6)
    segments = [("l3", 62_500, 256)] * 8  # 2,048 tokens: recompute 10 ms, load 16 ms at 31 MB/s
    assert cm.plan(segments) == 8, "the bounded estimate still loads"
    cm.calibrating = True
    assert cm.plan(segments) == 8, "a calibrating plan loads everything, to measure it"
    cm.observe_load("l3", 250_000, 8e-3)
    cm.calibrating = False
    assert cm.bandwidth["l3"] == pytest.approx(250_000 / 8e-3)
    assert cm.plan(segments) == 0, "measured, recomputing is faster"
