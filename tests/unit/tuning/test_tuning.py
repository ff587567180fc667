"""The pure side of `batchwork tune` on made-up curves: which sizes a sweep measures, the knee, the choice
per lane within a bound and a memory cap, the token budget, the fill time, the fit, and the precedence of
explicit settings over tuned limits. No torch, no device, no database."""

from __future__ import annotations

import random

import pytest

from worker.batching.policy import LanePolicy
from worker.batching.scheduler import Item, Scheduler
from worker.settings import BatchingSettings
from worker.tuning.choice import as_batching_settings, choose, choose_lane, fill_wait_ms, knees
from worker.tuning.curve import Point, knee, sweep_length
from worker.tuning.history import NotEnoughHistory, arrival_per_s, fit_cost


def linear(
    a_ms: float, b_ms: float, length: int = 1, *, per_token: bool = False, oom_above: int | None = None
):
    """A device whose batch of n items takes exactly a + b*n ms (b per padded token with ``per_token``)."""
    measured: list[int] = []

    def measure(n: int) -> Point:
        measured.append(n)
        if oom_above is not None and n > oom_above:
            return Point(n, length, float("inf"), float("inf"), oom=True)
        ms = a_ms + b_ms * n * (length if per_token else 1)
        return Point(n, length, ms, ms, peak_bytes=n * length * 1000)

    return measure, measured


def test_a_20_b_2_bound_180_recommends_the_largest_sweep_point_up_to_80() -> None:
    measure, measured = linear(20, 2)
    points = sweep_length(measure, bounds_ms=[45, 180, 720], max_n=1024)

    lanes = choose(points, max_batch_ms=180, memory_cap_bytes=None)

    assert measured[:10] == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]  # geometric until over the largest bound
    assert 80 in measured  # bisection found the edge where 20 + 2n = 180
    normal = lanes["normal"]
    assert normal.max_batch_size == max(p.n for p in points if p.n <= 80) == 80
    assert normal.p99_batch_ms == 180
    assert lanes["high"].max_batch_size == max(p.n for p in points if 20 + 2 * p.n <= 45)
    assert lanes["bulk"].max_batch_size == max(p.n for p in points if 20 + 2 * p.n <= 720)
    assert normal.max_batch_tokens is None  # a model without lengths has no token budget


def test_the_bisection_stops_within_an_eighth_of_n() -> None:
    measure, measured = linear(20, 2)
    points = sweep_length(measure, bounds_ms=[170], max_n=1024)
    lanes = choose(points, max_batch_ms=170, memory_cap_bytes=None)
    best = lanes["normal"].max_batch_size
    assert best is not None and 75 - 75 // 8 <= best <= 75  # 20 + 2n <= 170 -> n <= 75
    assert len(measured) < 16


def test_the_sweep_stops_at_out_of_memory_and_never_chooses_it() -> None:
    measure, measured = linear(1, 0.01, oom_above=40)
    points = sweep_length(measure, bounds_ms=[1e9], max_n=1024)
    assert max(measured) <= 64 and any(p.oom for p in points)
    assert choose(points, max_batch_ms=1e9, memory_cap_bytes=None)["bulk"].max_batch_size <= 40


def test_the_memory_cap_holds_n_down() -> None:
    measure, _ = linear(1, 1)
    points = sweep_length(measure, bounds_ms=[1e6], max_n=256)
    lane = choose_lane("bulk", points, bound_ms=1e6, memory_cap_bytes=64_000)
    assert lane.max_batch_size == 64  # peak = n * 1000 bytes


def test_a_plateau_ends_the_geometric_steps() -> None:
    curve = {1: 10.0, 2: 10.0, 4: 10.0, 8: 10.0, 16: 10.0}  # items/s flat beyond n=1 -> ms grows like n

    def measure(n: int) -> Point:
        ms = n * 100.0 / curve.get(n, 10.0)
        return Point(n, 1, ms, ms)

    points = sweep_length(measure, bounds_ms=[1e9], max_n=1024)
    assert max(p.n for p in points) == 8


def test_the_knee_is_the_smallest_n_at_90_percent_of_the_best() -> None:
    points = [
        Point(n, 1, n / rate * 1000, n / rate * 1000) for n, rate in [(1, 10), (2, 50), (4, 91), (8, 100)]
    ]
    found = knee(points)
    assert found is not None and found.n == 4
    assert knees(points) == {1: 4}


def test_the_token_budget_lets_short_items_ride_n_and_cuts_long_ones_to_the_bound() -> None:
    points: list[Point] = []
    for length in (16, 64, 256):
        measure, _ = linear(5, 0.01, length, per_token=True)  # 5 ms + 10 us per padded token
        points += sweep_length(measure, bounds_ms=[50], max_n=512)
    lane = choose_lane("normal", points, bound_ms=50, memory_cap_bytes=None)
    assert lane.max_batch_size is not None and lane.max_batch_tokens is not None
    # 5 + 0.01 * tokens <= 50 -> at most 4500 padded tokens in any batch the limits allow
    for length, size in lane.per_length.items():
        assert size * length <= 4500
    assert lane.per_length[256] == lane.max_batch_tokens // 256
    assert lane.p99_batch_ms is not None and lane.p99_batch_ms <= 50


