"""The three per-frame paths `edged bench` compares, the model and frame they run on, and the loops that measure them.

The floor is ``session.run`` on a ready tensor; the full path is the daemon's own; the naive
reference is the pipeline as the OpenCV and ultralytics examples write it. All three use the
engine's one `InferenceSession`, so they differ only in what happens around the run: a second
session would bring a second thread pool that, spinning, steals cores from the next row.
"""

from __future__ import annotations

import itertools
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import zmq

from edged.config import EngineName, ModelConfig, Precision, PublishConfig, RuntimeConfig, Spinning
from edged.decode import Detections
from edged.errors import InferenceError, ModelError
from edged.model import LoadedModel, load_model
from edged.pipeline import FramePath, FramePipeline, Processed, Rejected
from edged.preprocess import LETTERBOX_FILL
from edged.publish import Publisher, detections_topic
from edged.settings.http import HttpConfig
from edged.settings.inspect import InspectConfig
from edged.settings.sources import SourceBase
from edged.sources.base import Frame
from edged.sources.scenes import SceneGenerator
from edged.verdict import Inspector
from edged.view import LiveView

DEMO_MODEL = Path("models") / "demo.onnx"
# Where `edged bench` looks for the demo model: here, the source tree, and where the package installs it.
DEMO_MODELS = (DEMO_MODEL, Path(__file__).resolve().parents[2] / DEMO_MODEL, Path("/usr/share/edged") / DEMO_MODEL)
CAMERA_ID: str = SourceBase.model_fields["camera_id"].default
STAGES = ("preprocess", "inference", "decode", "publish", "view")  # every model's
MASKS = "masks (in decode)"  # a segmentation model's masks, outlines and sizes: part of decode


@dataclass(frozen=True, slots=True)
class TimedFrame:
    """One timed frame of one row: total wall time and, for the full path, each stage."""

    total_ms: float
    stages: dict[str, float] = field(default_factory=dict)


Row = Callable[[], TimedFrame]


def _ms(t0: int, t1: int) -> float:
    return (t1 - t0) / 1e6


def timing(ms: np.ndarray | list[float]) -> dict[str, float]:
    values = np.asarray(ms, float)
    return {"median_ms": float(np.median(values)), "p99_ms": float(np.percentile(values, 99))}


def bench_frame() -> np.ndarray:
    """The frame every row sees: a 1280x720 BGR scene (texture and defects, not zeros)."""
    return SceneGenerator(1280, 720, seed=0).render(0).image


def resolve_model(path: Path | None) -> Path:
    """The model to time: ``path``, or the demo model wherever it is installed."""
    if path is not None:
        if not path.is_file():
            raise ModelError(f"model file {path} does not exist")
        return path
    for candidate in DEMO_MODELS:
        if candidate.is_file():
            return candidate
    raise ModelError(f"no model to time: {DEMO_MODEL} is not here; pass --model PATH")


def load(
    path: Path,
    *,
    spinning: Spinning,
    threads: int = 0,
    conf: float = 0.25,
    engine: EngineName = "onnxruntime",
    precision: Precision = "f32",
) -> LoadedModel:
    """The model as the daemon loads it on ``engine`` at ``precision``, with the bench's runtime settings."""
    return load_model(
        ModelConfig(path=path, conf=conf, engine=engine, precision=precision),
        RuntimeConfig(spinning=spinning, intra_op_threads=threads),
    )


def timed(fn: Callable[[], object]) -> Row:
    """A row that times ``fn`` as a whole."""

    def row() -> TimedFrame:
        t0 = time.perf_counter_ns()
        fn()
        return TimedFrame(_ms(t0, time.perf_counter_ns()))

    return row


def floor_row(model: LoadedModel, tensor: np.ndarray) -> Row:
    """Inference alone: the engine fed a ready tensor, outputs allocated by the runtime."""
    engine, ready = model.engine, tensor.copy()
    return timed(lambda: engine.infer(ready))


