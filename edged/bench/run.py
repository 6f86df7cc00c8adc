"""The per-frame benchmark behind ``edged bench``: which rows run, in what order, and the figures.

This module owns the measurement plan and its result types; `edged.bench` turns a result into
the table or JSON. The rows themselves live in `edged.bench.rows`, memory figures in
`edged.bench.memory`.

Method: one process; rows interleaved (floor, full, naive, floor, ...) after a warm-up, on one
1280x720 scene frame, all on the engine's one session; medians and p99 from the interleaved
samples; CPU time per frame from a separate non-interleaved block per row, since process CPU
time cannot be split between interleaved rows.
"""

from __future__ import annotations

import os
import platform
import resource
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import onnxruntime as ort

from edged.bench.memory import Allocations, measure_allocations
from edged.bench.rows import (
    STAGES,
    CpuBlock,
    FloorPath,
    FullPath,
    NaivePath,
    Row,
    Sample,
    candidates_above,
    cpu_block,
    interleave,
    naive_unsupported,
    time_alone,
)
from edged.config import ModelConfig, RuntimeConfig, Spinning
from edged.cpus import online_cpus, physical_cores
from edged.model import LoadedModel, load_model
from edged.scenes import SceneGenerator


@dataclass(frozen=True, slots=True)
class Timing:
    median_ms: float
    p99_ms: float

    @classmethod
    def of(cls, ms: np.ndarray | list[float]) -> Timing:
        values = np.asarray(ms, float)
        return cls(float(np.median(values)), float(np.percentile(values, 99)))


@dataclass(frozen=True, slots=True)
class RowResult:
    latency: Timing
    cpu_ms_per_frame: float
    cores_busy: float
    stages: dict[str, Timing] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class SpinResult:
    """All rows under one ``runtime.spinning`` setting."""

    spinning: Spinning
    rows: dict[str, RowResult]
    full_over_floor: float
    naive_over_floor: float | None
    overhead_ms: float  # median(full) - median(floor)
    paired_overhead_ms: float  # median of per-frame differences, robust to drift
    messages_sent: int
    messages_received: int


@dataclass(frozen=True, slots=True)
class Alone:
    """Preprocess and decode + NMS each alone in a tight loop, as their targets are stated."""

    preprocess: Timing
    decode: Timing
    frame_size: tuple[int, int]
    input_size: tuple[int, int]
    candidates: int | None  # anchors at or above conf that decode and NMS see
    anchors: int
    detections: int


@dataclass(frozen=True, slots=True)
class BenchResult:
    machine: dict[str, Any]
    model: dict[str, Any]
    settings: dict[str, Any]
    runs: list[SpinResult]
    alone: Alone
    allocations: Allocations
    detections_match: bool | None
    naive_skipped: str | None
    peak_rss_kb: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def machine_info() -> dict[str, Any]:
    """CPU model from /proc/cpuinfo ("model name" on x86, "Model" on a Raspberry Pi); cores from sysfs."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = (part.strip() for part in line.partition(":"))
            if key in ("model name", "Model"):
                cpu = value
    except OSError:
        pass
    online = online_cpus() or frozenset(range(os.cpu_count() or 1))
    return {
        "cpu": cpu,
        "logical_cores": len(online),
        "physical_cores": physical_cores(online),
        "onnxruntime": ort.__version__,
        "numpy": np.__version__,
        "opencv": cv2.__version__,
        "python": platform.python_version(),
        "loadavg_start": round(os.getloadavg()[0], 2),
    }


@dataclass(frozen=True, slots=True)
class LoadSnapshot:
    """CPU accounting at one moment, to tell how much of the machine others took during a run.

    ``steal`` is time the hypervisor gave this VM's CPUs to other guests; ``busy`` is every
    non-idle tick of this machine, ours included (/proc/stat, in clock ticks).
    """

    wall_s: float
    steal: int
    busy: int
    own_s: float

    @classmethod
    def now(cls) -> LoadSnapshot | None:
        try:
            values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
        except (OSError, ValueError):
            return None
        user, nice, system, _idle, _iowait, irq, softirq, steal = (values + [0] * 8)[:8]
        own = os.times()
        return cls(time.monotonic(), steal, user + nice + system + irq + softirq, own.user + own.system)

    def since(self, start: LoadSnapshot) -> dict[str, float]:
        """Cores' worth taken by other guests (steal) and by other processes, averaged over the run."""
        ticks = os.sysconf("SC_CLK_TCK") * (self.wall_s - start.wall_s)
        others = (self.busy - start.busy) / ticks - (self.own_s - start.own_s) / (self.wall_s - start.wall_s)
        return {"steal_cores": round((self.steal - start.steal) / ticks, 3), "other_cores": round(max(0.0, others), 3)}


