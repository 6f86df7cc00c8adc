"""The reject line on the running daemon: `edged run` and `edged check` against the fake gpiod at the
import boundary (tests/fakes/gpiod), which records every level the line takes with its monotonic time."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from daemon import RunningDaemon, free_port, run_cli, write_config, write_video
from onnx_models import colour_probe, failing_probe, stalling_probe
from waiting import wait_for

from edged.daemon import MAX_INFERENCE_FAILURES
from edged.messages import RejectReport, StatusMessage, VerdictMessage, parse_message

pytestmark = pytest.mark.integration

FAKES = Path(__file__).parent / "fakes"
CHIP = "/dev/gpiochip0"
LINES = ["EJECT", "ALARM", "SPARE", "BUSY"]
NG = (255, 200, 255)  # bright: the probe scores both classes high, so every frame is NG
OK = (20, 20, 20)  # dark: no detection, an OK part
MS = 1_000_000
SLACK_MS = 250  # how far a busy machine may push an edge late
# How far after the capture its wall-clock time may be taken: once the frame is decoded, on a busy
# machine 107 ms later (seen in CI); the tests that use it send a part every 500 ms, so a rise this
# early is still this part's.
EARLY_MS = 200


class Rig:
    """A config in ``tmp_path`` for a clip of one colour and a model, the fake chip, and its record."""

    def __init__(
        self,
        tmp_path: Path,
        colour: tuple[int, int, int],
        reject: dict[str, Any],
        model: str = "probe",
        trigger: dict[str, Any] | None = None,
        fps: float = 20.0,
    ) -> None:
        tmp_path.mkdir(exist_ok=True)
        self.record = tmp_path / "gpio.record"
        spec = {"chips": {CHIP: {"label": "pinctrl-test", "lines": LINES, "held": {"3": "conveyor-plc"}}}}
        (tmp_path / "gpio.json").write_text(json.dumps(spec | {"record": str(self.record)}))
        self.env = {
            "PYTHONPATH": os.pathsep.join([str(FAKES), os.environ.get("PYTHONPATH", "")]),
            "FAKE_GPIOD": str(tmp_path / "gpio.json"),
        }
        builders = {"probe": colour_probe, "slow": lambda p: stalling_probe(p, 10**5), "failing": failing_probe}
        builders[model](tmp_path / "model.onnx")
        write_video(tmp_path / "clip.avi", [colour] * 10, fps=fps)
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.config = write_config(
            tmp_path / "edged.toml",
            {
                "source": {"type": "file", "path": "clip.avi", "loop": True, "realtime": True},
                "model": {"path": "model.onnx"},
                "publish": {"endpoints": [self.endpoint], "status_interval_s": 0.3},
                "thermal": {"enabled": False},
                "journal": {"enabled": False},
                "inspect": {},
                "reject": {"chip": CHIP, "line": "EJECT", "delay_ms": 100.0, "pulse_ms": 10.0} | reject,
            }
            | ({"trigger": trigger} if trigger else {}),
        )

    def start(self) -> RunningDaemon:
        return RunningDaemon(self.config, self.endpoint, env=self.env)

    def cli(self, command: str) -> Any:
        return run_cli(command, "--config", str(self.config), env=self.env)

    def levels(self, offset: int = 0) -> list[int | None]:
        """The levels the line took, in order (None: released)."""
        return [level for _, level in self.timed(offset)]

    def timed(self, offset: int = 0) -> list[tuple[int, int | None]]:
        if not self.record.exists():
            return []
        rows = [line.split() for line in self.record.read_text().splitlines()]
        return [(int(t), None if v == "released" else int(v)) for t, path, o, v in rows if path == CHIP and int(o) == offset]


@pytest.fixture
def daemons() -> Iterator[list[RunningDaemon]]:
    started: list[RunningDaemon] = []
    yield started
    for d in started:
        d.close()


def reject_of(status: StatusMessage) -> RejectReport:
    assert status.reject is not None
    return status.reject


def line_processes(daemon: RunningDaemon) -> list[int]:
    """The reject line processes the daemon started: its children running ``edged.reject``."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            command = (stat.parent / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue  # a process that ended meanwhile
        if parent == daemon.proc.pid and b"edged.reject" in command:
            found.append(int(stat.parent.name))
    return found


