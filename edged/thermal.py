"""Thermal policy: turns the readings of ``edged.thermal_readers`` into a state and a frame rate.

This module owns the thresholds (config, else derived from trip points or per-board defaults),
the state machine with hysteresis, and the report published in status messages (``edged thermal``
prints it: `edged.thermal_command`).

States, coolest first: ``unknown`` (no readable zone), ``ok``, ``warm``, ``throttled``,
``critical``. The state is at least ``throttled`` whenever the hardware says it is throttling
(Pi firmware bits, a cpufreq ceiling heat lowered, or x86 throttle counters rising:
`edged.thermal_readers`), whatever the temperatures. Stepping up is immediate; stepping down waits
until the hottest zone is more than ``hysteresis_c`` below the threshold of the state being left
and the hardware flag has cleared, so a reading hovering at a threshold cannot flap. A big drop may
step down several states at once.

What a sensor says is weighed first: a reading that jumps faster than a chip heats waits for the
next to say so too, a zone that misses a reading keeps its last one a while, and hardware throttling
holds until it has been off for `HARDWARE_CLEAR_S` (a cooling device flaps the clock at its trip).
The board is read off the caller's thread (`edged.thermal_background`): a sensor that hangs holds
no poll up.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from edged.config import ThermalConfig
from edged.messages import ThermalState
from edged.thermal_background import SLOW_READ_S, Background
from edged.thermal_readers import THROTTLING_NOW, BoardFamily, Snapshot, SysReader, Zone

log = logging.getLogger(__name__)


_RANK: dict[str, int] = {"unknown": 0, "ok": 1, "warm": 2, "throttled": 3, "critical": 4}
_LEVELS: tuple[ThermalState, ...] = ("warm", "throttled", "critical")

# A cpufreq ceiling below this fraction of the hardware (or power-mode) maximum is a cap.
FREQ_CAP_THROTTLED = 0.95

# Pi firmware throttles from 80 C and hard-limits at 85 C whatever the kernel trips say (the
# Raspberry Pi kernel raises cpu-crit to 110 C), so Pi thresholds never come from trip points.
_BOARD_DEFAULTS: dict[BoardFamily, tuple[float, float, float]] = {
    "raspberrypi": (70.0, 80.0, 85.0),
    "jetson": (80.0, 90.0, 97.0),
    "generic": (75.0, 85.0, 95.0),
}
# Trip-point derivation: pause this far below the first critical/hot trip, throttle at the
# first passive trip below that (else this far below critical), warm this far below throttled.
_CRITICAL_BELOW_TRIP_C = 7.5
_THROTTLED_BELOW_CRITICAL_C = 7.5
_WARM_BELOW_THROTTLED_C = 10.0
# Trip points outside this range are placeholders (x86_pkg_temp exposes 0 C passive trips).
_PLAUSIBLE_TRIP_C = (40.0, 150.0)
# A chip shuts down at 85 C or above (x86 packages 100+, Jetson 96+, Rockchip and i.MX 95+): a zone whose
# critical or hot trip is lower is a skin, battery or board sensor, and its trips say nothing of the chip's.
_CHIP_SHUTDOWN_MIN_C = 85.0
# Spacing kept between a configured threshold and a default one pushed out of its way.
_MIN_GAP_C = 2.0
# A poll waits this long for the board's files (a few milliseconds where they answer; 400 zones take
# 50 ms here): past it the daemon's loop goes on with the last readings (`edged.thermal_background`).
# The first, before anything was read, waits up to `SLOW_READ_S`.
READ_WAIT_S = 0.05
# With no reading finished for this long (or three polls, if longer), the state is unknown.
STALE_AFTER_S = 30.0
# Hardware throttling (a cpufreq cap, the Pi's bits) counts until it has been off this long: a
# cooling device lowers and raises the clock every second or two while a zone sits at its trip.
HARDWARE_CLEAR_S = 10.0
# A zone rising this much, this fast, between two readings is not a chip heating (silicon warms a
# few degrees a second at most): a glitch of the sensor, or its bus, until the next reading says so too.
JUMP_C = 20.0
JUMP_C_PER_S = 5.0
JUMP_LOG_S = 60.0
# A zone that gives no reading keeps its last one this long: a sensor that misses a reading now and
# then (a busy I2C bus) moves neither the state nor the rate.
ZONE_HOLD_S = 10.0


@dataclass(frozen=True)
class ThermalReport:
    """One poll's readings and decision; ``zones`` omits offline sensors."""

    state: ThermalState
    board: str
    zones: dict[str, float]
    hottest_c: float | None
    freq_cap_ratio: float | None
    throttled_flags: tuple[str, ...]
    rate_factor: float
    thresholds: dict[str, float]
    model: str | None = None
    freq_cur_ratio: float | None = None
    power_mode: str | None = None
    hardware_throttling: bool = False

    def summary(self) -> str:
        """One short line for systemd's STATUS=, e.g. ``thermal warm 72.3C rate 0.5``."""
        parts = ["thermal", self.state]
        if self.hottest_c is not None:
            parts.append(f"{self.hottest_c:.1f}C")
        if self.freq_cap_ratio is not None and self.freq_cap_ratio < FREQ_CAP_THROTTLED:
            parts.append(f"cap {self.freq_cap_ratio:.0%}")
        active = [f for f in self.throttled_flags if not f.endswith("_occurred")]
        if active:
            parts.append(",".join(active))
        if self.state == "critical":
            parts.append("paused")
        elif self.rate_factor < 1.0:
            parts.append(f"rate {self.rate_factor:g}")
        return " ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form for the status message."""

        def ratio(v: float | None) -> float | None:
            return None if v is None else round(v, 3)

        return {
            "state": self.state,
            "board": self.board,
            "model": self.model,
            "zones": dict(self.zones),
            "hottest_c": self.hottest_c,
            "freq_cap_ratio": ratio(self.freq_cap_ratio),
            "freq_cur_ratio": ratio(self.freq_cur_ratio),
            "throttled_flags": list(self.throttled_flags),
            "hardware_throttling": self.hardware_throttling,
            "rate_factor": self.rate_factor,
            "thresholds": dict(self.thresholds),
            "power_mode": self.power_mode,
        }


