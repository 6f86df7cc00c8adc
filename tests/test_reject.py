"""The reject line: its settings, and its pulses on a line that records them.

Every test runs against the fake ``gpiod`` at the import boundary (tests/fakes/gpiod), which
records each level a line takes with its monotonic time. Where the kernel has ``gpio-sim``
(configfs), the tests marked so run again on a simulated chip through the real binding,
reading the line's level back from the simulator; elsewhere they skip saying why.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from pydantic import ValidationError
from waiting import wait_for

from edged.config import Settings
from edged.errors import EXIT_CONFIG, EXIT_FAILURE, LineBusy, LineError
from edged.output import Services
from edged.reject import (
    DRAIN_S,
    INSTALL_GPIOD,
    RejectLine,
    RejectOutput,
    check_lines,
    holder_name,
    open_lines,
)
from edged.settings.reject import RejectConfig

FAKES = Path(__file__).parent / "fakes"
CHIP = "/dev/gpiochip0"
LINES = ["EJECT", "ALARM", "SPARE", "BUSY"]
MS = 1_000_000
SLACK_MS = 250  # how far a busy machine may push an edge late; never early
GPIO_SIM = Path("/sys/kernel/config/gpio-sim")
STALL = (
    f"/tmp/edged-gpio-stall-{uuid.uuid4().hex}"  # while it exists, the fake's requests wait (`test_a_reloads_new_line...`)
)


@pytest.fixture
def gpiod(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[ModuleType]:
    """The fake gpiod importable as ``gpiod`` here and in the line processes started, with one chip of
    four lines, BUSY held by another program; every process's levels go to one record file."""
    names = [name for name in sys.modules if name == "gpiod" or name.startswith("gpiod.")]
    for name in names:
        monkeypatch.delitem(sys.modules, name)
    spec = {"chips": {CHIP: {"label": "pinctrl-test", "lines": LINES, "held": {"3": "conveyor-plc"}}}}
    (tmp_path / "gpio.json").write_text(json.dumps(spec | {"record": str(tmp_path / "gpio.record"), "stall": STALL}))
    monkeypatch.setenv("FAKE_GPIOD", str(tmp_path / "gpio.json"))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(FAKES), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.syspath_prepend(str(FAKES))
    import gpiod as fake

    yield fake
    for name in [name for name in sys.modules if name == "gpiod" or name.startswith("gpiod.")]:
        sys.modules.pop(name, None)


def reject(**keys: Any) -> RejectConfig:
    return RejectConfig(**({"chip": CHIP, "line": "EJECT", "delay_ms": 100.0, "pulse_ms": 30.0} | keys))


@pytest.fixture
def lines() -> Iterator[list[RejectLine]]:
    started: list[RejectLine] = []
    yield started
    for line in started:
        line.stop()


def start(lines: list[RejectLine], cfg: RejectConfig, drain_s: float = DRAIN_S) -> RejectLine:
    line = RejectLine("cam0", cfg, drain_s=drain_s)
    lines.append(line)
    return line


def levels(fake: ModuleType, offset: int) -> list[tuple[int, int | None]]:
    """(monotonic ns, physical level or None: released) of one line, in order, by every process."""
    record = Path(fake.RECORD_FILE)
    rows = [row.split() for row in record.read_text().splitlines()] if record.exists() else []
    return [(int(t), None if v == "released" else int(v)) for t, path, o, v in rows if path == CHIP and int(o) == offset]


def pulses(fake: ModuleType, offset: int = 0) -> list[tuple[int, int]]:
    """The completed pulses of a line (active high) as (start, end) ns, after the level it was requested at."""
    found, rise = [], None
    for t, level in levels(fake, offset)[1:]:
        if level == 1 and rise is None:
            rise = t
        elif level != 1 and rise is not None:
            found.append((rise, t))
            rise = None
    return found


def sentinel(fake: ModuleType, line: RejectLine, count: int) -> None:
    """Send one NG part and wait for its pulse, the ``count``-th: whatever an earlier part was going to
    fire would have fired by then. It waits for the pulses before it to end first, or it would merge."""
    assert wait_for(lambda: len(pulses(fake)) >= count - 1, 5.0), levels(fake, 0)
    t = time.monotonic_ns()
    line.expect(t)
    line.resolve(t, "ng", time.monotonic_ns())
    assert wait_for(lambda: len(pulses(fake)) >= count, 5.0), levels(fake, 0)


# ---- settings -----------------------------------------------------------------------------------


def settings(**doc: Any) -> Settings:
    return Settings.model_validate({"model": {"path": "m.onnx"}, "inspect": {}} | doc)


def test_a_camera_table_overlays_the_board_one_and_the_merged_table_must_be_complete() -> None:
    s = settings(
        source=[{"type": "synthetic", "camera_id": "a"}, {"type": "synthetic", "camera_id": "b", "reject": {"line": 5}}],
        reject={"line": 4, "delay_ms": 500, "chip": "gpiochip4"},
    )
    a, b = (s.reject_for(cfg) for cfg in s.source)
    assert a is not None and b is not None
    assert (a.chip, a.line, a.delay_ms, a.on, a.late) == ("gpiochip4", 4, 500.0, ["ng"], "reject")
    assert (b.chip, b.line, b.delay_ms) == ("gpiochip4", 5, 500.0)
    assert s.rejecting() == ["a", "b"]
    with pytest.raises(ValidationError, match=r"reject.delay_ms: required"):
        settings(reject={"line": 4})
    with pytest.raises(ValidationError, match=r"reject.alarm_line: required with late = 'alarm'"):
        settings(reject={"line": 4, "delay_ms": 10, "late": "alarm"})