class FullPath:
    """The daemon's per-frame path: `FramePath.run`, then `FramePath.message` serialised and sent,
    and the frame offered to the live view when it asks (with the ``[http]`` defaults).

    The PUB binds a tcp loopback port with a SUB subscribed, so each send really queues a message
    for a peer (a PUB without subscribers drops it for free); the SUB is drained outside the timed
    region. ``with FullPath(...)`` waits until the SUB is connected and closes the sockets after.
    Nobody watches the view unless a row says so (`watched`).
    """

    def __init__(self, model: LoadedModel, image: np.ndarray) -> None:
        self.image = image
        self.path = FramePath(model, CAMERA_ID, "bgr")
        cfg = PublishConfig(endpoints=["tcp://127.0.0.1:*"])
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.publisher = Publisher(cfg, [CAMERA_ID], self._context)
        self._topic = detections_topic(cfg.topic_prefix, CAMERA_ID)
        self._publish_empty = cfg.publish_empty
        self._sub = self._context.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(self.publisher.endpoints[0])
        self._frame_ids = itertools.count()
        self._seq = itertools.count()
        self.received = 0
        view = HttpConfig()
        self.view = LiveView(CAMERA_ID, view.view_fps, view.view_width, view.jpeg_quality, {})
        self.plan: FramePipeline = self.process().plan  # the first frame plans for the image's size

    def __enter__(self) -> FullPath:
        self.view.start()
        deadline = time.monotonic() + 2.0
        while self.received == 0 and time.monotonic() < deadline:
            self()
            self._sub.poll(10)
            self.drain()
        return self

    def __exit__(self, *exc: object) -> None:
        self.view.close()
        self._sub.close(linger=0)
        self.publisher.close()
        self._context.term()

    def process(self) -> Processed:
        """`FramePath.run` on the current image, as the daemon's loop calls it; raises when rejected."""
        outcome = self.path.run(Frame(self.image, next(self._frame_ids), time.monotonic_ns(), time.time_ns(), "bgr"))
        if isinstance(outcome, Rejected):
            raise InferenceError(f"the bench frame was rejected ({outcome.reason}): {outcome.detail}")
        return outcome

    def __call__(self) -> TimedFrame:
        self.drain()
        t0 = time.perf_counter_ns()
        done = self.process()
        t1 = time.perf_counter_ns()
        msg = None
        if len(done.result) or self._publish_empty:
            msg = self.path.message(done, seq=next(self._seq), thermal_state="ok")
            self.publisher.send(self._topic, msg.model_dump_json().encode())
        t2 = time.perf_counter_ns()
        if self.view.wants_frame():
            self.view.offer(done.frame, msg or self.path.message(done, seq=0, thermal_state="ok"))
        t3 = time.perf_counter_ns()
        t = done.times
        stages = dict(zip(STAGES[:3], (t.preprocess_ms, t.inference_ms, t.decode_ms), strict=True))
        if self.plan.model.task == "segment":
            stages[MASKS] = t.masks_ms
        stages.update(zip(STAGES[3:], (_ms(t1, t2), _ms(t2, t3)), strict=True))
        return TimedFrame(_ms(t0, t3), stages)

    def drain(self) -> None:
        while True:
            try:
                self._sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.received += 1


def watched(full: FullPath) -> Row:
    """The full path with a live-view viewer connected: the frame copied for the view (at most
    ``view_fps`` times a second), and the view's encoder thread busy beside it."""

    def row() -> TimedFrame:
        with full.view.watch():
            return full()

    return row


def naive_unsupported(model: LoadedModel) -> str | None:
    """Why the naive reference cannot run this model (it is the ultralytics yolov8 recipe), or None."""
    c = model.contract
    if model.head != "yolov8":
        return f"the naive reference decodes yolov8 heads only, this model is {model.head}"
    if (c.layout, c.dtype, c.channel_order, c.resize) != ("nchw", np.float32, "rgb", "letterbox"):
        return "the naive reference handles float32 NCHW RGB letterbox inputs only"
    if c.mean != (0.0, 0.0, 0.0) or c.std != (1.0, 1.0, 1.0):
        return "the naive reference normalises by scale only (mean 0, std 1)"
    return None