# ---- thresholds -------------------------------------------------------------------------------


def _thresholds_from_trips(zones: tuple[Zone, ...]) -> tuple[float, float, float] | None:
    low, high = _PLAUSIBLE_TRIP_C
    chips = [
        z for z in zones if any(t.kind in ("critical", "hot") and _CHIP_SHUTDOWN_MIN_C <= t.temp_c <= high for t in z.trips)
    ]
    trips = [t for z in chips for t in z.trips if low <= t.temp_c <= high]
    shutdown = [t.temp_c for t in trips if t.kind in ("critical", "hot")]
    if not shutdown:
        return None
    critical = min(shutdown) - _CRITICAL_BELOW_TRIP_C
    passive = [t.temp_c for t in trips if t.kind == "passive" and t.temp_c < critical]
    throttled = min(passive) if passive else critical - _THROTTLED_BELOW_CRITICAL_C
    return throttled - _WARM_BELOW_THROTTLED_C, throttled, critical


def _base_thresholds(family: BoardFamily, zones: tuple[Zone, ...]) -> tuple[tuple[float, float, float], str]:
    if family != "raspberrypi":
        derived = _thresholds_from_trips(zones)
        if derived is not None:
            return derived, "trip points"
    return _BOARD_DEFAULTS[family], f"{family} default"


def _between(value: float, lo: float | None, hi: float | None) -> float:
    """``value`` if it lies strictly between the configured neighbours, else a spot that does."""
    if lo is not None and hi is not None and not lo < value < hi:
        return (lo + hi) / 2
    if lo is not None and value <= lo:
        return lo + _MIN_GAP_C
    if hi is not None and value >= hi:
        return hi - _MIN_GAP_C
    return value