def test_two_cameras_on_one_line_and_a_line_without_a_verdict_are_refused() -> None:
    with pytest.raises(ValidationError, match=r"cameras a and b both drive line 4 of gpiochip0"):
        settings(
            source=[{"type": "synthetic", "camera_id": "a"}, {"type": "synthetic", "camera_id": "b"}],
            reject={"line": 4, "delay_ms": 500},
        )
    with pytest.raises(ValidationError, match=r"camera cam0 has no verdict to act on: add \[inspect\]"):
        Settings.model_validate({"model": {"path": "m.onnx"}, "reject": {"line": 4, "delay_ms": 5}})


# ---- pulses -------------------------------------------------------------------------------------


def test_the_line_is_requested_inactive_and_an_ng_part_fires_one_pulse_at_its_deadline(
    gpiod: ModuleType, lines: list[RejectLine]
) -> None:
    line = start(lines, reject())
    assert levels(gpiod, 0) == [(levels(gpiod, 0)[0][0], 0)]  # requested as an output, inactive
    t = time.monotonic_ns()
    line.expect(t)
    line.resolve(t, "ng", time.monotonic_ns())
    assert wait_for(lambda: len(pulses(gpiod)) == 1, 5.0), levels(gpiod, 0)
    (rise, fall), target = pulses(gpiod)[0], t + 100 * MS
    assert target <= rise < target + SLACK_MS * MS
    assert 30 * MS <= fall - rise < (30 + SLACK_MS) * MS
    assert wait_for(lambda: line.report().pulses == 1, 5.0)
    report = line.report()
    assert (report.pulses, report.late, report.merged) == (1, 0, 0)
    assert report.margin_p50_ms is not None and 0 < report.margin_p50_ms <= 100
    assert 0 <= report.lateness_p50_ms <= report.lateness_max_ms


def test_an_ok_part_fires_nothing(gpiod: ModuleType, lines: list[RejectLine]) -> None:
    line = start(lines, reject(delay_ms=20.0))
    t = time.monotonic_ns()
    line.expect(t)
    line.resolve(t, "ok", time.monotonic_ns())
    sentinel(gpiod, line, 1)
    assert len(pulses(gpiod)) == 1 and wait_for(lambda: line.report().pulses == 1, 5.0)


def test_an_uncertain_part_fires_as_an_ng_one(gpiod: ModuleType, lines: list[RejectLine]) -> None:
    line = start(lines, reject(delay_ms=20.0))
    t = time.monotonic_ns()
    line.expect(t)
    line.resolve(t, "uncertain", time.monotonic_ns())  # a classifier below inspect.min_confidence
    assert wait_for(lambda: len(pulses(gpiod)) == 1, 5.0), levels(gpiod, 0)
    assert wait_for(lambda: line.report().pulses == 1, 5.0)


def test_active_low_inverts_the_level_on_the_pin(gpiod: ModuleType, lines: list[RejectLine]) -> None:
    line = start(lines, reject(active_low=True, delay_ms=0.0))
    line.expect(t := time.monotonic_ns())
    line.resolve(t, "ng", time.monotonic_ns())
    assert wait_for(lambda: [level for _, level in levels(gpiod, 0)] == [1, 0, 1], 5.0), levels(gpiod, 0)


def test_a_part_without_a_verdict_is_rejected_at_its_deadline_and_its_late_verdict_never_fires(
    gpiod: ModuleType, lines: list[RejectLine]
) -> None:
    line = start(lines, reject(delay_ms=50.0))
    t = time.monotonic_ns()
    line.expect(t)
    assert wait_for(lambda: len(pulses(gpiod)) == 1, 5.0), levels(gpiod, 0)
    assert pulses(gpiod)[0][0] >= t + 50 * MS
    line.resolve(t, "ng", time.monotonic_ns())  # the model's verdict, too late
    sentinel(gpiod, line, 2)
    counted = (2, 1, 1, 1)  # pulses, late, late_fired, late_verdicts
    assert wait_for(lambda: (r := line.report()) and (r.pulses, r.late, r.late_fired, r.late_verdicts) == counted, 5.0)
    assert len(pulses(gpiod)) == 2


def test_a_verdict_that_comes_after_its_deadline_but_before_the_line_saw_it_fires_once(
    gpiod: ModuleType, lines: list[RejectLine]
) -> None:
    line = start(lines, reject(delay_ms=10.0))
    t = time.monotonic_ns() - 500 * MS  # captured long ago: its deadline has passed
    line.expect(t)
    line.resolve(t, "ng", time.monotonic_ns())
    sentinel(gpiod, line, 2)
    assert len(pulses(gpiod)) == 2 and wait_for(lambda: line.report().late_fired == 1, 5.0)
    assert line.report().lateness_max_ms < 490  # late by the loop, not by the line: not its lateness


def test_a_part_without_a_verdict_fires_at_its_own_deadline_before_a_later_part_already_scheduled(
    gpiod: ModuleType, lines: list[RejectLine]
) -> None:
    line = start(lines, reject(delay_ms=300.0))
    t = time.monotonic_ns()
    stuck, ng = t - 150 * MS, t  # its frame stuck on one lane, the next one judged NG on another
    line.expect(stuck)
    line.expect(ng)
    line.resolve(ng, "ng", time.monotonic_ns())
    assert wait_for(lambda: len(pulses(gpiod)) == 2, 5.0), levels(gpiod, 0)
    for (rise, _), target in zip(pulses(gpiod), (stuck + 300 * MS, ng + 300 * MS), strict=True):
        assert target <= rise < target + SLACK_MS * MS
    assert wait_for(lambda: (line.report().merged, line.report().late_fired) == (0, 1), 5.0)