def bench_frame() -> np.ndarray:
    """The frame every row sees: a 1280x720 BGR scene (texture and defects, not zeros)."""
    return SceneGenerator(1280, 720, seed=0).render(0).image


def load(path: Path, *, spinning: Spinning, threads: int = 0, conf: float = 0.25) -> LoadedModel:
    runtime = RuntimeConfig(spinning=spinning, intra_op_threads=threads)
    return load_model(ModelConfig(path=path, conf=conf), runtime)


def _spin_run(
    model: LoadedModel, full: FullPath, image: np.ndarray, frames: int, warmup: int, cpu_frames: int
) -> SpinResult:
    full()  # fills the input tensor the floor row is fed a copy of
    rows: dict[str, Row] = {"floor": FloorPath(model, full.pipeline.preprocess.tensor), "full": full}
    if naive_unsupported(model) is None:
        rows["naive"] = NaivePath(model, image)
    samples = interleave(rows, frames, warmup)
    results = {name: _row_result(samples[name], cpu_block(row, cpu_frames, min(warmup, 10))) for name, row in rows.items()}
    floor, full_ms = (np.array([s.total_ms for s in samples[k]]) for k in ("floor", "full"))
    naive = results.get("naive")
    return SpinResult(
        spinning=model.engine.cfg.spinning,
        rows=results,
        full_over_floor=results["full"].latency.median_ms / results["floor"].latency.median_ms,
        naive_over_floor=naive.latency.median_ms / results["floor"].latency.median_ms if naive else None,
        overhead_ms=results["full"].latency.median_ms - results["floor"].latency.median_ms,
        paired_overhead_ms=float(np.median(full_ms - floor)),
        messages_sent=full.publisher.sent,
        messages_received=full.received,
    )


def _row_result(samples: list[Sample], cpu: CpuBlock) -> RowResult:
    stages = {}
    if samples and samples[0].stages:
        stages = {k: Timing.of([s.stages[k] for s in samples]) for k in STAGES}
    return RowResult(Timing.of([s.total_ms for s in samples]), cpu.cpu_ms_per_frame, cpu.cores_busy, stages)


def _alone(model: LoadedModel, full: FullPath, frames: int, warmup: int) -> Alone:
    pipeline = full.pipeline
    detections, _ = pipeline.process(full.image)
    output = pipeline.outputs[0].copy()
    decode = pipeline.decoder.decode
    m = pipeline.box_map
    return Alone(
        preprocess=Timing.of(time_alone(lambda: pipeline.preprocess(full.image), frames, warmup)),
        decode=Timing.of(time_alone(lambda: decode(output, m), frames, warmup)),
        frame_size=(m.frame_w, m.frame_h),
        input_size=(m.input_w, m.input_h),
        candidates=candidates_above(model, output),
        anchors=int(output.shape[2] if model.head == "yolov8" else output.shape[1]),
        detections=len(detections),
    )


def detections_match(model: LoadedModel, full: FullPath) -> bool:
    """edged's detections equal the naive reference's on the benchmark frame."""
    mine, _ = full.pipeline.process(full.image)
    xyxy, scores, class_ids = NaivePath(model, full.image).detect(full.image)
    if len(mine) != len(scores):
        return False
    order = np.lexsort((mine.xyxy[:, 0], mine.class_ids))
    theirs = np.lexsort((xyxy[:, 0], class_ids))
    return bool(
        np.array_equal(mine.class_ids[order], class_ids[theirs])
        and np.allclose(mine.xyxy[order], xyxy[theirs], atol=0.05)
        and np.allclose(mine.scores[order], scores[theirs], atol=1e-4)
    )


