"""The log-rate limiter, on a clock the tests move: one line, then none until the interval has passed;
a writer's failures, said once at the start and once at the end of a burst."""

from __future__ import annotations

from edged.lograte import Failures, LogRate


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_the_first_line_goes_out_whatever_the_clock_says() -> None:
    assert LogRate(10.0, Clock(0.0)).allows()
    assert LogRate(10.0, Clock(-5.0)).allows()  # time.monotonic() may start anywhere


def test_the_lines_within_the_interval_are_held_back_and_the_next_goes_out_once_it_has_passed() -> None:
    clock = Clock(100.0)
    rate = LogRate(10.0, clock)
    assert rate.allows()
    for clock.now in (100.0, 105.0, 109.999):
        assert not rate.allows()
    clock.now = 110.0
    assert rate.allows()
    clock.now = 119.0
    assert not rate.allows()


def test_the_interval_runs_from_the_last_line_that_went_out_not_from_those_held_back() -> None:
    clock = Clock(0.0)
    rate = LogRate(10.0, clock)
    assert rate.allows()
    allowed = []
    for second in range(1, 31):  # a failure every second for half a minute
        clock.now = float(second)
        allowed.append(rate.allows())
    assert [s for s, ok in zip(range(1, 31), allowed, strict=True) if ok] == [10, 20, 30]


def test_each_limiter_has_its_own_interval() -> None:
    clock = Clock(0.0)
    refused, cut_off = LogRate(60.0, clock), LogRate(60.0, clock)
    assert refused.allows()
    assert cut_off.allows()  # another kind of line is not held back by the first
    assert not refused.allows() and not cut_off.allows()


def test_failures_are_counted_and_a_burst_is_said_at_its_start_and_its_end() -> None:
    failures = Failures()
    assert failures.failed("disk full") and not failures.failed("disk full again")
    assert (failures.count, failures.last) == (2, "disk full again")
    assert failures.succeeded() and not failures.succeeded()
    assert failures.failed("read-only")  # a new burst
    carried = Failures(failures)  # a writer a reload replaces
    assert (carried.count, carried.last) == (3, "read-only") and carried.failed("again")
