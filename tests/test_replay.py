"""Store and forward: verdicts sent to the broker from the journal, none lost to an outage of the
broker or a restart of edged, in order, those from the outage marked ``replayed``.

A historian subscribes with a persistent session (QoS 1, clean session off) to a Mosquitto that
saves its sessions, so that it is sent every verdict the broker accepted, whenever it reconnects;
what it got is compared with the journal itself. Where only what one run of edged sends matters,
a `Listener` with a clean session subscribes just before it.
"""

from __future__ import annotations

import contextlib
import json
import signal
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import paho.mqtt.client as paho
import pytest
from daemon import RunningDaemon, free_port, rss_kb, run_cli, write_config
from mosquitto import Broker, Listener
from reports import inspecting
from test_journal import IDENTITY, entry, rows
from test_journal import start as journaled
from waiting import wait_for

from edged.config import load_config
from edged.journal import JournalOutput, JournalStore
from edged.messages import StatusMessage
from edged.mqtt import MqttOutput
from edged.replay import CURSORS, VerdictFeed, mark_replayed
from edged.settings.mqtt import topic_hostname

TOPIC = f"edged/{topic_hostname()}/cam0/verdict"


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


def verdicts_there(path: Path) -> list[dict[str, Any]]:
    """`journal_verdicts`, none while no journal is at ``path`` yet (or it has no table yet)."""
    try:
        return journal_verdicts(path)
    except sqlite3.Error:
        return []


def key(verdict: dict[str, Any]) -> tuple[Any, ...]:
    """The key docs/outputs.md gives a historian to count each verdict once."""
    return verdict["board_id"], verdict["run_id"], verdict["camera_id"], verdict["seq"]


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Broker]:
    b = Broker(tmp_path, free_port(), persistent=True)
    yield b
    b.close()


def start(tmp_path: Path, port: int, realtime: bool = True, **sections: dict[str, object]) -> RunningDaemon:
    """The journal's daemon (`test_journal.start`), inspecting, with [mqtt] on the broker at ``port``
    and ``sections`` added (``edged.toml`` in ``tmp_path``)."""
    mqtt = {"url": f"mqtt://127.0.0.1:{port}", "keepalive_s": 5, "max_queued": 10}
    return journaled(tmp_path, realtime=realtime, mqtt=mqtt, **sections)


def move_journal(d: RunningDaemon, config: Path, old: Path, new: Path) -> None:
    """SIGHUP with ``journal.path`` moved from ``old`` to ``new``; returns once the daemon records there."""
    config.write_text(config.read_text().replace(str(old), str(new)))
    d.signal(signal.SIGHUP)
    d.wait_status(lambda s: s.journal is not None and s.journal.path == str(new), timeout=30)


def listened(listener: Listener) -> list[dict[str, Any]]:
    return [json.loads(m.payload) for m in listener.on(TOPIC)]


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
    # The key the docs give a historian tells every verdict apart: seq starts again at 0 with the
    # second start, in the same boot, so board_id, boot_id, camera_id and seq would not.
    assert len({(v["board_id"], v["run_id"], v["camera_id"], v["seq"]) for v in sent}) == len(sent)
    assert len({v["run_id"] for v in sent}) == 2
    assert len({(v["board_id"], v["boot_id"], v["camera_id"], v["seq"]) for v in sent}) < len(sent)


@pytest.mark.integration
def test_verdicts_recorded_before_the_first_connection_ever_go_out_replayed_after_a_restart(
    tmp_path: Path, broker: Broker
) -> None:
    """A fresh journal, the broker away for a whole run: the next run, its broker up from the start,
    sends that run's verdicts first, replayed, then its own (before: none of the first run's, as
    the cursor was written on the first read, which only a connection made; and where the broker's
    connection came up before the journal was handed to the output, a backlog went out as live)."""
    broker.stop()
    journal = tmp_path / "journal.sqlite"
    d = start(tmp_path, broker.port)
    try:
        d.wait_status(lambda s: s.journal is not None and s.journal.recorded >= 20 and s.mqtt_state == "disconnected")
    finally:
        d.stop()
    first_run = len(journal_verdicts(journal))
    broker.start()
    listener = Listener(broker.port, TOPIC)
    d = start(tmp_path, broker.port)
    try:
        assert wait_for(lambda: len({key(v) for v in listened(listener)}) >= first_run + 20, 60), d.log()
    finally:
        d.stop()
        listener.close()
    sent = assert_everything_after(0, journal_verdicts(journal)[: first_run + 20], listened(listener))
    assert all(v["replayed"] for v in sent[:first_run])
    second_run = [v["replayed"] for v in sent[first_run:]]
    assert second_run == sorted(second_run, reverse=True)  # replayed only those recorded before the link came up