def test_late_pass_lets_the_part_go(gpiod: ModuleType, lines: list[RejectLine]) -> None:
    line = start(lines, reject(delay_ms=10.0, late="pass"))
    line.expect(time.monotonic_ns())
    assert wait_for(lambda: line.report().late == 1, 5.0)
    sentinel(gpiod, line, 1)
    assert wait_for(lambda: line.report().pulses == 1, 5.0)
    assert len(pulses(gpiod)) == 1 and line.report().late_fired == 0


def test_late_alarm_holds_the_alarm_line_until_a_verdict_is_on_time(gpiod: ModuleType, lines: list[RejectLine]) -> None:
    line = start(lines, reject(delay_ms=10.0, late="alarm", alarm_line="ALARM"))
    line.expect(time.monotonic_ns())
    assert wait_for(lambda: [level for _, level in levels(gpiod, 1)] == [0, 1], 5.0), levels(gpiod, 0)
    assert wait_for(lambda: line.report().alarm, 5.0) and pulses(gpiod) == []
    t = time.monotonic_ns()
    line.expect(t)
    line.resolve(t, "ok", time.monotonic_ns())
    assert wait_for(lambda: [level for _, level in levels(gpiod, 1)] == [0, 1, 0], 5.0), levels(gpiod, 1)
    assert wait_for(lambda: not line.report().alarm, 5.0)


def test_two_ng_parts_closer_than_min_gap_merge_into_one_pulse(gpiod: ModuleType, lines: list[RejectLine]) -> None:
    line = start(lines, reject(delay_ms=100.0, pulse_ms=30.0, min_gap_ms=50.0))
    t = time.monotonic_ns()
    for capture in (t, t + 60 * MS):  # 30 ms apart end to start
        line.expect(capture)
        line.resolve(capture, "ng", time.monotonic_ns())
    assert wait_for(lambda: len(pulses(gpiod)) == 1, 5.0), levels(gpiod, 0)
    rise, fall = pulses(gpiod)[0]
    assert rise >= t + 100 * MS and fall - rise >= 90 * MS
    sentinel(gpiod, line, 2)
    assert wait_for(lambda: (line.report().merged, line.report().pulses) == (1, 2), 5.0)


def test_a_stop_during_a_pulse_leaves_the_line_inactive_and_released(gpiod: ModuleType, lines: list[RejectLine]) -> None:
    line = start(lines, reject(delay_ms=0.0, pulse_ms=5000.0), drain_s=0.2)  # a pulse longer than the stop's bound
    line.expect(t := time.monotonic_ns())
    line.resolve(t, "ng", time.monotonic_ns())
    assert wait_for(lambda: [level for _, level in levels(gpiod, 0)] == [0, 1], 5.0)
    line.stop()
    assert [level for _, level in levels(gpiod, 0)] == [0, 1, 0, None]


# ---- stopping: the parts already on their way go as judged --------------------------------------


def released(fake: ModuleType) -> bool:
    return levels(fake, 0)[-1:][0][1] is None


def test_sigterm_to_the_line_process_fires_the_parts_in_flight_at_their_deadlines_then_lets_go(
    gpiod: ModuleType, lines: list[RejectLine]
) -> None:
    line = start(lines, reject(delay_ms=300.0), drain_s=1.0)
    t = time.monotonic_ns()
    late, ok, ng = t - 150 * MS, t - 50 * MS, t  # due in 150, 250 and 300 ms
    for capture in (late, ok, ng):
        line.expect(capture)
    line.resolve(ng, "ng", time.monotonic_ns())
    os.kill(line.pid, signal.SIGTERM)  # as systemd's stop sends it to every process of the unit at once
    line.resolve(ok, "ok", time.monotonic_ns())  # the daemon's last frames still bring verdicts
    assert wait_for(lambda: released(gpiod), 5.0), levels(gpiod, 0)
    rises = [rise for rise, _ in pulses(gpiod)]
    assert len(rises) == 2, levels(gpiod, 0)  # the late part (late = "reject", the fail-safe) and the NG one
    for rise, target in zip(rises, (late + 300 * MS, ng + 300 * MS), strict=True):
        assert target <= rise < target + SLACK_MS * MS
    assert [level for _, level in levels(gpiod, 0)][-2:] == [0, None]


def test_the_watchdogs_sigabrt_fires_the_parts_in_flight_then_lets_go(gpiod: ModuleType, lines: list[RejectLine]) -> None:
    """systemd's watchdog sends SIGABRT to every process of the unit: it killed the line process at
    once, a pulse under way left as the kernel has it and the parts on their way dropped."""
    line = start(lines, reject(delay_ms=300.0), drain_s=1.0)
    line.expect(ng := time.monotonic_ns())
    line.resolve(ng, "ng", time.monotonic_ns())
    os.kill(line.pid, signal.SIGABRT)
    assert wait_for(lambda: released(gpiod), 5.0), levels(gpiod, 0)
    ((rise, _),) = pulses(gpiod)
    assert ng + 300 * MS <= rise < ng + (300 + SLACK_MS) * MS
    assert [level for _, level in levels(gpiod, 0)][-2:] == [0, None]


def test_a_stop_fires_what_falls_due_within_its_bound_and_says_what_it_drops(
    gpiod: ModuleType, lines: list[RejectLine], capfd: pytest.CaptureFixture[str]
) -> None:
    line = start(lines, reject(delay_ms=1000.0), drain_s=0.5)
    t = time.monotonic_ns()
    soon, ng, late = t - 800 * MS, t, t - 50 * MS  # due in 200 ms; in 1 s, and in 950 ms without a verdict
    for capture in (soon, ng, late):
        line.expect(capture)
    for capture in (soon, ng):
        line.resolve(capture, "ng", time.monotonic_ns())
    line.stop()  # the daemon's stop
    assert len(pulses(gpiod)) == 1, levels(gpiod, 0)
    assert soon + 1000 * MS <= pulses(gpiod)[0][0] < soon + (1000 + SLACK_MS) * MS
    assert [level for _, level in levels(gpiod, 0)][-2:] == [0, None]
    said = capfd.readouterr().err
    assert "stopping (the daemon's stop), the drain's 0.5 s bound came: 2 parts in flight dropped, un-ejected" in said


