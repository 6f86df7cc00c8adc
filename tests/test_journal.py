"""The verdict journal: rows that say what, when, with which model and where; a damaged file moved
aside; retention; a full or read-only disk counted while nothing queued is lost; the daemon's own."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import logging
import os
import shutil
import signal
import sqlite3
import threading
import time
from pathlib import Path

import pytest
import zmq
from daemon import RunningDaemon, free_port, run_cli, write_config, write_video
from filesystems import fill, read_only_folder, tmpfs
from onnx_models import fixed_scene
from reports import inspecting
from test_http import get
from waiting import wait_for

from edged import history, journal
from edged.config import Settings, load_config
from edged.errors import EXIT_CONFIG, ConfigError
from edged.identity import CLOCK_EPOCH_NS, Identity, board_id, boot_id
from edged.journal import Entry, JournalOutput, JournalStore, JournalWriter
from edged.messages import AnyMessage, StatusMessage, VerdictMessage, parse_message
from edged.output import Services
from edged.reload import Reloads, Replacement, load_replacement
from edged.replay import VerdictFeed
from edged.settings.journal import JournalConfig

IDENTITY = Identity("b0a4d1d000000000", "boot-1", "9.9.9")
SERVICES = Services(lambda: None, threading.Event())


def entry(n: int, camera_id: str = "cam", wall_ns: int | None = None, size: int = 0) -> Entry:
    message = json.dumps({"kind": "verdict", "frame_id": n, "pad": "x" * size}).encode()
    wall = 1_700_000_000_000_000_000 + n if wall_ns is None else wall_ns
    return Entry("verdict", camera_id, n, n, f"P-{n}", "ng", "[]", wall, n, "m" * 64, "c" * 64, message)


def mqtt_journal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Settings, JournalOutput]:
    """A journal delivering to MQTT (a broker nobody listens for), which looks at journal.path before every write."""
    monkeypatch.setattr(journal, "LOOK_EVERY_S", 0.0)
    path = tmp_path / "journal.sqlite"
    mqtt: dict[str, dict[str, object]] = {"mqtt": {"url": "mqtt://127.0.0.1:1"}}
    settings = load_config(write_config(tmp_path / "edged.toml", inspecting(tmp_path, journal={"path": str(path)}, **mqtt)))
    return path, settings, JournalOutput(settings, threading.Event())


def rows(path: Path, query: str = "SELECT frame_id FROM entries ORDER BY id") -> list[tuple[object, ...]]:
    """Read as another process would: its own connection, while the writer may still be open."""
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
        return db.execute(query).fetchall()


def writer(path: Path, **keys: object) -> JournalWriter:
    cfg = JournalConfig(path=path, **keys)
    w = JournalWriter(cfg, IDENTITY, previous=None)
    w.start(records=True)
    return w


@pytest.mark.unit
def test_a_row_says_what_when_with_which_model_and_where(tmp_path: Path) -> None:
    path = tmp_path / "journal.sqlite"
    w = writer(path)
    try:
        for n in range(5):
            w.offer(entry(n))
        assert wait_for(lambda: w.report("cam").recorded == 5)
        got = rows(path, f"SELECT {', '.join(journal.COLUMNS)} FROM entries ORDER BY id")
        assert [r[2] for r in got] == [0, 1, 2, 3, 4]  # read while the writer holds the file: WAL
        (kind, camera, frame, seq, part, verdict, reasons, wall, mono, synced, model, config, version, board, boot) = got[1][
            :15
        ]
        evidence, msg = got[1][15:]
        assert evidence is None
        assert (kind, camera, frame, seq, part, verdict, reasons) == ("verdict", "cam", 1, 1, "P-1", "ng", "[]")
        assert (wall, mono, model, config) == (1_700_000_000_000_000_001, 1, "m" * 64, "c" * 64)
        assert (version, board, boot) == ("9.9.9", "b0a4d1d000000000", "boot-1")
        assert synced in (0, 1, None)
        assert json.loads(msg)["frame_id"] == 1
    finally:
        w.stop(5)
    assert rows(path, "PRAGMA journal_mode") == [("wal",)]


@pytest.mark.unit
def test_the_board_id_is_derived_from_the_machine_id_not_equal_to_it(tmp_path: Path) -> None:
    machine = tmp_path / "machine-id"
    machine.write_text("0123456789abcdef0123456789abcdef\n")
    derived = board_id(machine)
    assert len(derived) == 16 and derived not in machine.read_text()
    assert board_id(machine) == derived
    assert board_id(tmp_path / "none") == "unknown"


@pytest.mark.unit
@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_a_damaged_journal_is_moved_aside_and_a_new_one_started(tmp_path: Path, damage: str) -> None:
    path = tmp_path / "journal.sqlite"
    if damage == "garbage":
        path.write_bytes(b"this is not a journal\n" * 400)
    else:
        w = writer(path)
        for n in range(2000):
            w.offer(entry(n, size=200))
        assert wait_for(lambda: w.report("cam").recorded == 2000, 20)
        w.stop(5)
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    store = JournalStore(path, "normal")
    store.open()
    store.append([entry(7)], IDENTITY, None)
    store.close()
    aside = [p.name for p in tmp_path.iterdir() if ".damaged-" in p.name]
    assert aside and aside[0].startswith("journal.sqlite.damaged-")
    assert rows(path) == [(7,)]


@pytest.mark.unit
def test_a_journal_damaged_again_at_the_same_clock_time_keeps_the_one_moved_aside_before(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A board without a real-time clock boots to the same time each time: a journal damaged at one
    boot and another at the next were moved aside under one name, the second replacing the first."""
    monkeypatch.setattr(time, "strftime", lambda format, *when: "20260101T000012")  # the clock as booted, twice
    path = tmp_path / "journal.sqlite"
    for boot in ("first", "second"):
        path.write_bytes(f"the {boot} damaged journal\n".encode() * 400)
        store = JournalStore(path, "normal")
        store.open()
        store.close()
    aside = sorted(p.name for p in tmp_path.glob("journal.sqlite.damaged-*"))
    assert aside == ["journal.sqlite.damaged-20260101T000012", "journal.sqlite.damaged-20260101T000012-2"]
    assert [(tmp_path / name).read_bytes()[:10] for name in aside] == [b"the first ", b"the second"]


@pytest.mark.unit
def test_a_journal_with_another_tables_columns_is_moved_aside_kept_whole_and_a_new_one_started(tmp_path: Path) -> None:
    path = tmp_path / "journal.sqlite"
    with sqlite3.connect(path) as db:  # another version's table: "no such column" on every write, for ever
        db.execute("CREATE TABLE entries (id INTEGER PRIMARY KEY AUTOINCREMENT, kind TEXT NOT NULL, v2 TEXT)")
        db.execute("INSERT INTO entries (kind, v2) VALUES ('verdict', 'theirs')")
    db.close()
    w = writer(path)
    w.offer(entry(7))
    assert wait_for(lambda: w.report("cam").recorded == 1, 20), w.report("cam")
    w.stop(5)
    assert w.report("cam").errors == 0 and rows(path) == [(7,)]
    aside = [p for p in tmp_path.glob("journal.sqlite.damaged-*") if not p.name.endswith(("-wal", "-shm"))]
    assert len(aside) == 1 and rows(aside[0], "SELECT v2 FROM entries") == [("theirs",)]


@pytest.mark.unit
def test_a_journal_an_earlier_edged_wrote_gains_the_columns_added_since_and_keeps_its_rows(tmp_path: Path) -> None:
    """A column added in a later version (NULL allowed, as every later one is) is added to an earlier
    edged's table: its rows, the verdicts MQTT has not yet had among them, stay where an upgrade
    finds them (before: the journal went aside as another version's, and they were never sent)."""
    path = tmp_path / "journal.sqlite"
    store = JournalStore(path, "normal")
    store.append([entry(1), entry(2)], IDENTITY, None)
    store.close()
    with sqlite3.connect(path) as db:
        db.execute("ALTER TABLE entries DROP COLUMN evidence")  # as an edged from before the column wrote it
    db.close()
    store = JournalStore(path, "normal")
    store.open()
    store.append([entry(3)], IDENTITY, None)
    store.close()
    assert rows(path) == [(1,), (2,), (3,)] and not list(tmp_path.glob("journal.sqlite.damaged-*"))
    assert rows(path, "SELECT evidence IS NULL FROM entries ORDER BY id")[:2] == [(1,), (1,)]


