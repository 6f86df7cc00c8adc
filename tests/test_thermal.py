"""Thermal watch against captured sysfs trees: parsing, thresholds, the state machine, the CLI.

Every test that changes a reading copies a fixture tree to tmp_path first and rewrites the real
files there between polls.
"""

from __future__ import annotations

import errno
import io
import json
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from pydantic import ValidationError

from edged.config import ThermalConfig
from edged.thermal import ThermalReport, ThermalWatch, resolve_thresholds
from edged.thermal_command import run_thermal_command
from edged.thermal_readers import (
    BoardFamily,
    Trip,
    Zone,
    decode_throttled,
    detect_family,
    parse_power_mode,
)

FIXTURES = Path(__file__).parent / "fixtures" / "thermal"
ZONES = "sys/class/thermal"
GET_THROTTLED = "sys/devices/platform/soc/soc:firmware/get_throttled"
PI4_POLICY = "sys/devices/system/cpu/cpufreq/policy0"

BoardCopy = Callable[[str], Path]


@pytest.fixture
def board(tmp_path: Path) -> BoardCopy:
    """Copies a fixture tree into tmp_path and returns its root."""

    def copy(name: str) -> Path:
        return Path(shutil.copytree(FIXTURES / name, tmp_path / name))

    return copy


def polls_apart(step_s: float = 10.0) -> Callable[[], float]:
    """A clock for a watch polled back to back that says each poll came ``step_s`` after the one before:
    readings set between them are as far apart as a board's, and past `HARDWARE_CLEAR_S`."""
    now = [0.0]

    def clock() -> float:
        now[0] += step_s
        return now[0]

    return clock


def watch_on(root: Path, **overrides: object) -> ThermalWatch:
    """A watch on ``root`` whose polls wait for every reading, however busy the machine."""
    return ThermalWatch(ThermalConfig(root=root, use_vcgencmd=False, **overrides), read_wait_s=30.0, clock=polls_apart())


def write(root: Path, rel: str, text: str) -> None:
    (root / rel).write_text(text)


def set_temp(root: Path, celsius: float, zone: int = 0) -> None:
    write(root, f"{ZONES}/thermal_zone{zone}/temp", f"{round(celsius * 1000)}\n")


def busy(monkeypatch: pytest.MonkeyPatch, directory: Path) -> None:
    """Every file under ``directory`` fails with EBUSY, as cpufreq's files do for a policy whose CPUs are all offline."""
    read_bytes = Path.read_bytes

    def read(path: Path) -> bytes:
        if path.is_relative_to(directory):
            raise OSError(errno.EBUSY, os.strerror(errno.EBUSY), str(path))
        return read_bytes(path)

    monkeypatch.setattr(Path, "read_bytes", read)


def cooling_device(root: Path, kind: str, state: int, n: int = 0) -> None:
    """Cooling device ``n`` as the kernel shows it: ``cpufreq-cpu0`` since 5.x, ``thermal-cpufreq-0`` before,
    x86's ACPI ``Processor``; ``state`` is its cur_state, 0 while it caps nothing."""
    device = root / ZONES / f"cooling_device{n}"
    device.mkdir(exist_ok=True)
    (device / "type").write_text(f"{kind}\n")
    (device / "max_state").write_text("15\n")
    (device / "cur_state").write_text(f"{state}\n")