def test_a_second_sigterm_ends_the_drain_at_once_with_the_line_inactive(
    gpiod: ModuleType, lines: list[RejectLine], capfd: pytest.CaptureFixture[str]
) -> None:
    line = start(lines, reject(delay_ms=2000.0))
    t = time.monotonic_ns()
    for capture in (t - 1800 * MS, t):  # due in 200 ms and in 2 s
        line.expect(capture)
        line.resolve(capture, "ng", time.monotonic_ns())
    os.kill(line.pid, signal.SIGTERM)
    assert wait_for(lambda: len(pulses(gpiod)) == 1, 5.0), levels(gpiod, 0)  # the first signal drains
    os.kill(line.pid, signal.SIGTERM)
    assert wait_for(lambda: released(gpiod), 5.0), levels(gpiod, 0)
    assert len(pulses(gpiod)) == 1 and levels(gpiod, 0)[-1][0] < t + 2000 * MS
    assert "stopping (SIGTERM), a second signal ended the drain: 1 part in flight dropped" in capfd.readouterr().err


# ---- requesting the line ------------------------------------------------------------------------


def test_a_line_held_by_another_program_is_busy_naming_it(gpiod: ModuleType) -> None:
    with pytest.raises(LineBusy, match=r"reject.line 'BUSY' of gpiochip0 \(camera cam0\) is held by 'conveyor-plc'") as e:
        open_lines(reject(line="BUSY"), "cam0", "edged:1")
    assert e.value.exit_code == EXIT_FAILURE


def test_a_wrong_line_names_the_chips_lines_and_a_wrong_chip_says_so(gpiod: ModuleType) -> None:
    for line in ("EJCT", 9):
        with pytest.raises(LineError, match=r"its lines: 0 EJECT, 1 ALARM, 2 SPARE, 3 BUSY") as e:
            open_lines(reject(line=line), "cam0", "edged:1")
        assert e.value.exit_code == EXIT_CONFIG
    with pytest.raises(LineError, match=r"reject.chip '/dev/gpiochip7' \(camera cam0\): /dev/gpiochip7: No such file"):
        open_lines(reject(chip="/dev/gpiochip7"), "cam0", "edged:1")


def test_check_requests_each_line_once_and_releases_it(gpiod: ModuleType) -> None:
    s = settings(reject={"chip": CHIP, "line": "EJECT", "delay_ms": 100, "late": "alarm", "alarm_line": 1})
    assert check_lines(s) == [f"camera cam0: {CHIP} line 0, alarm line 1 (requested and released)"]
    assert [level for _, level in levels(gpiod, 0)] == [0, 0, None]
    assert gpiod.CHIPS[CHIP].requested == {}


def test_a_reloads_look_passes_its_own_daemons_lines_and_refuses_another_edgeds(gpiod: ModuleType) -> None:
    """Every edged named its lines ``edged``: a reload's look took a line another edged held (a second
    unit on the board) for its own, and its line process then failed to request it every 5 s."""
    held = settings(reject={"chip": CHIP, "line": "SPARE", "delay_ms": 100})
    other = open_lines(reject(line="SPARE"), "cam0", holder_name(4321))
    try:
        assert check_lines(held, request=False, own=4321) == [
            f"camera cam0: {CHIP} line 2 (found; not requested: --no-bind)"
        ]
        with pytest.raises(LineBusy, match=r"reject.line 'SPARE' of gpiochip0 \(camera cam0\) is held by 'edged:4321'"):
            check_lines(held, request=False, own=4322)
    finally:
        other.release()


def test_check_beside_the_service_finds_each_line_without_requesting_it(gpiod: ModuleType) -> None:
    """``check --no-bind`` left the lines untried, so a chip or line run refuses (exit 78) passed it, and
    a line another program holds (run exits 1)."""
    s = settings(reject={"chip": CHIP, "line": "EJECT", "delay_ms": 100, "late": "alarm", "alarm_line": 1})
    said = f"camera cam0: {CHIP} line 0, alarm line 1 (found; not requested: --no-bind)"
    assert check_lines(s, request=False) == [said]
    assert levels(gpiod, 0) == [] and gpiod.CHIPS[CHIP].requested == {}
    held = settings(reject={"chip": CHIP, "line": "SPARE", "delay_ms": 100})
    for name in ("edged:4321", "edged"):  # as the running service holds its own (an older edged: by one name)
        service = open_lines(reject(line="SPARE"), "cam0", name)
        try:
            assert check_lines(held, request=False) == [f"camera cam0: {CHIP} line 2 (found; not requested: --no-bind)"]
        finally:
            service.release()
    with pytest.raises(LineError, match=r"reject.line 'EJCT' \(camera cam0\): .* its lines: 0 EJECT, 1 ALARM"):
        check_lines(settings(reject={"chip": CHIP, "line": "EJCT", "delay_ms": 100}), request=False)
    with pytest.raises(LineBusy, match=r"reject.line 'BUSY' of gpiochip0 \(camera cam0\) is held by 'conveyor-plc'"):
        check_lines(settings(reject={"chip": CHIP, "line": "BUSY", "delay_ms": 100}), request=False)


# ---- the real binding on gpio-sim ---------------------------------------------------------------