@pytest.mark.unit
def test_retention_deletes_by_age_then_the_oldest_until_under_its_size(tmp_path: Path) -> None:
    path = tmp_path / "journal.sqlite"
    store = JournalStore(path, "normal")
    day_ns = 86_400 * 10**9
    now = CLOCK_EPOCH_NS + 100 * day_ns
    store.append([entry(n, wall_ns=now - (40 - n) * day_ns) for n in range(40)], IDENTITY, None)
    assert store.prune(now, max_age_days=30, max_bytes=10**9) == 10  # ages 40..31 days
    assert rows(path)[0] == (10,)
    store.append([entry(n, wall_ns=now, size=2000) for n in range(40, 400)], IDENTITY, None)
    assert store.size() > 200_000
    store.prune(now, max_age_days=0, max_bytes=200_000)
    left = [r[0] for r in rows(path)]
    assert store.size() <= 200_000 and left == list(range(left[0], 400))  # the newest kept, in order
    assert path.stat().st_size < 400 * 2000  # the space went back to the file system
    store.close()


DAY_NS = 86_400 * 10**9
EARLIER = Identity(IDENTITY.board_id, "boot-0", IDENTITY.version)  # a boot of the same board before this one


def at(n: int, wall_ns: int, mono_ns: int, kind: str = "verdict") -> Entry:
    """Entry ``n`` stamped ``wall_ns`` on the wall clock and ``mono_ns`` on the monotonic clock."""
    return dataclasses.replace(entry(n, wall_ns=wall_ns), mono_ns=mono_ns, kind=kind)


@pytest.mark.unit
def test_a_clock_stepped_forward_past_the_age_limit_deletes_no_row_of_this_boot(tmp_path: Path) -> None:
    """A board without a real-time clock records for days on a clock months behind, then NTP steps it
    forward: the rows of this boot are aged on the monotonic clock, which the step left alone, so
    none goes early (before: every one, each looking 200 days old). An earlier boot's rows stamped
    on a clock NTP had set have only their wall time, and go by it."""
    path = tmp_path / "journal.sqlite"
    store = JournalStore(path, "normal")
    wall, mono = CLOCK_EPOCH_NS + 100 * DAY_NS, 5 * DAY_NS  # the clock as booted; five days up
    store.append([at(n, wall - 60 * DAY_NS, mono) for n in range(3)], EARLIER, True)
    store.append([at(n, wall + (n - 3) * DAY_NS, mono + (n - 3) * DAY_NS) for n in range(3, 6)], IDENTITY, False)
    stepped = wall + 200 * DAY_NS  # two days on, NTP sets the clock 200 days later
    assert store.prune(stepped, 30, 10**9, boot=(IDENTITY.boot_id, mono + 2 * DAY_NS)) == 3  # the earlier boot's
    assert rows(path) == [(3,), (4,), (5,)]
    assert store.prune(stepped + 29 * DAY_NS, 30, 10**9, boot=(IDENTITY.boot_id, mono + 31 * DAY_NS)) == 1
    assert rows(path) == [(4,), (5,)]  # 31 days on the monotonic clock: the first is past the limit, and went
    store.close()


def backlog(path: Path, wall_ns: int) -> None:
    """An outage's ten verdicts and two detections messages, recorded by an earlier boot at ``wall_ns``
    on a clock NTP had set, MQTT's cursor after the fourth (all it had acknowledged)."""
    store = JournalStore(path, "normal")
    store.append([at(n, wall_ns, n, "detections" if n in (3, 8) else "verdict") for n in range(1, 13)], EARLIER, True)
    store.close()
    VerdictFeed(path, "mqtt", first_after=4)  # the feed writes its cursor as it is made


@pytest.mark.unit
def test_age_never_deletes_a_verdict_the_broker_has_not_acknowledged_and_size_still_bounds_them(tmp_path: Path) -> None:
    """The backlog of an outage months ago looks past any age limit: age deletes what MQTT had
    acknowledged (up to its cursor) and the detections messages, never a verdict still to send;
    ``max_bytes`` still bounds those."""
    path = tmp_path / "journal.sqlite"
    wall = CLOCK_EPOCH_NS + 100 * DAY_NS
    backlog(path, wall)
    store = JournalStore(path, "normal")
    boot = (IDENTITY.boot_id, DAY_NS)
    assert store.prune(wall + 200 * DAY_NS, 90, 10**9, boot=boot, keep_unsent=True) == 5  # ids 1..4, and 8
    assert rows(path, "SELECT id FROM entries ORDER BY id") == [(5,), (6,), (7,), (9,), (10,), (11,), (12,)]
    store.append([entry(n, size=20_000) for n in range(13, 40)], IDENTITY, None)
    store.prune(wall + 200 * DAY_NS, 90, 300_000, boot=boot, keep_unsent=True)
    assert store.size() <= 300_000 and (5,) not in rows(path, "SELECT id FROM entries")  # the oldest went for room
    store.close()


def held_snapshot(path: Path) -> sqlite3.Connection:
    """Another process's read left open on the snapshot of now, as ``sqlite3 journal.sqlite 'SELECT
    ...' | less`` holds one while the pager stops reading: COMMIT on it lets go."""
    reader = sqlite3.connect(f"file:{path}?mode=ro", uri=True, isolation_level=None)
    reader.execute("BEGIN")
    reader.execute("SELECT count(*) FROM entries").fetchone()
    return reader


@pytest.mark.unit
def test_a_reader_on_an_old_snapshot_holds_up_no_retention_pass(tmp_path: Path) -> None:
    """The pass's checkpoint waited for such a reader its whole busy timeout (5 s) on the journal's
    thread, every minute, and every verdict sent only once recorded waited as long; it folds what
    it can at once instead, and says whether the write-ahead log is empty."""
    path = tmp_path / "journal.sqlite"
    store = JournalStore(path, "normal")
    store.append([entry(n, size=1000) for n in range(100)], IDENTITY, None)
    reader = held_snapshot(path)
    store.append([entry(n, size=1000) for n in range(100, 400)], IDENTITY, None)
    started = time.monotonic()
    assert store.prune(time.time_ns(), 0, 100_000) > 300
    assert time.monotonic() - started < 1.0  # before: 5.1 s
    assert not store.folded and store.wal_bytes() > 100_000  # the reader keeps the log from being folded
    reader.execute("COMMIT")
    store.prune(time.time_ns(), 0, 100_000)
    assert store.folded and store.wal_bytes() == 0 and store.size() <= 100_000
    reader.close()
    store.close()


@pytest.mark.unit
def test_a_write_ahead_log_a_reader_keeps_past_max_bytes_is_counted_and_said_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Before, `bytes` gave the pages alone (1.9 MB of a 2 MB bound while the log beside took 50 MB),
    and nothing was said."""
    monkeypatch.setattr(journal, "PRUNE_EVERY_S", 0.02)
    caplog.set_level(logging.INFO, logger="edged.journal")
    path = tmp_path / "journal.sqlite"
    w = writer(path, max_bytes=100_000)
    try:
        w.offer(entry(0))
        assert wait_for(lambda: w.written == 1)
        reader = held_snapshot(path)
        for n in range(1, 400):
            w.offer(entry(n, size=1000))
        assert wait_for(lambda: "cannot be folded" in caplog.text, 10), w.report("cam")
        assert w.report("cam").bytes > 100_000  # the log counted, as the disk holds it
        reader.execute("COMMIT")
        reader.close()
        assert wait_for(lambda: "folded into it again" in caplog.text, 10)
        assert wait_for(lambda: w.report("cam").bytes <= 100_000)
    finally:
        w.stop(2)
    assert caplog.text.count("cannot be folded") == 1


@pytest.mark.unit
def test_verdicts_deleted_for_room_before_the_broker_had_them_are_said_and_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A broker away so long that the journal reaches max_bytes: the oldest verdicts go, as docs say,
    and those it had not acknowledged are said, how many, never those it had (before: not a word),
    and counted in the status for an alert (before: in the log alone), on across a reload's writer."""
    monkeypatch.setattr(journal, "PRUNE_EVERY_S", 0.02)
    path = tmp_path / "journal.sqlite"
    w = JournalWriter(JournalConfig(path=path, max_bytes=100_000), IDENTITY, previous=None, keep_unsent=True)
    w.start(records=True)
    try:
        feed = VerdictFeed(path, "mqtt", first_after=0)
        for n in range(10):
            w.offer(entry(n, size=1000))
        assert wait_for(lambda: w.written == 10)
        for forward in feed.take(10):
            feed.acked(forward.row_id)
        feed.close()  # the cursor written: the broker had the first ten
        for n in range(10, 400):
            w.offer(entry(n, size=1000))
        assert wait_for(lambda: w.written == 400, 10)
        assert wait_for(lambda: "has not acknowledged" in caplog.text, 5)
    finally:
        w.stop(2)
    kept = [r[0] for r in rows(path, "SELECT id FROM entries ORDER BY id")]
    lost = 390 - len([row_id for row_id in kept if row_id > 10])
    said = [int(r.getMessage().split(": ")[1].split()[0]) for r in caplog.records if "not acknowledged" in r.getMessage()]
    assert lost > 0 and sum(said) == lost == w.store.unsent_deleted == w.report("cam").unsent_deleted
    after_reload = JournalWriter(JournalConfig(path=tmp_path / "other.sqlite"), IDENTITY, previous=w)
    assert after_reload.report("cam").unsent_deleted == lost