# ---- each fixture board -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        # Pi 4: firmware file says under-voltage and throttling happened earlier; nothing now.
        (
            "rpi4",
            dict(
                board="raspberrypi",
                model="Raspberry Pi 4 Model B Rev 1.4",
                zones={"cpu-thermal": 52.095},
                hottest_c=52.095,
                state="ok",
                rate_factor=1.0,
                throttled_flags=("under_voltage_occurred", "throttled_occurred"),
                thresholds={"warm": 70.0, "throttled": 80.0, "critical": 85.0},
                freq_cap_ratio=1.0,
                power_mode=None,
            ),
        ),
        # Pi 5: no firmware file, so only hwmon's under-voltage alarm (clear) is known.
        (
            "rpi5",
            dict(
                board="raspberrypi",
                model="Raspberry Pi 5 Model B Rev 1.0",
                zones={"cpu-thermal": 62.25},
                hottest_c=62.25,
                state="ok",
                rate_factor=1.0,
                throttled_flags=(),
                thresholds={"warm": 70.0, "throttled": 80.0, "critical": 85.0},
                freq_cap_ratio=1.0,
                power_mode=None,
            ),
        ),
        # Orin: -256 C GPU/CV sensors are offline; thresholds come from the 104.5 C critical trips;
        # MODE_50W's own 1.5 GHz ceiling is not a cap.
        (
            "jetson_orin",
            dict(
                board="jetson",
                model="NVIDIA Jetson AGX Orin Developer Kit",
                zones={
                    "cpu-thermal": 41.437,
                    "soc0-thermal": 39.031,
                    "soc1-thermal": 38.937,
                    "soc2-thermal": 39.062,
                    "tj-thermal": 41.656,
                },
                hottest_c=41.656,
                state="ok",
                rate_factor=1.0,
                throttled_flags=(),
                thresholds={"warm": 79.5, "throttled": 89.5, "critical": 97.0},
                freq_cap_ratio=1.0,
                power_mode="MODE_50W",
            ),
        ),
        # VM/container: nothing to read is a state, not an error.
        (
            "none",
            dict(
                board="generic",
                model=None,
                zones={},
                hottest_c=None,
                state="unknown",
                rate_factor=1.0,
                throttled_flags=(),
                thresholds={"warm": 75.0, "throttled": 85.0, "critical": 95.0},
                freq_cap_ratio=None,
                power_mode=None,
            ),
        ),
    ],
)
def test_fixture_board_parses(name: str, expected: dict[str, object]) -> None:
    report = watch_on(FIXTURES / name).poll()
    for key, value in expected.items():
        assert getattr(report, key) == (pytest.approx(value) if isinstance(value, float) else value), key


def test_fixture_trips_and_offline_zones_are_read() -> None:
    watch = watch_on(FIXTURES / "jetson_orin")
    watch.poll()
    assert watch.last_snapshot is not None
    zones = {z.name: z for z in watch.last_snapshot.zones}
    assert list(zones) == [
        "cpu-thermal",
        "gpu-thermal",
        "cv0-thermal",
        "cv1-thermal",
        "cv2-thermal",
        "soc0-thermal",
        "soc1-thermal",
        "soc2-thermal",
        "tj-thermal",
    ]
    assert zones["gpu-thermal"].temp_c is None
    assert zones["cpu-thermal"].trips == (Trip(104.5, "critical"), Trip(99.0, "passive"))
    assert zones["tj-thermal"].trips == (Trip(75.0, "active"), Trip(95.0, "active"))


def test_report_is_json_ready() -> None:
    data = json.loads(json.dumps(watch_on(FIXTURES / "rpi4").poll().to_dict()))
    assert data["state"] == "ok"
    assert data["zones"] == {"cpu-thermal": 52.095}
    assert data["throttled_flags"] == ["under_voltage_occurred", "throttled_occurred"]
    assert data["freq_cur_ratio"] == 0.333


# ---- Raspberry Pi throttled bits ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "flags"),
    [
        (0x0, ()),  # nothing, ever
        (0x50000, ("under_voltage_occurred", "throttled_occurred")),  # earlier, not now
        (0x50005, ("under_voltage", "throttled", "under_voltage_occurred", "throttled_occurred")),
        (0x2, ("arm_freq_capped",)),  # capped now, bit 17 not yet latched
        (0x80008, ("soft_temp_limit", "soft_temp_limit_occurred")),  # Pi 3B+ style soft limit
        (
            0xF000F,
            (
                "under_voltage",
                "arm_freq_capped",
                "throttled",
                "soft_temp_limit",
                "under_voltage_occurred",
                "arm_freq_capped_occurred",
                "throttled_occurred",
                "soft_temp_limit_occurred",
            ),
        ),  # every documented bit
        (0x100000, ()),  # undocumented bits are ignored
    ],
)
def test_decode_throttled(value: int, flags: tuple[str, ...]) -> None:
    assert decode_throttled(value) == flags


@pytest.mark.parametrize(
    ("contents", "state", "flags"),
    [
        (
            "50005\n",
            "throttled",
            ("under_voltage", "throttled", "under_voltage_occurred", "throttled_occurred"),
        ),  # kernel format: hex without 0x
        (
            "0x50005\n",
            "throttled",
            ("under_voltage", "throttled", "under_voltage_occurred", "throttled_occurred"),
        ),  # vcgencmd-style prefix
        ("2\n", "throttled", ("arm_freq_capped",)),  # frequency capped now
        ("8\n", "throttled", ("soft_temp_limit",)),  # soft temperature limit now
        ("1\n", "ok", ("under_voltage",)),  # under-voltage alone is reported, not throttling
        (
            "f0000\n",
            "ok",
            ("under_voltage_occurred", "arm_freq_capped_occurred", "throttled_occurred", "soft_temp_limit_occurred"),
        ),  # history only
    ],
)
def test_pi_throttled_bit_alone_sets_state(board: BoardCopy, contents: str, state: str, flags: tuple[str, ...]) -> None:
    root = board("rpi4")  # 52 C: temperature alone says ok
    write(root, GET_THROTTLED, contents)
    report = watch_on(root).poll()
    assert (report.state, report.throttled_flags) == (state, flags)


