"""``edged bench --reject``: how late the reject line's pulses start, idle and with every core busy.

The real `edged.reject.RejectLine` (its line process) fires NG parts handed to it at a camera's
pace, on a ``gpio-sim`` chip through the real binding where the kernel has it (configfs, root),
otherwise on a line that drives nothing at the ``gpiod`` boundary (`edged.reject.RecordingRequest`).
Lateness is each pulse's start, as its ``set_value`` returns, minus its target (capture +
``delay_ms``), as the line's status reports it. Three loads: idle; every core busy (a spinning
process per core); and the same with a Python thread of this process spinning too, which holds
the interpreter lock as the loop's Python work does (the line process has a lock of its own).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

from edged.reject import RejectLine
from edged.settings.reject import RejectConfig
from edged.tools import bench_process

Load = Literal["idle", "cores busy", "cores + GIL busy"]
LOADS: tuple[Load, ...] = ("idle", "cores busy", "cores + GIL busy")
DELAY_MS = 20.0
PULSE_MS = 5.0
PART_INTERVAL_S = 0.02  # 50 parts a second: a fast belt
GPIO_SIM = Path("/sys/kernel/config/gpio-sim")


@contextlib.contextmanager
def _sim_chip() -> Iterator[str | None]:
    """A one-line gpio-sim chip's /dev path, or None where the kernel has no gpio-sim or edged may not make one."""
    if not GPIO_SIM.is_dir() or not os.access(GPIO_SIM, os.W_OK):
        yield None
        return
    try:
        import gpiod  # noqa: F401
    except ImportError:
        yield None
        return
    device = GPIO_SIM / f"edged-bench-{uuid.uuid4().hex[:8]}"
    bank = device / "bank0"
    bank.mkdir(parents=True)
    try:
        (bank / "num_lines").write_text("1")
        (device / "live").write_text("1")
        yield f"/dev/{(bank / 'chip_name').read_text().strip()}"
    finally:
        (device / "live").write_text("0")
        bank.rmdir()
        device.rmdir()


@contextlib.contextmanager
def _load(load: Load) -> Iterator[None]:
    """``load`` while the block runs: a spinning process per core, and a spinning thread here."""
    burners = [] if load == "idle" else [_burner() for _ in range(os.cpu_count() or 1)]
    stop = threading.Event()
    spinner = threading.Thread(target=_spin, args=(stop,), daemon=True) if load == "cores + GIL busy" else None
    if spinner is not None:
        spinner.start()
    try:
        yield
    finally:
        stop.set()
        if spinner is not None:
            spinner.join()
        for burner in burners:
            burner.kill()
            burner.wait()


def _burner() -> subprocess.Popen[bytes]:
    return bench_process.start([sys.executable, "-c", "while True: pass"])


def _spin(stop: threading.Event) -> None:
    n = 0
    while not stop.is_set():
        n += 1


def reject_lateness(chip: str | None, load: Load, parts: int) -> dict[str, Any]:
    """Fire ``parts`` NG parts under ``load`` and time each pulse's start against its target."""
    cfg = RejectConfig(chip=chip or "recording", line=0, delay_ms=DELAY_MS, pulse_ms=PULSE_MS)
    with _load(load):
        line = RejectLine("bench", cfg, record=chip is None)
        try:
            next_s = time.monotonic()
            for _ in range(parts):
                t = time.monotonic_ns()
                line.expect(t)
                line.resolve(t, "ng", time.monotonic_ns())
                next_s += PART_INTERVAL_S
                time.sleep(max(0.0, next_s - time.monotonic()))
            deadline = time.monotonic() + 10
            while (r := line.report()).pulses + r.merged < parts and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            line.stop()
    report = line.report()
    return {
        "load": load,
        "line": "gpio-sim" if chip is not None else "recording",
        "realtime": line.realtime,
        "parts": parts,
        "pulses": report.pulses,
        "merged": report.merged,
        "lateness_ms": {"p50": report.lateness_p50_ms, "p99": report.lateness_p99_ms, "max": report.lateness_max_ms},
    }


def run_reject_bench(parts: int) -> list[dict[str, Any]]:
    """Every load, on gpio-sim where there is one, else on the recording line."""
    with _sim_chip() as chip:
        return [reject_lateness(chip, load, parts) for load in LOADS]


def format_reject(rows: list[dict[str, Any]]) -> str:
    first = rows[0]
    lines = [
        f"reject line ({first['line']}): {first['parts']} NG parts at {1 / PART_INTERVAL_S:g} a second, "
        f"delay_ms {DELAY_MS:g}, pulse_ms {PULSE_MS:g}, {os.cpu_count()} CPUs; pulse start minus target"
    ]
    for r in rows:
        late = r["lateness_ms"]
        lines.append(
            f"  {r['load']:<16} p50 {late['p50']:.3f} ms  p99 {late['p99']:.3f} ms  max {late['max']:.3f} ms  "
            f"({r['pulses']} pulses, {r['merged']} merged; {'SCHED_FIFO' if r['realtime'] else 'normal scheduling'})"
        )
    return "\n".join(lines)