@pytest.mark.unit
def test_a_journal_removed_under_the_writer_is_said(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``rm journal.sqlite`` while edged runs: every verdict since went into a file no path names, gone
    at the next start and unseen by `edged history`; its ``-wal`` removed, history reads the file
    without it, and a kill loses it. Before, nothing said so; now each once, and the end of it, with
    journal.path opened anew (below) and the rows folded into the file while its -wal is away."""
    monkeypatch.setattr(journal, "PRUNE_EVERY_S", 0.02)
    caplog.set_level(logging.INFO, logger="edged.journal")
    path = tmp_path / "journal.sqlite"
    w = writer(path)
    try:
        w.offer(entry(0))
        assert wait_for(lambda: w.written == 1)
        wal = path.with_name("journal.sqlite-wal")
        wal.rename(tmp_path / "wal")
        assert wait_for(lambda: f"journal {path} was left without its -wal while edged writes it" in caplog.text)
        (tmp_path / "wal").rename(wal)
        assert wait_for(lambda: "at journal.path again" in caplog.text)
        path.unlink()
        assert wait_for(lambda: f"journal {path} was moved away or removed while edged wrote it" in caplog.text)
    finally:
        w.stop(2)


def restored(tmp_path: Path) -> Path:
    """A backup of a journal as a copy of its files, rows 100 and 101 still in its -wal."""
    backup = JournalStore(tmp_path / "backup.sqlite", "normal")
    backup.append([entry(100), entry(101)], IDENTITY, None)
    for suffix in ("", "-wal"):
        shutil.copyfile(f"{backup.path}{suffix}", tmp_path / f"restore.sqlite{suffix}")
    backup.close()
    return tmp_path / "restore.sqlite"


@pytest.mark.unit
@pytest.mark.parametrize("there", ["nothing", "a journal with its -wal", "a file that is not a journal"])
def test_a_journal_removed_or_replaced_under_the_store_is_opened_anew_with_the_rows_no_path_showed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, there: str
) -> None:
    """``rm journal.sqlite``, or a backup restored over it, while edged writes: the rows written since
    the last look went to a file no path names (before: so did every row after them, until edged
    restarted). The next look opens journal.path as a start would (a new journal, the one restored,
    or a file that is not one moved aside) and writes those rows to it first. The old file's -wal and
    -shm left beside its name go, as SQLite would read that -wal as the new file's; a restored
    journal's own -wal stays, and its rows with it."""
    monkeypatch.setattr(journal, "LOOK_EVERY_S", 0.0)
    path = tmp_path / "journal.sqlite"
    store = JournalStore(path, "normal")
    store.append([entry(n) for n in range(3)], IDENTITY, None)
    assert store.follow(keep_unsent=False) is None  # journal.path names it: these three were seen there
    if there == "nothing":
        path.unlink()
    elif there == "a journal with its -wal":
        backup = restored(tmp_path)
        for suffix in ("-wal", ""):
            os.replace(f"{backup}{suffix}", f"{path}{suffix}")
    else:
        (tmp_path / "other").write_bytes(b"not a journal\n" * 400)
        os.replace(tmp_path / "other", path)
    store.append([entry(n) for n in range(3, 5)], IDENTITY, None)  # into the file no path names
    reopened = store.follow(keep_unsent=False)
    store.append([entry(5)], IDENTITY, None)
    store.close()
    assert reopened is not None and (reopened.carried, reopened.lost) == (2, 0)
    assert rows(path, "PRAGMA quick_check") == [("ok",)]
    if there == "nothing":
        assert (reopened.was, reopened.now) == ("moved away or removed", "a new journal")
        assert [r[0] for r in rows(path)] == [3, 4, 5]
    elif there == "a journal with its -wal":
        assert (reopened.was, reopened.now) == ("replaced", "the journal found there (its newest entry 2)")
        assert [r[0] for r in rows(path)] == [100, 101, 3, 4, 5]
    else:
        assert reopened.was == "replaced" and reopened.now.startswith("a new journal (the file found there was not one")
        assert [r[0] for r in rows(path)] == [3, 4, 5]
        assert [p.read_bytes()[:13] for p in tmp_path.glob("journal.sqlite.damaged-*[0-9]")] == [b"not a journal"]


@pytest.mark.unit
def test_a_journal_removed_while_the_broker_is_away_sends_what_it_had_not_acknowledged_from_the_new_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """With [mqtt], the journal removed while the broker had acknowledged two of five verdicts: the
    other three were in a file no path names, and never sent (the feed found no journal at its
    path). They are written to the journal opened anew, and the feed sends them from it, then the
    new ones, in order; the reopening is counted as a journal error, named in ``last_error``.
    Removed again once those are acknowledged, they do not go again, only those after them; the feed
    says at most once that it reads a new file."""
    path, _, output = mqtt_journal(tmp_path, monkeypatch)
    try:
        feed = output.feed("mqtt", threading.Event())
        for n in range(5):  # a batch each, each looked at journal.path before: all seen there
            output.writer.offer(entry(n))
            assert wait_for(lambda n=n: output.writer.written == n + 1)
        for forward in feed.take(2):
            feed.acked(forward.row_id)
        feed.close()  # the cursor written: the broker had the first two
        path.unlink()
        for n in range(5, 7):
            output.writer.offer(entry(n))
        assert wait_for(lambda: output.writer.written == 7)
        taken = feed.take(10)
        assert [json.loads(forward.payload)["frame_id"] for forward in taken] == [2, 3, 4, 5, 6]
        for forward in taken:
            feed.acked(forward.row_id)
        feed.close()
        output.writer.offer(entry(7))
        assert wait_for(lambda: output.writer.written == 8)
        path.unlink()
        output.writer.offer(entry(8))
        assert wait_for(lambda: output.writer.written == 9)
        assert [json.loads(forward.payload)["frame_id"] for forward in feed.take(10)] == [7, 8]
        feed.close()
        report = output.writer.report("cam")
        assert report.errors == 2 and report.last_error is not None and "removed while edged wrote it" in report.last_error
        assert caplog.text.count("the file read before is gone from there") <= 1  # none where a new file has its inode
    finally:
        output.close()


@pytest.mark.unit
def test_a_journal_removed_again_and_again_is_opened_anew_each_time_said_once_and_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A cleanup that removes journal.sqlite each time it finds it: each entry after a removal is at
    journal.path, where `edged history` finds it (before: none was, until a restart); each
    reopening counted, one line said for them all, and the journal's lock held beside the new file."""
    monkeypatch.setattr(journal, "LOOK_EVERY_S", 0.0)
    caplog.set_level(logging.INFO, logger="edged.journal")
    path = tmp_path / "journal.sqlite"
    w = writer(path)
    try:
        for n in range(0, 8, 2):
            w.offer(entry(n))
            assert wait_for(lambda n=n: w.written == n + 1)
            path.unlink()
            w.offer(entry(n + 1))
            assert wait_for(lambda n=n: w.written == n + 2)
            assert [row["frame_id"] for row in history.entries(path, history.Query())][-1] == n + 1
        with pytest.raises(OSError, match="in use by another edged"):
            journal.lock(path)
    finally:
        w.stop(2)
    said = [r for r in caplog.records if "was moved away or removed while edged wrote it" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING, [r.getMessage() for r in said]
    assert "journal.path is opened anew, a new journal" in said[0].getMessage()
    assert w.report("cam").errors == 4 and not w.failures.failing


@pytest.mark.unit
def test_a_journal_whose_folder_is_removed_is_counted_until_it_is_back_then_opened_anew(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The journal's folder removed (before: written on into files no path names, not a word):
    counted as journal errors while it cannot be opened, the entries waiting in memory, and once the
    folder is back journal.path is opened anew with them, the one written to the old file first."""
    monkeypatch.setattr(journal, "LOOK_EVERY_S", 0.0)
    monkeypatch.setattr(journal, "IDLE_LOOK_S", 3600.0)  # no look between the first row and its removal
    monkeypatch.setattr(journal, "RETRY_S", (0.05, 0.2))
    caplog.set_level(logging.INFO, logger="edged.journal")
    folder = tmp_path / "state"
    folder.mkdir()
    path = folder / "journal.sqlite"
    w = writer(path)
    try:
        w.offer(entry(0))
        assert wait_for(lambda: w.written == 1)
        shutil.rmtree(folder)
        w.offer(entry(1))
        assert wait_for(lambda: w.report("cam").errors >= 2), w.report("cam")
        assert not w.writing
        folder.mkdir()
        assert wait_for(lambda: w.written == 2, 10), w.report("cam")
        assert [r[0] for r in rows(path)] == [0, 1]
    finally:
        w.stop(2)
    assert "was moved away or removed while edged wrote it: journal.path is opened anew, a new journal" in caplog.text
    assert "written again after" in caplog.text


@pytest.mark.unit
@pytest.mark.parametrize("then", ["reload", "stop"])
def test_what_a_journal_whose_folder_is_gone_held_goes_to_a_reloads_journal_or_is_counted_lost_at_the_stop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, then: str
) -> None:
    """The folder gone, then a reload that moves the journal (to rescue it) or a stop: the row written
    to the old file since the last look, and the entry waiting in memory, go to the new journal first,
    in order; at a stop both are counted as dropped and said lost."""
    monkeypatch.setattr(journal, "LOOK_EVERY_S", 0.0)
    monkeypatch.setattr(journal, "IDLE_LOOK_S", 3600.0)  # no look between the first row and its removal
    monkeypatch.setattr(journal, "RETRY_S", (0.05, 0.2))
    folder = tmp_path / "state"
    folder.mkdir()
    w = writer(folder / "journal.sqlite")
    w.offer(entry(0))
    assert wait_for(lambda: w.written == 1)
    shutil.rmtree(folder)
    w.offer(entry(1))
    assert wait_for(lambda: w.report("cam").errors >= 2), w.report("cam")
    left = w.stop(2)
    if then == "stop":
        w.give_up(left)
        assert w.report("cam").dropped == 2 and "stopping with 2 entries not written" in caplog.text
        return
    moved = JournalWriter(JournalConfig(path=tmp_path / "other.sqlite"), IDENTITY, previous=w, carried=left)
    moved.start(records=True)
    try:
        assert wait_for(lambda: moved.written == 1)
        assert [r[0] for r in rows(tmp_path / "other.sqlite")] == [0, 1]
    finally:
        moved.stop(2)


@pytest.mark.unit
def test_a_journal_left_without_its_wal_folds_each_batch_into_the_file_history_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``rm journal.sqlite-wal`` alone: the file is still at journal.path, its rows since written to a
    log no path names, which `edged history` (reading the file alone, as no -wal is beside it) never
    saw and a kill took (before). Each batch is now folded into the file at once; said once."""
    monkeypatch.setattr(journal, "LOOK_EVERY_S", 0.0)
    monkeypatch.setattr(journal, "PRUNE_EVERY_S", 0.02)
    path = tmp_path / "journal.sqlite"
    w = writer(path)
    try:
        w.offer(entry(0))
        assert wait_for(lambda: w.written == 1)
        Path(f"{path}-wal").unlink()
        for n in range(1, 4):
            w.offer(entry(n))
            assert wait_for(lambda n=n: w.written == n + 1)
        assert [row["frame_id"] for row in history.entries(path, history.Query())] == [0, 1, 2, 3]
        assert wait_for(lambda: f"journal {path} was left without its -wal while edged writes it" in caplog.text)
    finally:
        w.stop(2)
    assert caplog.text.count("left without its -wal") == 1


@pytest.mark.unit
def test_a_stop_right_after_the_journal_is_removed_writes_what_the_removed_file_held_to_journal_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``rm journal.sqlite; systemctl restart edged``: the rows recorded since the last look (a second
    apart) went to the removed file, and the stop let it go with them, sent and on no record, its
    -wal and -shm left at journal.path's name (before). The stop looks once more: they are there."""
    monkeypatch.setattr(journal, "LOOK_EVERY_S", 3600.0)  # the first write's look, then only the stop's
    path = tmp_path / "journal.sqlite"
    w = writer(path)
    w.offer(entry(0))
    assert wait_for(lambda: w.written == 1)
    path.unlink()
    w.offer(entry(1))
    assert wait_for(lambda: w.written == 2)
    w.give_up(w.stop(2))
    assert [r[0] for r in rows(path)] == [0, 1]
    assert w.report("cam").errors == 1 and w.report("cam").dropped == 0


def _three_the_broker_had_the_first_of(output: JournalOutput, feed: VerdictFeed) -> None:
    """Three verdicts written, a batch each, and the first acknowledged by the broker, its cursor written."""
    for n in range(3):
        output.writer.offer(entry(n))
        assert wait_for(lambda n=n: output.writer.written == n + 1)
    feed.acked(feed.take(1)[0].row_id)
    feed.close()


@pytest.mark.unit
def test_verdicts_carried_to_a_new_journal_no_feed_has_read_yet_are_sent_after_a_restart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With [mqtt], the journal removed, then edged stopped (or killed) before the feed read the journal
    opened anew: it held no cursor, so the next start's feed began at its end and the verdicts the
    broker had not acknowledged, carried there, were never sent (before). The cursor comes with them."""
    path, settings, output = mqtt_journal(tmp_path, monkeypatch)
    try:
        feed = output.feed("mqtt", threading.Event())
        _three_the_broker_had_the_first_of(output, feed)
        path.unlink()
        output.writer.offer(entry(3))
        assert wait_for(lambda: output.writer.written == 4)
    finally:
        output.close()
    again = JournalOutput(settings, threading.Event())  # the next start
    try:
        feed = again.feed("mqtt", threading.Event())
        assert [json.loads(forward.payload)["frame_id"] for forward in feed.take(10)] == [1, 2, 3]
        feed.close()
    finally:
        again.close()


@pytest.mark.unit
def test_verdicts_carried_to_a_journal_opened_anew_go_out_replayed_and_those_after_them_live(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With [mqtt] connected, the journal removed while the broker had acknowledged one of three
    verdicts: the other two, carried to the journal opened anew, went out as if just made, and a
    subscriber could not tell them from live ones (before). They are marked ``replayed``, as any
    verdict recorded before the connection it goes out on; those recorded after them go out live."""
    path, _, output = mqtt_journal(tmp_path, monkeypatch)
    try:
        feed = output.feed("mqtt", threading.Event())
        feed.connected()
        for n in range(3):  # a batch each, each looked at journal.path before
            output.writer.offer(entry(n))
            assert wait_for(lambda n=n: output.writer.written == n + 1)
        sent = feed.take(10)
        assert [json.loads(forward.payload).get("replayed") for forward in sent] == [None, None, None]
        feed.acked(sent[0].row_id)
        feed.close()  # the cursor written: the broker had the first
        path.unlink()
        output.writer.offer(entry(3))
        assert wait_for(lambda: output.writer.written == 4)
        taken = [json.loads(forward.payload) for forward in feed.take(10)]
        assert [(m["frame_id"], m.get("replayed")) for m in taken] == [(1, True), (2, True), (3, None)]
        feed.close()
    finally:
        output.close()


@pytest.mark.unit
def test_a_journal_removed_while_no_verdict_comes_is_opened_anew_within_a_second_with_what_it_held(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A line stopped (no verdict coming) and the journal removed: nothing looked at journal.path until
    the next retention pass, a minute on (before). Meanwhile `edged history` found no journal ("it is
    written once a verdict is made"), and a kill or power cut lost what only the removed file held: the
    last batch, and with [mqtt] the verdicts the broker had not acknowledged. An idle writer looks as
    a busy one does: they are at journal.path within a second, and the feed is woken to send them."""
    path, _, output = mqtt_journal(tmp_path, monkeypatch)
    woken = threading.Event()
    try:
        feed = output.feed("mqtt", woken)
        _three_the_broker_had_the_first_of(output, feed)
        path.unlink()
        woken.clear()
        assert wait_for(lambda: output.writer.report("cam").errors == 1 and not output.writer.store.carried, 5)
        assert [r[0] for r in rows(path)] == [1, 2]
        assert woken.is_set()
        assert [json.loads(forward.payload)["frame_id"] for forward in feed.take(10)] == [1, 2]
        feed.close()
    finally:
        output.close()


@pytest.mark.unit
def test_a_journal_removed_as_it_opens_is_opened_anew_at_the_next_look(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cleanup removing the file between SQLite's open and the read of its id left none to compare
    journal.path with: every look found it in place, and edged wrote into a file no path named until
    it restarted (before). It counts as removed: opened anew, the rows carried, its -wal gone with it."""
    monkeypatch.setattr(journal, "LOOK_EVERY_S", 0.0)
    connect = JournalStore._connect

    def removed_as_it_opens(store: JournalStore) -> sqlite3.Connection:
        db = connect(store)
        monkeypatch.setattr(JournalStore, "_connect", connect)
        store.path.unlink()
        return db

    monkeypatch.setattr(JournalStore, "_connect", removed_as_it_opens)
    path = tmp_path / "journal.sqlite"
    store = JournalStore(path, "normal")
    store.append([entry(0)], IDENTITY, None)
    reopened = store.follow(keep_unsent=False)
    store.append([entry(1)], IDENTITY, None)
    store.close()
    assert reopened is not None and (reopened.was, reopened.carried) == ("moved away or removed", 1)
    assert [r[0] for r in rows(path)] == [0, 1] and rows(path, "PRAGMA quick_check") == [("ok",)]


@pytest.mark.unit
def test_rows_carried_and_not_yet_written_stay_carried_when_the_journal_opened_anew_goes_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The journal removed, opened anew, the rows carried to it not written yet (another connection
    holds its write lock, or the disk is full), then that one removed too (a cleanup that makes room):
    the carried rows were replaced by the second file's, and lost without a word (before)."""
    monkeypatch.setattr(journal, "LOOK_EVERY_S", 0.0)
    monkeypatch.setattr(journal, "BUSY_WAIT_S", 0.05)
    path = tmp_path / "journal.sqlite"
    store = JournalStore(path, "normal")
    try:
        store.append([entry(0)], IDENTITY, None)
        assert store.follow(keep_unsent=False) is None
        path.unlink()
        store.append([entry(1)], IDENTITY, None)
        assert store.follow(keep_unsent=False) is not None  # opened anew: row 1 (0 was seen there) to write first
        with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as other:
            other.execute("BEGIN IMMEDIATE")
            with pytest.raises(sqlite3.OperationalError, match="locked"):
                store.append([entry(2)], IDENTITY, None)
            other.execute("ROLLBACK")
        path.unlink()
        reopened = store.follow(keep_unsent=False)
        assert reopened is not None and reopened.carried == 1
        store.append([entry(2)], IDENTITY, None)
    finally:
        store.close()
    assert [r[0] for r in rows(path)] == [1, 2]


@pytest.mark.unit
def test_of_a_removed_journals_unacknowledged_verdicts_the_newest_are_carried_within_memory_the_rest_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A week's backlog for a broker away, and the journal removed: the newest verdicts that fit in
    memory are carried, in order; the older ones are counted as lost, not read into memory."""
    monkeypatch.setattr(journal, "LOOK_EVERY_S", 0.0)
    monkeypatch.setattr(journal, "QUEUE_BYTES", 2 * len(entry(0).message))
    path = tmp_path / "journal.sqlite"
    store = JournalStore(path, "normal")
    try:
        store.append([entry(n) for n in range(5)], IDENTITY, None)
        feed = VerdictFeed(path, "mqtt", 0)  # its cursor before them all: none acknowledged
        feed.close()
        assert store.follow(keep_unsent=True) is None
        path.unlink()
        reopened = store.follow(keep_unsent=True)
        assert reopened is not None and (reopened.carried, reopened.lost) == (2, 3)
        store.append([entry(5)], IDENTITY, None)
    finally:
        store.close()
    assert [r[0] for r in rows(path)] == [3, 4, 5]


@pytest.mark.unit
def test_a_journal_replaced_by_a_fifo_under_the_writer_is_counted_as_what_it_is_until_it_goes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A FIFO (or a folder) put at journal.path while edged writes, which a start refuses: each write
    failed as a bare ``disk I/O error`` (before); now counted as what is there, the rows waiting, and
    written once it is gone."""
    monkeypatch.setattr(journal, "LOOK_EVERY_S", 0.0)
    monkeypatch.setattr(journal, "IDLE_LOOK_S", 3600.0)  # no look between the first row and its removal
    monkeypatch.setattr(journal, "RETRY_S", (0.05, 0.2))
    path = tmp_path / "journal.sqlite"
    w = writer(path)
    try:
        w.offer(entry(0))
        assert wait_for(lambda: w.written == 1)
        path.unlink()
        os.mkfifo(path)
        w.offer(entry(1))
        assert wait_for(lambda: w.report("cam").errors >= 2)
        assert "is no longer a regular file" in (w.report("cam").last_error or ""), w.report("cam")
        path.unlink()
        assert wait_for(lambda: w.written == 2, 5), w.report("cam")
    finally:
        w.stop(2)
    assert [r[0] for r in rows(path)] == [0, 1]


@pytest.mark.unit
def test_a_journal_lock_removed_under_the_writer_is_taken_again_and_one_another_edged_took_is_let_go(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``rm journal.sqlite.lock`` (a cleanup of the folder) while edged writes: a second edged found no
    lock held, and both wrote one journal, each replaying the other's verdicts (before). The next look
    takes the lock again, said; where another edged took it meanwhile, the file is let go, counted,
    the entries waiting in memory until that one has let go."""
    monkeypatch.setattr(journal, "LOOK_EVERY_S", 0.0)
    monkeypatch.setattr(journal, "RETRY_S", (0.05, 0.2))
    path = tmp_path / "journal.sqlite"
    held = Path(f"{path}.lock")
    w = writer(path)
    try:
        w.offer(entry(0))
        assert wait_for(lambda: w.written == 1)
        held.unlink()
        w.offer(entry(1))
        assert wait_for(lambda: w.written == 2)
        with pytest.raises(OSError, match="in use by another edged"):
            journal.lock(path)
        assert f"its lock {held} was removed while edged wrote it; taken again" in caplog.text
        held.unlink()
        held.mkdir()  # no lock can be made there: nor can another edged take one, and the writing goes on
        w.offer(entry(2))
        assert wait_for(lambda: w.written == 3) and w.report("cam").errors == 0
        held.rmdir()
        other = journal.lock(path)  # another edged, starting in between
        try:
            w.offer(entry(3))
            assert wait_for(lambda: w.report("cam").errors >= 1)
            assert "another edged took it" in (w.report("cam").last_error or "") and w.written == 3
        finally:
            os.close(other)
        assert wait_for(lambda: w.written == 4, 5), w.report("cam")
    finally:
        w.stop(2)
    assert [r[0] for r in rows(path)] == [0, 1, 2, 3]


@pytest.mark.unit
@pytest.mark.parametrize("mqtt", [True, False])
def test_a_journal_opened_after_the_clock_stepped_forward_keeps_what_mqtt_has_still_to_send(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mqtt: bool
) -> None:
    """The journal's first retention pass, as edged starts on a clock 200 days later than the one an
    outage's backlog was recorded on: with [mqtt], the verdicts it has not had acknowledged stay
    (before: all went, and the broker never had them); without it, age deletes them all, a cursor
    left in the file holding nothing back. A reload that adds or removes [mqtt] says so."""
    path = tmp_path / "journal.sqlite"
    wall = time.time_ns()
    backlog(path, wall)
    real = time.time_ns
    monkeypatch.setattr(time, "time_ns", lambda: real() + 200 * DAY_NS)  # the wall clock, stepped
    monkeypatch.setattr(journal, "clock_synced", lambda: True)  # as NTP set it, whatever this machine's says
    mqtt_section: dict[str, dict[str, object]] = {"mqtt": {"url": "mqtt://127.0.0.1:1"}} if mqtt else {}
    settings = load_config(
        write_config(tmp_path / "edged.toml", inspecting(tmp_path, journal={"path": str(path)}, **mqtt_section))
    )
    output = JournalOutput(settings, threading.Event())
    try:
        assert wait_for(lambda: output.writer.bytes > 0, 10)  # its first retention pass is done
        left = [r[0] for r in rows(path, "SELECT id FROM entries WHERE kind = 'verdict' ORDER BY id")]
        assert left == ([5, 6, 7, 9, 10, 11, 12] if mqtt else [])
        other = inspecting(
            tmp_path, journal={"path": str(path)}, **({} if mqtt else {"mqtt": {"url": "mqtt://127.0.0.1:1"}})
        )
        assert output.reload(load_config(write_config(tmp_path / "other.toml", other)), SERVICES) is output
        assert output.writer.keep_unsent is not mqtt
    finally:
        output.close()


@pytest.mark.unit
def test_an_earlier_boots_rows_stamped_before_ntp_set_its_clock_go_with_the_first_row_after_them_on_a_set_clock(
    tmp_path: Path,
) -> None:
    """Three earlier boots of a board without a real-time clock, none of them with [mqtt]: one
    recorded on a clock not yet set (1970) and lost power before NTP; one on a clock fake-hwclock
    had set back 120 days, until NTP set it right in that boot; then this one. The rows stamped
    before NTP look past a 30-day limit but are days old: they stay (before: deleted at once, the
    record of the boots where the clock was wrong), and go once a row recorded after them on a
    clock NTP had set is past the limit, as those rows do."""
    path = tmp_path / "journal.sqlite"
    store = JournalStore(path, "normal")
    synced_ns = CLOCK_EPOCH_NS + 400 * DAY_NS  # when NTP set the clock in the second boot
    unset = Identity(IDENTITY.board_id, "boot-unset", IDENTITY.version)
    store.append([at(n, 3600 * 10**9 + n, n) for n in range(1, 4)], unset, False)  # 1970, an hour up
    behind = [at(n, synced_ns - 120 * DAY_NS - (7 - n) * 60 * 10**9, n) for n in range(4, 7)]  # minutes before NTP
    store.append(behind, EARLIER, False)
    store.append([at(n, synced_ns + (n - 7) * 60 * 10**9, n) for n in range(7, 9)], EARLIER, True)
    mono = 2 * DAY_NS  # this boot, two days up
    store.append([at(n, synced_ns + 10 * DAY_NS, mono) for n in range(9, 11)], IDENTITY, True)
    now = synced_ns + 10 * DAY_NS + 60 * 10**9
    assert store.prune(now, 30, 10**9, boot=(IDENTITY.boot_id, mono + 60 * 10**9), synced=True) == 0
    assert [r[0] for r in rows(path)] == list(range(1, 11))
    later = now + 21 * DAY_NS  # the first boot's row after NTP is 31 days old; this boot's, 21
    assert store.prune(later, 30, 10**9, boot=(IDENTITY.boot_id, mono + 21 * DAY_NS), synced=True) == 8
    assert [r[0] for r in rows(path)] == [9, 10]
    store.close()


@pytest.mark.unit
@pytest.mark.parametrize("synced", [True, False])
def test_a_journal_started_on_a_clock_ntp_set_keeps_an_earlier_boots_rows_stamped_200_days_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, synced: bool
) -> None:
    """Without [mqtt], the journal is the only record: an earlier boot recorded on a clock 200 days
    behind, never synchronised, and the board started again on a clock NTP set. The journal's first
    retention pass keeps every row (before: it deleted them all, each looking 200 days old). On a
    line where no clock was ever synchronised the stamps are all there is, and age goes by them."""
    path = tmp_path / "journal.sqlite"
    store = JournalStore(path, "normal")
    store.append([at(n, time.time_ns() - 200 * DAY_NS + n, n) for n in range(1, 6)], EARLIER, False)
    store.close()
    monkeypatch.setattr(journal, "clock_synced", lambda: synced)
    settings = load_config(write_config(tmp_path / "edged.toml", inspecting(tmp_path, journal={"path": str(path)})))
    output = JournalOutput(settings, threading.Event())
    try:
        assert wait_for(lambda: output.writer.bytes > 0, 10)  # its first retention pass is done
        assert [r[0] for r in rows(path)] == ([1, 2, 3, 4, 5] if synced else [])
    finally:
        output.close()


@pytest.mark.unit
def test_on_a_line_without_ntp_an_earlier_boots_rows_go_by_the_time_they_carry(tmp_path: Path) -> None:
    """No clock on the line has ever been synchronised (fake-hwclock alone): the stamps and the clock
    now lag alike, so an earlier boot's rows are aged by the time they carry, and the age limit
    holds; a row recorded before them on a clock not yet set (1970) goes with them."""
    path = tmp_path / "journal.sqlite"
    store = JournalStore(path, "normal")
    wall = CLOCK_EPOCH_NS + 100 * DAY_NS
    store.append([at(1, 3600 * 10**9, 1)], Identity(IDENTITY.board_id, "boot-unset", IDENTITY.version), False)
    store.append([at(n, wall - (40 - n) * DAY_NS, n) for n in range(2, 6)], EARLIER, False)
    assert store.prune(wall, 30, 10**9, boot=(IDENTITY.boot_id, DAY_NS), synced=False) == 5  # ages 38..35 days
    assert rows(path) == []
    store.close()


def test_a_full_disk_is_counted_and_what_waits_is_written_once_there_is_room(tmp_path: Path) -> None:
    folder = tmp_path / "small"
    with tmpfs(folder, "size=512k") as mounted:
        if not mounted:
            pytest.skip("a small tmpfs needs root and mount")
        filler = folder / "filler"
        w = writer(folder / "journal.sqlite")
        try:
            w.offer(entry(0))
            assert wait_for(lambda: w.report("cam").recorded == 1)
            fill(filler)  # fill what is left
            for n in range(1, 200):
                w.offer(entry(n, size=1000))
            assert wait_for(lambda: w.report("cam").errors > 0, 10), w.report("cam")
            assert "full" in (w.report("cam").last_error or "")
            filler.unlink()
            assert wait_for(lambda: w.report("cam").recorded == 200, 60), w.report("cam")
        finally:
            w.stop(5)
        assert [r[0] for r in rows(folder / "journal.sqlite")] == list(range(200))
        assert w.report("cam").dropped == 0


def test_a_read_only_folder_is_counted_and_the_queue_stays_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "ro"
    folder.mkdir()
    monkeypatch.setattr(journal, "QUEUE_BYTES", 20_000)
    with read_only_folder(folder):
        w = writer(folder / "journal.sqlite")
        try:
            for n in range(100):
                w.offer(entry(n, size=1000))
            assert wait_for(lambda: w.report("cam").errors > 0, 10)
            report = w.report("cam")
            assert report.dropped >= 80 and report.recorded == 0  # ~19 wait in memory, the rest are counted
        finally:
            w.stop(1)


@pytest.mark.unit
def test_the_journal_defaults_beside_the_config_or_in_the_state_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fixed_scene(tmp_path / "m.onnx", [])
    config = write_config(tmp_path / "edged.toml", {"source": {"type": "synthetic"}, "model": {"path": "m.onnx"}})
    monkeypatch.delenv("STATE_DIRECTORY", raising=False)
    assert load_config(config).journal.path == tmp_path / "journal.sqlite"
    state = tmp_path / "state"
    state.mkdir()
    monkeypatch.setenv("STATE_DIRECTORY", str(state))
    assert load_config(config).journal.path == state / "journal.sqlite"
    write_config(
        config,
        {"source": {"type": "synthetic"}, "model": {"path": "m.onnx"}, "journal": {"path": "no/such/j.sqlite"}},
    )
    with pytest.raises(ConfigError, match=r"journal.path: folder .*no/such does not exist"):
        load_config(config)


def _config(tmp_path: Path, journal_path: Path) -> Path:
    """A configuration of its own for a journal at ``journal_path``."""
    name = f"{journal_path.parent.name}-{journal_path.stem}.toml"
    return write_config(tmp_path / name, inspecting(tmp_path, journal={"path": str(journal_path)}))


def _settings(tmp_path: Path, journal_path: Path) -> Settings:
    return load_config(_config(tmp_path, journal_path))


def test_a_reload_that_moves_the_journal_off_a_failing_disk_writes_what_waited_there_first(tmp_path: Path) -> None:
    # The entries waiting in memory for the full disk were in neither file: the reload that moves the
    # journal, what an operator does to rescue a full disk, threw them away without a word.
    (tmp_path / "ro").mkdir()
    (tmp_path / "good").mkdir()
    with read_only_folder(tmp_path / "ro"):
        output = JournalOutput(_settings(tmp_path, tmp_path / "ro" / "journal.sqlite"), threading.Event())
        for n in range(5):
            output.writer.offer(entry(n, wall_ns=time.time_ns()))  # within the retention
        assert wait_for(lambda: output.writer.report("cam").errors > 0)
        moved = output.reload(_settings(tmp_path, tmp_path / "good" / "journal.sqlite"), SERVICES)
        assert moved is not None and moved is not output
        try:
            assert wait_for(lambda: moved.writer.report("cam").recorded == 5), moved.writer.report("cam")
            assert [r[0] for r in rows(tmp_path / "good" / "journal.sqlite")] == list(range(5))
            assert moved.writer.report("cam").dropped == 0
            feed = moved.feed("mqtt", threading.Event())  # made after they were written: still theirs to send
            assert [forward.row_id for forward in feed.take(10)] == [1, 2, 3, 4, 5]
            feed.close()
        finally:
            moved.close()


def test_a_stop_while_the_disk_fails_says_and_counts_what_it_loses(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "ro").mkdir()
    with read_only_folder(tmp_path / "ro"):
        output = JournalOutput(_settings(tmp_path, tmp_path / "ro" / "journal.sqlite"), threading.Event())
        for n in range(3):
            output.writer.offer(entry(n))
        assert wait_for(lambda: output.writer.report("cam").errors > 0)
        output.close()
    assert output.writer.report("cam").dropped == 3
    assert "stopping with 3 entries not written" in caplog.text


@pytest.mark.unit
def test_a_retention_past_a_century_is_refused_at_load(tmp_path: Path) -> None:
    # 999999 days overflowed SQLite's integer at the first retention pass, and the journal's thread
    # ended there: nothing was recorded again, and the status said no error.
    doc = inspecting(tmp_path, journal={"path": str(tmp_path / "j.sqlite"), "max_age_days": 999999})
    with pytest.raises(ConfigError, match="max_age_days"):
        load_config(write_config(tmp_path / "edged.toml", doc))


def test_an_error_of_edged_own_in_the_journal_thread_is_counted_and_writing_goes_on(tmp_path: Path) -> None:
    cfg = JournalConfig.model_construct(
        **{**JournalConfig().model_dump(), "path": tmp_path / "j.sqlite", "max_age_days": 1e9}
    )
    w = JournalWriter(cfg, IDENTITY, previous=None)  # settings made in code, past what loading allows
    w.start(records=True)
    try:
        for n in range(3):
            w.offer(entry(n))
        assert wait_for(lambda: w.report("cam").recorded == 3), w.report("cam")
        assert w.report("cam").errors > 0 and "OverflowError" in (w.report("cam").last_error or "")
    finally:
        w.stop(1)


@pytest.mark.unit
def test_a_journal_held_by_another_edged_is_said_and_not_written_by_a_second(tmp_path: Path) -> None:
    # Two edged on one file each replayed the other's verdicts to its broker, under the same seq.
    settings = _settings(tmp_path, tmp_path / "journal.sqlite")
    assert JournalOutput.in_use(settings) is None
    first = JournalStore(tmp_path / "journal.sqlite", "normal")
    first.open()
    try:
        problem = JournalOutput.in_use(settings)
        assert problem is not None and "in use by another edged" in problem and "journal.path" in problem
        (tmp_path / "link.sqlite").symlink_to(tmp_path / "journal.sqlite")  # another configuration's path to it
        problem = JournalOutput.in_use(_settings(tmp_path, tmp_path / "link.sqlite"))
        assert problem is not None and f"its lock {tmp_path / 'journal.sqlite'}.lock is held" in problem
        elsewhere = _settings(tmp_path, tmp_path / "other.sqlite")
        onto = load_replacement(_config(tmp_path, tmp_path / "journal.sqlite"), elsewhere)
        assert "in use by another edged" in (onto.held(elsewhere) or "")  # a reload onto it is refused
        assert onto.held(settings) is None  # where it runs already (a reload switched in meanwhile), it is its own
        second = writer(tmp_path / "journal.sqlite")
        try:
            second.offer(entry(0))
            assert wait_for(lambda: second.report("cam").errors > 0)
            assert "in use by another edged" in (second.report("cam").last_error or "")
            assert second.report("cam").recorded == 0
        finally:
            second.stop(1)
    finally:
        first.close()
    assert JournalOutput.in_use(settings) is None  # let go with the file


@pytest.mark.unit
def test_a_reload_is_judged_against_the_journal_running_once_it_has_loaded(tmp_path: Path) -> None:
    # A reload that switched in while a later one loaded holds the later one's journal itself: judged
    # against the settings running as the load began, the later one was refused, "in use by another edged".
    began = _settings(tmp_path, tmp_path / "j1.sqlite")
    path = _config(tmp_path, tmp_path / "j2.sqlite")
    wake, sighup = threading.Event(), threading.Event()
    reloads = Reloads(path, wake, lambda: None, requests=False, trial_for=lambda s, m: None)
    sighup.set()
    assert reloads.take(sighup, began) is None and reloads.loading
    switched = JournalStore(tmp_path / "j2.sqlite", "normal")  # what the reload switched in meanwhile writes
    switched.open()
    try:
        assert wake.wait(60)
        assert isinstance(reloads.take(sighup, load_config(path)), Replacement)
        path.write_text(f"{path.read_text()}[evidence]\ndir = {str(tmp_path / 'evidence')!r}\n")
        wake.clear()
        sighup.set()
        assert reloads.take(sighup, began) is None and wake.wait(60)
        refused = reloads.take(sighup, began)  # its journal held: refused
        assert isinstance(refused, str) and "in use by another edged" in refused, refused
        assert not (tmp_path / "evidence").exists()  # the folders it made for its evidence, removed
    finally:
        switched.close()


@pytest.mark.unit
def test_journals_that_record_nothing_hold_nothing(tmp_path: Path) -> None:
    # Without [inspect], edged beside one configuration folder share the default journal path (as
    # `edged bench --cameras` runs them): none opens, locks or refuses it.
    doc = inspecting(tmp_path, journal={"path": str(tmp_path / "journal.sqlite")})
    del doc["inspect"]
    settings = load_config(write_config(tmp_path / "plain.toml", doc))
    outputs = [JournalOutput(settings, threading.Event()) for _ in range(2)]
    try:
        assert not (tmp_path / "journal.sqlite").exists() and JournalOutput.in_use(settings) is None
    finally:
        for output in outputs:
            output.close()


@pytest.mark.unit
def test_an_output_new_to_a_journal_that_records_nothing_leaves_the_earlier_verdicts_unsent(tmp_path: Path) -> None:
    """A configuration with [inspect] recorded verdicts; the next, with [mqtt] and no [inspect], records
    nothing and never opened the file: its feed started at row 0 and sent them all, as live ones
    (``replayed`` false). Those recorded before the output stay unsent, as for any output new to a journal."""
    path = tmp_path / "journal.sqlite"
    earlier = writer(path)
    for n in range(2):
        earlier.offer(entry(n))
    assert wait_for(lambda: earlier.written == 2)
    earlier.stop(2)
    doc = inspecting(tmp_path, journal={"path": str(path)})
    del doc["inspect"]
    output = JournalOutput(load_config(write_config(tmp_path / "plain.toml", doc)), threading.Event())
    try:
        feed = output.feed("mqtt", threading.Event())
        assert feed.take(10) == []
        output.writer.offer(entry(2))  # a verdict of its own (a promotion's, say): the output's to send
        assert wait_for(lambda: output.writer.written == 1)
        assert [forward.row_id for forward in feed.take(10)] == [3]
        feed.close()
    finally:
        output.close()


@pytest.mark.integration
def test_a_second_daemon_naming_a_running_daemons_journal_is_refused_at_start(tmp_path: Path) -> None:
    d = start(tmp_path)
    try:
        d.collect("verdict", 1)  # recording
        done = run_cli("run", "--config", str(tmp_path / "edged.toml"), timeout=60)  # the same configuration again
        journal_path = tmp_path / "journal.sqlite"
        assert done.returncode == EXIT_CONFIG, done.stderr
        assert f"journal.path {journal_path} is in use by another edged" in done.stderr
    finally:
        d.close()


@pytest.mark.unit
@pytest.mark.parametrize("where", ["folder", "device"])
def test_a_journal_path_that_is_a_folder_or_not_a_file_is_refused_at_load(tmp_path: Path, where: str) -> None:
    fixed_scene(tmp_path / "m.onnx", [])
    path = tmp_path / "j" if where == "folder" else Path("/dev/null")
    if where == "folder":
        path.mkdir()
    config = write_config(
        tmp_path / "edged.toml",
        {"source": {"type": "synthetic"}, "model": {"path": "m.onnx"}, "journal": {"path": str(path)}},
    )
    with pytest.raises(ConfigError, match=rf"journal.path: {path} is not a regular file .*journal.enabled = false"):
        load_config(config)


SCENE = [(16.0, 20.0, 8.0, 8.0, 1, 0.9)]  # one crack in every frame: ng


def start(
    tmp_path: Path,
    *,
    realtime: bool = True,
    inspect: bool = True,
    env: dict[str, str] | None = None,
    **sections: dict[str, object],
) -> RunningDaemon:
    """`edged run` on a looping clip whose every frame holds a crack, ng with ``inspect``; ``sections``
    added, ``env`` in its environment."""
    fixed_scene(tmp_path / "scene.onnx", SCENE)
    write_video(tmp_path / "clip.avi", [(90, 90, 90)] * 10)
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    doc: dict[str, dict[str, object]] = {
        "source": {"type": "file", "path": "clip.avi", "loop": True, "realtime": realtime},
        "model": {"path": "scene.onnx"},
        "publish": {"endpoints": [endpoint], "status_interval_s": 0.3},
        "thermal": {"enabled": False},
    }
    if inspect:
        doc["inspect"] = {"ng_classes": ["crack"]}
    return RunningDaemon(write_config(tmp_path / "edged.toml", {**doc, **sections}), endpoint, env)


@pytest.mark.integration
def test_the_daemon_records_every_verdict_and_a_kill_leaves_a_journal_that_opens(tmp_path: Path) -> None:
    port = free_port()
    token = tmp_path / "http.token"
    token.write_text("0123456789abcdef0123\n")
    token.chmod(0o600)
    d = start(tmp_path, http={"listen": f"127.0.0.1:{port}", "token_file": "http.token"})
    path = tmp_path / "journal.sqlite"
    try:
        verdicts = [m for m in d.collect("verdict", 20) if isinstance(m, VerdictMessage)]
        status = d.wait_status(lambda s: s.journal is not None and s.journal.recorded >= 20)
        assert status.journal is not None and status.journal.path == str(path) and status.journal.errors == 0
        here = Identity.here()
        assert (status.board_id, status.boot_id) == (here.board_id, here.boot_id) == (board_id(), boot_id())
        assert {(v.board_id, v.boot_id) for v in verdicts} == {(here.board_id, here.boot_id)}
        assert {v.clock_synced for v in verdicts} <= {True, False, None}
        assert wait_for(lambda: len(rows(path)) >= 20, 10)
        during = run_cli("history", "--config", str(tmp_path / "edged.toml"), "--json", "--limit", "5")
        assert during.returncode == 0, during.stderr
        assert [row["verdict"] for row in json.loads(during.stdout)] == ["ng"] * 5
        # The live view serves it too, with the same filters and its token.
        assert get(port, "/history.json")[0] == 401
        bearer = {"Authorization": "Bearer 0123456789abcdef0123"}
        code, _, body = get(port, "/history.json?camera=cam0&verdict=ng&limit=3&part_id=", bearer)
        assert code == 200 and [row["message"]["kind"] for row in json.loads(body)] == ["verdict"] * 3
        assert json.loads(get(port, "/history.json?verdict=ok", bearer)[2]) == []
        assert get(port, "/history.json?since=soon", bearer)[0] == 400
        assert get(port, "/history.json?limit=5000", bearer)[0] == 400
        d.signal(signal.SIGKILL)
        d.proc.wait(10)
    finally:
        d.close()
    assert rows(path, "PRAGMA quick_check") == [("ok",)]
    recorded = rows(path, "SELECT seq, frame_id, verdict, message, model_sha256 FROM entries WHERE kind = 'verdict'")
    by_seq = {seq: (frame, verdict, json.loads(message), model) for seq, frame, verdict, message, model in recorded}
    for v in verdicts:
        frame, verdict, message, model = by_seq[v.seq]
        assert (frame, verdict, message["frame_id"]) == (v.frame_id, "ng", v.frame_id)
        assert model == v.model_sha256 == status.model.sha256


@pytest.mark.integration
def test_a_kill_in_a_burst_leaves_in_the_journal_every_verdict_a_subscriber_or_a_requester_received(
    tmp_path: Path,
) -> None:
    """One camera floods verdicts to a subscriber while requests for another are answered back to
    back; SIGKILL at any moment: whatever either got is on record (``full``: each batch fsynced,
    so a verdict sent before its commit would be caught most runs)."""
    trigger = f"tcp://127.0.0.1:{free_port()}"
    clip = {"type": "file", "path": "clip.avi", "loop": True}
    line, gate = {**clip, "camera_id": "line", "realtime": False}, {**clip, "camera_id": "gate", "trigger": "request"}
    d = start(
        tmp_path, source=[line, gate], trigger={"endpoint": trigger, "timeout_s": 10.0}, journal={"durability": "full"}
    )
    replies: list[AnyMessage] = []
    requesting = threading.Thread(target=request_until_silence, args=(trigger, replies), daemon=True)
    try:
        received = d.collect("verdict", 10)
        requesting.start()
        assert wait_for(lambda: len(replies) >= 3, 30), d.log()
        received += d.collect("verdict", 10)
        d.signal(signal.SIGKILL)
        d.proc.wait(10)
        received += [parse_message(payload) for _, payload in drain(d.sub)]
        requesting.join(30)
    finally:
        d.close()
    got = [m for m in [*received, *replies] if isinstance(m, VerdictMessage)]
    assert {m.camera_id for m in got} == {"line", "gate"}, got
    recorded = set(rows(tmp_path / "journal.sqlite", "SELECT camera_id, seq FROM entries WHERE kind = 'verdict'"))
    missing = [(m.camera_id, m.seq) for m in got if (m.camera_id, m.seq) not in recorded]
    assert missing == [], f"received but not on record: {missing}"


def request_until_silence(endpoint: str, replies: list[AnyMessage]) -> None:
    """Ask camera gate for one part after another, each as soon as the last is answered, until none is."""
    context = zmq.Context()
    try:
        for n in itertools.count():
            sock = context.socket(zmq.REQ)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(endpoint)
            sock.send(json.dumps({"part_id": f"P-{n}", "camera_id": "gate"}).encode())
            answered = sock.poll(5000)
            if answered:
                replies.append(parse_message(sock.recv()))
            sock.close(linger=0)
            if not answered:
                return
    finally:
        context.term()


def drain(sub: zmq.Socket[bytes]) -> list[list[bytes]]:
    """What a subscriber holds already, once the publisher is gone."""
    frames: list[list[bytes]] = []
    while sub.poll(200):
        frames.append(sub.recv_multipart())
    return frames


@pytest.mark.integration
def test_without_inspect_the_journal_reports_nothing_of_the_camera(tmp_path: Path) -> None:
    d = start(tmp_path, inspect=False)
    try:
        status = d.wait_status(lambda s: s.frames_processed > 0)
        assert isinstance(status, StatusMessage) and status.journal is None
    finally:
        d.stop()


@pytest.mark.integration
def test_a_disk_filled_under_the_running_daemon_is_counted_inspection_goes_on_and_nothing_queued_is_lost(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "small"
    with tmpfs(folder, "size=1m") as mounted:
        if not mounted:
            pytest.skip("a small tmpfs needs root and mount")
        d = start(tmp_path, journal={"path": str(folder / "journal.sqlite")})
        filler = folder / "filler"
        try:
            d.wait_status(lambda s: s.journal is not None and s.journal.recorded >= 5)
            fill(filler)  # the disk fills up under the running daemon
            full = d.wait_status(lambda s: s.journal is not None and s.journal.errors > 0)
            assert full.journal is not None and "full" in (full.journal.last_error or ""), full.journal
            during = d.collect("verdict", 10)  # inspection goes on, at its pace
            assert all(isinstance(v, VerdictMessage) and v.verdict == "ng" for v in during)
            filler.unlink()
            after = d.wait_status(lambda s: s.journal is not None and s.journal.recorded > full.journal.recorded + 10)
            assert after.journal is not None and after.journal.dropped == 0
            newest = during[-1]
        finally:
            d.close()
        seqs = [seq for (seq,) in rows(folder / "journal.sqlite", "SELECT seq FROM entries ORDER BY id")]
        assert seqs == list(range(seqs[0], seqs[-1] + 1)) and newest.seq in seqs  # what waited was written, in order