def rises(rig: Rig) -> list[int]:
    timed = rig.timed()
    return [t for (t, level), (_, before) in zip(timed[1:], timed, strict=False) if level == 1 and before == 0]


def assert_each_fired_at_its_time(rig: Rig, verdicts: list[VerdictMessage], delay_ms: float, since_ns: int) -> None:
    """Each verdict's part pulsed at capture + ``delay_ms``, some of them after ``since_ns``. The
    capture time is the wall clock's, taken just after the monotonic one the line counts from."""
    offset = time.time_ns() - time.monotonic_ns()
    targets = [v.capture_time_ns - offset + int(delay_ms * MS) for v in verdicts]
    assert any(target > since_ns for target in targets), "no part was on its way"
    fired = rises(rig)
    for target in targets:
        assert any(target - EARLY_MS * MS <= rise < target + SLACK_MS * MS for rise in fired), (target, fired)


def test_ng_parts_pulse_the_line_once_each_after_their_capture(tmp_path: Path, daemons: list[RunningDaemon]) -> None:
    rig = Rig(tmp_path, NG, {"delay_ms": 1000.0})  # every verdict in time, on a busy machine too
    d = rig.start()
    daemons.append(d)
    verdicts = [m for m in d.collect("verdict", 3, timeout=60) if isinstance(m, VerdictMessage)]
    assert {v.verdict for v in verdicts} == {"ng"}
    status = d.wait_status(lambda s: s.reject is not None and s.reject.pulses >= 3, timeout=30)
    report = reject_of(status)
    assert report.late == 0 and report.margin_p1_ms is not None and 0 < report.margin_p1_ms <= 1000
    assert 0 <= report.lateness_p50_ms <= report.lateness_max_ms
    timed = rig.timed()
    assert timed[0][1] == 0  # requested inactive
    rises = [t for (t, level), (_, before) in zip(timed[1:], timed, strict=False) if level == 1 and before == 0]
    falls = [t for (t, level), (_, before) in zip(timed[1:], timed, strict=False) if level == 0 and before == 1]
    assert len(rises) >= 3 and all(fall - rise >= 10 * MS for rise, fall in zip(rises, falls, strict=False))
    assert d.stop() == 0
    assert rig.levels()[-2:] == [0, None]


def test_ok_parts_never_pulse(tmp_path: Path, daemons: list[RunningDaemon]) -> None:
    rig = Rig(tmp_path, OK, {"delay_ms": 3000.0})  # every verdict in time, on a busy machine too
    d = rig.start()
    daemons.append(d)
    status = d.wait_status(lambda s: s.frames_processed >= 5 and s.reject is not None and s.reject.margin_p50_ms is not None)
    assert reject_of(status).pulses == 0 and reject_of(status).late == 0
    assert d.stop() == 0
    assert rig.levels() == [0, 0, None]


def test_a_slow_model_fires_the_fail_safe_at_the_deadline_and_never_again_for_its_late_verdict(
    tmp_path: Path, daemons: list[RunningDaemon]
) -> None:
    rig = Rig(tmp_path, NG, {"delay_ms": 5.0}, model="slow")
    d = rig.start()
    daemons.append(d)
    status = d.wait_status(lambda s: s.reject is not None and s.reject.late_verdicts >= 2, timeout=60)
    report = reject_of(status)
    # Every part is late: each pulse is a fail-safe one, none fired by the verdict that came after it.
    assert report.late >= 2 and report.late_fired == report.late
    assert report.pulses <= report.late_fired and report.margin_p50_ms is None
    d.stop()
    assert rig.levels()[-2:] == [0, None]