@pytest.mark.integration
def test_a_backlog_handed_over_after_the_connection_came_up_goes_out_replayed_and_new_verdicts_live(
    tmp_path: Path, broker: Broker
) -> None:
    """At a start, the MQTT thread may connect before the outputs are lent the journal (the other
    outputs take a while to start): the backlog of the run before goes out replayed all the same,
    and a verdict recorded from then on live (before: the whole backlog went out as live)."""
    settings = load_config(
        write_config(
            tmp_path / "edged.toml", inspecting(tmp_path, mqtt={"url": f"mqtt://127.0.0.1:{broker.port}", "keepalive_s": 5})
        )
    )
    path = settings.journal.file
    store = JournalStore(path, "normal")
    store.append([entry(n, "cam0", time.time_ns()) for n in range(5)], IDENTITY, None)  # within retention
    store.close()
    with contextlib.closing(sqlite3.connect(path)) as db, db:  # the run before: rows 1 and 2 acknowledged
        db.execute(CURSORS)
        db.execute("INSERT INTO cursors (name, row_id) VALUES ('mqtt', 2)")
    listener = Listener(broker.port, TOPIC)
    mqtt = MqttOutput(settings.mqtt, settings.camera_ids())
    journal = JournalOutput(settings, threading.Event())
    try:
        assert wait_for(lambda: mqtt.state == "connected", 30)
        mqtt.use_journal(journal)  # as `Outputs` does once every output is made
        journal.writer.offer(entry(5, "cam0", time.time_ns()))  # recorded while the connection is up
        listener.wait(TOPIC, 4)
    finally:
        mqtt.close()
        journal.close()
        listener.close()
    assert [(v["frame_id"], v.get("replayed", False)) for v in listened(listener)] == [
        (2, True),
        (3, True),
        (4, True),
        (5, False),
    ]


@pytest.mark.integration
def test_a_reload_that_moves_the_journal_while_connected_sends_the_new_files_verdicts_live(
    tmp_path: Path, broker: Broker
) -> None:
    """The new file's verdicts are recorded while the connection is up: none is replayed (before:
    those up to the old file's last row when the connection came up were). Then the new file is
    removed under the running daemon (a cleanup's ``rm``): edged opens journal.path anew by itself,
    and the verdicts after it are at journal.path, in `edged history`, and at the broker (before:
    written to a file no path names, seen by neither and lost at the stop, until a restart). Those
    carried to it that the broker had already had (its last second's, its cursor not yet saved) go
    again marked replayed (before: as live, a subscriber could not tell them from new ones)."""
    broker.stop()
    first, second = tmp_path / "first.sqlite", tmp_path / "second.sqlite"
    d = start(tmp_path, broker.port, journal={"path": str(first)})
    try:
        d.wait_status(lambda s: s.journal is not None and s.journal.recorded >= 30)
        broker.start()  # the connection comes up with 30 verdicts and more in the first file
        listener = Listener(broker.port, TOPIC)
        try:
            d.wait_status(lambda s: s.mqtt_state == "connected", timeout=60)
            move_journal(d, tmp_path / "edged.toml", first, second)
            assert wait_for(lambda: len(journal_verdicts(second)) >= 40, 30), d.log()
            moved = {key(v) for v in journal_verdicts(second)[:40]}
            assert wait_for(lambda: moved <= {key(v) for v in listened(listener)}, 30), d.log()
            second.unlink()
            assert wait_for(lambda: len(verdicts_there(second)) >= 20, 30), d.log()
            anew = {key(v) for v in journal_verdicts(second)[:20]}
            assert wait_for(lambda: anew <= {key(v) for v in listened(listener)}, 30), d.log()
            shown = run_cli("history", "--journal", str(second), "--json", "--limit", "1000")
            assert shown.returncode == 0, shown.stderr
            assert anew <= {key(row["message"]) for row in json.loads(shown.stdout)}
            assert "journal.path is opened anew" in d.log()
        finally:
            listener.close()
    finally:
        d.stop()
    heard: dict[tuple[Any, ...], dict[str, Any]] = {}  # each verdict as it first came
    again = [v for v in listened(listener) if heard.setdefault(key(v), v) is not v]
    assert not [v["seq"] for v in heard.values() if key(v) in moved and v["replayed"]]
    assert not [v["seq"] for v in again if not v["replayed"]]


