"""The real daemon on a board whose wall clock is stepped: a Raspberry Pi has no real-time clock, runs
for days on a clock months behind, and NTP (or a technician) then sets it right. The wall clock is
the OS boundary, moved for the daemon alone by libfaketime; the monotonic clock is left as it is."""

from __future__ import annotations

import glob
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon import free_port
from mosquitto import Broker, Listener
from test_journal import start
from test_replay import TOPIC, journal_verdicts, key, listened
from waiting import wait_for

DAY_NS = 86_400 * 10**9
FAKETIME = next(iter(sorted(glob.glob("/usr/lib/*/faketime/libfaketimeMT.so.1"))), None)
needs_faketime = pytest.mark.skipif(
    FAKETIME is None, reason="libfaketime is absent (scripts/setup test installs the faketime package)"
)


def behind(days: int) -> dict[str, str]:
    """The environment of a daemon whose wall clock reads ``days`` days earlier than the machine's."""
    assert FAKETIME is not None
    return {"LD_PRELOAD": FAKETIME, "FAKETIME": f"-{days}d", "FAKETIME_DONT_FAKE_MONOTONIC": "1"}


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Broker]:
    b = Broker(tmp_path, free_port(), persistent=True)
    yield b
    b.close()


@pytest.mark.integration
@needs_faketime
def test_a_clock_set_forward_past_the_age_limit_between_runs_of_one_boot_keeps_the_journal_whole(tmp_path: Path) -> None:
    """Without [mqtt], the journal is the only record: the first run's verdicts, stamped on a clock
    200 days behind, are aged on the monotonic clock of the boot that recorded them, and outlive
    the next start's retention pass (before: it deleted every one)."""
    journal = tmp_path / "journal.sqlite"
    d = start(tmp_path, env=behind(200))
    try:
        d.wait_status(lambda s: s.journal is not None and s.journal.recorded >= 20)
    finally:
        d.stop()
    first = journal_verdicts(journal)
    d = start(tmp_path)
    try:
        # The journal's size is reported from its retention pass, the first of which runs at start.
        d.wait_status(lambda s: s.journal is not None and s.journal.bytes > 0 and s.journal.recorded >= 5)
    finally:
        d.stop()
    assert journal_verdicts(journal)[: len(first)] == first


@pytest.mark.integration
@needs_faketime
def test_a_clock_set_forward_past_the_age_limit_deletes_no_verdict_and_the_outage_reaches_the_broker(
    tmp_path: Path, broker: Broker
) -> None:
    """The first run records on a clock 200 days behind while the broker is away; the next runs on the
    clock as NTP set it. With ``journal.max_age_days`` at 90 every verdict of the first run looks
    past it; before, the next start's retention pass deleted them all, and the broker never had them.
    Now they stay in the journal, and reach the broker, replayed, before the new run's."""
    broker.stop()
    journal = tmp_path / "journal.sqlite"
    mqtt = {"url": f"mqtt://127.0.0.1:{broker.port}", "keepalive_s": 5}
    d = start(tmp_path, env=behind(200), mqtt=mqtt)
    try:
        d.wait_status(lambda s: s.journal is not None and s.journal.recorded >= 20 and s.mqtt_state == "disconnected")
    finally:
        d.stop()
    first = journal_verdicts(journal)
    assert max(v["capture_time_ns"] for v in first) < time.time_ns() - 199 * DAY_NS  # stamped on the clock behind
    broker.start()
    listener = Listener(broker.port, TOPIC)
    d = start(tmp_path, mqtt=mqtt)
    try:
        assert wait_for(lambda: len({key(v) for v in listened(listener)}) >= len(first) + 5, 60), d.log()
    finally:
        d.stop()
        listener.close()
    assert journal_verdicts(journal)[: len(first)] == first  # the journal's record is whole
    got = {key(v): v for v in listened(listener)}
    assert all(key(v) in got and got[key(v)]["replayed"] for v in first), [key(v) in got for v in first]
