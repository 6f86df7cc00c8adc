"""Raw thermal readings from sysfs, procfs and /etc under a configurable root.

This module owns *reading and parsing*: thermal zones with their trip points, cpufreq limits
(told from a ceiling set on purpose by the kernel's cpufreq cooling devices, a Jetson power mode
or the ceiling since start), x86's thermal throttle counters, the Raspberry Pi throttled bits, the
board model and the Jetson power mode. What the readings mean (states, thresholds, rates) is
decided in ``edged.thermal``.

Every read tolerates a missing, unreadable or garbled file: the value becomes ``None`` and the
path is logged once, because a flaky sensor must never stop the daemon.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from edged.thermal_background import SlowFiles

log = logging.getLogger(__name__)

BoardFamily = Literal["raspberrypi", "jetson", "generic"]

# Raspberry Pi firmware get_throttled bits (official "get_throttled" documentation table).
THROTTLED_BITS: tuple[tuple[int, str], ...] = (
    (0, "under_voltage"),
    (1, "arm_freq_capped"),
    (2, "throttled"),
    (3, "soft_temp_limit"),
    (16, "under_voltage_occurred"),
    (17, "arm_freq_capped_occurred"),
    (18, "throttled_occurred"),
    (19, "soft_temp_limit_occurred"),
)
# Active-now bits that mean the SoC is running below its normal clock.
THROTTLING_NOW = frozenset({"arm_freq_capped", "throttled", "soft_temp_limit"})

# Outside this range a zone reading is a sentinel (Jetson reports -256 C for a powered-down
# sensor) or garbage, so the zone counts as offline.
_VALID_TEMP_C = (-50.0, 200.0)
_POWERED_DOWN_C = -256.0
_REPEAT_S = 60.0
_MAX_TRIPS = 32
_VCGENCMD_TIMEOUT_S = 1.0

_ZONES = "sys/class/thermal"
_CPUS = "sys/devices/system/cpu"
_CPUFREQ = f"{_CPUS}/cpufreq"
_HWMON = "sys/class/hwmon"
_PLATFORM = "sys/devices/platform"
_MODEL = "proc/device-tree/model"
_NVPMODEL_CONF = "etc/nvpmodel.conf"
_NVPMODEL_STATUS = "var/lib/nvpmodel/status"

_MODE_HEADER = re.compile(r"<\s*POWER_MODEL\s+ID=(\d+)\s+NAME=(\S+?)\s*>")
_MODE_DEFAULT = re.compile(r"<\s*PM_CONFIG\s+DEFAULT=(\d+)\s*>")
_MODE_STATUS = re.compile(r"pmode:(\d+)")
_MODE_CPU_MAX = re.compile(r"CPU_\w+\s+MAX_FREQ\s+(-?\d+)")
_VCGENCMD_OUT = re.compile(r"throttled=(0x[0-9a-fA-F]+)")
# The kernel's cpufreq cooling devices: ``cpufreq-cpuN`` caps the policy of first CPU N (kernels
# since 5.x); ``thermal-cpufreq-N`` (older kernels: N counts devices, not CPUs) and x86's ACPI
# ``Processor`` do not say which policy they cap, so any of them active counts for every policy.
_COOLING_OF_POLICY = re.compile(r"cpufreq-cpu(\d+)")
_COOLING_OF_SOME_POLICY = re.compile(r"thermal-cpufreq-\d+|Processor")
# Zones that read a fixed value below their first alarm rather than a temperature: the MAX77620
# PMIC of Jetson Nano/TX1/TX2 reads 100 C until its die reaches 120 C.
_ALARM_ONLY_ZONES = {"pmic-die": 100.0}


@dataclass(frozen=True, slots=True)
class Trip:
    """One trip point; ``kind`` is the kernel's type: critical, hot, passive or active."""

    temp_c: float
    kind: str


@dataclass(frozen=True, slots=True)
class Zone:
    """A thermal zone; ``temp_c`` is None while the sensor is offline, or while it reads its resting
    alarm level (``alarm_only``), which is no temperature."""

    name: str
    temp_c: float | None
    trips: tuple[Trip, ...]
    alarm_only: bool = False