def resolve_thresholds(cfg: ThermalConfig, family: BoardFamily, zones: tuple[Zone, ...]) -> tuple[dict[str, float], str]:
    """Configured thresholds win; defaults fill the gaps, moved aside to keep warm < throttled < critical.

    Returns the thresholds and where they came from, for the ``edged thermal`` table.
    """
    (base_warm, base_throttled, base_critical), source = _base_thresholds(family, zones)
    throttled = cfg.throttled_c
    if throttled is None:
        throttled = _between(base_throttled, cfg.warm_c, cfg.critical_c)
    warm = cfg.warm_c if cfg.warm_c is not None else min(base_warm, throttled - _MIN_GAP_C)
    critical = cfg.critical_c if cfg.critical_c is not None else max(base_critical, throttled + _MIN_GAP_C)
    explicit = [v is not None for v in (cfg.warm_c, cfg.throttled_c, cfg.critical_c)]
    if all(explicit):
        source = "config"
    elif any(explicit):
        source = f"config + {source}"
    return {"warm": warm, "throttled": throttled, "critical": critical}, source


# ---- state machine ----------------------------------------------------------------------------


def _temperature_level(temp_c: float, thresholds: dict[str, float]) -> ThermalState:
    level: ThermalState = "ok"
    for name in _LEVELS:
        if temp_c >= thresholds[name]:
            level = name
    return level


def _hotter(a: ThermalState, b: ThermalState) -> ThermalState:
    return a if _RANK[a] >= _RANK[b] else b


def next_state(
    current: ThermalState,
    hottest_c: float | None,
    hardware_throttling: bool,
    thresholds: dict[str, float],
    hysteresis_c: float,
) -> ThermalState:
    """One step of the state machine: up at once, down only past the hysteresis band."""
    if hottest_c is None:
        return "throttled" if hardware_throttling else "unknown"
    target = _temperature_level(hottest_c, thresholds)
    if hardware_throttling:
        target = _hotter(target, "throttled")
    if current == "unknown" or _RANK[target] >= _RANK[current]:
        return target
    # Each state at or below the current one holds until the hottest zone is more than
    # hysteresis_c below its threshold.
    held = _temperature_level(hottest_c + hysteresis_c, thresholds)
    return _hotter(target, held if _RANK[held] < _RANK[current] else current)


def rate_factor(cfg: ThermalConfig, state: ThermalState) -> float:
    """Fraction of the full frame rate allowed; 0 pauses inference (status keeps publishing)."""
    return {"warm": cfg.warm_rate, "throttled": cfg.throttled_rate, "critical": 0.0}.get(state, 1.0)


def _zone_temps(zones: tuple[Zone, ...]) -> dict[str, float]:
    """Online zones by name; a repeated name (two acpitz zones) gets its position appended."""
    temps: dict[str, float] = {}
    for index, zone in enumerate(zones):
        if zone.temp_c is None:
            continue
        name = zone.name if zone.name not in temps else f"{zone.name}#{index}"
        temps[name] = zone.temp_c
    return temps


def _hardware_throttling(snapshot: Snapshot, throttle_events_before: int | None) -> bool:
    """Whether this reading shows throttling. An x86 CPU throttling itself at its own limit (PROCHOT, a TCC
    offset) lowers no cpufreq ceiling: its throttle counters rising since the reading before say it."""
    cap = snapshot.cpufreq.cap_ratio if snapshot.cpufreq else None
    pi_now = bool(THROTTLING_NOW.intersection(snapshot.pi_flags or ()))
    events = snapshot.throttle_events
    x86_now = events is not None and throttle_events_before is not None and events > throttle_events_before
    return pi_now or x86_now or (cap is not None and cap < FREQ_CAP_THROTTLED)