def test_fill_time_at_the_arrival_rate_within_the_bound() -> None:
    assert fill_wait_ms(64, arrival_per_s=1000, bound_ms=200) == 64.0
    assert fill_wait_ms(64, arrival_per_s=10, bound_ms=200) == 200  # would take 6.4 s: capped at the bound
    assert fill_wait_ms(64, arrival_per_s=None, bound_ms=200) is None
    assert arrival_per_s([10, 10, 10], [0.0, 1.0, 2.0]) == 10.0


def test_tuned_limits_have_the_settings_shape() -> None:
    measure, _ = linear(20, 2)
    points = sweep_length(measure, bounds_ms=[45, 180, 720], max_n=128)
    tuned = as_batching_settings(
        choose(points, max_batch_ms=180, memory_cap_bytes=None, arrival_per_s={"normal": 500})
    )
    parsed = BatchingSettings.model_validate(tuned)
    assert parsed.max_batch_size == 80 and parsed.max_wait_ms == 160.0
    assert set(parsed.lanes) == {"high", "bulk"} and parsed.lanes["bulk"].max_batch_size == 128


def test_the_fit_recovers_a_and_b() -> None:
    rng = random.Random(1)
    tokens = [rng.randint(16, 4096) for _ in range(500)]
    run_ms = [20 + 0.05 * t + rng.gauss(0, 1) for t in tokens]
    fit = fit_cost(tokens, run_ms)
    assert fit.a_ms == pytest.approx(20, abs=0.5) and fit.b_ms_per_token == pytest.approx(0.05, rel=0.01)
    assert fit.rmse_ms == pytest.approx(1, rel=0.2) and fit.r2 > 0.99
    assert fit.meets(1000, bound_ms=80) and not fit.meets(1300, bound_ms=80)
    with pytest.raises(NotEnoughHistory):
        fit_cost([64, 64, 64], [1, 2, 3])


def test_a_lane_takes_new_limits_with_its_waiting_items() -> None:
    policies = {("m", "normal"): LanePolicy(max_batch_size=4, max_wait_s=1.0, bucket_edges=(8,))}
    s = Scheduler(policies.__getitem__)
    for i in range(10):
        s.add("m", "normal", Item("job", i, length=1 + i, arrived=0.0))
    policies["m", "normal"] = LanePolicy(max_batch_size=6, max_wait_s=1.0, bucket_edges=(4, 16))
    s.reconfigure("m")
    batch = s.next_batch(now=0.0)
    assert batch is not None and len(batch.items) == 6  # the new N, from the re-bucketed items
    assert len(s) == 4


def test_a_slow_reading_below_a_faster_larger_batch_is_taken_for_interference() -> None:
    times = {1: 10.0, 2: 400.0, 4: 20.0, 8: 35.0, 16: 300.0}  # n=2 was hit by another process
    points = [Point(n, 64, ms, ms) for n, ms in times.items()]
    lane = choose_lane("normal", points, bound_ms=100, memory_cap_bytes=None)
    assert lane.max_batch_size == 8 and lane.p99_batch_ms == 35.0


def test_the_budget_lands_every_length_on_a_point_within_the_bound() -> None:
    short = [Point(n, 16, 5 + n, 5 + n) for n in (1, 2, 4, 8, 16, 32)]
    long = [Point(n, 128, 5 + 10 * n, 5 + 10 * n) for n in (1, 2, 4, 8)]  # 8 x 128 tokens: 85 ms
    lane = choose_lane("normal", short + long, bound_ms=50, memory_cap_bytes=None)
    assert lane.max_batch_size == 32 and lane.max_batch_tokens == 4 * 128  # n=4 at 128 tokens: 45 ms
    assert lane.per_length == {16: 32, 128: 4} and lane.p99_batch_ms == 45


def test_the_plot_of_a_backends_sweep_draws_the_chosen_pair() -> None:
    from worker.tuning.report import plotted

    points = [
        Point(n, 16, 10.0 * n, 11.0 * n, precision=label)
        for label in ("torch/fp32", "onnx/fp32", "onnx/int8")
        for n in (1, 2, 4)
    ]
    chosen = plotted(points, {"precision": "fp32", "backend": "onnx"})
    assert [(p.precision, p.n) for p in chosen] == [("onnx/fp32", 1), ("onnx/fp32", 2), ("onnx/fp32", 4)]
    assert plotted([Point(1, 16, 1.0, 1.0, precision="bf16")], {"precision": "bf16"})
