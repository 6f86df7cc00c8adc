"""``edged bench --cameras N``: N cameras served by one `edged run` against N `edged run`s side by side.

Each camera is 1280x720 at ``--camera-fps``: a synthetic source, or (``--camera-source video``)
an MJPG clip of rendered scenes decoded by OpenCV at its own pace, as a UVC camera's frames are.
The synthetic source renders every frame in Python and numpy on its capture thread, which holds
the interpreter lock in proportion to the frame rate where a real camera's decode (in OpenCV)
releases it; in one process that lock is shared with the inference loop, so the two sources
bracket what a camera costs the loop. For each arrangement the processes are
started, every camera's first detections message awaited, ``--warmup-s`` let pass, and then for
``--seconds`` every detections message is received on one SUB connected to every endpoint:
processed frames per second in total, each camera's frame age as a consumer sees it (its
receive time less the frame's capture time, both wall clock) at p50 and p99, CPU seconds per
processed frame (user + system time of the processes over the window, from /proc) and, at the
end, the processes' total RSS and PSS (PSS splits the pages they share, libraries included, so
it is the fairer sum for side-by-side processes). Linux only, as the daemon is.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Literal

import cv2
import numpy as np
import zmq

from edged.config import Spinning
from edged.errors import ColdStartError
from edged.messages import DetectionsMessage, parse_message
from edged.sources.scenes import SceneGenerator
from edged.tools import bench_process
from edged.tools.bench_config import write_config

ARRANGEMENTS = ("one process", "separate processes")
CameraKind = Literal["synthetic", "video"]
CLIP_FRAMES = 30  # scenes in the video clip, looped
FRAME_W, FRAME_H = 1280, 720
FIRST_MESSAGE_TIMEOUT_S = 120.0


def camera_ids(n: int) -> list[str]:
    return [f"cam{i}" for i in range(n)]


def write_clip(path: Path, fps: float) -> Path:
    """An MJPG clip of `CLIP_FRAMES` rendered 1280x720 scenes at ``fps``: what a UVC camera sends."""
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter.fourcc(*"MJPG"), fps, (FRAME_W, FRAME_H))
    scenes = SceneGenerator(FRAME_W, FRAME_H, seed=0)
    for index in range(CLIP_FRAMES):
        writer.write(scenes.render(index).image)
    writer.release()
    return path


def source_table(name: str, kind: CameraKind, fps: float, clip: Path) -> str:
    """One camera's ``[[source]]``: a synthetic source, or the clip decoded at its own pace."""
    if kind == "synthetic":
        seed = int(name.removeprefix("cam"))
        keys = f'type = "synthetic"\nwidth = {FRAME_W}\nheight = {FRAME_H}\nfps = {fps}\nseed = {seed}\n'
    else:
        keys = f'type = "file"\npath = {json.dumps(str(clip))}\nloop = true\nrealtime = true\n'
    return f'[[source]]\ncamera_id = "{name}"\n{keys}'


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` and its threads so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def memory_kb(pid: int) -> tuple[float, float]:
    """(RSS, PSS) of process ``pid`` in KB."""
    rollup = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines() if ":" in line)
    return float(rollup["Rss"].split()[0]), float(rollup["Pss"].split()[0])


def measure(
    model: Path,
    cameras: int,
    *,
    separate: bool,
    kind: CameraKind,
    fps: float,
    seconds: float,
    warmup_s: float,
    spinning: Spinning,
) -> dict[str, Any]:
    """One arrangement of ``cameras`` cameras: its throughput, frame ages, CPU per frame and memory."""
    names = camera_ids(cameras)
    groups = [[name] for name in names] if separate else [names]
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.RCVHWM, 100_000)
    sub.setsockopt(zmq.SUBSCRIBE, b"edged/detections/")
    children: list[subprocess.Popen[bytes]] = []
    env = {k: v for k, v in os.environ.items() if not k.startswith("EDGED_")}
    with tempfile.TemporaryDirectory(prefix="edged-cameras-") as tmp:
        clip = write_clip(Path(tmp) / "clip.avi", fps) if kind == "video" else Path(tmp)
        try:
            for i, group in enumerate(groups):
                endpoint = f"ipc://{tmp}/{i}.sock"
                tables = "".join(source_table(name, kind, fps, clip) for name in group)
                config = write_config(Path(tmp) / f"{i}.toml", model, endpoint, tables, spinning=spinning, thermal=False)
                sub.connect(endpoint)
                argv = [sys.executable, "-m", "edged", "run", "--config", str(config)]
                children.append(bench_process.start(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env))
            _await_cameras(sub, children, cameras)
            _receive(sub, children, warmup_s)
            cpu0 = sum(cpu_s(c.pid) for c in children)
            ages = _receive(sub, children, seconds)
            cpu1 = sum(cpu_s(c.pid) for c in children)
            rss, pss = (sum(values) for values in zip(*(memory_kb(c.pid) for c in children), strict=True))
        finally:
            for child in children:
                child.kill()
                child.wait()
            sub.close(linger=0)
            context.term()
    frames = sum(len(a) for a in ages.values())
    return {
        "arrangement": ARRANGEMENTS[separate],
        "camera_kind": kind,
        "cameras": cameras,
        "processes": len(groups),
        "fps_total": frames / seconds,
        "cameras_fps": {name: len(ages.get(name, [])) / seconds for name in names},
        "age_p50_ms": {name: float(np.percentile(ages[name], 50)) if ages.get(name) else None for name in names},
        "age_p99_ms": {name: float(np.percentile(ages[name], 99)) if ages.get(name) else None for name in names},
        "cpu_s_per_frame": (cpu1 - cpu0) / frames if frames else None,
        "rss_mb": rss / 1024,
        "pss_mb": pss / 1024,
    }


def _await_cameras(sub: zmq.Socket[bytes], children: list[subprocess.Popen[bytes]], cameras: int) -> None:
    """Until every camera has published (each process loads its model and draws its scenes first)."""
    seen = _receive(sub, children, FIRST_MESSAGE_TIMEOUT_S, cameras)
    if len(seen) < cameras:
        raise ColdStartError(
            f"bench --cameras: only {len(seen)} of {cameras} cameras published in {FIRST_MESSAGE_TIMEOUT_S:.0f} s"
        )


def _receive(
    sub: zmq.Socket[bytes], children: list[subprocess.Popen[bytes]], limit_s: float, cameras: int | None = None
) -> dict[str, list[float]]:
    """Frame ages (ms) by camera of the detections received for ``limit_s``, or until ``cameras`` have published."""
    ages: dict[str, list[float]] = {}
    deadline = time.monotonic() + limit_s
    while (cameras is None or len(ages) < cameras) and (left := deadline - time.monotonic()) > 0:
        if any(child.poll() is not None for child in children):
            raise ColdStartError(f"bench --cameras: edged run exited with {[c.poll() for c in children]}")
        if sub.poll(int(min(left, 0.2) * 1000) + 1):
            msg = parse_message(sub.recv_multipart()[1])
            received_ns = time.time_ns()
            if isinstance(msg, DetectionsMessage):
                ages.setdefault(msg.camera_id, []).append((received_ns - msg.capture_time_ns) / 1e6)
    return ages


def run_cameras(
    model: Path,
    counts: list[int],
    *,
    kind: CameraKind,
    fps: float,
    seconds: float,
    warmup_s: float,
    spinning: Spinning,
    repeat: int = 1,
) -> list[dict[str, Any]]:
    """Both arrangements for each camera count (one process alone when there is one camera),
    ``repeat`` times, interleaved so that a change in the machine's load falls on both; each row
    says which ``run`` it is."""
    return [
        measure(model, n, separate=separate, kind=kind, fps=fps, seconds=seconds, warmup_s=warmup_s, spinning=spinning)
        | {"run": run}
        for run in range(repeat)
        for n in counts
        for separate in ((False, True) if n > 1 else (False,))
    ]


def format_rows(model_name: str, kind: CameraKind, fps: float, rows: list[dict[str, Any]]) -> str:
    """The rows as a table, one line per arrangement: totals and the worst camera's p99 frame age,
    each the median over the runs; with several runs, the worst p99's range beside it (frame
    ages from a shared machine vary from run to run by more than arrangements differ)."""
    what = "synthetic" if kind == "synthetic" else "MJPG video"
    runs = len({r["run"] for r in rows})
    lines = [
        f"edged bench --cameras: {model_name}, {what} {FRAME_W}x{FRAME_H} cameras at {fps:g} fps each"
        + (f", median of {runs} runs" if runs > 1 else ""),
        "",
        "cameras  arrangement            fps total  age p50 ms  age p99 ms (worst)  CPU ms/frame  RSS MB  PSS MB",
    ]
    nan = float("nan")
    groups: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["cameras"], r["arrangement"]), []).append(r)
    for (cameras, arrangement), group in groups.items():
        p50s = [float(np.median(p50)) for r in group if (p50 := [v for v in r["age_p50_ms"].values() if v is not None])]
        p99s = [max(p99) for r in group if (p99 := [v for v in r["age_p99_ms"].values() if v is not None])]
        cpus = [r["cpu_s_per_frame"] * 1000 for r in group if r["cpu_s_per_frame"]]
        worst = f"{_median(p99s):.1f}" + (f" [{min(p99s):.0f}-{max(p99s):.0f}]" if len(p99s) > 1 else "") if p99s else nan
        lines.append(
            f"{cameras:7d}  {arrangement:<20}{_median([r['fps_total'] for r in group]):11.1f}  {_median(p50s):10.1f}"
            f"  {worst:>18}  {_median(cpus):12.1f}"
            f"  {_median([r['rss_mb'] for r in group]):6.0f}  {_median([r['pss_mb'] for r in group]):6.0f}"
        )
    return "\n".join(lines)


def _median(values: list[float]) -> float:
    return float(np.median(values)) if values else float("nan")