class ThermalWatch:
    """Reads the board once per :meth:`poll` and keeps the state across polls.

    ``cfg.enabled`` is the daemon's switch for creating a watch at all; a watch always reads. The
    reading runs off the caller's thread (`edged.thermal_background`): a poll waits ``read_wait_s``
    at most, and otherwise returns the last report, which after `STALE_AFTER_S` is ``unknown``.
    """

    cfg: ThermalConfig

    def __init__(
        self,
        cfg: ThermalConfig,
        read_wait_s: float = READ_WAIT_S,
        clock: Callable[[], float] = time.monotonic,
        previous: ThermalWatch | None = None,
    ) -> None:
        """``previous``: the watch a reload replaces. Of the same board, its state, what its sensors said
        and the reading in flight go on here, so that a reload neither lets a board inside a hysteresis
        band step down nor logs a start."""
        if previous is not None and (previous.cfg.root, previous.cfg.use_vcgencmd) == (cfg.root, cfg.use_vcgencmd):
            vars(self).update(vars(previous))
            self.cfg, self._read_wait_s, self._clock = cfg, read_wait_s, clock
            return
        self.cfg = cfg
        self._reader = SysReader(cfg.root, cfg.use_vcgencmd)
        self._background = Background(self._reader.slow_files, self._reader.read)
        self._read_wait_s = read_wait_s
        self._clock = clock
        self._state: ThermalState | None = None
        self._report: ThermalReport | None = None
        self._read_at = clock()
        self._hardware_at: float | None = None  # when hardware throttling was last seen
        self._throttle_events: int | None = None  # the x86 throttle counters' sum at the last reading
        self._temps: dict[str, tuple[float, float]] = {}  # zone: (accepted reading, when)
        self._jumped: set[str] = set()
        self._said_waiting = False
        self._jump_said: dict[str, float] = {}  # a zone that glitches every few readings: a line a minute
        self.last_snapshot: Snapshot | None = None
        self.thresholds_source = ""

    def poll(self) -> ThermalReport:
        """Read everything, advance the state machine and return the report; never raises."""
        snapshot = self._background.take(self._read_wait_s if self._report else max(self._read_wait_s, SLOW_READ_S))
        now = self._clock()
        if snapshot is None:
            return self._held(now)
        self._read_at = now
        thresholds, self.thresholds_source = resolve_thresholds(self.cfg, snapshot.family, snapshot.zones)
        zones = self._plausible(_zone_temps(snapshot.zones), now)
        hottest = max(zones.values()) if zones else None
        if _hardware_throttling(snapshot, self._throttle_events):
            self._hardware_at = now
        self._throttle_events = snapshot.throttle_events  # None (counters found again): no rise to the next
        hw = self._hardware_at is not None and now - self._hardware_at < HARDWARE_CLEAR_S
        previous = self._state
        state = next_state(previous or "unknown", hottest, hw, thresholds, self.cfg.hysteresis_c)
        self.last_snapshot = snapshot
        cpufreq = snapshot.cpufreq
        report = ThermalReport(
            state=state,
            board=snapshot.family,
            zones=zones,
            hottest_c=hottest,
            freq_cap_ratio=cpufreq.cap_ratio if cpufreq else None,
            throttled_flags=snapshot.pi_flags or (),
            rate_factor=rate_factor(self.cfg, state),
            thresholds=thresholds,
            model=snapshot.model,
            freq_cur_ratio=cpufreq.cur_ratio if cpufreq else None,
            power_mode=snapshot.power_mode.name if snapshot.power_mode else None,
            hardware_throttling=hw,
        )
        return self._decided(previous, report)

    def _decided(self, previous: ThermalState | None, report: ThermalReport) -> ThermalReport:
        self._state, self._report = report.state, report
        if report.state != previous:
            _log_change(previous, report)
        return report

    def _held(self, now: float) -> ThermalReport:
        """The last report while the reading in flight is not too old, else one of state ``unknown``."""
        stale_s = max(STALE_AFTER_S, 3 * self.cfg.poll_interval_s, 2 * SLOW_READ_S)
        last = self._report
        if last is None:
            if not self._said_waiting:
                log.info("the board's first thermal reading has not finished yet: thermal state unknown until it has")
            self._said_waiting = True
            return ThermalReport(
                "unknown", "generic", {}, None, None, (), 1.0, resolve_thresholds(self.cfg, "generic", ())[0]
            )
        if now - self._read_at < stale_s or (last.state == "unknown" and not last.zones):
            return last
        log.warning("no thermal reading has finished for %.0f s: the board's files do not answer", now - self._read_at)
        return self._decided(self._state, ThermalReport("unknown", last.board, {}, None, None, (), 1.0, last.thresholds))

    def _plausible(self, zones: dict[str, float], now: float) -> dict[str, float]:
        """Each zone's reading, but one that jumped (`JUMP_C`) taken as the one before until the next confirms it."""
        for name, temp in zones.items():
            before = self._temps.get(name)
            rise = temp - before[0] if before else 0.0
            if before and rise >= JUMP_C and rise >= JUMP_C_PER_S * (now - before[1]) and name not in self._jumped:
                if now - self._jump_said.get(name, now - JUMP_LOG_S) >= JUMP_LOG_S:
                    self._jump_said[name] = now
                    log.warning(
                        "thermal zone %s jumped from %.1fC to %.1fC in %.1f s, faster than a chip heats: taken as %.1fC "
                        "unless the next reading says so too (a broken sensor, then, pauses inference at critical)",
                        name, before[0], temp, now - before[1], before[0],
                    )  # fmt: skip
                self._jumped.add(name)
                zones[name] = before[0]
                continue
            self._jumped.discard(name)
            self._temps[name] = (temp, now)
        for gone in set(self._temps) - set(zones):
            if now - self._temps[gone][1] < ZONE_HOLD_S:
                zones[gone] = self._temps[gone][0]
            else:
                del self._temps[gone]
        return zones