def test_hwmon_under_voltage_alarm(board: BoardCopy) -> None:
    root = board("rpi5")
    write(root, "sys/class/hwmon/hwmon2/in0_lcrit_alarm", "1\n")
    report = watch_on(root).poll()
    assert report.throttled_flags == ("under_voltage",)
    assert report.state == "ok"


def test_hardware_flag_must_clear_before_stepping_down(board: BoardCopy) -> None:
    root = board("rpi4")
    watch = watch_on(root)
    set_temp(root, 60.0)
    write(root, GET_THROTTLED, "50005\n")
    assert watch.poll().state == "throttled"
    set_temp(root, 45.0)
    assert watch.poll().state == "throttled"  # cool, but the firmware still throttles
    write(root, GET_THROTTLED, "50000\n")
    assert watch.poll().state == "ok"  # flag cleared and far below every threshold


# ---- cpufreq ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("scaling_max", "ratio", "state"),
    [
        (1800000, 1.0, "ok"),  # no cap
        (1728000, 0.96, "ok"),  # within the 95 % tolerance
        (1700000, 1700000 / 1800000, "throttled"),  # just below it
        (600000, 1 / 3, "throttled"),  # held at the minimum clock
    ],
)
def test_cpufreq_cap_alone_sets_throttled(board: BoardCopy, scaling_max: int, ratio: float, state: str) -> None:
    root = board("rpi4")
    write(root, f"{PI4_POLICY}/scaling_max_freq", f"{scaling_max}\n")
    cooling_device(root, "cpufreq-cpu0", 3)  # the kernel caps the clock for heat
    write(root, GET_THROTTLED, "0\n")
    report = watch_on(root).poll()
    assert report.freq_cap_ratio == pytest.approx(ratio)
    assert report.state == state


@pytest.mark.parametrize(
    ("status", "mode", "ratio", "state"),
    [
        ("pmode:0003\n", "MODE_50W", 1.0, "ok"),  # 1497600 is this mode's own ceiling
        ("pmode:0000\n", "MAXN", 1497600 / 2201600, "throttled"),  # MAXN: same clock is a cap
        (None, "MODE_30W", 1497600 / 1728000, "throttled"),  # no status file: conf default (2)
    ],
)
def test_jetson_power_mode_sets_the_cpufreq_ceiling(
    board: BoardCopy, status: str | None, mode: str, ratio: float, state: str
) -> None:
    root = board("jetson_orin")
    status_file = root / "var/lib/nvpmodel/status"
    if status is None:
        status_file.unlink()
    else:
        status_file.write_text(status)
    report = watch_on(root).poll()
    assert (report.power_mode, report.state) == (mode, state)
    assert report.freq_cap_ratio == pytest.approx(ratio)


def test_parse_power_mode_lowest_cluster_ceiling() -> None:
    conf = (
        "< POWER_MODEL ID=5 NAME=CUSTOM >\nCPU_A78_0 MAX_FREQ 1420800\nCPU_A78_1 MAX_FREQ -1\n"
        "CPU_A78_2 MAX_FREQ 1113600\nGPU MAX_FREQ 612000000\n< PM_CONFIG DEFAULT=5 >\n"
    )
    mode = parse_power_mode(conf, None)
    assert mode is not None
    assert (mode.id, mode.name, mode.cpu_max_khz) == (5, "CUSTOM", 1113600)
    assert parse_power_mode(conf, "pmode:0009\n") is None  # status names a mode the conf lacks


