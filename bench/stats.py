"""Percentiles and rates of a benchmark run, and the CPU-time helpers of its micro
measurements."""

from __future__ import annotations

import asyncio
import math
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence


def percentile(values: Sequence[float], q: float) -> float | None:
    """The `q`-th percentile (0..100) by linear interpolation; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summary_ms(values_s: Sequence[float]) -> dict[str, float | None]:
    """p50/p95/p99/max of durations given in seconds, in milliseconds."""
    return {
        name: None if (value := percentile(values_s, q)) is None else round(value * 1000, 1)
        for name, q in (("p50", 50), ("p95", 95), ("p99", 99), ("max", 100))
    }


def steady_rate(times: Sequence[float], low: float = 0.1, high: float = 0.9) -> float | None:
    """Completions per second between the `low` and `high` fractions of all completions.

    Leaves out the ramp-up (connections opening, the first burst of claims) and the tail
    (the last stragglers of the jitter), which a burst of N would otherwise charge to N.
    """
    ordered = sorted(times)
    if len(ordered) < 10:
        return overall_rate(ordered, ordered[0] if ordered else 0.0)
    first = int(len(ordered) * low)
    last = int(len(ordered) * high) - 1
    span = ordered[last] - ordered[first]
    return (last - first) / span if span > 0 else None


def overall_rate(times: Sequence[float], started_at: float) -> float | None:
    """Completions per second from `started_at` to the last completion."""
    if not times:
        return None
    span = max(times) - started_at
    return len(times) / span if span > 0 else None


def quarter_rates(times: Sequence[float]) -> tuple[float | None, float | None]:
    """Completions per second within the first and within the last quarter of completions."""
    ordered = sorted(times)
    quarter = len(ordered) // 4
    if quarter < 2:
        return None, None
    first_span = ordered[quarter - 1] - ordered[0]
    last_span = ordered[-1] - ordered[-quarter]
    first = (quarter - 1) / first_span if first_span > 0 else None
    last = (quarter - 1) / last_span if last_span > 0 else None
    return first, last


def tenth_rates(times: Sequence[float]) -> list[float | None]:
    """Completions per second within each tenth of completions, first to last: the shape of
    a drain, where `quarter_rates` gives its two ends."""
    ordered = sorted(times)
    tenth = len(ordered) // 10
    if tenth < 2:
        return []
    rates: list[float | None] = []
    for start in range(0, tenth * 10, tenth):
        span = ordered[start + tenth - 1] - ordered[start]
        rates.append((tenth - 1) / span if span > 0 else None)
    return rates


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def rounded(value: float | None, digits: int = 1) -> float | None:
    return None if value is None else round(value, digits)


async def alternating_medians(
    rounds: int, *ways: Callable[[], Awaitable[float]]
) -> tuple[float, ...]:
    """Measure several ways `rounds` times, taking turns (the machine may be shared
    meanwhile), and give the median of each."""
    samples: list[list[float]] = [[] for _ in ways]
    for _ in range(rounds):
        for way, taken in zip(ways, samples, strict=True):
            taken.append(await way())
    return tuple(statistics.median(taken) for taken in samples)


async def cpu_us_each(
    count: int, in_flight: int, operation: Callable[[int], Awaitable[None]]
) -> float:
    """The process's CPU time per operation in µs: `operation(0)` to `operation(count - 1)`,
    at most `in_flight` of them at once."""
    gate = asyncio.Semaphore(in_flight)

    async def one(index: int) -> None:
        async with gate:
            await operation(index)

    started = time.process_time()
    await asyncio.gather(*(one(index) for index in range(count)))
    return (time.process_time() - started) / count * 1e6


async def faststream_against_bare(
    what: str,
    url: str,
    ways: tuple[Callable[[str], Awaitable[float]], Callable[[str], Awaitable[float]]],
    *,
    rounds: int,
) -> None:
    """Print the CPU of one operation on the broker at `url` through FastStream and through
    bare aio-pika (`ways`, in that order; µs each, the median of `rounds` alternating runs)."""
    faststream, bare = ways
    through_faststream, through_aio_pika = await alternating_medians(
        rounds, lambda: faststream(url), lambda: bare(url)
    )
    print(
        f"{what}, median of {rounds}: FastStream {through_faststream:.0f} µs, bare aio-pika "
        f"{through_aio_pika:.0f} µs ({through_faststream / through_aio_pika:.2f}x)"
    )
