"""Store and forward: verdicts sent to the broker from the journal, none lost to an outage of the
broker or a restart of edged, in order, those from the outage marked ``replayed``.

A historian subscribes with a persistent session (QoS 1, clean session off) to a Mosquitto that
saves its sessions, so that it is sent every verdict the broker accepted, whenever it reconnects;
what it got is compared with the journal itself.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import paho.mqtt.client as paho
import pytest
from daemon import RunningDaemon, free_port, rss_kb
from mosquitto import Broker
from test_journal import IDENTITY, entry, rows
from test_journal import start as journaled
from waiting import wait_for

from edged.messages import StatusMessage
from edged.replay import VerdictFeed, mark_replayed
from edged.settings.mqtt import topic_hostname


class Historian:
    """A paho subscriber with a persistent session; it reconnects by itself."""

    def __init__(self, port: int, topic: str) -> None:
        self.payloads: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._subscribed = threading.Event()
        self.client = paho.Client(
            callback_api_version=paho.CallbackAPIVersion.VERSION2, client_id="historian", clean_session=False
        )
        self.client.reconnect_delay_set(0.1, 1)
        self.client.on_connect = lambda c, *_: c.subscribe(topic, qos=1)
        self.client.on_subscribe = lambda *_: self._subscribed.set()
        self.client.on_message = self._on_message
        self.client.connect("127.0.0.1", port, keepalive=5)
        self.client.loop_start()
        assert self._subscribed.wait(20), "the historian did not subscribe"

    def _on_message(self, client: Any, userdata: Any, message: Any) -> None:
        with self._lock:
            self.payloads.append(json.loads(message.payload))

    def got(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self.payloads)

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def journal_verdicts(path: Path) -> list[dict[str, Any]]:
    return [json.loads(str(m)) for (m,) in rows(path, "SELECT message FROM entries WHERE kind = 'verdict' ORDER BY id")]


def key(verdict: dict[str, Any]) -> tuple[Any, ...]:
    return verdict["boot_id"], verdict["camera_id"], verdict["capture_time_ns"], verdict["seq"]


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Broker]:
    b = Broker(tmp_path, free_port(), persistent=True)
    yield b
    b.close()


def start(tmp_path: Path, port: int, realtime: bool = True) -> RunningDaemon:
    """The journal's daemon (`test_journal.start`), inspecting, with [mqtt] on the broker at ``port``."""
    return journaled(
        tmp_path, realtime=realtime, mqtt={"url": f"mqtt://127.0.0.1:{port}", "keepalive_s": 5, "max_queued": 10}
    )


def recorded(d: RunningDaemon) -> int:
    status = d.wait_status(lambda s: s.journal is not None)
    assert isinstance(status, StatusMessage) and status.journal is not None
    return status.journal.recorded