def _gpio_sim_reason() -> str | None:
    if not GPIO_SIM.is_dir():
        return "gpio-sim is absent: no /sys/kernel/config/gpio-sim (configfs with the gpio-sim module)"
    if not os.access(GPIO_SIM, os.W_OK):
        return "gpio-sim needs root to create a simulated chip"
    try:
        import gpiod  # noqa: F401
    except ImportError:
        return "the gpiod package is not installed (pip install 'edged[gpio]')"
    return None


@pytest.fixture
def sim() -> Iterator[tuple[str, Path]]:
    """A simulated chip of four named lines through configfs: its /dev path and its sysfs folder."""
    reason = _gpio_sim_reason()
    if reason is not None:
        pytest.skip(reason)
    device = GPIO_SIM / f"edged-{uuid.uuid4().hex[:8]}"
    bank = device / "bank0"
    bank.mkdir(parents=True)
    (bank / "num_lines").write_text("4")
    for offset, name in enumerate(LINES):
        (bank / f"line{offset}").mkdir()
        (bank / f"line{offset}" / "name").write_text(name)
    (device / "live").write_text("1")
    try:
        chip = (bank / "chip_name").read_text().strip()
        platform = Path("/sys/devices/platform") / (device / "dev_name").read_text().strip() / chip
        yield f"/dev/{chip}", platform
    finally:
        (device / "live").write_text("0")
        for offset in range(len(LINES)):
            (bank / f"line{offset}").rmdir()
        bank.rmdir()
        device.rmdir()


def sim_level(platform: Path, offset: int) -> int:
    return int((platform / f"sim_gpio{offset}" / "value").read_text())


def test_on_gpio_sim_an_ng_part_pulses_the_real_line_and_a_stop_leaves_it_inactive(
    sim: tuple[str, Path], lines: list[RejectLine]
) -> None:
    path, platform = sim
    line = start(lines, reject(chip=path, delay_ms=20.0, pulse_ms=400.0))
    assert sim_level(platform, 0) == 0
    line.expect(t := time.monotonic_ns())
    line.resolve(t, "ng", time.monotonic_ns())
    assert wait_for(lambda: sim_level(platform, 0) == 1, 5.0)
    assert wait_for(lambda: sim_level(platform, 0) == 0, 5.0) and line.report().pulses == 1
    line.expect(t := time.monotonic_ns())
    line.resolve(t, "ng", time.monotonic_ns())
    assert wait_for(lambda: sim_level(platform, 0) == 1, 5.0)
    line.stop()
    assert sim_level(platform, 0) == 0


def test_on_gpio_sim_a_wrong_line_names_the_lines_and_a_held_one_is_busy(sim: tuple[str, Path]) -> None:
    import gpiod
    from gpiod.line import Direction

    path, _ = sim
    with pytest.raises(LineError, match=r"its lines: 0 EJECT, 1 ALARM, 2 SPARE, 3 BUSY"):
        open_lines(reject(chip=path, line="EJCT"), "cam0", "edged:1")
    held = gpiod.request_lines(path, {3: gpiod.LineSettings(direction=Direction.OUTPUT)}, consumer="conveyor-plc")
    try:
        with pytest.raises(LineBusy, match=r"held by 'conveyor-plc'"):
            open_lines(reject(chip=path, line="BUSY"), "cam0", "edged:1")
    finally:
        held.release()


def test_without_gpiod_the_configuration_is_refused_saying_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from edged.config import load_config
    from edged.errors import ConfigError

    monkeypatch.setitem(sys.modules, "gpiod", None)
    (tmp_path / "m.onnx").write_bytes(b"x")
    config = tmp_path / "edged.toml"
    config.write_text('[model]\npath = "m.onnx"\n[inspect]\n[reject]\nline = 4\ndelay_ms = 100\n')
    with pytest.raises(ConfigError, match=r"reject: the reject line needs libgpiod's v2 Python binding") as e:
        load_config(config)
    assert INSTALL_GPIOD in str(e.value)


def test_a_reload_keeps_an_unchanged_line_with_its_new_timing_and_moves_a_changed_one(gpiod: ModuleType) -> None:
    def board(**keys: Any) -> Settings:
        return settings(reject={"chip": CHIP, "line": "EJECT", "delay_ms": 100.0} | keys)

    services = Services(lambda: None, threading.Event())
    output = RejectOutput.from_settings(board(), services)
    assert output is not None
    try:
        kept = output.lines["cam0"]
        assert output.reload(board(delay_ms=300.0, pulse_ms=80.0), services) is output
        assert output.lines["cam0"] is kept and kept.cfg.delay_ms == 300.0
        assert [level for _, level in levels(gpiod, 0)] == [0]  # never let go of
        assert output.reload(board(line="SPARE"), services) is output
        assert output.lines["cam0"] is not kept
        assert wait_for(lambda: levels(gpiod, 2)[:1] and levels(gpiod, 2)[0][1] == 0, 5.0)  # requested, not waited for
        assert wait_for(lambda: [level for _, level in levels(gpiod, 0)] == [0, 0, None], 5.0)  # drained on its own
        # None once no line is left draining (while one is, the output stays for the stop to wait for it:
        # test_a_reload_that_leaves_no_line_still_has_the_stop_wait_for_the_old_lines_parts)
        assert wait_for(lambda: output.reload(settings(), services) is None, 5.0)
        assert [level for _, level in levels(gpiod, 2)] == [0, 0, None]  # drained, let go of
    finally:
        output.close()