def reloaded_watch(
    cfg: ThermalConfig, watch: ThermalWatch | None, report: ThermalReport | None
) -> tuple[ThermalWatch | None, ThermalReport | None]:
    """The watch and the last report once a reload's ``[thermal]`` takes over: off, neither (a report
    kept would hold a warm board's rate cap, or a critical one's pause, until a restart); on, the watch
    going on from ``watch`` (`ThermalWatch`'s ``previous``) with ``report`` until its next poll."""
    if not cfg.enabled:
        return None, None
    return ThermalWatch(cfg, previous=watch), report


def _log_change(previous: ThermalState | None, report: ThermalReport) -> None:
    """WARNING on every change; the first reading is INFO unless it is already a problem."""
    hottest_zone = max(report.zones, key=report.zones.__getitem__) if report.zones else "none"
    level = logging.WARNING
    if previous is None and report.state in ("ok", "unknown"):
        level = logging.INFO
    extra: dict[str, Any] = {
        "THERMAL_STATE": report.state,
        "THERMAL_BOARD": report.board,
        "THERMAL_RATE": report.rate_factor,
    }
    if previous is not None:
        extra["THERMAL_PREVIOUS_STATE"] = previous
    if report.hottest_c is not None:
        extra["TEMP_C"] = report.hottest_c
        extra["THERMAL_ZONE"] = hottest_zone
    if report.freq_cap_ratio is not None:
        extra["FREQ_CAP_RATIO"] = round(report.freq_cap_ratio, 3)
    if report.throttled_flags:
        extra["THROTTLED_FLAGS"] = ",".join(report.throttled_flags)
    log.log(
        level,
        "thermal state %s -> %s on %s: hottest %s (%s), freq cap %s, flags %s, rate %g%s",
        previous or "start",
        report.state,
        report.board,
        celsius(report.hottest_c),
        hottest_zone,
        percent(report.freq_cap_ratio),
        ",".join(report.throttled_flags) or "none",
        report.rate_factor,
        ", hardware throttling" if report.hardware_throttling else "",
        extra=extra,
    )


def celsius(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}C"


def percent(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0%}"
