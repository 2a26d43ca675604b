"""The arithmetic behind `make bench`'s numbers (`bench.stats`)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from bench.stats import (
    alternating_medians,
    cpu_us_each,
    faststream_against_bare,
    percentile,
    quarter_rates,
    steady_rate,
    summary_ms,
    tenth_rates,
)


def test_percentiles_interpolate_between_ranks() -> None:
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 0) == 1.0
    assert percentile(values, 50) == 2.5
    assert percentile(values, 100) == 4.0
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None


def test_a_summary_is_in_milliseconds() -> None:
    assert summary_ms([0.001, 0.002, 0.003]) == {"p50": 2.0, "p95": 2.9, "p99": 3.0, "max": 3.0}
    assert summary_ms([]) == {"p50": None, "p95": None, "p99": None, "max": None}


def test_the_steady_rate_leaves_out_ramp_up_and_tail() -> None:
    # 100 completions 0.1 s apart, then 10 stragglers much later.
    times = [i * 0.1 for i in range(100)] + [100.0 + i for i in range(10)]
    assert steady_rate(times) == pytest.approx(10.0)


def test_quarter_rates_tell_a_slowing_drain() -> None:
    fast_then_slow = [i * 0.01 for i in range(50)] + [1.0 + i * 0.1 for i in range(50)]
    first, last = quarter_rates(fast_then_slow)
    assert first == pytest.approx(100.0)
    assert last == pytest.approx(10.0)
    assert quarter_rates([1.0, 2.0, 3.0]) == (None, None)


def test_tenth_rates_give_the_shape_of_a_drain() -> None:
    slowing = [i * 0.01 for i in range(50)] + [1.0 + i * 0.1 for i in range(50)]
    rates = tenth_rates(slowing)
    assert rates[:5] == pytest.approx([100.0] * 5)
    assert rates[5:] == pytest.approx([10.0] * 5)
    assert tenth_rates([float(i) for i in range(19)]) == []


async def test_ways_take_turns_and_each_gets_its_median() -> None:
    calls: list[str] = []
    samples = {"a": iter([5.0, 1.0, 3.0]), "b": iter([20.0, 10.0, 30.0]), "c": iter([7.0] * 3)}

    def way(name: str) -> Callable[[], Awaitable[float]]:
        async def measure() -> float:
            calls.append(name)
            return next(samples[name])

        return measure

    medians = await alternating_medians(3, way("a"), way("b"), way("c"))
    assert medians == (3.0, 20.0, 7.0)
    assert calls == ["a", "b", "c"] * 3


async def test_cpu_per_operation_runs_each_once_with_bounded_concurrency() -> None:
    done: list[int] = []
    running = 0
    most = 0

    async def operation(index: int) -> None:
        nonlocal running, most
        running += 1
        most = max(most, running)
        await asyncio.sleep(0)
        running -= 1
        done.append(index)

    cpu_us = await cpu_us_each(50, 4, operation)
    assert sorted(done) == list(range(50))
    assert most == 4
    assert cpu_us >= 0


async def test_faststream_against_bare_prints_both_medians_and_their_ratio(
    capsys: pytest.CaptureFixture[str],
) -> None:
    async def faststream(url: str) -> float:
        assert url == "amqp://broker"
        return 150.0

    async def bare(url: str) -> float:
        return 100.0

    await faststream_against_bare("CPU per thing", "amqp://broker", (faststream, bare), rounds=3)
    assert capsys.readouterr().out == (
        "CPU per thing, median of 3: FastStream 150 µs, bare aio-pika 100 µs (1.50x)\n"
    )
