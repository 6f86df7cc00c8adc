"""``edged thermal``: the board's readings and the state edged decides on them, once or every interval."""

from __future__ import annotations

import sys
import time
from typing import TextIO

from edged.config import ThermalConfig
from edged.thermal import ThermalReport, ThermalWatch, celsius, percent

# It waits longer than the daemon's loop: each file that hangs costs it `edged.thermal_background.SLOW_READ_S`,
# and it prints what it read.
CLI_READ_WAIT_S = 10.0


def _write_table(out: TextIO, report: ThermalReport, watch: ThermalWatch) -> None:
    snapshot = watch.last_snapshot
    cfg = watch.cfg
    out.write(
        f"state       {report.state}  rate {report.rate_factor:g}"
        f"{'  (hardware throttling)' if report.hardware_throttling else ''}\n"
    )
    out.write(f"board       {report.board}{f' ({report.model})' if report.model else ''}\n")
    out.write(f"{'ZONE':<18}{'TEMP':>9}  TRIPS\n")
    zones = snapshot.zones if snapshot else ()
    for zone in zones:
        temp = "offline" if zone.temp_c is None else celsius(zone.temp_c)
        trips = ", ".join(f"{t.temp_c:.1f}C {t.kind}" for t in zone.trips) or "-"
        if zone.alarm_only:
            temp, trips = "no temp", f"{trips}  (reads its level below its first alarm: left out)"
        out.write(f"{zone.name:<18}{temp:>9}  {trips}\n")
    if not zones:
        out.write("(no thermal zones)\n")
    th = report.thresholds
    out.write(
        f"thresholds  warm {celsius(th['warm'])}  throttled {celsius(th['throttled'])}  "
        f"critical {celsius(th['critical'])}  hysteresis {celsius(cfg.hysteresis_c)}"
        f"  ({watch.thresholds_source})\n"
    )
    judged_by = " and ".join(snapshot.cpufreq.judged_by) if snapshot and snapshot.cpufreq else ""
    out.write(
        f"cpufreq     cap {percent(report.freq_cap_ratio)}  cur {percent(report.freq_cur_ratio)}"
        f"{f'  (heat judged by {judged_by})' if judged_by else ''}\n"
    )
    if snapshot and snapshot.throttle_events is not None:
        out.write(
            f"throttle    began {snapshot.throttle_events} times since boot"
            "  (x86 thermal_throttle: a rise between readings is throttling)\n"
        )
    if snapshot and snapshot.pi_source:
        out.write(f"pi flags    {', '.join(report.throttled_flags) or 'none'}  ({snapshot.pi_source})\n")
    if report.power_mode:
        out.write(f"power mode  {report.power_mode}\n")
    if not cfg.enabled:
        out.write("note        thermal.enabled is false: the daemon ignores these readings\n")


def run_thermal_command(
    cfg: ThermalConfig, watch: bool, interval_s: float | None, out: TextIO = sys.stdout, iterations: int | None = None
) -> int:
    """``edged thermal``: print readings and state once, or every interval with ``--watch``."""
    thermal_watch = ThermalWatch(cfg, read_wait_s=CLI_READ_WAIT_S)
    interval = cfg.poll_interval_s if interval_s is None else interval_s
    done = 0
    try:
        while True:
            report = thermal_watch.poll()
            if watch:
                out.write(f"-- {time.strftime('%H:%M:%S')}\n")
            _write_table(out, report, thermal_watch)
            out.flush()
            done += 1
            if not watch or (iterations is not None and done >= iterations):
                return 0
            time.sleep(max(0.0, interval))
    except KeyboardInterrupt:
        return 0