@dataclass(frozen=True, slots=True)
class CpuFreq:
    """Lowest ratio over all cpufreq policies of scaling_max (cap) and scaling_cur to the ceiling.

    ``cap_ratio`` counts only a cap set for heat: a ceiling set on purpose (a power mode, a user's or a
    tool's ``scaling_max_freq``) is 1.0. ``judged_by`` says how that was told, for ``edged thermal``.
    """

    cap_ratio: float | None
    cur_ratio: float | None
    judged_by: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class PowerMode:
    """The active Jetson nvpmodel mode; ``cpu_max_khz`` is its CPU ceiling (None = unlimited)."""

    id: int
    name: str
    cpu_max_khz: int | None


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Everything one poll read. ``pi_flags`` is None when no source of the Pi bits exists;
    ``throttle_events`` (`SysReader._throttle_events`) where no x86 throttle counter is, or one failed."""

    family: BoardFamily
    model: str | None
    zones: tuple[Zone, ...]
    cpufreq: CpuFreq | None
    pi_flags: tuple[str, ...] | None
    pi_source: str | None
    power_mode: PowerMode | None
    throttle_events: int | None


def decode_throttled(value: int) -> tuple[str, ...]:
    """Names of the set get_throttled bits, in bit order."""
    return tuple(name for bit, name in THROTTLED_BITS if value >> bit & 1)


def detect_family(model: str | None, zone_names: set[str], has_pi_source: bool) -> BoardFamily:
    """The device-tree model decides; boards with a vendor model string fall back to zone names."""
    if model:
        if model.startswith("Raspberry Pi"):
            return "raspberrypi"
        if "jetson" in model.lower():
            return "jetson"
    names = {n.lower() for n in zone_names}
    # Orin: lower-case *-thermal with a tj zone; Nano/TX2/Xavier: CPU-therm, GPU-therm.
    if "tj-thermal" in names or {"cpu-thermal", "gpu-thermal"} <= names or "gpu-therm" in names:
        return "jetson"
    if "cpu-thermal" in names and has_pi_source:
        return "raspberrypi"
    return "generic"


def parse_power_mode(conf: str, status: str | None) -> PowerMode | None:
    """Active mode from nvpmodel's status file (``pmode:0003``), else the conf's PM_CONFIG default.

    The CPU ceiling is the lowest positive ``CPU_* MAX_FREQ`` of that mode: taking the lowest
    means a per-cluster difference can never look like a thermal cap.
    """
    match = _MODE_STATUS.search(status or "") or _MODE_DEFAULT.search(conf)
    if match is None:
        return None
    wanted = int(match.group(1))
    found: tuple[int, str] | None = None
    in_block = False
    caps: list[int] = []
    for raw in conf.splitlines():
        line = raw.strip()
        if line.startswith("<"):
            header = _MODE_HEADER.match(line)
            in_block = header is not None and int(header.group(1)) == wanted
            if in_block and header is not None:
                found = (wanted, header.group(2))
            continue
        cap = _MODE_CPU_MAX.match(line) if in_block else None
        if cap is not None and int(cap.group(1)) > 0:
            caps.append(int(cap.group(1)))
    if found is None:
        return None
    return PowerMode(found[0], found[1], min(caps) if caps else None)


class _Problems:
    """Logs each problem path once, so a broken sensor does not flood the journal every poll; once
    more after it was `cleared` (a sensor that breaks again), unless within `_REPEAT_S` of its last
    line: a sensor that comes and goes every reading is a line a minute, not one a reading."""

    def __init__(self) -> None:
        self._seen: dict[str, int] = {}  # problem path: level logged at, 0 if not logged
        self._said: dict[str, float] = {}

    def once(self, level: int, path: Path, msg: str, *args: object) -> None:
        key, now = str(path), time.monotonic()
        if key in self._seen:
            return
        quiet = now - self._said.get(key, now - _REPEAT_S) < _REPEAT_S
        self._seen[key] = 0 if quiet else level
        if not quiet:
            self._said[key] = now
            log.log(level, msg, *args)

    def cleared(self, path: Path) -> int | None:
        """The level the problem ``path`` had was logged at (0: not logged), now over."""
        return self._seen.pop(str(path), None)


def _numbered(directory: Path, prefix: str, problems: _Problems) -> list[Path]:
    """Entries ``prefixN`` of a directory, sorted by N (zone10 after zone9)."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    except OSError as e:
        problems.once(logging.WARNING, directory, "cannot list %s: %s", directory, e)
        return []
    pattern = re.compile(re.escape(prefix) + "([0-9]+)")
    found = sorted((int(m.group(1)), n) for n in names if (m := pattern.fullmatch(n)))
    return [directory / n for _, n in found]