@pytest.mark.integration
def test_a_reload_that_moves_the_journal_during_an_outage_sends_the_old_files_backlog_first(
    tmp_path: Path, broker: Broker
) -> None:
    """The verdicts the old file holds past its cursor go out once the broker is back, in order,
    replayed, before the new file's (before: they were never sent)."""
    historian = Historian(broker.port, TOPIC)
    first, second = tmp_path / "first.sqlite", tmp_path / "second.sqlite"
    d = start(tmp_path, broker.port, journal={"path": str(first)})
    try:
        assert wait_for(lambda: len(historian.got()) >= 3, 30), d.log()
        d.wait_status(lambda s: s.mqtt_state == "connected")  # past the statuses from before the connection
        broker.stop()
        d.wait_status(lambda s: s.mqtt_state == "disconnected")
        outage = len(journal_verdicts(first))  # from here on, recorded while edged knew the broker away
        d.wait_status(lambda s: s.journal is not None and s.journal.recorded >= outage + 20)
        move_journal(d, tmp_path / "edged.toml", first, second)
        assert wait_for(lambda: len(journal_verdicts(second)) >= 20, 30), d.log()
        verdicts = journal_verdicts(first) + journal_verdicts(second)[:20]
        broker.start()
        assert wait_for(lambda: len({key(v) for v in historian.got()}) >= len(verdicts), 60), d.log()
    finally:
        d.stop()
        historian.close()
    sent = assert_everything_after(0, verdicts, historian.got())
    assert all(v["replayed"] for v in sent[outage:])


@pytest.mark.unit
def test_the_cursor_is_written_as_the_feed_is_made_so_a_run_that_never_connected_is_sent_by_the_next(
    tmp_path: Path,
) -> None:
    path = tmp_path / "journal.sqlite"
    store = JournalStore(path, "normal")
    store.append([entry(n) for n in range(3)], IDENTITY, None)  # before the output was there
    VerdictFeed(path, "mqtt", first_after=3).close()  # a run whose broker never came
    store.append([entry(n) for n in range(3, 6)], IDENTITY, None)
    store.close()
    again = VerdictFeed(path, "mqtt", first_after=6)  # the next start
    again.connected()
    assert [(f.row_id, json.loads(f.payload)["replayed"]) for f in again.take(10)] == [(4, True), (5, True), (6, True)]
    again.close()


@pytest.mark.unit
def test_a_journal_moved_aside_as_damaged_before_the_first_read_has_every_verdict_of_the_new_one_sent(
    tmp_path: Path,
) -> None:
    path = tmp_path / "journal.sqlite"
    store = JournalStore(path, "normal")
    store.append([entry(n) for n in range(5)], IDENTITY, None)
    store.close()
    feed = VerdictFeed(path, "mqtt", first_after=5)  # made while the broker is away
    path.write_bytes(b"this is not a journal\n" * 400)
    store = JournalStore(path, "normal")
    store.append([entry(n) for n in range(5, 8)], IDENTITY, None)  # moved aside, a new journal started
    store.close()
    feed.connected()
    assert [f.row_id for f in feed.take(10)] == [1, 2, 3]
    feed.close()


def damage_index(path: Path) -> None:
    """Garbage over the root page of the part-id index, as a failing SD card leaves it: the next
    insert meets it ("database disk image is malformed"); the rows stay readable."""
    with contextlib.closing(sqlite3.connect(path)) as db:
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # the pages in the file itself
        root = db.execute("SELECT rootpage FROM sqlite_master WHERE name = 'entries_part'").fetchone()[0]
        size = db.execute("PRAGMA page_size").fetchone()[0]
    with path.open("r+b") as f:
        f.seek((root - 1) * size)
        f.write(b"\xa5" * size)