def naive_detect(model: LoadedModel, image: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """xyxy boxes, scores and class ids of ``image`` the usual way: letterbox copy, blobFromImage,
    session.run, numpy decode, cv2 NMS.

    Boxes are mapped to the frame and clipped before NMS, degenerate ones dropped, and NMS is
    ``cv2.dnn.NMSBoxesBatched`` (``NMSBoxes`` when ``agnostic_nms``), so the detections must equal
    edged's: the bench cross-checks that on the benchmark frame.
    """
    c, cfg = model.contract, model.cfg
    (in_w, in_h), (h, w) = (c.width, c.height), image.shape[:2]
    r = min(in_w / w, in_h / h)
    new_w, new_h = round(w * r), round(h * r)
    left, top = round((in_w - new_w) / 2 - 0.1), round((in_h - new_h) / 2 - 0.1)
    resized = cv2.resize(image, (new_w, new_h), interpolation=cv2.INTER_LINEAR)
    padded = cv2.copyMakeBorder(
        resized, top, in_h - new_h - top, left, in_w - new_w - left, cv2.BORDER_CONSTANT, value=(LETTERBOX_FILL,) * 3
    )
    blob = cv2.dnn.blobFromImage(padded, c.scale, (in_w, in_h), swapRB=True)
    pred = model.engine.infer(blob)[0][0].T
    class_scores = pred[:, 4:]
    class_ids = class_scores.argmax(axis=1)
    scores = class_scores.max(axis=1)
    keep = scores >= cfg.conf
    cx, cy, bw, bh = pred[keep, :4].astype(np.float64).T
    x1 = np.clip((cx - bw / 2 - left) / r, 0, w)
    y1 = np.clip((cy - bh / 2 - top) / r, 0, h)
    x2 = np.clip((cx + bw / 2 - left) / r, 0, w)
    y2 = np.clip((cy + bh / 2 - top) / r, 0, h)
    xyxy = np.stack([x1, y1, x2, y2], axis=1).astype(np.float32)
    valid = (xyxy[:, 2] > xyxy[:, 0]) & (xyxy[:, 3] > xyxy[:, 1])
    xyxy, scores, class_ids = xyxy[valid], scores[keep][valid], class_ids[keep][valid]
    xywh = np.concatenate([xyxy[:, :2], xyxy[:, 2:] - xyxy[:, :2]], axis=1).astype(np.float64)
    # OpenCV's stubs list only sequences for the boxes; the bindings take arrays too.
    if cfg.agnostic_nms:
        picked = cv2.dnn.NMSBoxes(xywh, scores, cfg.conf, cfg.iou)  # type: ignore[arg-type]
    else:
        batched = class_ids.astype(np.int32)
        picked = cv2.dnn.NMSBoxesBatched(xywh, scores, batched, cfg.conf, cfg.iou)  # type: ignore[arg-type]
    idx = np.asarray(picked, np.intp).reshape(-1)[: cfg.max_det]
    return xyxy[idx], scores[idx], class_ids[idx].astype(np.int32)


def detections_match(model: LoadedModel, full: FullPath) -> bool:
    """edged's detections equal the naive reference's on the benchmark frame."""
    mine = full.process().result
    if not isinstance(mine, Detections):
        return False  # the naive reference is a detector's
    xyxy, scores, class_ids = naive_detect(model, full.image)
    if len(mine) != len(scores):
        return False
    order, theirs = np.lexsort((mine.xyxy[:, 0], mine.class_ids)), np.lexsort((xyxy[:, 0], class_ids))
    return bool(
        np.array_equal(mine.class_ids[order], class_ids[theirs])
        and np.allclose(mine.xyxy[order], xyxy[theirs], atol=0.05)
        and np.allclose(mine.scores[order], scores[theirs], atol=1e-4)
    )


def interleave(rows: dict[str, Row], frames: int, warmup: int) -> dict[str, list[TimedFrame]]:
    """Run the rows in rounds, one frame of each per round, so drift hits every row alike; each
    round in the next of every order of the rows, so that each row follows each other one equally
    often. A row right after one running the same code (the live-view row after the full path) finds
    that code's caches warm, and ran 0.1 ms faster on the demo model, as much as edged's full path
    and the naive reference differ."""
    for _ in range(warmup):
        for row in rows.values():
            row()
    samples: dict[str, list[TimedFrame]] = {name: [] for name in rows}
    for order in itertools.islice(itertools.cycle(itertools.permutations(rows)), frames):
        for name in order:
            samples[name].append(rows[name]())
    return samples


def cpu_per_frame(row: Row, frames: int, warmup: int) -> dict[str, float]:
    """Process CPU time per frame of one row run alone (interleaved rows cannot be told apart),
    every thread included, and that time over the wall time ("cores busy"). `time.process_time_ns`
    is `os.times` at nanosecond rather than clock-tick (10 ms) resolution."""
    for _ in range(warmup):
        row()
    cpu0, t0 = time.process_time_ns(), time.perf_counter_ns()
    for _ in range(frames):
        row()
    cpu_ms, wall_ms = _ms(cpu0, time.process_time_ns()), _ms(t0, time.perf_counter_ns())
    return {"cpu_ms_per_frame": cpu_ms / frames, "cores_busy": cpu_ms / wall_ms if wall_ms else 0.0}


def heap_per_frame(full: FullPath, frames: int, warmup: int = 20) -> dict[str, float]:
    """The full path's Python heap per frame in steady state (tracemalloc): net growth in blocks
    and bytes (what stays behind), and the median per-frame peak above the frame's start."""
    for _ in range(warmup):
        full()
    tracemalloc.start(1)
    try:
        for _ in range(5):
            full()
        start = tracemalloc.take_snapshot()
        peaks = np.empty(frames)
        for i in range(frames):
            base = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            full()
            peaks[i] = tracemalloc.get_traced_memory()[1] - base
        growth = tracemalloc.take_snapshot().compare_to(start, "filename")
    finally:
        tracemalloc.stop()
    return {
        "frames": frames,
        "heap_blocks": sum(s.count_diff for s in growth) / frames,
        "heap_bytes": sum(s.size_diff for s in growth) / frames,
        "transient_peak_bytes": float(np.median(peaks)),
    }


VERDICT_DETECTIONS = 100
VERDICT_FRAME = (1280, 720)


def verdict_cost(frames: int, warmup: int = 20) -> dict[str, Any]:
    """What ``[inspect]`` adds to a frame at 100 detections: zones (an 8-point polygon and a
    square, matched by overlap, the costlier rule), NG classes and min_area, dropping outside."""
    w, h = VERDICT_FRAME
    rng = np.random.default_rng(0)
    corners = rng.uniform(0, (w, h), (VERDICT_DETECTIONS, 2))
    sides = rng.uniform(4, 120, (VERDICT_DETECTIONS, 2))
    xyxy = np.concatenate([corners, np.minimum(corners + sides, (w, h))], axis=1).astype(np.float32)
    scores = np.sort(rng.uniform(0.3, 1.0, VERDICT_DETECTIONS)).astype(np.float32)[::-1].copy()
    detections = Detections(xyxy, scores, rng.integers(0, 3, VERDICT_DETECTIONS).astype(np.int32))
    angles = np.linspace(0, 2 * np.pi, 8, endpoint=False)
    octagon = [(0.5 + 0.3 * np.cos(a), 0.5 + 0.3 * np.sin(a)) for a in angles]
    cfg = InspectConfig(
        zones={"part": octagon, "corner": [(0.0, 0.0), (0.2, 0.0), (0.2, 0.2), (0.0, 0.2)]},
        match="overlap",
        ng_classes=["0", "2"],
        min_area={"2": 0.001},
    )
    inspect = Inspector(cfg, [], 3, 0.25, VERDICT_DETECTIONS)
    for _ in range(warmup):
        inspect(detections, w, h)
    ms = np.empty(frames)
    for i in range(frames):
        t0 = time.perf_counter_ns()
        inspect(detections, w, h)
        ms[i] = _ms(t0, time.perf_counter_ns())
    return {"detections": VERDICT_DETECTIONS, **timing(ms)}