def test_a_reloads_slow_trial_frame_fires_the_fail_safe_at_its_deadline_not_when_its_verdict_comes(
    tmp_path: Path, daemons: list[RunningDaemon]
) -> None:
    # A reload's trial frame was never announced to the line: its part's deadline was found only when
    # its verdict came, seconds after the capture here, and the fail-safe pulse fired then, on the part
    # at the ejector by that time, not on this one. Frames 500 ms apart keep other parts' pulses clear.
    rig = Rig(tmp_path, NG, {"delay_ms": 300.0}, fps=2.0)
    d = rig.start()
    daemons.append(d)
    d.wait_status(lambda s: s.reject is not None and s.reject.pulses >= 1, timeout=60)
    slow = stalling_probe(tmp_path / "model.onnx", 5 * 10**6)  # seconds on a bright frame, none on the grey warm-up
    sha = hashlib.sha256(slow.read_bytes()).hexdigest()
    since = time.monotonic_ns()
    d.signal(signal.SIGHUP)
    trial = next(m for m in d.messages(120) if isinstance(m, VerdictMessage) and m.model_sha256 == sha and m.verdict == "ng")
    target = trial.capture_time_ns - (time.time_ns() - time.monotonic_ns()) + 300 * MS  # on the line's clock
    assert wait_for(lambda: any(rise >= target - EARLY_MS * MS for rise in rises(rig)), 30)
    assert_each_fired_at_its_time(rig, [trial], 300.0, since)


def test_late_pass_and_alarm(tmp_path: Path, daemons: list[RunningDaemon]) -> None:
    passing = Rig(tmp_path / "pass", NG, {"delay_ms": 5.0, "late": "pass"}, model="slow")
    d = passing.start()
    daemons.append(d)
    report = reject_of(d.wait_status(lambda s: s.reject is not None and s.reject.late >= 2, timeout=60))
    assert report.pulses == report.late_fired == 0
    d.stop()
    assert passing.levels() == [0, 0, None]
    alarm = Rig(tmp_path / "alarm", NG, {"delay_ms": 5.0, "late": "alarm", "alarm_line": "ALARM"}, model="slow")
    d = alarm.start()
    daemons.append(d)
    report = reject_of(d.wait_status(lambda s: s.reject is not None and s.reject.alarm, timeout=60))
    assert report.pulses == 0 and alarm.levels(1)[:2] == [0, 1]
    d.stop()
    assert alarm.levels(1)[-2:] == [0, None]


def test_sigterm_during_a_pulse_and_sighup_leave_the_line_inactive(tmp_path: Path, daemons: list[RunningDaemon]) -> None:
    rig = Rig(tmp_path, NG, {"delay_ms": 0.0, "pulse_ms": 1000.0})  # a part every 50 ms: one pulse, on and on
    d = rig.start()
    daemons.append(d)
    assert wait_for(lambda: 1 in rig.levels(), 60), d.log()
    config = rig.config.read_text().replace('line = "EJECT"', 'line = "SPARE"')
    rig.config.write_text(config)
    d.signal(signal.SIGHUP)  # the reload moves the line: the old one drains, inactive and released; the new one requested
    assert wait_for(lambda: rig.levels()[-2:] == [0, None] and rig.levels(2)[:1] == [0], 60), d.log()
    assert wait_for(lambda: 1 in rig.levels(2), 60), d.log()
    # A reload that leaves no line, then systemd's stop at once, SIGTERM to every process of the unit: the
    # daemon's stop waits for the draining line process, which had outlived it holding the line (then
    # systemd's SIGTERM once the daemon has exited cut its pulse short).
    rig.config.write_text(config.partition("\n[reject]\n")[0] + "\n")
    d.signal(signal.SIGHUP)
    d.wait_status(lambda s: s.reject is None, timeout=60)
    stopped = time.monotonic()
    for pid in [d.proc.pid, *line_processes(d)]:
        os.kill(pid, signal.SIGTERM)
    assert d.proc.wait(10) == 0, d.log()
    assert time.monotonic() - stopped < 5.0  # TimeoutStopSec=5s
    # The stop let the pulse under way run to its end (then inactive as it is released: 0 again).
    assert rig.levels(2)[-4:] == [1, 0, 0, None] and rig.levels()[-2:] == [0, None]


def test_a_loop_that_gives_up_leaves_the_line_inactive_after_its_parts_fail_safe(
    tmp_path: Path, daemons: list[RunningDaemon]
) -> None:
    rig = Rig(tmp_path, NG, {"delay_ms": 300.0, "pulse_ms": 5.0}, model="failing")  # every bright frame fails in ORT
    d = rig.start()
    daemons.append(d)
    assert d.proc.wait(60) == 1, d.log()
    levels = rig.levels()
    # No verdict: each part the loop took is rejected at its deadline, those still on their way as it gave up too.
    assert len(rises(rig)) >= MAX_INFERENCE_FAILURES and levels[-2:] == [0, None], levels