@pytest.mark.unit
def test_a_journal_found_damaged_while_edged_runs_has_the_new_files_verdicts_sent(tmp_path: Path) -> None:
    """Damage met while edged runs moves the journal aside and starts a new one at its path; the feed
    read the old file on, and not one verdict more reached the broker until edged restarted
    (before: none of the new file's). Now the new file's go, in order, as they are; the old file's
    verdicts handed out and acknowledged late move no cursor of the new one."""
    path = tmp_path / "journal.sqlite"
    settings = load_config(write_config(tmp_path / "edged.toml", inspecting(tmp_path, journal={"path": str(path)})))
    output = JournalOutput(settings, threading.Event())
    try:
        feed = output.feed("mqtt", threading.Event())
        for n in range(5):
            output.writer.offer(entry(n))
        assert wait_for(lambda: output.writer.written == 5)
        old = feed.take(10)
        feed.acked(old[0].row_id)  # the broker had the first; 2 to 5 are in flight
        damage_index(path)
        for n in range(5, 8):
            output.writer.offer(entry(n))
        assert wait_for(lambda: output.writer.written == 8, 10), output.writer.report("cam")
        assert len(list(tmp_path.glob("journal.sqlite.damaged-*[0-9]"))) == 1  # moved aside
        new = feed.take(10)
        assert [(f.row_id, json.loads(f.payload)["frame_id"]) for f in new] == [(1, 5), (2, 6), (3, 7)]
        assert not any(json.loads(f.payload).get("replayed") for f in new)
        for f in old[1:] + new[:2]:
            feed.acked(f.row_id)
        feed.close()
        assert rows(path, "SELECT row_id FROM cursors") == [(2,)]  # the new file's first two, no more
    finally:
        output.close()


@pytest.mark.unit
def test_a_journal_with_no_file_yet_is_neither_made_nor_an_error(tmp_path: Path) -> None:
    """A journal that records nothing has no file until its first entry, made and locked by its
    writer alone (before: the feed made a bare one, and logged "no such table" every minute)."""
    path = tmp_path / "journal.sqlite"
    feed = VerdictFeed(path, "mqtt", first_after=0)
    feed.connected()
    assert feed.take(10) == [] and feed.errors == 0 and not path.exists()
    feed.close()


@pytest.mark.unit
def test_the_cursor_moves_over_acknowledged_verdicts_only_and_survives_a_reopen(tmp_path: Path) -> None:
    path = tmp_path / "journal.sqlite"
    store = JournalStore(path, "normal")
    store.append([entry(n) for n in range(10)], IDENTITY, None)
    feed = VerdictFeed(path, "mqtt", first_after=2)  # rows 1, 2 were there before the output
    feed.connected()  # with all 10 recorded
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
    again.connected()
    assert [f.row_id for f in again.take(100)] == [5, 6, 7, 8, 9, 10]
    store.close()


def test_the_first_acknowledgement_is_written_at_once_on_a_board_just_up_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cursor is written at most every `SAVE_EVERY_S`, which was counted from a write at the boot:
    on a board up less than that, the first acknowledgements waited (a power cut sent them again)."""
    monkeypatch.setattr("edged.replay.SAVE_EVERY_S", time.monotonic() + 3600.0)  # longer than this machine is up
    path = tmp_path / "journal.sqlite"
    store = JournalStore(path, "normal")
    store.append([entry(n) for n in range(3)], IDENTITY, None)
    feed = VerdictFeed(path, "mqtt", first_after=0)
    feed.connected()
    assert [f.row_id for f in feed.take(3)] == [1, 2, 3]
    feed.acked(1)
    feed.acked(2)  # within the interval: written at the close
    cursor = "SELECT row_id FROM cursors WHERE name = 'mqtt'"
    assert [row for (row,) in rows(path, cursor)] == [1]
    feed.close()
    assert [row for (row,) in rows(path, cursor)] == [2]
    store.close()


@pytest.mark.unit
def test_a_replayed_verdict_keeps_every_field() -> None:
    message = '{"kind":"verdict","seq":3,"replayed":false,"part_id":"A-1"}'
    assert json.loads(mark_replayed(message)) == {"kind": "verdict", "seq": 3, "replayed": True, "part_id": "A-1"}