class SysReader:
    """Reads one :class:`Snapshot` per call from the tree under ``root``."""

    def __init__(self, root: Path, use_vcgencmd: bool) -> None:
        self.root = Path(root)
        self._problems = _Problems()
        self.slow_files = SlowFiles.of(self.root)
        # vcgencmd reads the live firmware, so it only makes sense for the real root.
        self._vcgencmd_allowed = use_vcgencmd and self.root == Path("/")
        # Per policy, the ceiling set on purpose as far as it is known: the last one seen with its cooling
        # device idle, else the highest seen (a cap lifting shows what was under it).
        self._ceilings: dict[str, int] = {}
        self._throttle_files: list[Path] | None = None  # the counters `_throttle_events` sums; None: to find

    def read(self) -> Snapshot:
        model = self._model()
        zones = tuple(self._zone(p) for p in _numbered(self.root / _ZONES, "thermal_zone", self._problems))
        pi_flags, pi_source = self._pi_flags()
        power_mode = self._power_mode()
        family = detect_family(model, {z.name for z in zones}, pi_source is not None)
        cpufreq = self._cpufreq(power_mode)
        return Snapshot(family, model, zones, cpufreq, pi_flags, pi_source, power_mode, self._throttle_events())

    # ---- primitives ------------------------------------------------------------------------

    def _text(self, path: Path, offline_level: int = logging.WARNING) -> str | None:
        """File contents stripped of whitespace and NULs; None if absent or unreadable (or, read on its own
        since it hung, without a recent value: `edged.thermal_background`)."""
        return self.slow_files.text(path, lambda p: self._read(p, offline_level))

    def _read(self, path: Path, offline_level: int) -> str | None:
        try:
            data = path.read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as e:
            # EBUSY is a device off for now, never a broken file: cpufreq answers it for every file of a
            # policy whose CPUs are all offline (a Jetson power mode that turns a cluster off).
            level = offline_level
            if isinstance(e, PermissionError):
                level = logging.WARNING
            elif e.errno == errno.EBUSY:
                level = logging.DEBUG
            self._problems.once(level, path, "cannot read %s: %s", path, e)
            return None
        return data.decode("utf-8", errors="replace").strip("\x00 \t\r\n")

    def _int(self, path: Path, base: int = 10, offline_level: int = logging.WARNING) -> int | None:
        text = self._text(path, offline_level)
        if not text:
            return None
        try:
            return int(text, base)
        except ValueError:
            self._problems.once(logging.WARNING, path, "unexpected contents in %s: %r", path, text[:40])
            return None

    # ---- board -----------------------------------------------------------------------------

    def _model(self) -> str | None:
        return self._text(self.root / _MODEL) or None

    def _power_mode(self) -> PowerMode | None:
        conf = self._text(self.root / _NVPMODEL_CONF)
        if not conf:
            return None
        return parse_power_mode(conf, self._text(self.root / _NVPMODEL_STATUS))

    # ---- thermal zones ---------------------------------------------------------------------

    def _zone(self, path: Path) -> Zone:
        name = self._text(path / "type") or path.name
        trips = self._trips(path)
        # The ABI says millidegrees; a driver giving whole degrees shows it in its trip points too
        # (none of them 1 C or more read as millidegrees, some of them a chip's 20..200): then both
        # are taken as degrees, else a hot chip of such a board would read as 0.09 C.
        unit = 1.0
        if trips and all(abs(t) < 1000 for t, _ in trips) and any(20 <= t <= 200 for t, _ in trips):
            unit = 1000.0
            self._problems.once(logging.WARNING, path, "%s reads in degrees, not millidegrees: taken as degrees", path)
        temp = self._zone_temp(path / "temp", unit)
        alarm_only = temp is not None and temp == _ALARM_ONLY_ZONES.get(name.lower())
        if alarm_only:
            msg = "%s reads %.0f C, its level below its first alarm, not a temperature: left out while it does"
            self._problems.once(logging.INFO, path / "type", msg, path, temp)
        elif name.lower() in _ALARM_ONLY_ZONES:
            self._problems.cleared(path / "type")
        return Zone(name, None if alarm_only else temp, tuple(Trip(t * unit / 1000, kind) for t, kind in trips), alarm_only)

    def _zone_temp(self, path: Path, unit: float) -> float | None:
        # A disabled or powered-down sensor fails with EIO/ENODATA or reads empty: that is normal.
        milli = self._int(path, offline_level=logging.DEBUG)
        if milli is None:
            return None
        temp_c = milli * unit / 1000
        low, high = _VALID_TEMP_C
        if not low <= temp_c <= high:
            # Jetson's powered-down sensors read -256 C; anything else out there is a sensor broken
            # or unplugged (0xff: 255 C; -273 C), never a board that hot or cold: it is said.
            if temp_c == _POWERED_DOWN_C:
                self._problems.once(logging.DEBUG, path, "%s reads -256 C: a sensor powered down, offline", path)
                return None
            msg = "%s reads %.1f C: a sensor broken or disconnected, left out until it reads %g..%g C"
            self._problems.once(logging.WARNING, path, msg, path, temp_c, low, high)
            return None
        if self._problems.cleared(path) == logging.WARNING:
            log.warning("%s reads %.1f C again", path, temp_c)
        return temp_c

    def _trips(self, zone: Path) -> list[tuple[int, str]]:
        trips = []
        for n in range(_MAX_TRIPS):
            temp_path = zone / f"trip_point_{n}_temp"
            if not os.path.exists(temp_path):
                break
            raw = self._int(temp_path)
            kind = self._text(zone / f"trip_point_{n}_type")
            if raw is not None and kind:
                trips.append((raw, kind))
        return trips

    # ---- cpufreq ---------------------------------------------------------------------------

    def _cpufreq(self, power_mode: PowerMode | None) -> CpuFreq | None:
        """scaling_max and scaling_cur against each policy's ceiling: its hardware maximum, or lower a Jetson
        power mode's; the cap counts only as far as heat set it (`_heat_cap`)."""
        mode_cap = power_mode.cpu_max_khz if power_mode else None
        by_policy, any_policy = self._cpufreq_cooling()
        caps: list[float] = []
        curs: list[float] = []
        judged_by: list[str] = []
        for policy in _numbered(self.root / _CPUFREQ, "policy", self._problems):
            hw_max = self._int(policy / "cpuinfo_max_freq")
            if not hw_max or hw_max <= 0:
                continue
            ceiling = min(hw_max, mode_cap) if mode_cap else hw_max
            scaling_max = self._int(policy / "scaling_max_freq")
            scaling_cur = self._int(policy / "scaling_cur_freq")
            if scaling_max is not None and scaling_max <= 0:  # no clock has a ceiling of 0: garbage, not a cap
                self._problems.once(logging.WARNING, policy, "%s/scaling_max_freq reads %d: ignored", policy, scaling_max)
            elif scaling_max is not None:
                cooling = by_policy.get(policy.name.removeprefix("policy"), any_policy)
                cap, how = self._heat_cap(policy.name, scaling_max, ceiling, power_mode is not None, cooling)
                caps.append(cap)
                judged_by.append(how)
            if scaling_cur is not None:
                curs.append(min(1.0, scaling_cur / ceiling))
        if not caps and not curs:
            return None
        return CpuFreq(min(caps) if caps else None, min(curs) if curs else None, tuple(dict.fromkeys(judged_by)))

    def _cpufreq_cooling(self) -> tuple[dict[str, int], int | None]:
        """``cur_state`` of the cpufreq cooling devices (`_COOLING_OF_POLICY`) by the policy's first CPU,
        and the highest of those that name no policy (None: there are none); an unreadable one is left out."""
        by_policy: dict[str, int] = {}
        any_policy: int | None = None
        for device in _numbered(self.root / _ZONES, "cooling_device", self._problems):
            kind = self._text(device / "type") or ""
            of_policy = _COOLING_OF_POLICY.fullmatch(kind)
            if of_policy is None and _COOLING_OF_SOME_POLICY.fullmatch(kind) is None:
                continue
            state = self._int(device / "cur_state")
            if state is None or state < 0:
                continue
            if of_policy is not None:
                by_policy[of_policy.group(1)] = state
            else:
                any_policy = max(state, any_policy or 0)
        return by_policy, any_policy

    def _heat_cap(self, policy: str, scaling_max: int, ceiling: int, mode: bool, cooling: int | None) -> tuple[float, str]:
        """The ratio by which heat lowers this policy's ceiling, and what told it.

        The kernel caps a clock for heat through a cpufreq cooling device, so where one covers the policy
        its ``cur_state`` decides: 0, and the ceiling, however low, was set on purpose. Without one, a Jetson
        power mode's ceiling is the reference; with neither, the highest ceiling seen since edged started,
        so that a ceiling lowered before it (a power mode without its nvpmodel.conf, ``cpufreq-set -u``) is no cap.
        """
        if cooling == 0:
            self._ceilings[policy] = scaling_max
            return 1.0, "the cpufreq cooling device"
        if cooling is not None:
            reference = min(ceiling, self._ceilings.get(policy, ceiling))
            return min(1.0, scaling_max / reference), "the cpufreq cooling device"
        if mode:
            return min(1.0, scaling_max / ceiling), "the power mode"
        highest = self._ceilings[policy] = max(self._ceilings.get(policy, 0), scaling_max)
        return min(1.0, scaling_max / min(ceiling, highest)), "the highest ceiling since start"

    # ---- x86 thermal throttle counters -----------------------------------------------------

    def _throttle_events(self) -> int | None:
        """The sum of the x86 thermal throttle counters (`_throttle_counters`): how many times the CPUs began
        throttling themselves at their own limit (PROCHOT, TCC) since boot. None on boards without them
        (ARM), and when one failed to read (a CPU taken offline): they are found again for the next read,
        whose sum is then over other files."""
        if self._throttle_files is None:
            self._throttle_files = self._throttle_counters()
        if not self._throttle_files:
            return None
        counts = [self._int(path, offline_level=logging.DEBUG) for path in self._throttle_files]
        if None in counts:
            self._throttle_files = None
            return None
        return sum(c for c in counts if c is not None)

    def _throttle_counters(self) -> list[Path]:
        """``package_throttle_count`` of the first CPU of each package, else ``core_throttle_count`` of each CPU.

        The kernel counts a package's events on every CPU of it, so one file says them all: 64 CPUs in one
        package are one read a poll, not 64 (or 128 with the core counters, which count per CPU). The
        package throttles when its hottest part is at its limit; CPUs without package thermal status
        (before 2011) have core counters only.
        """
        firsts: dict[str, Path] = {}
        cores: list[Path] = []
        for cpu in _numbered(self.root / _CPUS, "cpu", self._problems):
            counters = cpu / "thermal_throttle"
            if (counters / "package_throttle_count").exists():
                firsts.setdefault(self._text(cpu / "topology/physical_package_id") or cpu.name, counters)
            elif (counters / "core_throttle_count").exists():
                cores.append(counters / "core_throttle_count")
        return [c / "package_throttle_count" for c in firsts.values()] + cores

    # ---- Raspberry Pi throttled bits -------------------------------------------------------

    def _pi_flags(self) -> tuple[tuple[str, ...] | None, str | None]:
        """Firmware sysfs file (all bits), else hwmon (under-voltage only), else vcgencmd."""
        firmware = self._firmware_throttled()
        if firmware is not None:
            return firmware, "firmware"
        hwmon = self._hwmon_undervoltage()
        if hwmon is not None:
            return hwmon, "hwmon"
        vcgencmd = self._vcgencmd_throttled()
        if vcgencmd is not None:
            return vcgencmd, "vcgencmd"
        return None, None

    def _firmware_throttled(self) -> tuple[str, ...] | None:
        # soc/soc:firmware on the Pi 4; the glob also covers soc@<addr>/soc@<addr>:firmware.
        try:
            paths = sorted((self.root / _PLATFORM).glob("soc*/*firmware/get_throttled"))
        except OSError:
            return None
        for path in paths:
            value = self._int(path, base=16)
            if value is not None:
                return decode_throttled(value)
        return None

    def _hwmon_undervoltage(self) -> tuple[str, ...] | None:
        for hwmon in _numbered(self.root / _HWMON, "hwmon", self._problems):
            if self._text(hwmon / "name") == "rpi_volt":
                alarm = self._int(hwmon / "in0_lcrit_alarm")
                if alarm is None:
                    return None
                return ("under_voltage",) if alarm else ()
        return None

    def _vcgencmd_throttled(self) -> tuple[str, ...] | None:
        """Asks vcgencmd; the first failure is logged and vcgencmd is not asked again."""
        exe = shutil.which("vcgencmd") if self._vcgencmd_allowed else None
        if exe is None:
            return None
        try:
            done = subprocess.run(
                [exe, "get_throttled"], capture_output=True, text=True, timeout=_VCGENCMD_TIMEOUT_S, check=True
            )
            match = _VCGENCMD_OUT.search(done.stdout)
            if match is None:
                raise ValueError(f"unexpected output {done.stdout.strip()[:60]!r}")
        except (OSError, subprocess.SubprocessError, ValueError) as e:
            log.warning("vcgencmd get_throttled failed (%s); not asking it again", e)
            self._vcgencmd_allowed = False
            return None
        return decode_throttled(int(match.group(1), 16))
