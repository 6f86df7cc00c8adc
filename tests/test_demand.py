"""The decode-on-demand policy on exact clocks: which grabbed frames a consumer of a known pace may take."""

from __future__ import annotations

import pytest

from edged.demand import AWAY_NS, DEMAND_CYCLES, Demand, StreamTiming

MS = 1_000_000
NEWER_READY = 40 * MS  # a 30 fps camera's interval plus a 7 ms decode


def consumer(cycles_ms: list[int]) -> tuple[Demand, int]:
    """A consumer that took a frame after each busy time in ``cycles_ms``; and the time of its last take."""
    demand, now = Demand(), 0
    demand.asked(now)
    demand.answered(now, served=True)
    for busy in cycles_ms:
        now += busy * MS
        demand.asked(now)
        demand.answered(now, served=True)
    return demand, now


def test_every_frame_is_wanted_until_the_consumer_pace_is_known() -> None:
    demand, served = consumer([200] * (DEMAND_CYCLES - 1))
    assert demand.wants(served + 1 * MS, NEWER_READY)


def test_a_steady_consumer_wants_only_the_frames_near_its_next_take() -> None:
    demand, served = consumer([200] * DEMAND_CYCLES)
    # Busy 200 ms: a frame grabbed 50 ms in is replaced by a newer one ready at 90 ms.
    assert not demand.wants(served + 50 * MS, NEWER_READY)
    assert not demand.wants(served + 139 * MS, NEWER_READY)
    # From 10 % before its usual cycle, less the time a newer frame needs, every frame may be taken.
    assert demand.wants(served + 141 * MS, NEWER_READY)
    assert demand.wants(served + 199 * MS, NEWER_READY)


def test_a_waiting_consumer_wants_every_frame() -> None:
    demand, served = consumer([200] * DEMAND_CYCLES)
    demand.asked(served + 20 * MS)  # sooner than ever before: it is inside take(), waiting
    assert demand.wants(served + 21 * MS, NEWER_READY)


def test_one_shorter_cycle_counts_at_once_a_longer_pace_only_once_it_is_the_norm() -> None:
    demand, served = consumer([200] * DEMAND_CYCLES + [100])
    assert demand.wants(served + 60 * MS, NEWER_READY)  # 100 ms is now the soonest it may return
    demand, served = consumer([100] * DEMAND_CYCLES + [200] * (DEMAND_CYCLES - 1))
    assert demand.wants(served + 60 * MS, NEWER_READY)
    demand, served = consumer([100] * DEMAND_CYCLES + [200] * DEMAND_CYCLES)
    assert not demand.wants(served + 60 * MS, NEWER_READY)


def test_a_consumer_away_past_its_longest_cycle_wants_nothing() -> None:
    demand, served = consumer([200] * DEMAND_CYCLES)
    assert demand.wants(served + 200 * MS + AWAY_NS, NEWER_READY)
    assert not demand.wants(served + 201 * MS + AWAY_NS, NEWER_READY)
    demand.asked(served + 5000 * MS)  # back: the next frame grabbed is decoded
    assert demand.wants(served + 5001 * MS, NEWER_READY)


def test_a_take_that_timed_out_leaves_no_last_frame_to_judge_from() -> None:
    demand, served = consumer([200] * DEMAND_CYCLES)
    demand.asked(served + 200 * MS)
    demand.answered(served + 1200 * MS, served=False)
    assert demand.wants(served + 1250 * MS, NEWER_READY)


def test_a_paced_stream_keeps_its_period_and_a_live_one_learns_it() -> None:
    paced = StreamTiming(period_ns=33 * MS, paced=True)
    for t in (0, 10, 20):
        paced.grabbed(t * MS)
    paced.decoded(7 * MS)
    assert paced.newer_ready_ns == pytest.approx(40 * MS)
    live = StreamTiming()
    for t in range(0, 200, 20):
        live.grabbed(t * MS)
    live.decoded(5 * MS)
    live.decoded(13 * MS)
    assert live.period_ns == pytest.approx(20 * MS)
    assert live.newer_ready_ns == pytest.approx(20 * MS + 6 * MS)
