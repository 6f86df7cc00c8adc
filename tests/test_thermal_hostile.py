"""The thermal watch on boards that misbehave: sensors that hang or take seconds, readings that are
absurd, jump or come and go, clocks a cooling device flaps, drivers in whole degrees, hundreds of
zones; and the daemon on a board whose sensor hangs from boot.

A sensor that hangs is a named pipe where its file is: opening it blocks until someone writes, as a
read of a hwmon sensor on a stuck I2C bus blocks in the kernel. Every test that makes one answers
it at the end, so no reader stays blocked.
"""

from __future__ import annotations

import errno
import io
import json
import logging
import os
import shutil
import signal
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from daemon import RunningDaemon, board_config, free_port
from pymodbus.client import ModbusTcpClient
from test_service import NotifySocket
from waiting import wait_for

from edged import thermal_background
from edged.config import ThermalConfig
from edged.messages import StatusMessage
from edged.thermal import HARDWARE_CLEAR_S, STALE_AFTER_S, ThermalReport, ThermalWatch
from edged.thermal_background import SLOW_READ_S
from edged.thermal_command import run_thermal_command

FIXTURES = Path(__file__).parent / "fixtures" / "thermal"
ZONES = "sys/class/thermal"
GET_THROTTLED = "sys/devices/platform/soc/soc:firmware/get_throttled"
PI4_POLICY = "sys/devices/system/cpu/cpufreq/policy0"
CPUS = "sys/devices/system/cpu"
TJ = f"{ZONES}/thermal_zone8"  # the Orin's tj-thermal, the hottest of its zones


class Clock:
    """A clock the test moves: each poll ``step_s`` after the one before."""

    def __init__(self, step_s: float) -> None:
        self.now, self.step_s = 1000.0, step_s

    def __call__(self) -> float:
        self.now += self.step_s
        return self.now


def copy_board(tmp_path: Path, name: str) -> Path:
    return Path(shutil.copytree(FIXTURES / name, tmp_path / name))


def set_temp(root: Path, celsius: float, zone: int = 0) -> None:
    (root / f"{ZONES}/thermal_zone{zone}/temp").write_text(f"{round(celsius * 1000)}\n")


def watch_on(root: Path, clock: Callable[[], float] | None = None, **kwargs: object) -> ThermalWatch:
    cfg = ThermalConfig(root=root, use_vcgencmd=False)
    if clock is None:
        return ThermalWatch(cfg, **kwargs)  # type: ignore[arg-type]
    return ThermalWatch(cfg, read_wait_s=30.0, clock=clock)


def answer(fifo: Path, text: str) -> bool:
    """Write ``text`` to whoever is blocked opening ``fifo``; False if nobody is."""
    try:
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    except OSError as e:
        if e.errno == errno.ENXIO:
            return False
        raise
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)
    return True


@pytest.fixture
def hang() -> Iterator[Callable[[Path], Path]]:
    """Replaces a file by a named pipe nobody writes to; at the end, every reader blocked on it is let go."""
    made: list[Path] = []

    def make(path: Path) -> Path:
        path.unlink()
        os.mkfifo(path)
        made.append(path)
        return path

    yield make
    for fifo in made:
        # A reading's thread may be about to open it again: answer until none has for a moment.
        assert wait_for(lambda f=fifo: not answer(f, "") and not answer(f, ""), timeout_s=10)  # type: ignore[misc]