@contextmanager
def full_path_for(
    path: Path, spinning: Spinning, threads: int, conf: float, image: np.ndarray
) -> Iterator[tuple[LoadedModel, FullPath]]:
    """A freshly loaded model and its full path, sockets closed on the way out."""
    model = load(path, spinning=spinning, threads=threads, conf=conf)
    full = FullPath(model, image)
    try:
        full.wait_for_subscriber()
        yield model, full
    finally:
        full.close()


@dataclass(frozen=True, slots=True)
class _Extras:
    alone: Alone
    allocations: Allocations
    detections_match: bool | None
    naive_skipped: str | None
    model: dict[str, Any]


def _extras(
    model: LoadedModel,
    full: FullPath,
    path: Path,
    frames: int,
    warmup: int,
    alloc_frames: int,
    model_info: dict[str, Any] | None,
) -> _Extras:
    skipped = naive_unsupported(model)
    return _Extras(
        alone=_alone(model, full, frames, warmup),
        allocations=measure_allocations(full, alloc_frames),
        detections_match=None if skipped else detections_match(model, full),
        naive_skipped=skipped,
        model=_model_info(model, path, model_info),
    )


def bench(
    path: Path,
    *,
    frames: int = 300,
    warmup: int = 20,
    cpu_frames: int = 100,
    spinning: tuple[Spinning, ...] = ("during-run",),
    threads: int = 0,
    conf: float = 0.25,
    alloc_frames: int = 100,
    model_info: dict[str, Any] | None = None,
) -> BenchResult:
    """Run every measurement on the model at ``path``.

    Each spinning setting gets its own session (loaded in turn, never two at once); the first
    setting also gives the stage-alone, allocation and cross-check figures, which do not depend
    on spinning.
    """
    if not spinning:
        raise ValueError("spinning needs at least one setting")
    machine = machine_info()
    load_start = LoadSnapshot.now()
    image = bench_frame()
    with full_path_for(path, spinning[0], threads, conf, image) as planned:
        runs = [_spin_run(*planned, image, frames, warmup, cpu_frames)]
        extras = _extras(*planned, path, frames, warmup, alloc_frames, model_info)
    del planned  # the session goes before the next one loads
    for spin in spinning[1:]:
        with full_path_for(path, spin, threads, conf, image) as planned:
            runs.append(_spin_run(*planned, image, frames, warmup, cpu_frames))
        del planned
    machine["loadavg_end"] = round(os.getloadavg()[0], 2)
    load_end = LoadSnapshot.now()
    if load_start and load_end:
        machine.update(load_end.since(load_start))
    settings = {
        "frames": frames,
        "warmup": warmup,
        "cpu_frames": cpu_frames,
        "threads": threads,
        "conf": conf,
        "alloc_frames": alloc_frames,
        "frame": "1280x720 BGR scene 0, seed 0",
    }
    return BenchResult(
        machine,
        extras.model,
        settings,
        runs,
        extras.alone,
        extras.allocations,
        extras.detections_match,
        extras.naive_skipped,
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
    )


def _model_info(model: LoadedModel, path: Path, extra: dict[str, Any] | None) -> dict[str, Any]:
    info = {
        "path": str(path),
        "name": model.engine.identity.name,
        "provider": model.engine.provider,
        "threads": model.engine.threads.summary,
        "input": list(model.contract.shape),
        "output": list(model.engine.outputs[0].shape),
        "head": model.head,
        "classes": model.num_classes,
    }
    from edged.bench.timing_model import MissingOnnx, graph_stats

    try:
        stats = graph_stats(path)
        info.update(gflops=round(stats.gflops, 3), params=stats.params)
    except MissingOnnx as e:  # the figures are optional for a given model
        info.update(gflops=None, params=None, stats_note=str(e))
    info.update(extra or {})
    return info
