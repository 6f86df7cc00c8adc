"""systemd's notify protocol for real: a bound unix datagram socket and the daemon as a subprocess."""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import cv2
import numpy as np
import pytest
import zmq
from daemon import RunningDaemon, free_port, write_config
from filesystems import opening_stalled
from onnx_models import colour_probe, failing_probe, stalling_probe
from waiting import wait_for

from edged import service
from edged.service import Notifier, Signals, StartTimeout
from edged.wake import Wake, ready

pytestmark = pytest.mark.integration

WATCHDOG_USEC = 600_000  # pings expected every 0.3 s


class NotifySocket:
    """What systemd would be: the receiving end of NOTIFY_SOCKET, read on its own thread as systemd
    reads it, timestamping every datagram on arrival."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.1)
        self._received: list[tuple[float, str]] = []
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._reader = threading.Thread(target=self._read, name="notify-reader", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while not self._closed.is_set():
            try:
                data = self.sock.recv(4096)
            except TimeoutError:
                continue
            except OSError:
                return
            with self._lock:
                self._received.append((time.monotonic(), data.decode()))

    @property
    def received(self) -> list[tuple[float, str]]:
        with self._lock:
            return list(self._received)

    def drain(self, seconds: float) -> list[tuple[float, str]]:
        """Everything received after ``seconds`` more of listening."""
        time.sleep(seconds)
        return self.received

    def wait_for(self, line: str, timeout: float) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for t, datagram in self.received:
                if line in datagram.splitlines():
                    return t
            time.sleep(0.1)
        raise AssertionError(f"{line!r} never arrived; got {[d for _, d in self.received]}")

    def times_of(self, line: str, since: float = 0.0) -> list[float]:
        return [t for t, d in self.received if line in d.splitlines() and t >= since]

    def close(self) -> None:
        self._closed.set()
        self._reader.join()
        self.sock.close()


@pytest.fixture
def notify(tmp_path: Path) -> Iterator[NotifySocket]:
    n = NotifySocket(tmp_path / "notify.sock")
    yield n
    n.close()


def _start(
    tmp_path: Path,
    notify: NotifySocket,
    source: dict,
    model: Path | None = None,
    env: dict[str, str] | None = None,
    **service: object,
) -> RunningDaemon:
    return _spawn(*_configure(tmp_path, source, model, **service), notify, env)


def _configure(tmp_path: Path, source: dict, model: Path | None = None, **service: object) -> tuple[Path, str]:
    """``tmp_path/edged.toml`` for ``source`` and ``model`` (the colour probe by default), and its endpoint."""
    model = model or colour_probe(tmp_path / "probe.onnx")
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    config = write_config(
        tmp_path / "edged.toml",
        {
            "source": source,
            "model": {"path": str(model)},
            "publish": {"endpoints": [endpoint], "status_interval_s": 0.3},
            "thermal": {"enabled": False},
            "service": {"stall_timeout_s": 1.0, **service},
        },
    )
    return config, endpoint


def _spawn(config: Path, endpoint: str, notify: NotifySocket, env: dict[str, str] | None = None) -> RunningDaemon:
    """`edged run` of ``config`` as systemd starts it: told where to notify, and its watchdog period."""
    os.environ.pop("WATCHDOG_PID", None)
    env = {"NOTIFY_SOCKET": str(notify.path), "WATCHDOG_USEC": str(WATCHDOG_USEC), **(env or {})}
    return RunningDaemon(config, endpoint, env=env)


def _images(folder: Path, colours: list[tuple[int, int, int]]) -> Path:
    folder.mkdir()
    for i, colour in enumerate(colours):
        cv2.imwrite(str(folder / f"{i:03d}.png"), np.full((128, 128, 3), colour, np.uint8))
    return folder


def test_ready_status_watchdog_and_stopping_in_order(tmp_path: Path, notify: NotifySocket) -> None:
    _images(tmp_path / "imgs", [(0, 0, 255)] * 3)
    d = _start(tmp_path, notify, {"type": "images", "path": "imgs", "fps": 20.0})
    try:
        ready_at = notify.wait_for("READY=1", timeout=20)
        notify.drain(2.0)
        before_ready = [x for t, x in notify.received if t < ready_at]
        assert all(x.startswith("STATUS=") for x in before_ready), before_ready  # no ping before READY
        assert sum("READY=1" in x.splitlines() for _, x in notify.received) == 1
        pings = notify.times_of("WATCHDOG=1", since=ready_at)
        gaps = np.diff(pings)
        assert len(pings) >= 4, pings
        assert 0.2 < float(np.median(gaps)) < 0.45  # half of WATCHDOG_USEC
        statuses = [d for _, d in notify.received if d.startswith("STATUS=")]
        assert any("fps" in s and "camera ok" in s and "thermal off" in s for s in statuses), statuses
        assert d.stop() == 0
        notify.drain(0.3)
        assert notify.received[-1][1] == "STOPPING=1" or "STOPPING=1" in [x for _, x in notify.received[-3:]]
    finally:
        d.close()


def test_a_sighup_while_the_configuration_is_read_at_start_reloads_it_and_does_not_end_edged(
    tmp_path: Path, notify: NotifySocket
) -> None:
    """A board's slow start, held here at the configuration's read (the kernel holds the open, as a
    stalled card would). SIGHUP's default action ended edged there, and systemd counts an end by
    SIGHUP as a clean exit: ``Restart=on-failure`` never started it again."""
    _images(tmp_path / "imgs", [(0, 0, 255)] * 3)
    config, endpoint = _configure(tmp_path, {"type": "images", "path": "imgs", "fps": 20.0})
    d = None
    try:
        with opening_stalled(config) as waiting:
            d = _spawn(config, endpoint, notify)
            assert wait_for(waiting, timeout_s=20), d.log()
            d.signal(signal.SIGHUP)
        d.collect("detections", 1)  # raises as soon as edged has exited (-1: ended by SIGHUP)
        notify.wait_for("READY=1", timeout=20)
        assert wait_for(lambda: "reloaded: model probe@" in d.log(), timeout_s=20), d.log()
        assert d.captured_after(time.time_ns(), 2)
        assert d.stop() == 0, d.log()
    finally:
        if d is not None:
            d.close()


def test_sigusr1_sigusr2_and_sigalrm_are_said_and_ignored(tmp_path: Path, notify: NotifySocket) -> None:
    """Their default action ends a process: a log rotation script's ``kill -USR1`` (its habit for daemons
    that reopen their log files) ended edged, and the line stopped while systemd restarted it."""
    _images(tmp_path / "imgs", [(0, 0, 255)] * 3)
    d = _start(tmp_path, notify, {"type": "images", "path": "imgs", "fps": 20.0})
    try:
        notify.wait_for("READY=1", timeout=20)
        for unused in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM, signal.SIGUSR1):
            d.signal(unused)
        assert wait_for(lambda: "received SIGUSR1, which edged has no use for: ignored" in d.log(), timeout_s=20)
        assert d.captured_after(time.time_ns(), 2)  # after all four: each one's default action ended edged
        log = d.log()
        assert "SIGUSR2" not in log and "SIGALRM" not in log, log  # said once a minute at most
        assert d.stop() == 0, log
    finally:
        d.close()


def test_a_stop_while_the_model_loads_at_start_ends_the_start_at_once_with_exit_0(
    tmp_path: Path, notify: NotifySocket
) -> None:
    """The load runs in native code for as long as the board takes (a large model, an engine built on the
    first start, a card that stalls: here the kernel holds the model's open). A stop waited for the load to
    finish, past ``TimeoutStopSec=5s``: systemd killed edged and marked the unit failed. Stalled, the load
    does not extend the start's timeout, and ``STATUS=`` says it stalls."""
    model = colour_probe(tmp_path / "probe.onnx")
    _images(tmp_path / "imgs", [(0, 0, 255)] * 3)
    config, endpoint = _configure(tmp_path, {"type": "images", "path": "imgs", "fps": 20.0}, model)
    with opening_stalled(model) as waiting:
        d = _spawn(config, endpoint, notify)
        try:
            assert wait_for(waiting, timeout_s=20), d.log()
            # The open that waits may be a probe the load goes on after: judged once the load has stalled 2 s.
            assert wait_for(lambda: _stalled_for(notify, 2), timeout_s=20), notify.received
            said = _stalled_for(notify, 2)
            extended = notify.times_of("EXTEND_TIMEOUT_USEC=30000000")
            assert said is not None and not [t for t in extended if said - 1.5 < t <= said], notify.received
            d.signal(signal.SIGTERM)
            assert d.proc.wait(timeout=3) == 0, d.log()  # the model's open still held
            log = d.log()
            assert "stopped before the start had finished" in log and "Traceback" not in log, log
            assert not notify.times_of("READY=1")
        finally:
            d.close()


def test_a_reloaded_model_that_fails_its_first_run_is_refused_and_the_running_one_carries_on(
    tmp_path: Path, notify: NotifySocket
) -> None:
    """The new model loads (ONNX Runtime cannot see the failure coming) but fails on every frame."""
    probe = colour_probe(tmp_path / "probe.onnx")
    failing = failing_probe(tmp_path / "failing.onnx", brighter_than=-1.0)
    _images(tmp_path / "imgs", [(0, 0, 255)] * 3)
    d = _start(tmp_path, notify, {"type": "images", "path": "imgs", "fps": 20.0}, probe)
    try:
        notify.wait_for("READY=1", timeout=20)
        running = d.collect("detections", 2)[-1].model.sha256
        config = tmp_path / "edged.toml"
        config.write_text(config.read_text().replace(str(probe), str(failing)))
        d.signal(signal.SIGHUP)
        notify.wait_for("RELOADING=1", timeout=20)

        def readies() -> int:
            notify.drain(0.1)
            return len(notify.times_of("READY=1"))

        assert wait_for(lambda: readies() == 2, timeout_s=30), d.log()  # READY=1 again: the reload is over
        log = d.log()
        assert "reload refused, keeping the running configuration and model" in log, log
        assert "fails on its first run" in log
        after = d.collect("detections", 5)  # raises if the daemon exited
        assert all(m.model.sha256 == running and m.detections for m in after)
        assert d.proc.poll() is None
    finally:
        d.close()


def _start_for_reloads(tmp_path: Path, notify: NotifySocket) -> tuple[RunningDaemon, Path, Path]:
    """The daemon on a folder of images and probe.onnx, with b.onnx and c.onnx beside it to reload to;
    returns it, its configuration and the probe."""
    probe = colour_probe(tmp_path / "probe.onnx")
    for name in ("b", "c"):
        colour_probe(tmp_path / f"{name}.onnx", metadata={"version": name})
    _images(tmp_path / "imgs", [(0, 0, 255)] * 3)
    return _start(tmp_path, notify, {"type": "images", "path": "imgs", "fps": 20.0}, probe), tmp_path / "edged.toml", probe


def _on_trial(d: RunningDaemon, config: Path, text: str) -> None:
    """``text`` as the configuration, reloaded: its model b loaded, on trial."""
    config.write_text(text)
    d.signal(signal.SIGHUP)
    assert wait_for(lambda: "loaded model b@" in d.log(), timeout_s=20), d.log()


def test_ready_waits_for_the_newest_reload_when_an_older_one_switches_in_while_it_loads(
    tmp_path: Path, notify: NotifySocket
) -> None:
    """B, on trial for the camera it adds (not there yet; the running one serves meanwhile), switches in
    once that camera delivers, while C's model file stalls: READY=1, what `systemctl reload` waits for,
    comes once C is in."""
    d, config, probe = _start_for_reloads(tmp_path, notify)
    added = config.read_text().replace('path = "imgs"', 'path = "later"\ncamera_id = "added"')
    try:
        notify.wait_for("READY=1", timeout=20)
        _on_trial(d, config, added.replace(str(probe), str(tmp_path / "b.onnx")))
        config.write_text(added.replace(str(probe), str(tmp_path / "c.onnx")))
        with opening_stalled(tmp_path / "c.onnx") as waiting:
            d.signal(signal.SIGHUP)
            assert wait_for(waiting, timeout_s=20), d.log()
            _images(tmp_path / "later", [(0, 0, 255)] * 3)
            assert wait_for(lambda: "reloaded: model b@" in d.log(), timeout_s=30), d.log()
            assert {m.camera_id for m in d.captured_after(time.time_ns(), 3)} == {"added"}
            assert "loaded model c@" not in d.log()
            assert len(notify.times_of("RELOADING=1")) == 2 and len(notify.times_of("READY=1")) == 1
        assert wait_for(lambda: "reloaded: model c@" in d.log(), timeout_s=30), d.log()
        assert wait_for(lambda: len(notify.times_of("READY=1")) == 2, timeout_s=10), notify.received
    finally:
        d.close()


def test_a_reload_on_trial_that_closed_the_running_camera_gives_way_when_a_newer_one_loads(
    tmp_path: Path, notify: NotifySocket
) -> None:
    """B reopens the running camera at a folder not there yet, so it waits on trial with no camera serving;
    C's SIGHUP (to set it right) stalls on its model file: B gives way, and the running camera and model
    serve until C is in."""
    d, config, probe = _start_for_reloads(tmp_path, notify)
    running = config.read_text()
    try:
        notify.wait_for("READY=1", timeout=20)
        first = d.collect("detections", 2)[-1].model.sha256
        reopened = running.replace('path = "imgs"', 'path = "later"')
        _on_trial(d, config, reopened.replace(str(probe), str(tmp_path / "b.onnx")))
        config.write_text(running.replace(str(probe), str(tmp_path / "c.onnx")))
        with opening_stalled(tmp_path / "c.onnx") as waiting:
            d.signal(signal.SIGHUP)
            assert wait_for(waiting, timeout_s=20), d.log()
            assert {m.model.sha256 for m in d.captured_after(time.time_ns(), 5)} == {first}
            assert "the reload on trial gives way to a newer one" in d.log()
        assert wait_for(lambda: "reloaded: model c@" in d.log(), timeout_s=30), d.log()
        assert "reloaded: model b@" not in d.log()
        assert wait_for(lambda: len(notify.times_of("READY=1")) == 2, timeout_s=10), notify.received
    finally:
        d.close()


def test_a_reload_still_on_trial_at_the_stop_removes_the_evidence_folders_it_made(
    tmp_path: Path, notify: NotifySocket
) -> None:
    """A reload adding a camera that gives no frame waits on trial; a stop then left the evidence folders it
    had made for that camera behind, empty."""
    d, config, probe = _start_for_reloads(tmp_path, notify)
    added = config.read_text().replace('path = "imgs"', 'path = "later"\ncamera_id = "added"')
    try:
        notify.wait_for("READY=1", timeout=20)
        _on_trial(d, config, added.replace(str(probe), str(tmp_path / "b.onnx")) + f'[evidence]\ndir = "{tmp_path}/ev"\n')
        assert (tmp_path / "ev" / "added").is_dir()  # made as the reload loaded, to compare the cameras' folders
        assert d.stop() == 0
    finally:
        d.close()
    assert not (tmp_path / "ev").exists()


def test_a_reload_still_loading_at_the_stop_removes_the_evidence_folders_it_made(
    tmp_path: Path, notify: NotifySocket
) -> None:
    """A reload whose model file stalls has made the new camera's evidence folder as it began; a stop
    does not wait for the load, and left that folder behind, empty."""
    d, config, probe = _start_for_reloads(tmp_path, notify)
    added = config.read_text().replace('path = "imgs"', 'path = "later"\ncamera_id = "added"')
    try:
        notify.wait_for("READY=1", timeout=20)
        config.write_text(added.replace(str(probe), str(tmp_path / "b.onnx")) + f'[evidence]\ndir = "{tmp_path}/ev"\n')
        with opening_stalled(tmp_path / "b.onnx") as waiting:
            d.signal(signal.SIGHUP)
            assert wait_for(waiting, timeout_s=20), d.log()
            assert (tmp_path / "ev" / "added").is_dir()
            assert d.stop() == 0
    finally:
        d.close()
    assert not (tmp_path / "ev").exists()


def test_pings_stop_when_inference_wedges(tmp_path: Path, notify: NotifySocket) -> None:
    """Black frames run normally; the bright frame after them hangs inside ONNX Runtime. Unpaced, the
    folder is read an image at a time as the model takes them: paced, a start slower than the black
    frames skipped them all, the bright one came first and READY=1 never did. The watchdog's thread
    says why it withholds the pings, and a SIGTERM then still ends edged, exit 0."""
    model = stalling_probe(tmp_path / "stall.onnx")
    _images(tmp_path / "imgs", [(0, 0, 0)] * 4 + [(255, 255, 255)])
    d = _start(tmp_path, notify, {"type": "images", "path": "imgs", "pace": False, "loop": False}, model)
    try:
        ready_at = notify.wait_for("READY=1", timeout=20)
        # The pings stop stall_timeout_s after the last frame, however long a loaded machine takes to
        # get there: wait for ten ping intervals of silence, not for a fixed time.
        deadline = time.monotonic() + 30
        while True:
            notify.drain(0.5)
            pings = notify.times_of("WATCHDOG=1", since=ready_at)
            if time.monotonic() - (pings[-1] if pings else ready_at) > 3.0:
                break
            assert time.monotonic() < deadline, "pings continued while inference was stuck"
        assert pings, "no pings while frames flowed"
        assert d.proc.poll() is None  # wedged, not crashed: systemd's watchdog acts, we do not
        # Why, said by the watchdog's thread: with one lane the loop runs inference, so its status line is stale.
        assert "watchdog pings withheld: the loop has not turned for" in d.log(), d.log()
        statuses = [x for _, x in notify.received if x.startswith("STATUS=")]
        assert statuses[-1].startswith("STATUS=unhealthy: the loop has not turned for"), statuses[-3:]
        # SIGTERM's handler cannot run while that thread is inside the model: the stop is not left to SIGKILL.
        d.signal(signal.SIGTERM)
        assert d.proc.wait(timeout=30) == 0, d.log()  # by itself, after STOP_STUCK_S: not left to SIGKILL
        assert "received SIGTERM, but the main thread has not come out of a call for 4 s" in d.log(), d.log()
    finally:
        d.close()


def test_a_lost_camera_keeps_pings_while_reconnecting(tmp_path: Path, notify: NotifySocket) -> None:
    colour_probe(tmp_path / "probe.onnx")
    d = _start(tmp_path, notify, {"type": "v4l2", "device": "/dev/video99"})
    try:
        ready_at = notify.wait_for("READY=1", timeout=20)  # up and honest: camera lost
        notify.drain(2.5)
        assert len(notify.times_of("WATCHDOG=1", since=ready_at)) >= 4
        statuses = [x for _, x in notify.received if "STATUS=" in x]
        assert any("camera lost" in s for s in statuses), statuses
        # The first status may come before the capture thread's first attempt has failed.
        states = [m.source_state for m in d.messages(3) if m.kind == "status"]
        assert "lost" in states and set(states[states.index("lost") :]) == {"lost"}, states
        assert set(states) <= {"starting", "lost"}, states
    finally:
        d.close()


JOURNAL_SOCKET = Path("/run/systemd/journal/socket")


@pytest.fixture
def journal() -> Iterator[NotifySocket]:
    """journald's socket, where libsystemd sends log entries; only where no journald runs."""
    if JOURNAL_SOCKET.exists():
        pytest.skip("a journald already listens on this machine")
    JOURNAL_SOCKET.parent.mkdir(parents=True, exist_ok=True)
    j = NotifySocket(JOURNAL_SOCKET)
    yield j
    j.close()
    JOURNAL_SOCKET.unlink()


def _entries(journal: NotifySocket) -> list[dict[str, str]]:
    return [dict(line.split("=", 1) for line in datagram.splitlines() if "=" in line) for _, datagram in journal.received]


def test_under_systemd_logs_go_to_journald_with_structured_fields(
    tmp_path: Path, notify: NotifySocket, journal: NotifySocket
) -> None:
    _images(tmp_path / "imgs", [(0, 0, 255)] * 3)
    d = _start(tmp_path, notify, {"type": "images", "path": "imgs", "fps": 20.0}, env={"JOURNAL_STREAM": "8:1234"})
    try:
        notify.wait_for("READY=1", timeout=20)
        journal.drain(2.0)  # 40 frames go by: none of them may produce a log entry
        entries = _entries(journal)
        ready = [e for e in entries if e.get("MESSAGE") == "first frame processed: ready"]
        assert len(ready) == 1, entries
        assert ready[0]["SYSLOG_IDENTIFIER"] == "edged" and ready[0]["PRIORITY"] == "6"
        assert ready[0]["CAMERA"] == "cam0" and ready[0]["LOGGER"] == "edged.daemon"
        assert len(entries) < 15, [e.get("MESSAGE") for e in entries]
        assert d.log() == ""  # nothing on stderr when journald has it
    finally:
        d.close()


def test_a_notify_socket_nobody_reads_never_blocks_the_sender_and_the_drop_is_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A full NOTIFY_SOCKET queue drops notifications instead of freezing the loop and the watchdog."""
    unread = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    unread.bind(str(tmp_path / "notify.sock"))
    notifier = Notifier(str(tmp_path / "notify.sock"))
    sender = threading.Thread(target=lambda: [notifier.status(f"frame {i}") for i in range(5000)], daemon=True)
    try:
        with caplog.at_level(logging.INFO, logger="edged.service"):
            sender.start()
            sender.join(timeout=30)
            assert not sender.is_alive(), "sd_notify blocked on a queue nobody reads"
            assert [r.message for r in caplog.records].count(
                f"sd_notify: {tmp_path / 'notify.sock'} is full (nothing reads it); dropping notifications"
            ) == 1
            unread.settimeout(0.1)
            queued = 0
            while True:
                try:
                    unread.recv(4096)
                except TimeoutError:
                    break
                queued += 1
            assert 0 < queued < 5000
            notifier.status("read again")
            assert unread.recv(4096) == b"STATUS=read again"
            assert f"accepts again after {5000 - queued} dropped notification(s)" in caplog.text
    finally:
        notifier.close()
        unread.close()


def _loading(notify: NotifySocket, work: Callable[[], None]) -> threading.Thread:
    """``work`` as the start runs the model's load (`Signals.unless_stopped`), under a `StartTimeout` telling ``notify``."""

    def start() -> None:
        notifier, signals = Notifier(str(notify.path)), Signals()
        with StartTimeout(notifier, signals):
            signals.unless_stopped(work)
        notifier.close()

    thread = threading.Thread(target=start, daemon=True)
    thread.start()
    return thread


def _stalls(notify: NotifySocket, since: float = 0.0) -> list[float]:
    return [t for t, d in notify.received if "no progress for" in d and t >= since]


def _stalled_for(notify: NotifySocket, seconds: int) -> float | None:
    """When ``STATUS=`` first said the load had made no progress for ``seconds`` or more, if it has."""
    said = (t for t, d in notify.received if (m := re.search(r"no progress for (\d+) s", d)) and int(m[1]) >= seconds)
    return next(said, None)


def test_a_load_that_works_on_extends_the_start_timeout_and_one_that_stalls_does_not(
    monkeypatch: pytest.MonkeyPatch, notify: NotifySocket, caplog: pytest.LogCaptureFixture
) -> None:
    """A model the board takes longer than ``TimeoutStartSec=`` to load was killed and started again without
    end. Working (CPU here), the load moves the timeout on at each look; stalled (waiting, as on a hung disk),
    it gets no more: ``STATUS=`` says so, and the journal once, as the last extension runs out."""
    monkeypatch.setattr(service, "LOAD_CHECK_S", 0.05)
    monkeypatch.setattr(service, "LOAD_EXTEND_S", 0.3)
    extend = "EXTEND_TIMEOUT_USEC=300000"
    stall, stalled, release = threading.Event(), threading.Event(), threading.Event()

    def work() -> None:
        while not stall.is_set():
            sum(range(10_000))
        stalled.set()
        release.wait(20)

    with caplog.at_level(logging.WARNING, logger="edged.service"):
        start = _loading(notify, work)
        assert wait_for(lambda: len(notify.times_of(extend)) >= 3, timeout_s=20), notify.received
        assert any(d.startswith(f"{extend}\nSTATUS=loading the model: ") for _, d in notify.received)
        stall.set()
        assert stalled.wait(20)
        waiting = time.monotonic()
        assert wait_for(lambda: len(_stalls(notify, since=waiting)) >= 10, timeout_s=20), notify.received
        seen = _stalls(notify, since=waiting)[0]
        release.set()
        start.join(20)
    assert not start.is_alive()
    assert not notify.times_of(extend, since=seen)
    said = [r.message for r in caplog.records if "no longer extended" in r.message]
    assert len(said) == 1, said


def test_a_load_reading_its_file_slowly_extends_the_start_timeout(
    monkeypatch: pytest.MonkeyPatch, notify: NotifySocket
) -> None:
    """A large model read from a slow card or a network mount: the bytes coming in are progress, CPU or not."""
    monkeypatch.setattr(service, "LOAD_CHECK_S", 0.05)
    reading, writing = os.pipe()
    stop = threading.Event()

    def trickle() -> None:
        while not stop.wait(0.02):
            os.write(writing, b"x")
        os.close(writing)

    def work() -> None:
        with os.fdopen(reading, "rb", buffering=0) as f:
            while f.read(1):
                pass

    feeder = threading.Thread(target=trickle, daemon=True)
    feeder.start()
    start = _loading(notify, work)
    try:
        assert wait_for(lambda: len(notify.times_of("EXTEND_TIMEOUT_USEC=30000000")) >= 3, timeout_s=20), notify.received
    finally:
        stop.set()
        feeder.join(5)
        start.join(20)
    assert not start.is_alive()


def test_outside_systemd_nothing_watches_the_load() -> None:
    watching = {t for t in threading.enumerate() if t.name == "start-timeout"}
    with StartTimeout(Notifier(""), Signals()):
        assert {t for t in threading.enumerate() if t.name == "start-timeout"} == watching


@pytest.mark.unit
def test_each_signal_wakes_the_loop_where_it_waits_for_frames() -> None:
    """The loop waits for frames in select, and a signal's handler runs only once it is back: the
    kernel may give the signal to another thread, and a wait the signal ends is taken up again after
    the handler. So a stop or a reload waited for the next frame (or up to 0.25 s). The signals'
    thread, woken by every signal, sets the loop's wake-up."""
    signals = Signals()
    signals.wake = wake = Wake()
    woken, written = os.pipe()
    watcher = threading.Thread(target=signals._watch_stops, args=(woken,), daemon=True)
    watcher.start()
    try:
        os.write(written, bytes([signal.SIGHUP]))  # as the C-level handler writes it (a stop would wait to exit)
        assert ready([wake], [], 30)[0] == [wake]
    finally:
        os.close(written)  # the thread reads the end of the pipe and returns
        watcher.join(30)
        os.close(woken)
        wake.close()
    assert not watcher.is_alive()


EXITING = """
import select, sys
from edged.config import PublishConfig
from edged.publish import Publisher
from edged.service import exit_safely

pub = Publisher(PublishConfig(endpoints=[sys.argv[1]], hwm=100, linger_ms=10_000), ["cam0"])
while not select.select([sys.stdin], [], [], 0.02)[0]:  # a probe at a time until the subscriber has one
    pub.send(b"probe", b"{}")
payload = bytes(1 << 20)
for _ in range(int(sys.argv[2])):
    pub.send(b"big", payload)
pub.close()
exit_safely(5)
"""


def test_the_exit_sends_what_was_queued_for_a_slow_subscriber_before_it_ends_the_process(tmp_path: Path) -> None:
    """The process ends without interpreter finalisation, but only once ZeroMQ has sent what was
    queued behind a slow subscriber: libzmq does so while its context is terminated, which
    finalisation did in freeing it. 64 MB is more than loopback's socket buffers hold: an exit
    without the wait lost half of them."""
    count = 64
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    with subprocess.Popen(
        [sys.executable, "-c", EXITING, endpoint, str(count)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    ) as child:
        try:
            assert sub.poll(30_000), child.communicate()[0] if child.poll() is not None else "never heard the child"
            child.stdin.write(b"go\n")  # type: ignore[union-attr]
            child.stdin.flush()  # type: ignore[union-attr]
            got = 0
            while got < count and sub.poll(10_000):
                if sub.recv_multipart()[0] == b"big":
                    got += 1
                    time.sleep(0.01)  # a slow subscriber: the rest waits in ZeroMQ's queue
            assert child.wait(30) == 5, child.communicate()[0]
            assert got == count
        finally:
            child.kill()
            sub.close(linger=0)
