"""Cron schedule math: pure functions of (spec, time zone, instants), no I/O, no clock.

Expressions are croniter's: five fields (minute hour day-of-month month day-of-week), an
optional sixth field for seconds, and aliases such as `@hourly`. They are evaluated on the
wall clock of the job's time zone (IANA name, default UTC) and every instant returned is UTC.

Daylight-saving transitions follow croniter (checked against croniter 7):
- Spring forward, a wall-clock time that does not exist is shifted to the first instant after
  the gap when the hour field leaves some hour out (a value, a list, a range or a step such
  as `*/2`): `30 2 * * *` in Europe/Berlin fires at 03:00 CEST on the last Sunday of March,
  once (01:00 UTC), as does `30 */2 * * *`. A job whose hour field matches every hour (`*`,
  `*/1`, `0-23`) has no run in the gap, as cron's own wildcard jobs have none: `0 * * * *`
  has no 02:00 that day, and in Australia/Lord_Howe, whose clock skips 02:00-02:30,
  `*/20 * * * *` has no 02:00 or 02:20 (its next run is 02:40) and `0 * * * *` none between
  01:00 and 03:00.
- Fall back, a wall-clock time that occurs twice fires twice, once per occurrence:
  `30 2 * * *` in Europe/Berlin fires at 02:30 CEST and at 02:30 CET (00:30 and 01:30 UTC) on
  the last Sunday of October; the jobs are idempotent, so a second run is harmless. Where the
  clock goes back by less than an hour (Australia/Lord_Howe, 30 minutes), croniter steps over
  the repeated times when it starts before the fall-back; `next_fire_time` asks it again
  from just before it, so they fire too.
- Zones without DST (Asia/Shanghai, UTC) are plain offsets: `0 3 * * *` in Asia/Shanghai is
  19:00 UTC of the previous day, every day.

croniter's random (`R`, `R(0-29)`, `R/10`) and hashed (`H`...) fields are refused: a random
field is drawn afresh by every iterator, so the dispatcher's plan, its next due time and each
replica disagreed on the schedule, and the job fired at several times an hour, or at none.
A hashed one needs a hash id, which nothing here gives (croniter refuses it without one).
"""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import CroniterBadDateError, croniter

from services.scheduler.errors import ConfigurationError

_JUST_AFTER = timedelta(microseconds=1)
_A_SECOND = timedelta(seconds=1)
_A_DAY = timedelta(days=1)
# A field croniter fills by a random draw (`R`) or a hash (`H`), with an optional range and
# step: `R`, `H(0-29)`, `r/15` (croniter reads fields case-insensitively).
_DRAWN_FIELD = re.compile(r"^[HR](\(\d+-\d+\))?(/\d+)?$", re.IGNORECASE | re.ASCII)


# Names a host's zoneinfo may hold that are not one zone everywhere: `localtime` is the
# host's own (replicas on hosts of different zones each fired at their own instant, twice in
# all), `posixrules` the host's default rules, `Factory` no zone at all; and the `right/` and
# `posix/` trees that some packagings add (a config loading on one replica and refused on
# another; `right/` zones count leap seconds, their offsets about 27 s off).
HOST_DEPENDENT_ZONES = frozenset({"localtime", "posixrules", "Factory"})
HOST_DEPENDENT_TREES = ("right/", "posix/")


def zone(name: str) -> ZoneInfo:
    """The IANA time zone `name`; raises `ConfigurationError` for an unknown one, or one
    whose meaning depends on the host (`HOST_DEPENDENT_ZONES`)."""
    if name in HOST_DEPENDENT_ZONES or name.startswith(HOST_DEPENDENT_TREES):
        raise ConfigurationError(
            f"time zone {name!r} depends on the host; name the zone itself (such as Europe/Berlin)"
        )
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError) as error:
        raise ConfigurationError(f"unknown time zone {name!r}") from error


def validate_spec(spec: str) -> str:
    """`spec` itself when croniter accepts it and it draws nothing at random; raises
    `ConfigurationError` otherwise."""
    if drawn := [field for field in spec.split() if _DRAWN_FIELD.match(field)]:
        raise ConfigurationError(
            f"invalid cron expression {spec!r}: random or hashed fields ({', '.join(drawn)}) "
            "give each scheduler replica a schedule of its own; write the values out"
        )
    if not croniter.is_valid(spec):
        raise ConfigurationError(f"invalid cron expression {spec!r}")
    return spec


def _aware(instant: datetime) -> datetime:
    if instant.tzinfo is None:
        raise ValueError("cron instants must be timezone-aware")
    return instant


def next_fire_time(spec: str, tz: str, after: datetime) -> datetime | None:
    """The first fire time strictly after `after`, in UTC; None when there is none (a date
    that never comes, such as `0 0 30 2 *`, or a year field already past).

    croniter's answer depends on where it starts when a clock goes back by less than an
    hour (Australia/Lord_Howe's 30 minutes): from before the fall-back it steps over the
    repeated wall times (`*/20` from 01:40 +11 answered 02:00 +10:30, not 01:40 +10:30). So
    croniter is asked again from just before each fall-back between `after` and its answer,
    and the earlier of the two is taken."""
    where = zone(tz)
    found = _next_from(spec, where, _aware(after))
    if found is None:
        return None
    for fall_back in _fall_backs(where, after, found):
        earlier = _next_from(spec, where, fall_back)
        if earlier is not None and after < earlier < found:
            found = earlier
    return found


def _next_from(spec: str, where: ZoneInfo, after: datetime) -> datetime | None:
    try:
        return croniter(spec, after.astimezone(where)).get_next(datetime).astimezone(UTC)
    except CroniterBadDateError:
        return None


def _fall_backs(where: ZoneInfo, start: datetime, end: datetime) -> list[datetime]:
    """An instant just before each time the zone's clock goes back within `start`..`end`
    (found a day at a time: no zone changes its offset twice within a day)."""
    found = []
    step = start
    while step < end:
        step_end = min(step + _A_DAY, end)
        if _offset(where, step) > _offset(where, step_end):
            found.append(_last_before_change(where, step, step_end))
        step = step_end
    return found


def _last_before_change(where: ZoneInfo, before: datetime, after: datetime) -> datetime:
    """An instant within a second before the zone's offset changes between the two."""
    offset = _offset(where, before)
    while after - before > _A_SECOND:
        middle = before + (after - before) / 2
        if _offset(where, middle) == offset:
            before = middle
        else:
            after = middle
    return before


def _offset(where: ZoneInfo, instant: datetime) -> timedelta:
    return instant.astimezone(where).utcoffset() or timedelta(0)


def next_fire_times(
    spec: str, tz: str, after: datetime, until: datetime, *, limit: int | None = None
) -> list[datetime]:
    """Fire times `t` with `after < t <= until`, ascending, in UTC; at most `limit` of them."""
    found: list[datetime] = []
    last = _aware(after)
    while limit is None or len(found) < limit:
        fire_time = next_fire_time(spec, tz, last)
        if fire_time is None or fire_time > _aware(until):
            break
        found.append(fire_time)
        last = fire_time
    return found


def latest_fire_time(spec: str, tz: str, at_or_before: datetime) -> datetime:
    """The last fire time `t <= at_or_before`, in UTC: croniter's, or a later one it stepped
    over at a fall-back of less than an hour (`next_fire_time`)."""
    iterator = croniter(spec, (_aware(at_or_before) + _JUST_AFTER).astimezone(zone(tz)))
    latest: datetime = iterator.get_prev(datetime).astimezone(UTC)
    while (later := next_fire_time(spec, tz, latest)) is not None and later <= at_or_before:
        latest = later
    return latest