def test_a_line_another_program_holds_exits_1_naming_it(tmp_path: Path) -> None:
    rig = Rig(tmp_path, NG, {"line": "BUSY"})
    for command in ("run", "check", "--no-bind"):  # --no-bind: beside the service, it finds who holds the line
        result = (
            rig.cli(command)
            if command != "--no-bind"
            else run_cli("check", command, "--config", str(rig.config), env=rig.env)
        )
        assert result.returncode == 1, result.stderr
        assert "reject.line 'BUSY' of gpiochip0 (camera cam0) is held by 'conveyor-plc'" in result.stderr + result.stdout


def test_a_wrong_line_exits_78_naming_the_chips_lines(tmp_path: Path) -> None:
    rig = Rig(tmp_path, NG, {"line": "EJCT"})
    for command in ("run", "check"):
        result = rig.cli(command)
        assert result.returncode == 78, result.stderr
        assert "its lines: 0 EJECT, 1 ALARM, 2 SPARE, 3 BUSY" in result.stderr + result.stdout


def test_a_reload_naming_a_line_the_chip_lacks_is_refused_and_the_running_line_fires_on(
    tmp_path: Path, daemons: list[RunningDaemon]
) -> None:
    """A reload with a typo in reject.line took over with the camera driving no line: NG parts went on
    with the good ones, said only in a log line."""
    rig = Rig(tmp_path, NG, {"delay_ms": 50.0})
    d = rig.start()
    daemons.append(d)
    assert wait_for(lambda: len(rises(rig)) >= 1, 60), d.log()
    rig.config.write_text(rig.config.read_text().replace('line = "EJECT"', 'line = "EJCT"'))
    d.signal(signal.SIGHUP)
    assert wait_for(lambda: "reload refused" in d.log(), 30), d.log()
    refused = d.log().split("reload refused", 1)[1]
    assert "reject.line 'EJCT' (camera cam0): gpiochip0 (pinctrl-test) has no such line" in refused, refused
    fired = len(rises(rig))
    status = d.wait_status(lambda s: s.reject is not None and s.reject.pulses > fired + 2, timeout=30)
    assert status.reject is not None and len(rises(rig)) > fired + 2  # the running line, EJECT, fires on
    rig.config.write_text(rig.config.read_text().replace('line = "EJCT"', 'line = "BUSY"'))
    d.signal(signal.SIGHUP)  # a line another program holds: refused too
    assert wait_for(lambda: d.log().count("reload refused") == 2, 30), d.log()
    assert (
        "reject.line 'BUSY' of gpiochip0 (camera cam0) is held by 'conveyor-plc'" in d.log().rsplit("reload refused", 1)[1]
    )
    assert "drives no reject line" not in d.log()


def test_a_reload_onto_the_line_another_edged_holds_is_refused_naming_it_and_its_own_fires_on(
    tmp_path: Path, daemons: list[RunningDaemon]
) -> None:
    """Two units on one board, the second reloaded onto the first's line: every edged named its lines
    ``edged``, so the reload's look took the line for its own and took over, its line process then
    failing to request it every 5 s and each NG part dropped."""
    first, second = Rig(tmp_path / "first", NG, {}), Rig(tmp_path / "second", NG, {"line": "SPARE"})
    second.env, second.record = first.env, first.record  # one chip: the first's
    a = first.start()
    daemons.append(a)
    assert wait_for(lambda: len(rises(first)) >= 1, 60), a.log()
    b = second.start()
    daemons.append(b)
    assert wait_for(lambda: second.levels(2).count(1) >= 1, 60), b.log()
    second.config.write_text(second.config.read_text().replace('line = "SPARE"', 'line = "EJECT"'))
    b.signal(signal.SIGHUP)
    assert wait_for(lambda: "reload refused" in b.log(), 30), b.log()
    held = f"reject.line 'EJECT' of gpiochip0 (camera cam0) is held by 'edged:{a.proc.pid}'"
    assert held in b.log().split("reload refused", 1)[1], b.log()
    fired = second.levels(2).count(1)
    assert wait_for(lambda: second.levels(2).count(1) > fired + 2, 30), b.log()  # its own line fires on
    assert a.proc.poll() is None and len(rises(first)) > 1