def test_a_reload_that_leaves_no_line_still_has_the_stop_wait_for_the_old_lines_parts(gpiod: ModuleType) -> None:
    """The daemon drops an output whose reload returns None: its draining process then outlived the daemon's
    stop, holding the line (systemd's last SIGTERM then cut its pulses short, or TimeoutStopSec's SIGKILL
    left the line as it was)."""
    output, services, t = _an_ng_part_in_flight(300.0)
    try:
        assert output.reload(settings(), services) is output
        began = time.monotonic()
        output.drain()  # the daemon's stop, at once
        assert time.monotonic() - began < DRAIN_S + 1.0
        assert released(gpiod), levels(gpiod, 0)  # inactive and let go of before the daemon exits
        ((rise, fall),) = pulses(gpiod)
        assert t + 300 * MS <= rise < t + (300 + SLACK_MS) * MS and fall - rise >= 30 * MS  # ran to its end
    finally:
        output.close()


def _an_ng_part_in_flight(delay_ms: float) -> tuple[RejectOutput, Services, int]:
    """A reject output on line EJECT after ``delay_ms``, its services, and when the NG part it is to
    fire for was seen."""
    services = Services(lambda: None, threading.Event())
    output = RejectOutput.from_settings(settings(reject={"chip": CHIP, "line": "EJECT", "delay_ms": delay_ms}), services)
    assert output is not None
    t = time.monotonic_ns()
    output.lines["cam0"].expect(t)
    output.lines["cam0"].resolve(t, "ng", time.monotonic_ns())
    return output, services, t


def test_a_reload_that_moves_the_line_lets_the_old_one_fire_its_parts_in_flight_while_the_new_one_serves(
    gpiod: ModuleType,
) -> None:
    output, services, t = _an_ng_part_in_flight(1500.0)
    try:
        assert output.reload(settings(reject={"chip": CHIP, "line": "SPARE", "delay_ms": 1500.0}), services) is output
        # The reload did not wait for the old line's part: that line is still held, the new one requested.
        assert wait_for(lambda: [level for _, level in levels(gpiod, 2)] == [0], 5.0), levels(gpiod, 2)
        assert levels(gpiod, 0)[-1][1] == 0
        assert wait_for(lambda: released(gpiod), 5.0), levels(gpiod, 0)
        ((rise, _),) = pulses(gpiod)
        assert t + 1500 * MS <= rise < t + (1500 + SLACK_MS) * MS
    finally:
        output.close()


def test_a_reload_that_drives_the_same_line_otherwise_requests_it_again_at_once_and_fires_the_parts_in_flight(
    gpiod: ModuleType,
) -> None:
    """It waited for the old process to fire its parts and let go, on the loop's thread: up to 3 s
    without frames or watchdog pings."""
    output, services, t = _an_ng_part_in_flight(300.0)
    try:
        line = output.lines["cam0"]
        inverted = {"chip": CHIP, "line": "EJECT", "delay_ms": 300.0, "active_low": True}
        assert output.reload(settings(reject=inverted | {"alarm_line": "ALARM"}), services) is output
        assert pulses(gpiod) == [] and output.lines["cam0"] is line  # nothing waited for the part's pulse
        # Requested again active-low by the same process (1 is inactive now), the part's pulse (0) at its time.
        assert wait_for(lambda: [level for _, level in levels(gpiod, 0)] == [0, 0, None, 1, 0, 1], 5.0)
        fall = levels(gpiod, 0)[4][0]
        assert t + 300 * MS <= fall < t + (300 + SLACK_MS) * MS
        assert [level for _, level in levels(gpiod, 1)] == [1]  # the alarm line, requested inactive
        assert wait_for(lambda: line.report().pulses == 1 and line.alarm == 1, 5.0)
        assert output.reload(settings(reject=inverted | {"alarm_line": "NOPE"}), services) is output
        said = "the reject line could not be requested again: reject.alarm_line 'NOPE' (camera cam0)"
        assert wait_for(lambda: (line.report().last_error or "").startswith(said), 5.0)
        assert line.alarm == 1 and levels(gpiod, 0)[-1][1] == 1  # requested again as it was: held, inactive
    finally:
        output.close()


