"""How many inference threads fit the CPUs this process may run on.

ONNX Runtime's default thread count (``intra_op_num_threads = 0``) is one thread per physical
core of the whole machine, each pinned to its core, whatever CPUs the process was given. Under
systemd's ``CPUAffinity=`` (or ``taskset``) its workers pin themselves onto the cores the
administrator kept for something else, such as a second edged instance or the camera; under
``AllowedCPUs=`` or a container's cpuset the pinning fails (ORT logs ``pthread_setaffinity_np
failed``) and the threads crowd onto the allowed CPUs, which nearly doubled the demo model's
inference time on one of two CPUs. So when the process may not use every online CPU, edged
counts the physical cores among its own CPUs and passes that number; ORT pins no thread whose
count it was given, so they stay inside the process's CPUs.

Several inference lanes (`edged.lanes`) run at once on the session's one thread pool, each on
its own thread as well as the pool's: ``n`` threads for ``k`` lanes keep ``n - 1 + k`` busy. The
default then gives the pool one thread per physical core less the extra lanes, so the lanes and
the pool together fill the cores once. On two cores, two lanes of a model that kept the board
busy served 20.0 fps with a p99 frame age of 193 ms this way, against 16.2 fps and 381 ms with
the pool's two threads on top (BENCHMARKS.md, Several cameras).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

SYSFS_CPU = Path("/sys/devices/system/cpu")


@dataclass(frozen=True, slots=True)
class ThreadPlan:
    """The intra-op thread count to give ONNX Runtime, and what to say about it."""

    intra_op_threads: int  # 0 leaves ORT's own default
    summary: str  # for `edged check` and the start log
    warning: str | None = None  # a configured count the CPUs cannot hold


def plan_threads(
    configured: int, cpus: frozenset[int] | None = None, sysfs: Path = SYSFS_CPU, *, lanes: int = 1
) -> ThreadPlan:
    """The thread count for ``runtime.intra_op_threads`` on ``cpus`` (default: this process's),
    for a session that runs on ``lanes`` threads at once."""
    cpus = allowed_cpus() if cpus is None else cpus
    if not cpus:
        return ThreadPlan(configured, f"{configured or 'ONNX Runtime default'} (this process's CPUs are unknown)")
    online = online_cpus(sysfs) or cpus
    restricted = not online <= cpus
    listed = f"{format_cpus(cpus)} of {format_cpus(online)}" if restricted else format_cpus(cpus)
    if configured == 0:
        if lanes > 1:
            cores = physical_cores(cpus, sysfs)
            threads = max(1, cores - lanes + 1)
            crowded = (
                f"runtime.inference_lanes = {lanes} on {cores} physical core(s) ({listed}): the lanes beyond the "
                f"cores only take turns on them, each frame slower; set at most {cores}"
                if lanes > cores
                else None
            )
            summary = f"{threads}, with {lanes} inference lanes on the {cores} physical core(s) of CPUs {listed}"
            return ThreadPlan(threads, summary, warning=crowded)
        if not restricted:
            return ThreadPlan(0, f"ONNX Runtime default, one per physical core of CPUs {listed}")
        cores = physical_cores(cpus, sysfs)
        return ThreadPlan(cores, f"{cores}, one per physical core of the CPUs this process may use ({listed})")
    summary = f"{configured}, as configured; this process may use CPUs {listed}"
    if configured - 1 + lanes <= len(cpus):
        return ThreadPlan(configured, summary)
    return ThreadPlan(
        configured,
        summary,
        warning=(
            f"runtime.intra_op_threads = {configured}{f' with {lanes} inference lanes' if lanes > 1 else ''} but this "
            f"process may use only {len(cpus)} CPU(s) ({listed}): the threads share them and every inference waits "
            "for the slowest; set 0 for one per physical core"
        ),
    )


def allowed_cpus() -> frozenset[int] | None:
    """The CPUs this process may run on (affinity and cpuset both narrow it); None where unknown."""
    getaffinity = getattr(os, "sched_getaffinity", None)
    if getaffinity is None:
        return None
    try:
        return frozenset(getaffinity(0))
    except OSError:
        return None


def online_cpus(sysfs: Path = SYSFS_CPU) -> frozenset[int] | None:
    return _read_cpus(sysfs / "online")


def physical_cores(cpus: Iterable[int], sysfs: Path = SYSFS_CPU) -> int:
    """Distinct cores among ``cpus``: SMT siblings count once; a CPU without topology is its own."""
    cores = {_read_cpus(sysfs / f"cpu{cpu}" / "topology" / "thread_siblings_list") or frozenset({cpu}) for cpu in cpus}
    return max(1, len(cores))


def parse_cpus(text: str) -> frozenset[int]:
    """The kernel's CPU list format, e.g. ``0-3,6``; raises ValueError on anything else."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        first, dash, last = part.partition("-")
        lo, hi = int(first), int(last if dash else first)
        if not 0 <= lo <= hi:
            raise ValueError(f"not a CPU range: {part!r}")
        cpus.update(range(lo, hi + 1))
    return frozenset(cpus)


def format_cpus(cpus: Iterable[int]) -> str:
    """The kernel's CPU list format, ranges collapsed: {0, 1, 2, 5} -> ``0-2,5``."""
    runs: list[list[int]] = []
    for cpu in sorted(cpus):
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in runs)


def _read_cpus(path: Path) -> frozenset[int] | None:
    try:
        return parse_cpus(path.read_text())
    except (OSError, ValueError):
        return None