def test_check_requests_and_releases_the_line(tmp_path: Path) -> None:
    rig = Rig(tmp_path, NG, {})
    result = rig.cli("check")
    assert result.returncode == 0, result.stderr
    assert f"reject     camera cam0: {CHIP} line 0 (requested and released)" in result.stdout
    assert rig.levels() == [0, 0, None]


def test_in_request_mode_each_request_pulses_once_counted_from_its_frames_capture(
    tmp_path: Path, daemons: list[RunningDaemon]
) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    rig = Rig(tmp_path, NG, {"delay_ms": 1000.0}, trigger={"mode": "request", "endpoint": endpoint, "timeout_s": 5.0})
    d = rig.start()
    daemons.append(d)
    d.wait_status(lambda s: s.capture is not None and s.capture.frames_captured >= 3, timeout=30)
    context = zmq.Context()
    try:
        for part in range(2):
            sent = time.monotonic_ns()
            sock = context.socket(zmq.REQ)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(endpoint)
            sock.send(f'{{"part_id": "P{part}"}}'.encode())
            assert sock.poll(15_000), d.log()
            reply = parse_message(sock.recv())
            sock.close(linger=0)
            assert isinstance(reply, VerdictMessage) and reply.verdict == "ng", reply
            assert wait_for(lambda n=part + 1: rig.levels().count(1) == n, 30), (rig.levels(), d.log())
            rise = next(t for t, level in rig.timed() if level == 1 and t > sent)
            assert rise >= sent + 1000 * MS  # the frame was captured after the request arrived
    finally:
        context.destroy(linger=0)
    status = d.wait_status(lambda s: s.reject is not None and s.reject.pulses == 2, timeout=30)
    assert reject_of(status).late == 0  # no frame between requests, nor the warm-up's, had a deadline
    assert d.stop() == 0
    assert rig.levels().count(1) == 2


def test_a_stop_fires_the_parts_judged_before_it_at_their_time_then_lets_go_of_the_line(
    tmp_path: Path, daemons: list[RunningDaemon]
) -> None:
    rig = Rig(tmp_path, NG, {"delay_ms": 800.0}, fps=2.0)  # a part every 500 ms: each pulse is its own
    d = rig.start()
    daemons.append(d)
    verdicts = [m for m in d.collect("verdict", 2, timeout=60) if isinstance(m, VerdictMessage)]
    stopped = time.monotonic_ns()
    unit = [d.proc.pid, *line_processes(d)]
    assert len(unit) == 2, unit
    for pid in unit:  # systemd's stop (KillMode=control-group): SIGTERM to every process of the unit at once
        os.kill(pid, signal.SIGTERM)
    assert d.proc.wait(10) == 0, d.log()
    assert_each_fired_at_its_time(rig, verdicts, 800.0, stopped)
    assert rig.levels()[-2:] == [0, None]
    assert "another takes over" not in d.log() and "started again" not in d.log()  # a stop, not a lone signal


def test_a_daemon_killed_outright_still_fires_its_parts_in_flight_at_their_time(
    tmp_path: Path, daemons: list[RunningDaemon]
) -> None:
    rig = Rig(tmp_path, NG, {"delay_ms": 800.0}, fps=2.0)
    d = rig.start()
    daemons.append(d)
    verdicts = [m for m in d.collect("verdict", 2, timeout=60) if isinstance(m, VerdictMessage)]
    killed = time.monotonic_ns()
    d.proc.kill()  # SIGKILL: nothing of the daemon runs again; its line process sees the pipe close
    d.proc.wait()
    assert wait_for(lambda: rig.levels()[-1:] == [None], 10), rig.levels()
    assert_each_fired_at_its_time(rig, verdicts, 800.0, killed)
    assert rig.levels()[-2:] == [0, None]


def test_a_daemon_killed_outright_during_a_pulse_still_leaves_the_line_inactive(
    tmp_path: Path, daemons: list[RunningDaemon]
) -> None:
    rig = Rig(tmp_path, NG, {"delay_ms": 0.0, "pulse_ms": 10_000.0})
    d = rig.start()
    daemons.append(d)
    assert wait_for(lambda: 1 in rig.levels(), 60), d.log()
    d.proc.kill()  # SIGKILL: nothing of the daemon runs again; its line process sees the pipe close
    d.proc.wait()
    assert wait_for(lambda: rig.levels()[-2:] == [0, None], 10), rig.levels()