def test_a_line_process_that_dies_is_said_in_the_status_and_started_again(
    gpiod: ModuleType, lines: list[RejectLine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first restart is never held back: restarts, at most one per interval, were counted from a
    start at the boot, so on a board up less than the interval the line waited out the rest of it."""
    monkeypatch.setattr("edged.reject.RESTART_INTERVAL_S", time.monotonic() + 3600.0)  # longer than this machine is up
    line = start(lines, reject(delay_ms=10.0))
    sentinel(gpiod, line, 1)
    assert wait_for(lambda: line.report().pulses == 1, 5.0)
    os.kill(line.pid, signal.SIGKILL)
    said = "the reject line's process ended (exit -9); started again"
    assert wait_for(lambda: line.report().last_error == said, 5.0)
    sentinel(gpiod, line, 2)  # the new process requested the line and fires again
    assert wait_for(lambda: line.report().pulses == 2, 5.0)  # counted on from the first process's
    assert [level for _, level in levels(gpiod, 0)] == [0, 1, 0, 0, 1, 0]


def test_sigterm_to_the_line_process_alone_is_said_its_parts_fire_and_another_process_takes_over(
    gpiod: ModuleType, lines: list[RejectLine]
) -> None:
    """An admin's kill: it was said nowhere, and what the loop sent after the process ended was lost
    until the next status round noticed."""
    line = start(lines, reject(delay_ms=10.0), drain_s=0.3)
    sentinel(gpiod, line, 1)
    os.kill(line.pid, signal.SIGTERM)
    said = "the reject line's process got SIGTERM: it fires the parts on their way for 0.3 s at most"
    assert wait_for(lambda: (line.report().last_error or "").startswith(said), 5.0)
    sentinel(gpiod, line, 2)  # the draining process still fires what the loop sends
    assert wait_for(lambda: line.ended, 5.0)
    restarted = "the reject line's process ended (exit 0); started again"
    t = time.monotonic_ns()
    line.expect(t)  # the loop's next write finds it gone: a new process takes this part, before any status round
    line.resolve(t, "ng", time.monotonic_ns())
    assert line.last_error == restarted
    assert wait_for(lambda: len(pulses(gpiod)) == 3, 5.0), levels(gpiod, 0)
    assert wait_for(lambda: (r := line.report()) and (r.pulses, r.dropped, r.alarm) == (3, 0, False), 5.0)


def test_parts_a_line_process_drops_or_that_find_none_are_counted_said_and_raise_the_alarm(
    gpiod: ModuleType, lines: list[RejectLine], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An NG part whose pulse could not be fired was said in a log line at most, counted nowhere."""
    monkeypatch.setattr("edged.reject.RESTART_INTERVAL_S", 0.0)
    line = start(lines, reject(delay_ms=2000.0, alarm_line="ALARM"), drain_s=0.2)
    line.expect(t := time.monotonic_ns())
    line.resolve(t, "ng", time.monotonic_ns())
    os.kill(line.pid, signal.SIGTERM)  # its drain's bound comes before the part is due: dropped
    assert wait_for(lambda: line.ended, 5.0)
    assert wait_for(lambda: (r := line.report()) and (r.dropped, r.alarm) == (1, True), 5.0)
    assert [level for _, level in levels(gpiod, 1)][-2:] == [0, 1]  # the new process raised the alarm line
    monkeypatch.setattr("edged.reject.RESTART_INTERVAL_S", 3600.0)
    os.kill(line.pid, signal.SIGKILL)  # ended again within RESTART_INTERVAL_S: no process for a while
    assert wait_for(lambda: line.ended, 5.0)
    line.expect(t := time.monotonic_ns())
    line.resolve(t, "ng", time.monotonic_ns())
    line.resolve(t, "ok", time.monotonic_ns())  # nothing to eject: not counted
    said = "1 part to be ejected found no line process to fire its pulse: dropped, un-ejected"
    assert wait_for(lambda: (r := line.report()) and (r.dropped, r.last_error) == (2, said), 5.0)
    assert said in caplog.text
    monkeypatch.setattr("edged.reject.RESTART_INTERVAL_S", 0.0)  # the interval over
    restarted = "the reject line's process ended (exit -9); started again"
    assert wait_for(lambda: line.report().last_error == restarted, 5.0)
    assert wait_for(lambda: line.report().alarm, 5.0)  # the new process raised the alarm again
    assert [level for _, level in levels(gpiod, 1)][-2:] == [0, 1]
    t = time.monotonic_ns()
    line.expect(t)
    line.resolve(t, "ok", time.monotonic_ns())  # a verdict on time again: the alarm off
    assert wait_for(lambda: not line.report().alarm, 5.0) and levels(gpiod, 1)[-1][1] == 0
    assert line.report().dropped == 2


def test_a_stopped_line_process_whose_pipe_is_full_never_blocks_the_loop_and_its_parts_are_counted(
    gpiod: ModuleType, lines: list[RejectLine]
) -> None:
    """A line process stopped (SIGSTOP, a debugger) reads nothing: the loop's writes filled its pipe,
    and the next one blocked the loop for good. A reload's settings sent meanwhile reach it once it reads again."""
    line = start(lines, reject(delay_ms=10.0, late="pass"), drain_s=0.2)
    os.kill(line.pid, signal.SIGSTOP)
    try:
        done = threading.Event()

        def flood() -> None:
            for _ in range(5000):  # about 300 KiB of commands: several times a pipe's 64 KiB
                t = time.monotonic_ns()
                line.expect(t)
                line.resolve(t, "ng", time.monotonic_ns())
            done.set()

        threading.Thread(target=flood, daemon=True).start()
        assert done.wait(5.0), "the loop's write blocked on the stopped process's full pipe"
        report = line.report()
        assert report.dropped > 0 and "taking no commands, stopped or stuck: dropped" in (report.last_error or ""), report
        line.adopt(reject(delay_ms=10.0, late="pass", pulse_ms=80.0))
    finally:
        os.kill(line.pid, signal.SIGCONT)
    sentinel(gpiod, line, 1)  # taken after the backlog, which fires nothing (late = "pass")
    rise, fall = pulses(gpiod)[0]
    assert fall - rise >= 80 * MS, (fall - rise) / MS  # the reload's pulse_ms, not the 30 ms before it


def test_a_late_verdict_of_a_part_the_ended_process_had_fires_no_second_pulse_in_the_next_one(
    gpiod: ModuleType, lines: list[RejectLine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The process a signal ended had applied ``late`` (a pulse) at the part's deadline; its verdict,
    coming later to the process after it, which had never heard of the part, fired it again."""
    monkeypatch.setattr("edged.reject.RESTART_INTERVAL_S", 0.0)
    line = start(lines, reject(delay_ms=50.0), drain_s=0.3)
    t = time.monotonic_ns()
    line.expect(t)
    os.kill(line.pid, signal.SIGTERM)
    assert wait_for(lambda: line.ended, 5.0)
    assert len(pulses(gpiod)) == 1  # the fail-safe pulse at its deadline, during the drain
    line.resolve(t, "ok", time.monotonic_ns())  # its verdict at last: the next process takes it
    assert wait_for(lambda: line.report().late_verdicts == 1, 5.0), line.report()
    sentinel(gpiod, line, 2)
    assert len(pulses(gpiod)) == 2, levels(gpiod, 0)
    counted = (2, 1, 1)  # pulses, late_fired, late_verdicts: the fail-safe pulse once
    assert wait_for(lambda: (r := line.report()) and (r.pulses, r.late_fired, r.late_verdicts) == counted, 5.0)


def test_parts_sent_to_a_line_process_started_again_that_cannot_request_the_line_are_counted_dropped(
    gpiod: ModuleType, lines: list[RejectLine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The process started again in place of one that ended had the loop's commands in its pipe;
    finding the line held, it said so and ended, and the NG parts in them were lost uncounted."""
    monkeypatch.setattr("edged.reject.RESTART_INTERVAL_S", 0.0)
    line = start(lines, reject(delay_ms=2000.0, late="pass"))
    os.kill(line.pid, signal.SIGKILL)
    assert wait_for(lambda: line.ended, 5.0)
    taken = open_lines(reject(), "cam9", "conveyor-plc")  # another program takes the line meanwhile
    try:
        for verdict in ("ng", "ok", "uncertain", None):  # the first write starts the next process
            line.expect(t := time.monotonic_ns())
            line.resolve(t, verdict, time.monotonic_ns())
        assert line.last_error == "the reject line's process ended (exit -9); started again"
        monkeypatch.setattr("edged.reject.RESTART_INTERVAL_S", 3600.0)  # no third process
        said = "2 parts to be ejected found the line process just started unable to request its line"
        assert wait_for(lambda: (line.report().last_error or "").startswith(said), 5.0), line.report()
        assert line.report().dropped == 2  # the NG and the uncertain part; neither the OK part nor the late one
        assert wait_for(lambda: line.ended, 5.0) and line.report().dropped == 2
    finally:
        taken.release()


def test_parts_a_line_process_held_when_sigkill_ended_it_are_counted_dropped(
    gpiod: ModuleType, lines: list[RejectLine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A SIGKILL (the OOM killer, ``kill -9``) ends the line process with no drain: the NG parts it had
    scheduled were lost uncounted. Those due from then on are counted dropped; one it fired is not."""
    monkeypatch.setattr("edged.reject.RESTART_INTERVAL_S", 0.0)
    line = start(lines, reject(delay_ms=3000.0, late="pass", alarm_line="ALARM"))
    fired = time.monotonic_ns() - 2900 * MS  # due 100 ms from now
    line.expect(fired)
    line.resolve(fired, "ng", time.monotonic_ns())
    assert wait_for(lambda: len(pulses(gpiod)) == 1, 5.0), levels(gpiod, 0)
    for verdict in ("ng", "ok", "uncertain"):
        line.expect(t := time.monotonic_ns())
        line.resolve(t, verdict, time.monotonic_ns())
    os.kill(line.pid, signal.SIGKILL)
    assert wait_for(lambda: line.ended, 5.0)
    said = "2 parts to be ejected were held by the line process, which SIGKILL ended: dropped, un-ejected"
    assert wait_for(lambda: (r := line.report()) and (r.dropped, r.last_error) == (2, said), 5.0), line.report()
    monkeypatch.setattr("edged.reject.RESTART_INTERVAL_S", 3600.0)
    assert wait_for(lambda: line.report().alarm, 5.0)  # the process started again says it on the alarm line
    assert line.report().dropped == 2 and len(pulses(gpiod)) == 1


def test_a_reloads_new_line_is_requested_while_the_loop_goes_on_and_fires_the_parts_judged_meanwhile(
    gpiod: ModuleType,
) -> None:
    """The reload waited on the loop's thread for the new line's process to start and request its line:
    a second or more on a board, every frame meanwhile left unjudged; ten, with a chip slow to answer."""
    output, services, t = _an_ng_part_in_flight(1500.0)
    stall = Path(STALL)
    stall.touch()
    try:
        reloaded = threading.Event()
        moved = settings(reject={"chip": CHIP, "line": "SPARE", "delay_ms": 1500.0})
        threading.Thread(target=lambda: output.reload(moved, services) and reloaded.set(), daemon=True).start()
        assert reloaded.wait(5.0), "the reload waited for the new line's process"
        line = output.lines["cam0"]
        line.expect(judged := time.monotonic_ns())  # judged while the new process still waits for its chip
        line.resolve(judged, "ng", time.monotonic_ns())
        assert levels(gpiod, 2) == []
        stall.unlink()
        assert wait_for(lambda: len(pulses(gpiod, 2)) == 1, 5.0), levels(gpiod, 2)
        ((rise, _),) = pulses(gpiod, 2)
        assert judged + 1500 * MS <= rise < judged + (1500 + SLACK_MS) * MS  # fired at its time
        assert wait_for(lambda: len(pulses(gpiod, 0)) == 1, 5.0)  # and the old line its part in flight, at its time
        assert t + 1500 * MS <= pulses(gpiod, 0)[0][0] < t + (1500 + SLACK_MS) * MS
        assert output.report("cam0").fields["reject"].dropped == 0
    finally:
        stall.unlink(missing_ok=True)
        output.close()


def test_a_camera_whose_line_a_reload_moved_counts_on_with_what_the_old_line_fired(gpiod: ModuleType) -> None:
    """The camera's report began again from zero with the new line, and what the old line fired or
    dropped as it drained was counted nowhere: the status, the page and the metrics' counters went back."""
    output, services, _ = _an_ng_part_in_flight(300.0)
    old = output.lines["cam0"]
    try:
        assert output.reload(settings(reject={"chip": CHIP, "line": "SPARE", "delay_ms": 300.0}), services) is output
        assert wait_for(lambda: old.ended, 5.0) and released(gpiod), levels(gpiod, 0)  # fired its part, let go
        assert output.report("cam0").fields["reject"].pulses == 1  # its process reaped: what it said last, kept
        line = output.lines["cam0"]
        line.expect(t := time.monotonic_ns())
        line.resolve(t, "ng", time.monotonic_ns())
        assert wait_for(lambda: output.report("cam0").fields["reject"].pulses == 2, 5.0), output.report("cam0")
        output.drain()  # the daemon's stop, before its last status round
        assert output.report("cam0").fields["reject"].pulses == 2
    finally:
        output.close()