@pytest.mark.parametrize(
    "kind",
    [
        "cpufreq-cpu0",  # kernels since 5.x: the device of the policy of CPU 0
        "thermal-cpufreq-0",  # older kernels: which policy it caps is not said
        "Processor",  # x86's ACPI processor cooling
        None,  # no cooling device: the ceiling at start is the one set on purpose
    ],
)
def test_a_ceiling_set_on_purpose_is_no_cap_and_heat_below_it_is(board: BoardCopy, kind: str | None) -> None:
    root = board("rpi4")
    write(root, GET_THROTTLED, "0\n")
    set_temp(root, 60.0)
    write(root, f"{PI4_POLICY}/scaling_max_freq", "600000\n")  # cpufreq-set -u 600MHz: power saving
    if kind is not None:
        cooling_device(root, kind, 0)
    watch = watch_on(root)
    first = watch.poll()
    assert (first.state, first.freq_cap_ratio, first.hardware_throttling) == ("ok", 1.0, False)
    write(root, f"{PI4_POLICY}/scaling_max_freq", "300000\n")  # then heat caps it lower still
    if kind is not None:
        cooling_device(root, kind, 9)
    hot = watch.poll()
    assert (hot.state, hot.freq_cap_ratio) == ("throttled", 0.5)
    write(root, f"{PI4_POLICY}/scaling_max_freq", "600000\n")
    if kind is not None:
        cooling_device(root, kind, 0)
    assert watch.poll().state == "ok"


def test_each_policy_is_judged_by_its_own_cooling_device(board: BoardCopy) -> None:
    root = board("jetson_orin")
    for n, (cpu, state) in enumerate([(0, 0), (4, 2), (8, 0)]):
        cooling_device(root, f"cpufreq-cpu{cpu}", state, n)
    write(root, "sys/devices/system/cpu/cpufreq/policy8/scaling_max_freq", "729600\n")  # set on purpose
    watch = watch_on(root)
    assert (watch.poll().state, watch.poll().freq_cap_ratio) == ("ok", 1.0)  # policy4's device caps nothing yet
    write(root, "sys/devices/system/cpu/cpufreq/policy4/scaling_max_freq", "1113600\n")  # heat caps policy4
    hot = watch.poll()
    assert (hot.state, hot.freq_cap_ratio) == ("throttled", pytest.approx(1113600 / 1497600))


def test_a_jetson_without_nvpmodel_conf_takes_its_mode_ceiling_at_start(board: BoardCopy) -> None:
    root = board("jetson_orin")
    (root / "etc/nvpmodel.conf").unlink()  # MODE_50W caps the CPUs at 1.5 GHz of 2.2 by design
    watch = watch_on(root)
    report = watch.poll()
    assert (report.state, report.power_mode, report.freq_cap_ratio) == ("ok", None, 1.0)
    write(root, "sys/devices/system/cpu/cpufreq/policy0/scaling_max_freq", "729600\n")  # heat
    assert watch.poll().state == "throttled"
    out = io.StringIO()
    run_thermal_command(ThermalConfig(root=root, use_vcgencmd=False), watch=False, interval_s=None, out=out)
    assert "(heat judged by the highest ceiling since start)" in out.getvalue()