def assert_everything_after(first: int, journal: list[dict[str, Any]], got: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every journal verdict from ``first`` on reached the historian, in the journal's order (a
    verdict sent again after an unacknowledged send may come twice); returns what it got, once each."""
    once: dict[tuple[Any, ...], dict[str, Any]] = {}
    for verdict in got:
        once.setdefault(key(verdict), verdict)
    wanted = [key(v) for v in journal[first:]]
    arrived = [k for k in once if k in set(wanted)]
    assert arrived == wanted[: len(arrived)] and len(arrived) == len(wanted), (len(arrived), len(wanted))
    return [once[k] for k in wanted]


@pytest.mark.integration
def test_a_broker_outage_loses_no_verdict_and_those_from_it_come_replayed_in_order(tmp_path: Path, broker: Broker) -> None:
    topic = f"edged/{topic_hostname()}/cam0/verdict"
    historian = Historian(broker.port, topic)
    d = start(tmp_path, broker.port, realtime=False)  # frames as fast as they decode: verdicts pile up
    journal = tmp_path / "journal.sqlite"
    try:
        # Verdicts recorded before the link first came up are replayed too: wait for live ones.
        assert wait_for(lambda: sum(not v["replayed"] for v in historian.got()) >= 5, 30), d.log()
        broker.stop()
        before = recorded(d)
        live_before = max(v["seq"] for v in historian.got() if not v["replayed"])
        d.wait_status(lambda s: s.journal is not None and s.journal.recorded >= before + 100)
        rss_early = rss_kb(d.proc.pid)
        outage = d.wait_status(lambda s: s.journal is not None and s.journal.recorded >= before + 600, timeout=60)
        assert outage.mqtt_state == "disconnected"
        assert outage.mqtt_drops is not None and outage.mqtt_drops["verdict"] == 0  # none went through the outbox
        assert rss_kb(d.proc.pid) - rss_early < 4_000  # KB: the outage's verdicts wait on disk, not in memory
        broker.start()
        after = d.wait_status(lambda s: s.mqtt_state == "connected", timeout=60)
        assert after.journal is not None
        upto = after.journal.recorded
        assert wait_for(lambda: len({key(v) for v in historian.got()}) >= upto, 60), (len(historian.got()), upto)
    finally:
        d.stop()
        historian.close()
    verdicts = journal_verdicts(journal)
    sent = assert_everything_after(0, verdicts[:upto], historian.got())
    replayed = [v["seq"] for v in sent if v["replayed"] and v["seq"] > live_before]
    assert len(replayed) >= 500, len(replayed)  # those recorded while the broker was down
    assert replayed == list(range(replayed[0], replayed[-1] + 1))  # one run of them, no gap
    first_live = min(v["seq"] for v in sent if not v["replayed"])
    assert not any(v["replayed"] for v in sent if first_live <= v["seq"] <= live_before)  # live while the link was up


@pytest.mark.integration
def test_edged_restarted_during_the_outage_sends_both_runs_verdicts_once_the_broker_is_back(
    tmp_path: Path, broker: Broker
) -> None:
    topic = f"edged/{topic_hostname()}/cam0/verdict"
    historian = Historian(broker.port, topic)
    d = start(tmp_path, broker.port)
    journal = tmp_path / "journal.sqlite"
    try:
        assert wait_for(lambda: len(historian.got()) >= 3, 30), d.log()
        broker.stop()
        before = recorded(d)
        d.wait_status(lambda s: s.journal is not None and s.journal.recorded >= before + 20)
    finally:
        d.stop()
    first_run = len(journal_verdicts(journal))
    d = start(tmp_path, broker.port)
    try:
        d.wait_status(lambda s: s.journal is not None and s.journal.recorded >= 20)
        broker.start()
        d.wait_status(lambda s: s.mqtt_state == "connected", timeout=60)
        assert wait_for(lambda: len({key(v) for v in historian.got()}) >= first_run + 20, 60)
    finally:
        d.stop()
        historian.close()
    verdicts = journal_verdicts(journal)
    sent = assert_everything_after(0, verdicts[: first_run + 20], historian.got())
    assert len({v["boot_id"] for v in sent}) == 1 and sent[first_run - 1]["replayed"] and sent[first_run]["replayed"]


@pytest.mark.unit
def test_the_cursor_moves_over_acknowledged_verdicts_only_and_survives_a_reopen(tmp_path: Path) -> None:
    from edged.journal import JournalStore

    path = tmp_path / "journal.sqlite"
    store = JournalStore(path, "normal")
    store.append([entry(n) for n in range(10)], IDENTITY, None)
    feed = VerdictFeed(path, "mqtt", first_after=2)  # rows 1, 2 were there before the output
    feed.connected(live_from=10)
    sent = feed.take(4)
    assert [f.row_id for f in sent] == [3, 4, 5, 6]
    assert json.loads(sent[0].payload)["replayed"] is True  # recorded before this connection
    feed.give_back(5)  # 5 and 6 were not taken by the client after all
    assert [f.row_id for f in feed.take(2)] == [5, 6]
    feed.acked(4)
    feed.acked(3)
    feed.acked(6)  # 5 not yet: the cursor stays at 4
    feed.close()
    again = VerdictFeed(path, "mqtt", first_after=0)
    again.connected(live_from=0)
    assert [f.row_id for f in again.take(100)] == [5, 6, 7, 8, 9, 10]
    store.close()


@pytest.mark.unit
def test_a_replayed_verdict_keeps_every_field() -> None:
    message = '{"kind":"verdict","seq":3,"replayed":false,"part_id":"A-1"}'
    assert json.loads(mark_replayed(message)) == {"kind": "verdict", "seq": 3, "replayed": True, "part_id": "A-1"}