def poll_within(watch: ThermalWatch, timeout_s: float) -> ThermalReport:
    """One poll, which must return within ``timeout_s``: a regression fails here, never hangs the suite."""
    got: list[ThermalReport] = []
    thread = threading.Thread(target=lambda: got.append(watch.poll()), daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert got, f"a poll did not return in {timeout_s} s"
    return got[0]


def messages(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


# ---- sensors that hang or take seconds ----------------------------------------------------------


def test_a_hung_sensor_holds_up_no_poll_and_is_said_once_until_it_answers(
    tmp_path: Path, hang: Callable[[Path], Path], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(thermal_background, "HUNG_AFTER_S", 0.5)
    caplog.set_level(logging.INFO)
    root = copy_board(tmp_path, "jetson_orin")
    fifo = hang(root / TJ / "temp")
    # Polls 20 s apart as the watch sees them (past ZONE_HOLD_S), each one returning at once.
    watch = ThermalWatch(ThermalConfig(root=root, use_vcgencmd=False), clock=Clock(20.0))
    others = {"cpu-thermal", "soc0-thermal", "soc1-thermal", "soc2-thermal"}
    # Once the read has hung past SLOW_READ_S the other zones are read without it.
    reports: list[ThermalReport] = []
    assert wait_for(lambda: reports.append(poll_within(watch, 5.0)) or set(reports[-1].zones) == others, 15)
    assert reports[-1].state == "ok" and reports[-1].board == "jetson"
    for _ in range(3):
        poll_within(watch, 5.0)
    assert len(messages(caplog, "thermal_zone8/temp")) == 1  # one line for the whole outage
    # It answers: its value is read, and that is said once.
    assert wait_for(lambda: answer(fifo, "61000\n"), 10)
    assert wait_for(lambda: poll_within(watch, 5.0).zones.get("tj-thermal") == 61.0, 10)
    assert len(messages(caplog, "thermal_zone8/temp answers again")) == 1
    # It hangs again: its value stands until the read after it has hung for HUNG_AFTER_S, then not.
    assert wait_for(lambda: set(poll_within(watch, 5.0).zones) == others, 10)
    assert len(messages(caplog, "thermal_zone8/temp has not answered for")) == 1
    # A new watch on the board (a reload) knows the file hangs and blocks on it no more.
    again = ThermalWatch(ThermalConfig(root=root, use_vcgencmd=False), read_wait_s=30.0)
    assert set(poll_within(again, 5.0).zones) == others


def test_a_sensor_taking_seconds_per_read_is_read_without_waiting_for_it(
    tmp_path: Path, hang: Callable[[Path], Path]
) -> None:
    root = copy_board(tmp_path, "jetson_orin")
    fifo = hang(root / TJ / "temp")
    stop = threading.Event()
    answer_after_s = SLOW_READ_S + 1.5

    def sensor() -> None:  # the read in flight answers answer_after_s after it began
        while not stop.is_set():
            try:
                fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            except OSError:
                stop.wait(0.01)
                continue
            stop.wait(answer_after_s)
            os.write(fd, b"66000\n")
            os.close(fd)
            return

    thread = threading.Thread(target=sensor, daemon=True)
    thread.start()
    try:
        watch = watch_on(root)
        longest = 0.0

        def read_66() -> bool:
            nonlocal longest
            began = time.monotonic()
            report = poll_within(watch, 5.0)
            longest = max(longest, time.monotonic() - began)
            return report.zones.get("tj-thermal") == 66.0 and report.zones.get("cpu-thermal") == 41.437

        assert wait_for(read_66, 15)
        assert longest < answer_after_s - 0.5, longest  # no poll waited for the sensor
    finally:
        stop.set()
        thread.join(10)


def test_when_no_reading_finishes_the_state_becomes_unknown_and_says_why(
    tmp_path: Path, hang: Callable[[Path], Path], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A whole bus hung: more files block than reads are left blocked (one here), so the readings stop;
    a board that was hot then is not said to be hot for ever."""
    monkeypatch.setattr(thermal_background, "MAX_BLOCKED_READS", 1)
    root = copy_board(tmp_path, "rpi4")
    set_temp(root, 82.0)
    clock = Clock(0.0)
    watch = ThermalWatch(ThermalConfig(root=root, use_vcgencmd=False), clock=clock)
    assert poll_within(watch, 30.0).state == "throttled"
    caplog.set_level(logging.WARNING)
    hang(root / ZONES / "thermal_zone0/temp")
    hang(root / GET_THROTTLED)
    handed_on = lambda: poll_within(watch, 5.0).state == "throttled" and bool(messages(caplog, "has not returned after"))  # noqa: E731
    assert wait_for(handed_on, 10)  # the first is, the second waits for it
    clock.now += STALE_AFTER_S / 2
    assert poll_within(watch, 5.0).state == "throttled"  # the last reading stands a while
    clock.now += STALE_AFTER_S
    stale = poll_within(watch, 5.0)
    assert (stale.state, stale.zones, stale.rate_factor) == ("unknown", {}, 1.0)
    assert len(messages(caplog, "no thermal reading has finished for")) == 1
    assert messages(caplog, "throttled -> unknown")
    assert poll_within(watch, 5.0).state == "unknown"
    assert len(messages(caplog, "no thermal reading has finished for")) == 1


def test_a_value_nobody_can_read_again_ages_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With as many reads blocked as are let block (one here), a slow file's last value is not read again:
    it stands HUNG_AFTER_S from when it was read, not for ever."""
    monkeypatch.setattr(thermal_background, "MAX_BLOCKED_READS", 1)
    monkeypatch.setattr(thermal_background, "HUNG_AFTER_S", 0.5)
    files = thermal_background.SlowFiles()
    hung, slow = tmp_path / "hung", tmp_path / "slow"
    files._files[hung] = thermal_background._Slow(hung, reading_since=time.monotonic())  # the one read let block
    files._files[slow] = thermal_background._Slow(slow, reading_since=None, text="44000", read_at=time.monotonic())
    asked: list[Path] = []
    assert files.text(slow, lambda p: asked.append(p) or None) == "44000"
    assert wait_for(lambda: files.text(slow, lambda p: asked.append(p) or None) is None, 5)
    assert asked == []  # never read again: no read may block beside the hung one


def test_edged_thermal_prints_the_board_with_a_hung_sensor(tmp_path: Path, hang: Callable[[Path], Path]) -> None:
    root = copy_board(tmp_path, "rpi4")
    hang(root / GET_THROTTLED)
    out = io.StringIO()
    done = threading.Thread(
        target=lambda: run_thermal_command(ThermalConfig(root=root, use_vcgencmd=False), False, None, out), daemon=True
    )
    done.start()
    done.join(20)
    assert not done.is_alive(), "edged thermal waited for the hung file"
    assert "cpu-thermal" in out.getvalue() and "52.1C" in out.getvalue(), out.getvalue()


# ---- readings that are absurd, jump, or come and go --------------------------------------------


def test_a_cold_board_reads_and_a_broken_sensor_is_said_once_per_burst(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = copy_board(tmp_path, "rpi4")
    (root / GET_THROTTLED).write_text("0\n")
    caplog.set_level(logging.DEBUG, logger="edged.thermal_readers")
    watch = watch_on(root, Clock(20.0))
    set_temp(root, -40.0)  # a cold factory
    cold = watch.poll()
    assert (cold.state, cold.zones) == ("ok", {"cpu-thermal": -40.0})
    for broken in (255.0, -273.15, 255.0):  # 0xff and absolute zero: a sensor unplugged
        set_temp(root, broken)
        report = watch.poll()
        assert report.zones == {} and report.state == "unknown", report
    said = [r for r in caplog.records if "a sensor broken or disconnected" in r.getMessage()]
    assert [r.levelno for r in said] == [logging.WARNING]
    set_temp(root, 45.0)
    assert watch.poll().zones == {"cpu-thermal": 45.0}
    assert len(messages(caplog, "reads 45.0 C again")) == 1
    set_temp(root, 255.0)  # broken again within the minute: the same burst, no more lines
    assert watch.poll().zones == {}
    set_temp(root, 46.0)
    assert watch.poll().zones == {"cpu-thermal": 46.0}
    assert not messages(caplog, "reads 46.0 C again")
    assert len(messages(caplog, "a sensor broken or disconnected")) == 1


def test_jetson_powered_down_sensors_are_no_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    watch_on(copy_board(tmp_path, "jetson_orin"), Clock(2.0)).poll()  # its GPU and CV zones read -256 C
    assert not messages(caplog, "broken or disconnected")


def test_a_reading_that_jumps_waits_for_the_next_to_say_so_too(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = copy_board(tmp_path, "rpi4")
    (root / GET_THROTTLED).write_text("0\n")
    caplog.set_level(logging.WARNING, logger="edged.thermal")
    watch = watch_on(root, Clock(2.0))
    states = []
    for temp in (45.0, 150.0, 45.0, 150.0, 46.0):  # a flaky bus: single readings of 150 C
        set_temp(root, temp)
        report = watch.poll()
        states.append((report.state, report.hottest_c))
    assert states == [("ok", 45.0), ("ok", 45.0), ("ok", 45.0), ("ok", 45.0), ("ok", 46.0)]
    assert len(messages(caplog, "jumped from 45.0C to 150.0C")) == 1  # a line a minute, not one a glitch
    set_temp(root, 150.0)
    assert watch.poll().state == "ok"
    broken = watch.poll()  # read twice: taken as read, and the pause is said with its zone
    assert (broken.state, broken.hottest_c) == ("critical", 150.0)
    assert messages(caplog, "ok -> critical")
    # Real heating, however quick, is never held back.
    watch = watch_on(root, Clock(2.0))
    heating = []
    for temp in (50.0, 65.0, 78.0, 86.0):
        set_temp(root, temp)
        heating.append(watch.poll().state)
    assert heating == ["ok", "ok", "warm", "critical"]


def test_a_sensor_that_misses_a_reading_moves_nothing_and_an_unplugged_one_is_said(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = copy_board(tmp_path, "rpi4")
    (root / GET_THROTTLED).write_text("0\n")
    caplog.set_level(logging.WARNING, logger="edged.thermal")
    clock = Clock(2.0)
    watch = watch_on(root, clock)
    set_temp(root, 75.0)
    assert watch.poll().state == "warm"
    zone = root / ZONES / "thermal_zone0"
    saved = shutil.copytree(zone, tmp_path / "unplugged")
    shutil.rmtree(zone)  # a USB sensor unplugged: its zone is gone
    held = [watch.poll() for _ in range(4)]  # 8 s: its last reading stands
    assert [(r.state, r.zones) for r in held] == [("warm", {"cpu-thermal": 75.0})] * 4
    gone = watch.poll()
    assert (gone.state, gone.zones) == ("unknown", {})
    assert messages(caplog, "warm -> unknown")
    shutil.copytree(saved, zone)  # plugged back
    back = watch.poll()
    assert (back.state, back.zones) == ("warm", {"cpu-thermal": 75.0})


def test_a_cooling_device_flapping_the_clock_holds_throttled(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = copy_board(tmp_path, "rpi4")
    (root / GET_THROTTLED).write_text("0\n")
    set_temp(root, 60.0)
    caplog.set_level(logging.WARNING, logger="edged.thermal")
    clock = Clock(2.0)
    watch = watch_on(root, clock)
    policy = root / PI4_POLICY / "scaling_max_freq"
    device = root / ZONES / "cooling_device0"
    device.mkdir()
    (device / "type").write_text("cpufreq-cpu0\n")
    states = []
    for i in range(10):  # the cooling device lowers and raises the ceiling every reading
        (device / "cur_state").write_text("5\n" if i % 2 == 0 else "0\n")
        policy.write_text("600000\n" if i % 2 == 0 else "1800000\n")
        states.append(watch.poll().state)
    assert states == ["throttled"] * 10
    assert len(messages(caplog, "thermal state")) == 1
    assert [watch.poll().state for _ in range(int(HARDWARE_CLEAR_S / clock.step_s) + 1)][-1] == "ok"


def test_a_reloaded_watch_of_the_same_board_carries_its_state_on(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = copy_board(tmp_path, "rpi4")
    (root / GET_THROTTLED).write_text("0\n")
    clock = Clock(2.0)
    watch = watch_on(root, clock)
    states = []
    for temp in (70.0, 80.0, 86.0, 83.0):  # critical, then inside its 3 C hysteresis band
        set_temp(root, temp)
        states.append(watch.poll().state)
    assert states == ["warm", "throttled", "critical", "critical"]
    caplog.set_level(logging.INFO, logger="edged.thermal")
    caplog.clear()
    cfg = ThermalConfig(root=root, use_vcgencmd=False, warm_rate=0.6)  # a reload that changed a rate
    carried = ThermalWatch(cfg, read_wait_s=30.0, clock=clock, previous=watch)
    assert carried.poll().state == "critical"  # still paused: 83 C is not 3 C below 85
    assert not messages(caplog, "thermal state")  # no start, no change
    assert ThermalWatch(cfg, read_wait_s=30.0, clock=clock).poll().state == "throttled"  # a fresh watch forgets
    other = copy_board(tmp_path / "other", "rpi4")
    assert ThermalWatch(ThermalConfig(root=other, use_vcgencmd=False), read_wait_s=30.0, previous=watch).poll().zones == {
        "cpu-thermal": 52.095
    }  # another board's readings are its own


def test_a_clock_ceiling_of_zero_is_no_cap(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = copy_board(tmp_path, "rpi4")
    (root / GET_THROTTLED).write_text("0\n")
    (root / PI4_POLICY / "scaling_max_freq").write_text("0\n")
    caplog.set_level(logging.WARNING)
    report = watch_on(root, Clock(2.0)).poll()
    assert (report.state, report.freq_cap_ratio, report.rate_factor) == ("ok", None, 1.0)
    assert len(messages(caplog, "scaling_max_freq reads 0: ignored")) == 1


# ---- boards out of the ordinary -----------------------------------------------------------------


def _zone(root: Path, n: int, kind: str, temp: str, trips: list[tuple[str, str]]) -> None:
    zone = root / ZONES / f"thermal_zone{n}"
    zone.mkdir(parents=True)
    (zone / "type").write_text(f"{kind}\n")
    (zone / "temp").write_text(f"{temp}\n")
    for i, (trip, trip_type) in enumerate(trips):
        (zone / f"trip_point_{i}_temp").write_text(f"{trip}\n")
        (zone / f"trip_point_{i}_type").write_text(f"{trip_type}\n")


def _cpu(root: Path, n: int, package: int, package_count: int | None, core_count: int = 0) -> None:
    """CPU ``n`` of an x86 board: its package, and its ``thermal_throttle`` counters, how many times it began
    throttling since boot (a package's count on each of its CPUs; ``package_count`` None: no package status)."""
    cpu = root / CPUS / f"cpu{n}"
    (cpu / "topology").mkdir(parents=True, exist_ok=True)
    (cpu / "topology/physical_package_id").write_text(f"{package}\n")
    (cpu / "thermal_throttle").mkdir(exist_ok=True)
    (cpu / "thermal_throttle/core_throttle_count").write_text(f"{core_count}\n")
    if package_count is not None:
        (cpu / "thermal_throttle/package_throttle_count").write_text(f"{package_count}\n")


def test_an_x86_cpu_throttling_at_its_own_limit_is_throttled(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A TCC offset throttles the package at 75 C, under the 80/90/97.5 C from the trips, and lowers no cpufreq
    ceiling: edged said ``ok`` at full rate while the CPU ran at a fraction of its clock."""
    root = tmp_path / "board"
    _zone(root, 0, "x86_pkg_temp", "75000", [("0", "passive")])
    _zone(root, 1, "acpitz", "40000", [("105000", "critical")])
    for n in range(8):  # two packages of four CPUs, each with events from before edged started
        _cpu(root, n, package=n // 4, package_count=7, core_count=3)
    (root / CPUS / "cpu5/thermal_throttle/package_throttle_count").unlink()
    (root / CPUS / "cpu5/thermal_throttle/package_throttle_count").mkdir()  # unreadable, never read: one CPU a package
    clock = Clock(2.0)
    watch = watch_on(root, clock)
    first = watch.poll()
    assert (first.state, first.hardware_throttling, first.rate_factor) == ("ok", False, 1.0)
    for n in (4, 6, 7):  # package 1 throttles: the kernel counts it on each of its CPUs
        (root / CPUS / f"cpu{n}/thermal_throttle/package_throttle_count").write_text("9\n")
    caplog.set_level(logging.WARNING, logger="edged.thermal")
    hot = watch.poll()
    assert (hot.state, hot.hardware_throttling) == ("throttled", True)
    assert messages(caplog, "ok -> throttled")[0].endswith("rate 0.25, hardware throttling")
    held = [watch.poll().state for _ in range(int(HARDWARE_CLEAR_S / clock.step_s) + 1)]  # no new event
    assert held[0] == "throttled" and held[-1] == "ok"
    out = io.StringIO()
    run_thermal_command(ThermalConfig(root=root, use_vcgencmd=False), watch=False, interval_s=None, out=out)
    assert "throttle    began 16 times since boot" in out.getvalue()


def test_an_x86_cpu_without_package_status_is_judged_by_its_cores(tmp_path: Path) -> None:
    root = tmp_path / "board"
    _zone(root, 0, "acpitz", "50000", [("105000", "critical")])
    for n in range(2):
        _cpu(root, n, package=0, package_count=None, core_count=4)
    watch = watch_on(root, Clock(2.0))
    assert watch.poll().state == "ok"
    (root / CPUS / "cpu1/thermal_throttle/core_throttle_count").write_text("5\n")
    assert watch.poll().state == "throttled"


def test_an_x86_cpu_taken_offline_is_no_throttling(tmp_path: Path) -> None:
    root = tmp_path / "board"
    _zone(root, 0, "acpitz", "50000", [("105000", "critical")])
    for n in range(4):
        _cpu(root, n, package=0, package_count=9 if n else 7)  # cpu0 was offline once and missed two events
    watch = watch_on(root, Clock(2.0))
    states = [watch.poll().state]
    shutil.rmtree(root / CPUS / "cpu0/thermal_throttle")  # taken offline: the kernel removes its counters
    states += [watch.poll().state for _ in range(3)]  # then cpu1's count stands for the package
    assert states == ["ok"] * 4


def test_a_driver_reporting_whole_degrees_is_read_in_degrees(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "board"
    _zone(root, 0, "x86_pkg_temp", "48000", [("0", "passive")])
    _zone(root, 1, "soc_dts", "93", [("90", "passive"), ("105", "critical")])  # degrees, trips too
    caplog.set_level(logging.WARNING)
    report = watch_on(root, Clock(2.0)).poll()
    assert report.zones == {"x86_pkg_temp": 48.0, "soc_dts": 93.0}
    assert report.thresholds == {"warm": 80.0, "throttled": 90.0, "critical": 97.5}  # from its trips
    assert report.state == "throttled"
    assert len(messages(caplog, "reads in degrees")) == 1


def test_a_skin_sensors_low_critical_trip_sets_no_threshold_of_the_chip(tmp_path: Path) -> None:
    """A DPTF skin sensor's 68 C limit set the thresholds of the whole board: inference paused with the CPU at 61 C."""
    root = tmp_path / "board"
    _zone(root, 0, "x86_pkg_temp", "66000", [("0", "passive")])
    _zone(root, 1, "acpitz", "27800", [("105000", "critical")])
    _zone(root, 2, "TSKN", "34000", [("68000", "critical")])  # a skin sensor's limit, not the CPU's
    report = watch_on(root, Clock(2.0)).poll()
    assert report.thresholds == {"warm": 80.0, "throttled": 90.0, "critical": 97.5}  # from acpitz's trip
    assert (report.state, report.rate_factor) == ("ok", 1.0)


def test_a_jetson_nano_pmic_at_its_resting_alarm_level_is_no_temperature(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "board"
    (root / "proc/device-tree").mkdir(parents=True)
    (root / "proc/device-tree/model").write_text("NVIDIA Jetson Nano Developer Kit\x00")
    _zone(root, 0, "CPU-therm", "41500", [])
    _zone(root, 1, "PMIC-Die", "100000", [("120000", "active")])  # the MAX77620 below its first alarm
    caplog.set_level(logging.INFO, logger="edged.thermal_readers")
    watch = watch_on(root, Clock(2.0))
    report = watch.poll()
    assert (report.state, report.zones, report.rate_factor) == ("ok", {"CPU-therm": 41.5}, 1.0)
    watch.poll()
    assert len(messages(caplog, "its level below its first alarm")) == 1
    out = io.StringIO()
    run_thermal_command(ThermalConfig(root=root, use_vcgencmd=False), watch=False, interval_s=None, out=out)
    assert "no temp" in out.getvalue()
    (root / ZONES / "thermal_zone1/temp").write_text("120000\n")  # its die past 120 C: an alarm that counts
    assert (watch.poll().state, watch.poll().zones["PMIC-Die"]) == ("critical", 120.0)


def test_hundreds_of_zones(tmp_path: Path) -> None:
    root = tmp_path / "board"
    for n in range(400):
        _zone(root, n, f"sensor{n}", str(40000 + n * 10), [("100000", "critical"), ("90000", "passive")])
    report = watch_on(root, Clock(2.0)).poll()
    assert len(report.zones) == 400 and report.hottest_c == 43.99 and report.state == "ok"


# ---- the daemon on a board whose sensor hangs from boot ----------------------------------------


def test_the_daemon_with_a_hung_sensor_from_boot_starts_serves_reloads_and_stops(
    tmp_path: Path, hang: Callable[[Path], Path]
) -> None:
    root = copy_board(tmp_path, "rpi4")
    fifo = hang(root / ZONES / "thermal_zone0/temp")
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    config = board_config(tmp_path, root, endpoint, service={"stall_timeout_s": 2.0})
    notify = NotifySocket(tmp_path / "notify.sock")
    os.environ.pop("WATCHDOG_PID", None)
    d = RunningDaemon(config, endpoint, env={"NOTIFY_SOCKET": str(notify.path), "WATCHDOG_USEC": "1000000"})
    try:
        ready_at = notify.wait_for("READY=1", timeout=20)
        # The sensor has no value: the state says so, the clock and flags are still read, frames flow.
        unknown = d.wait_status(lambda s: s.thermal is not None and s.thermal.board == "raspberrypi", timeout=10)
        assert unknown.thermal is not None and (unknown.thermal.state, unknown.thermal.zones) == ("unknown", {})
        assert unknown.thermal.freq_cap_ratio == 1.0 and unknown.rate_cap_fps is None
        d.collect("detections", 10)
        assert wait_for(lambda: "has not returned after" in d.log(), 10), d.log()
        assert wait_for(lambda: len(notify.times_of("WATCHDOG=1", since=ready_at + 2 * SLOW_READ_S)) >= 3, 10)
        # It answers: its reading is in the status, and the state follows it.
        assert wait_for(lambda: answer(fifo, "61000\n"), 10)
        ok = d.wait_status(lambda s: s.thermal is not None and s.thermal.zones == {"cpu-thermal": 61.0}, timeout=10)
        assert ok.thermal is not None and ok.thermal.state == "ok"
        # A reload does not wait on the file, nor does the stop.
        d.signal(signal.SIGHUP)
        assert wait_for(lambda: len(notify.times_of("READY=1")) == 2, 20), d.log()
        d.collect("detections", 3)
        began = time.monotonic()
        assert d.stop(timeout=10) == 0
        assert time.monotonic() - began < 2.0
    finally:
        d.close()
        notify.close()


def test_every_output_says_the_same_thermal_state(tmp_path: Path) -> None:
    """The status message, the live view's /status.json, /metrics and the Modbus state register, as the
    board goes critical and cools (OPC UA's State is the camera's, not the board's: starting, ok, lost, ended)."""
    root = copy_board(tmp_path, "rpi4")
    (root / GET_THROTTLED).write_text("0\n")
    endpoint, http, modbus = f"tcp://127.0.0.1:{free_port()}", free_port(), free_port()
    listen = {"http": {"listen": f"127.0.0.1:{http}"}, "modbus": {"listen": f"127.0.0.1:{modbus}"}}
    config = board_config(tmp_path, root, endpoint, **listen)
    d = RunningDaemon(config, endpoint)
    plc = ModbusTcpClient("127.0.0.1", port=modbus, timeout=10, retries=0)
    try:
        assert wait_for(lambda: "Modbus TCP on" in d.log() and plc.connect(), 30), d.log()

        def said() -> tuple[str, str, int]:
            """/status.json's state, the state /metrics gives 1, and the Modbus state register."""
            status = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{http}/status.json", timeout=10).read())
            metrics = urllib.request.urlopen(f"http://127.0.0.1:{http}/metrics", timeout=10).read().decode()
            ones = [
                line for line in metrics.splitlines() if line.startswith("edged_thermal_state{") and line.endswith(" 1.0")
            ]
            reply = plc.read_holding_registers(1, count=1, device_id=1)
            assert not reply.isError(), reply
            return status["thermal"]["state"], ones[0].split('"')[1], reply.registers[0]

        for temp, state, register in ((90.0, "critical", 3), (50.0, "ok", 1)):  # 3: throttled, 1: running
            set_temp(root, temp)
            d.wait_status(lambda s, state=state: s.thermal is not None and s.thermal.state == state, timeout=10)  # type: ignore[misc]
            assert wait_for(lambda state=state, register=register: said() == (state, state, register), 10), said()  # type: ignore[misc]
    finally:
        plc.close()
        d.close()


def test_a_reload_keeps_a_board_inside_its_hysteresis_band_throttled(tmp_path: Path) -> None:
    """A SIGHUP's new configuration takes the board's thermal state over (`ThermalWatch(previous=)`): a board
    that went throttled and cooled to inside the band stays throttled after the reload, its rate not raised by it.
    A reload that turns the watch off lifts its cap (the last report stayed: the cap, or a critical board's pause,
    lasted until a restart)."""
    root = copy_board(tmp_path, "rpi4")
    (root / GET_THROTTLED).write_text("0\n")
    heat = root / ZONES / "thermal_zone0/temp"
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    config = board_config(tmp_path, root, endpoint)
    d = RunningDaemon(config, endpoint)
    try:
        d.collect("detections", 3)
        heat.write_text("80000\n")
        d.wait_status(lambda s: s.thermal is not None and s.thermal.state == "throttled", timeout=10)
        heat.write_text("78000\n")  # inside the 3 C band below 80: still throttled
        inside = d.wait_status(lambda s: s.thermal is not None and s.thermal.zones == {"cpu-thermal": 78.0}, timeout=10)
        assert inside.thermal is not None and inside.thermal.state == "throttled"
        d.signal(signal.SIGHUP)
        assert wait_for(lambda: "reloaded: model" in d.log(), 20), d.log()
        after = [m for m in d.messages(1.5) if isinstance(m, StatusMessage)]
        assert after and all(m.thermal is not None and m.thermal.state == "throttled" for m in after), d.log()
        assert "thermal state throttled -> warm" not in d.log()
        config.write_text(config.read_text().replace("[thermal]\n", "[thermal]\nenabled = false\n"))
        d.signal(signal.SIGHUP)
        off = d.wait_status(lambda s: s.thermal is None, timeout=20)
        assert off.rate_cap_fps is None, d.log()
    finally:
        d.close()