def test_a_cluster_a_power_mode_turned_off_is_no_warning_and_a_broken_file_still_is(
    board: BoardCopy, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A Jetson power mode with policy8's CPUs offline logged a WARNING for each of its files at start."""
    root = board("jetson_orin")
    policies = root / "sys/devices/system/cpu/cpufreq"
    busy(monkeypatch, policies / "policy8")
    (policies / "policy4/scaling_cur_freq").unlink()
    (policies / "policy4/scaling_cur_freq").mkdir()  # a file nobody can read: that is still said
    caplog.set_level(logging.DEBUG, logger="edged.thermal_readers")
    report = watch_on(root).poll()
    assert (report.state, report.freq_cap_ratio) == ("ok", 1.0)
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 1 and "policy4/scaling_cur_freq" in warned[0], warned
    assert any("policy8" in r.getMessage() and "busy" in r.getMessage() for r in caplog.records)  # at DEBUG


# ---- state machine ------------------------------------------------------------------------------

# (hottest C, expected state, expected rate) with the Pi thresholds 70/80/85 and 3 C hysteresis.
HEAT_UP_AND_COOL_DOWN = [
    (50.0, "ok", 1.0),
    (70.0, "warm", 0.5),  # at the threshold counts as reached
    (80.0, "throttled", 0.25),
    (85.5, "critical", 0.0),
    (83.0, "critical", 0.0),  # below 85 but inside the 3 C band
    (82.1, "critical", 0.0),
    (81.9, "throttled", 0.25),  # more than 3 C below 85
    (77.5, "throttled", 0.25),  # inside the band of 80
    (76.9, "warm", 0.5),
    (67.5, "warm", 0.5),
    (66.9, "ok", 1.0),
    (95.0, "critical", 0.0),  # up skips states at once
    (40.0, "ok", 1.0),  # far below everything: straight down
]


def test_state_sequence_with_hysteresis(board: BoardCopy) -> None:
    root = board("rpi4")
    write(root, GET_THROTTLED, "0\n")
    watch = watch_on(root)
    seen = []
    for temp, _, _ in HEAT_UP_AND_COOL_DOWN:
        set_temp(root, temp)
        report = watch.poll()
        seen.append((temp, report.state, report.rate_factor))
    assert seen == HEAT_UP_AND_COOL_DOWN


def test_hovering_at_a_threshold_does_not_flap(board: BoardCopy, caplog: pytest.LogCaptureFixture) -> None:
    root = board("rpi4")
    write(root, GET_THROTTLED, "0\n")
    watch = watch_on(root)
    set_temp(root, 75.0)
    watch.poll()
    caplog.set_level(logging.WARNING, logger="edged.thermal")
    caplog.clear()
    states = []
    for temp in (80.2, 79.8, 80.1, 79.6, 80.0, 79.9, 78.0, 80.3, 77.5):
        set_temp(root, temp)
        states.append(watch.poll().state)
    assert states == ["throttled"] * 9
    changes = [r for r in caplog.records if r.name == "edged.thermal"]
    assert len(changes) == 1


def test_state_change_logs_warning_with_journal_fields(board: BoardCopy, caplog: pytest.LogCaptureFixture) -> None:
    root = board("rpi4")
    watch = watch_on(root)
    watch.poll()
    caplog.set_level(logging.INFO, logger="edged.thermal")
    caplog.clear()
    set_temp(root, 72.0)
    watch.poll()
    watch.poll()  # no change, no log
    records = [r for r in caplog.records if r.name == "edged.thermal"]
    assert len(records) == 1
    record = records[0]
    assert record.levelno == logging.WARNING
    fields = {k: record.__dict__[k] for k in ("THERMAL_STATE", "THERMAL_PREVIOUS_STATE", "TEMP_C")}
    assert fields == {"THERMAL_STATE": "warm", "THERMAL_PREVIOUS_STATE": "ok", "TEMP_C": 72.0}
    assert "ok -> warm" in record.getMessage() and "cpu-thermal" in record.getMessage()


def test_jetson_gpu_waking_up_hot(board: BoardCopy) -> None:
    root = board("jetson_orin")
    watch = watch_on(root)
    assert watch.poll().state == "ok"
    set_temp(root, 91.0, zone=1)  # gpu-thermal comes online above throttled (89.5)
    report = watch.poll()
    assert (report.state, report.zones["gpu-thermal"]) == ("throttled", 91.0)
    set_temp(root, -256.0, zone=1)  # powered down again: hottest is tj at 41.7 C
    assert watch.poll().state == "ok"


def test_all_zones_going_offline_is_unknown(board: BoardCopy) -> None:
    root = board("rpi5")
    watch = watch_on(root)
    set_temp(root, 72.0)
    assert watch.poll().state == "warm"
    write(root, f"{ZONES}/thermal_zone0/temp", "")
    report = watch.poll()
    assert (report.state, report.rate_factor, report.hottest_c) == ("unknown", 1.0, None)


# ---- thresholds ---------------------------------------------------------------------------------

RK3588_LIKE = (Zone("soc-thermal", 40.0, (Trip(85.0, "passive"), Trip(115.0, "critical"))),)
X86_PLACEHOLDERS = (Zone("x86_pkg_temp", 45.0, (Trip(0.0, "passive"), Trip(0.0, "passive"))),)
ORIN_NANO_OLD = (
    Zone("cpu-thermal", 40.0, (Trip(104.5, "critical"), Trip(99.0, "hot"), Trip(95.0, "passive"), Trip(80.0, "active"))),
)


@pytest.mark.parametrize(
    ("family", "zones", "overrides", "expected"),
    [
        # Pi: fixed defaults, the 110 C kernel trip is ignored.
        ("raspberrypi", (Zone("cpu-thermal", 50.0, (Trip(110.0, "critical"),)),), {}, (70.0, 80.0, 85.0)),
        ("jetson", (), {}, (80.0, 90.0, 97.0)),  # no trips: board default
        # Orin Nano's first DT: lowest critical/hot is 99, passive 95 is above the new critical.
        ("jetson", ORIN_NANO_OLD, {}, (74.0, 84.0, 91.5)),
        ("generic", RK3588_LIKE, {}, (75.0, 85.0, 107.5)),  # passive trip is where throttling starts
        ("generic", X86_PLACEHOLDERS, {}, (75.0, 85.0, 95.0)),  # 0 C trips are placeholders
        ("raspberrypi", (), {"critical_c": 90.0}, (70.0, 80.0, 90.0)),  # one key from config
        ("raspberrypi", (), {"warm_c": 90.0}, (90.0, 92.0, 94.0)),  # defaults pushed above it
        ("raspberrypi", (), {"critical_c": 60.0}, (56.0, 58.0, 60.0)),  # defaults pushed below it
        ("raspberrypi", (), {"warm_c": 50.0, "critical_c": 60.0}, (50.0, 55.0, 60.0)),  # midpoint
        (
            "generic",
            RK3588_LIKE,
            {"warm_c": 60.0, "throttled_c": 65.0, "critical_c": 70.0},
            (60.0, 65.0, 70.0),
        ),  # all from config
    ],
)
def test_resolve_thresholds(
    family: BoardFamily, zones: tuple[Zone, ...], overrides: dict[str, float], expected: tuple[float, float, float]
) -> None:
    thresholds, _ = resolve_thresholds(ThermalConfig(**overrides), family, zones)
    assert (thresholds["warm"], thresholds["throttled"], thresholds["critical"]) == pytest.approx(expected)


@pytest.mark.parametrize(
    "overrides",
    [
        {"warm_c": 80.0, "throttled_c": 70.0},  # throttled below warm
        {"warm_c": 80.0, "critical_c": 80.0},  # equal is not above
        {"throttled_c": 90.0, "critical_c": 85.0},  # critical below throttled
    ],
)
def test_config_rejects_unordered_thresholds(overrides: dict[str, float]) -> None:
    with pytest.raises(ValidationError):
        ThermalConfig(**overrides)


@pytest.mark.parametrize(
    ("model", "zones", "has_pi_source", "family"),
    [
        ("Raspberry Pi 4 Model B Rev 1.4", {"cpu-thermal"}, True, "raspberrypi"),  # model decides
        ("NVIDIA Jetson AGX Orin Developer Kit", {"cpu-thermal"}, False, "jetson"),  # model decides
        (
            "Seeed reComputer J4012",
            {"cpu-thermal", "gpu-thermal", "tj-thermal"},
            False,
            "jetson",
        ),  # vendor carrier board: Orin zone names
        (None, {"CPU-therm", "GPU-therm", "PLL-therm"}, False, "jetson"),  # Nano/TX2 names
        (None, {"cpu-thermal"}, True, "raspberrypi"),  # model missing, Pi firmware present
        (None, {"cpu-thermal"}, False, "generic"),  # some other SoC
        ("Radxa ROCK 5B", {"soc-thermal", "bigcore0-thermal"}, False, "generic"),  # other SBC
        (None, set(), False, "generic"),  # VM
    ],
)
def test_detect_family(model: str | None, zones: set[str], has_pi_source: bool, family: str) -> None:
    assert detect_family(model, zones, has_pi_source) == family


@pytest.mark.parametrize(
    ("name", "family"),
    [
        ("rpi4", "raspberrypi"),  # cpu-thermal plus the firmware's get_throttled
        ("jetson_orin", "jetson"),  # tj-thermal
    ],
)
def test_family_from_zones_without_device_tree(board: BoardCopy, name: str, family: str) -> None:
    root = board(name)
    (root / "proc/device-tree/model").unlink()
    assert watch_on(root).poll().board == family


# ---- weird trees --------------------------------------------------------------------------------


def _make_dir(path: Path) -> None:
    path.unlink()
    path.mkdir()


def _dangling_link(path: Path) -> None:
    path.unlink()
    path.symlink_to(path.parent / "does-not-exist")


@pytest.mark.parametrize(
    ("board_name", "rel", "damage", "check"),
    [
        # garbage temperature: zone offline, nothing else readable, so unknown
        ("rpi4", f"{ZONES}/thermal_zone0/temp", "hot!\n", lambda r: r.state == "unknown"),
        # binary junk in the temperature
        ("rpi4", f"{ZONES}/thermal_zone0/temp", b"\xff\xfe\x00", lambda r: r.zones == {}),
        # temp is a directory: read fails with EISDIR
        ("rpi4", f"{ZONES}/thermal_zone0/temp", _make_dir, lambda r: r.hottest_c is None),
        # dangling symlink for the temperature
        ("rpi4", f"{ZONES}/thermal_zone0/temp", _dangling_link, lambda r: r.state == "unknown"),
        # garbage trip point: zone still read, Pi thresholds unaffected
        (
            "rpi4",
            f"{ZONES}/thermal_zone0/trip_point_0_temp",
            "abc",
            lambda r: r.zones == {"cpu-thermal": 52.095} and r.thresholds["critical"] == 85.0,
        ),
        # garbage get_throttled: falls back to hwmon (under-voltage only)
        ("rpi4", GET_THROTTLED, "zzz\n", lambda r: r.throttled_flags == () and r.state == "ok"),
        # model with invalid UTF-8: still a string, family from zones
        ("rpi4", "proc/device-tree/model", b"\xffRaspberry\x00", lambda r: r.board == "raspberrypi"),
        # hardware maximum of 0: policy ignored
        ("rpi4", f"{PI4_POLICY}/cpuinfo_max_freq", "0\n", lambda r: r.freq_cap_ratio is None),
        # garbage scaling_max: no cap known, current clock still reported
        (
            "rpi4",
            f"{PI4_POLICY}/scaling_max_freq",
            "-\n",
            lambda r: r.freq_cap_ratio is None and r.freq_cur_ratio == pytest.approx(1 / 3),
        ),
        # nvpmodel conf is junk: no power mode, so the 1.5 GHz ceiling at start is the one set on purpose
        (
            "jetson_orin",
            "etc/nvpmodel.conf",
            "\x00\x01 not a conf",
            lambda r: r.power_mode is None and r.state == "ok",
        ),
        # status file garbage: conf default (MODE_30W) applies
        ("jetson_orin", "var/lib/nvpmodel/status", "pmode:\n", lambda r: r.power_mode == "MODE_30W"),
        # the thermal class is a file, not a directory
        ("rpi5", ZONES, "not a directory", lambda r: r.state == "unknown" and r.board == "raspberrypi"),
        # a zone directory replaced by a file
        ("jetson_orin", f"{ZONES}/thermal_zone8", "x", lambda r: "tj-thermal" not in r.zones),
    ],
)
def test_weird_tree_does_not_raise(
    board: BoardCopy,
    board_name: str,
    rel: str,
    damage: str | bytes | Callable[[Path], None],
    check: Callable[[ThermalReport], bool],
) -> None:
    root = board(board_name)
    target = root / rel
    if callable(damage):
        damage(target)
    else:
        if target.is_dir():
            shutil.rmtree(target)
        target.write_bytes(damage if isinstance(damage, bytes) else damage.encode())
    report = watch_on(root).poll()
    assert check(report), report


def test_unreadable_file_does_not_raise(board: BoardCopy) -> None:
    root = board("rpi4")
    temp = root / f"{ZONES}/thermal_zone0/temp"
    temp.unlink()
    temp.mkdir()  # reading it fails with IsADirectoryError, even as root (permissions would not)
    assert watch_on(root).poll().state == "unknown"


def test_bad_path_is_logged_once(board: BoardCopy, caplog: pytest.LogCaptureFixture) -> None:
    root = board("rpi4")
    write(root, f"{ZONES}/thermal_zone0/temp", "garbage\n")
    caplog.set_level(logging.DEBUG, logger="edged.thermal_readers")
    watch = watch_on(root)
    for _ in range(3):
        watch.poll()
    mentions = [r for r in caplog.records if "thermal_zone0/temp" in r.getMessage()]
    assert len(mentions) == 1
    assert mentions[0].levelno == logging.WARNING


def test_duplicate_zone_names_stay_distinct_in_numeric_order(board: BoardCopy) -> None:
    root = board("none")
    for n, temp in ((10, "47000"), (2, "45000")):  # zone10 sorts after zone2
        zone = root / f"{ZONES}/thermal_zone{n}"
        zone.mkdir()
        (zone / "type").write_text("acpitz\n")
        (zone / "temp").write_text(temp)
    report = watch_on(root).poll()
    assert report.zones == {"acpitz": 45.0, "acpitz#1": 47.0}
    assert (report.board, report.state) == ("generic", "ok")


# ---- vcgencmd -----------------------------------------------------------------------------------


def _fake_vcgencmd(bin_dir: Path, body: str) -> Path:
    """An executable named vcgencmd that counts its calls in a file next to it."""
    bin_dir.mkdir(exist_ok=True)
    exe = bin_dir / "vcgencmd"
    exe.write_text(f"#!/bin/sh\necho call >> '{bin_dir}/calls'\n{body}\n")
    exe.chmod(0o755)
    return bin_dir / "calls"


def _host_has_pi_sysfs() -> bool:
    return any(Path("/sys/devices/platform").glob("soc*/*firmware/get_throttled")) or any(
        (p / "name").read_text().strip() == "rpi_volt"
        for p in Path("/sys/class/hwmon").glob("hwmon*")
        if (p / "name").is_file()
    )


@pytest.mark.skipif(_host_has_pi_sysfs(), reason="the host's own Pi sysfs files take precedence")
def test_vcgencmd_fallback_on_the_real_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _fake_vcgencmd(tmp_path / "bin", "echo throttled=0x50005")
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    report = ThermalWatch(ThermalConfig(root=Path("/"), use_vcgencmd=True)).poll()
    assert report.throttled_flags == ("under_voltage", "throttled", "under_voltage_occurred", "throttled_occurred")
    assert report.state in ("throttled", "critical")  # critical only if this host runs that hot
    assert calls.read_text().count("call") == 1


@pytest.mark.skipif(_host_has_pi_sysfs(), reason="the host's own Pi sysfs files take precedence")
def test_failing_vcgencmd_is_logged_once_then_left_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    calls = _fake_vcgencmd(tmp_path / "bin", "echo 'VCHI initialization failed' >&2; exit 1")
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    caplog.set_level(logging.WARNING, logger="edged.thermal_readers")
    watch = ThermalWatch(ThermalConfig(root=Path("/"), use_vcgencmd=True))
    flags = [watch.poll().throttled_flags for _ in range(3)]
    assert flags == [(), (), ()]
    assert calls.read_text().count("call") == 1
    assert sum("vcgencmd" in r.getMessage() for r in caplog.records) == 1


def test_vcgencmd_is_not_asked_about_a_fixture_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _fake_vcgencmd(tmp_path / "bin", "echo throttled=0x50005")
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    report = ThermalWatch(ThermalConfig(root=FIXTURES / "none", use_vcgencmd=True)).poll()
    assert report.throttled_flags == ()
    assert not calls.exists()


# ---- summary and the edged thermal command ------------------------------------------------------


@pytest.mark.parametrize(
    ("temp", "throttled", "scaling_max", "summary"),
    [
        (52.1, "0", 1800000, "thermal ok 52.1C"),  # nothing to add
        (72.3, "0", 1800000, "thermal warm 72.3C rate 0.5"),  # reduced rate
        (60.0, "50005", 1800000, "thermal throttled 60.0C under_voltage,throttled rate 0.25"),  # active bits, not history
        (60.0, "0", 900000, "thermal throttled 60.0C cap 50% rate 0.25"),  # cpufreq cap
        (86.0, "0", 1800000, "thermal critical 86.0C paused"),  # inference paused
    ],
)
def test_summary_line(board: BoardCopy, temp: float, throttled: str, scaling_max: int, summary: str) -> None:
    root = board("rpi4")
    set_temp(root, temp)
    write(root, GET_THROTTLED, throttled + "\n")
    write(root, f"{PI4_POLICY}/scaling_max_freq", f"{scaling_max}\n")
    cooling_device(root, "cpufreq-cpu0", 0 if scaling_max == 1800000 else 5)
    assert watch_on(root).poll().summary() == summary


def test_summary_line_without_sensors() -> None:
    assert watch_on(FIXTURES / "none").poll().summary() == "thermal unknown"


def test_thermal_command_prints_state_and_zones() -> None:
    out = io.StringIO()
    code = run_thermal_command(
        ThermalConfig(root=FIXTURES / "jetson_orin", use_vcgencmd=False), watch=False, interval_s=None, out=out
    )
    text = out.getvalue()
    assert code == 0
    assert "state       ok" in text
    for name in ("cpu-thermal", "gpu-thermal", "soc2-thermal", "tj-thermal"):
        assert name in text
    assert "gpu-thermal" in text.split("offline")[0]  # offline zones are listed as offline
    assert "(trip points)" in text and "MODE_50W" in text


def test_thermal_command_watch_repeats(board: BoardCopy) -> None:
    root = board("rpi4")
    out = io.StringIO()
    code = run_thermal_command(
        ThermalConfig(root=root, use_vcgencmd=False, enabled=False), watch=True, interval_s=0.0, out=out, iterations=3
    )
    text = out.getvalue()
    assert code == 0
    assert text.count("-- ") == 3
    assert text.count("cpu-thermal") == 3
    assert "thermal.enabled is false" in text
