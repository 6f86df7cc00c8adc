"""The three per-frame paths `edged bench` compares, and the loops that time them.

* floor: ``session.run(None, {name: tensor})`` on a ready input tensor: inference alone through
  ONNX Runtime's plain API, the least any pipeline can cost;
* full: edged's own path, `FramePipeline.process` then the daemon's message building,
  serialisation and send on a real ZeroMQ PUB socket;
* naive: the pipeline as commonly written from the OpenCV and ultralytics examples.

All three use the engine's one `InferenceSession`: same options, same thread pool, same
optimised graph, so the rows differ only in what happens around the run. A second session
would bring a second thread pool that, with spinning on, keeps spinning after its own run and
steals cores from the next row in the interleaved loop.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import cv2
import numpy as np
import zmq

from edged.config import PublishConfig, Settings, SyntheticSource, ThermalConfig
from edged.messages import ModelInfo
from edged.model import LoadedModel
from edged.pipeline import FramePipeline, detections_message
from edged.publish import Publisher, detections_topic
from edged.sources import Frame

STAGES = ("preprocess", "inference", "decode", "publish")
DetectionColumns = tuple[np.ndarray, np.ndarray, np.ndarray]  # xyxy, scores, class ids


@dataclass(frozen=True, slots=True)
class Sample:
    """One timed frame of one row: total wall time and, for the full path, each stage."""

    total_ms: float
    stages: dict[str, float] = field(default_factory=dict)


Row = Callable[[], Sample]


def _ms(t0: int, t1: int) -> float:
    return (t1 - t0) / 1e6


class FloorPath:
    """Inference alone: the engine's session fed a ready tensor, outputs allocated by ORT."""

    def __init__(self, model: LoadedModel, tensor: np.ndarray) -> None:
        self._session = model.engine.session
        self._feed = {model.contract.input_name: tensor.copy()}

    def __call__(self) -> Sample:
        t0 = time.perf_counter_ns()
        self._session.run(None, self._feed)
        return Sample(_ms(t0, time.perf_counter_ns()))


class FullPath:
    """edged's per-frame path: process, then build, serialise and send the detections message.

    The PUB socket binds a tcp loopback port with a SUB connected and subscribed to everything,
    so each send really queues a message for a peer (a PUB without subscribers drops it for
    free). The SUB is drained before each frame, outside the timed region, so the queue never
    reaches its high-water mark; ZeroMQ's I/O thread still does its work concurrently, as in
    production.
    """

    def __init__(self, model: LoadedModel, image: np.ndarray) -> None:
        h, w = image.shape[:2]
        self.image = image
        self.pipeline = FramePipeline(model, w, h, "bgr")
        settings = Settings(
            model=model.cfg,
            source=SyntheticSource(width=w, height=h),
            publish=PublishConfig(endpoints=["tcp://127.0.0.1:*"]),
            thermal=ThermalConfig(enabled=False),
        )
        self._context = zmq.Context()
        self.publisher = Publisher(settings.publish, self._context)
        self._model = model
        identity = model.engine.identity
        self._model_info = ModelInfo(name=identity.name, sha256=identity.sha256, provider=model.engine.provider)
        self._camera_id = settings.source.camera_id
        self._topic = detections_topic(settings.publish.topic_prefix, self._camera_id)
        self._sub = self._context.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(self.publisher.endpoints[0])
        self._publish_empty = settings.publish.publish_empty
        self._frame_ids = itertools.count()
        self.received = 0

    def __call__(self) -> Sample:
        self.drain()
        t0 = time.perf_counter_ns()
        frame = Frame(
            image=self.image,
            frame_id=next(self._frame_ids),
            t_capture_ns=time.monotonic_ns(),
            t_wall_ns=time.time_ns(),
            channel_order="bgr",
        )
        detections, times = self.pipeline.process(frame.image)
        age_ms = (time.monotonic_ns() - frame.t_capture_ns) / 1e6
        t1 = time.perf_counter_ns()
        if len(detections) or self._publish_empty:
            msg = detections_message(
                self._camera_id,
                frame.frame_id,
                frame,
                self.pipeline.box_map,
                self._model,
                self._model_info,
                detections,
                times,
                age_ms,
                "ok",
            )
            self.publisher.send(self._topic, msg.model_dump_json().encode())
        t2 = time.perf_counter_ns()
        stages = {
            "preprocess": times.preprocess_ms,
            "inference": times.inference_ms,
            "decode": times.decode_ms,
            "publish": _ms(t1, t2),
        }
        return Sample(_ms(t0, t2), stages)

    def drain(self) -> None:
        while True:
            try:
                self._sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.received += 1

    def wait_for_subscriber(self, timeout_s: float = 2.0) -> None:
        """Send until the SUB sees a message, so timed frames never meet a half-open connection."""
        deadline = time.monotonic() + timeout_s
        while self.received == 0 and time.monotonic() < deadline:
            self()
            time.sleep(0.01)
            self.drain()

    def close(self) -> None:
        self._sub.close(linger=0)
        self.publisher.close()
        self._context.term()


def naive_unsupported(model: LoadedModel) -> str | None:
    """Why the naive reference cannot run this model (it knows one common export), or None."""
    c = model.contract
    if model.head != "yolov8":
        return f"the naive reference decodes yolov8 heads only, this model is {model.head}"
    if (c.layout, c.dtype, c.channel_order, c.resize) != ("nchw", np.float32, "rgb", "letterbox"):
        return "the naive reference handles float32 NCHW RGB letterbox inputs only"
    if c.mean != (0.0, 0.0, 0.0) or c.std != (1.0, 1.0, 1.0):
        return "the naive reference normalises by scale only (mean 0, std 1)"
    return None


class NaivePath:
    """Letterbox copy, blobFromImage, session.run, numpy decode, cv2 NMS: the usual recipe.

    Boxes are mapped to the frame and clipped before NMS, degenerate ones dropped, and NMS is
    ``cv2.dnn.NMSBoxesBatched`` (``NMSBoxes`` when ``agnostic_nms``), so its detections must equal
    edged's: the bench cross-checks that on the benchmark frame.
    """

    def __init__(self, model: LoadedModel, image: np.ndarray) -> None:
        self.image = image
        self._session = model.engine.session
        self._name = model.contract.input_name
        self._size = (model.contract.width, model.contract.height)
        self._scale = model.contract.scale
        cfg = model.cfg
        self._conf, self._iou = cfg.conf, cfg.iou
        self._max_det, self._agnostic = cfg.max_det, cfg.agnostic_nms

    def __call__(self) -> Sample:
        t0 = time.perf_counter_ns()
        self.detect(self.image)
        return Sample(_ms(t0, time.perf_counter_ns()))

    def detect(self, image: np.ndarray) -> DetectionColumns:
        (in_w, in_h), (h, w) = self._size, image.shape[:2]
        r = min(in_w / w, in_h / h)
        new_w, new_h = round(w * r), round(h * r)
        left, top = round((in_w - new_w) / 2 - 0.1), round((in_h - new_h) / 2 - 0.1)
        resized = cv2.resize(image, (new_w, new_h), interpolation=cv2.INTER_LINEAR)
        padded = cv2.copyMakeBorder(
            resized, top, in_h - new_h - top, left, in_w - new_w - left, cv2.BORDER_CONSTANT, value=(114, 114, 114)
        )
        blob = cv2.dnn.blobFromImage(padded, self._scale, (in_w, in_h), swapRB=True)
        pred = self._session.run(None, {self._name: blob})[0][0].T
        class_scores = pred[:, 4:]
        class_ids = class_scores.argmax(axis=1)
        scores = class_scores.max(axis=1)
        keep = scores >= self._conf
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
        if self._agnostic:
            picked = cv2.dnn.NMSBoxes(xywh, scores, self._conf, self._iou)  # type: ignore[arg-type]
        else:
            picked = cv2.dnn.NMSBoxesBatched(
                xywh,
                scores,
                class_ids.astype(np.int32),  # type: ignore[arg-type]
                self._conf,
                self._iou,
            )
        idx = np.asarray(picked, np.intp).reshape(-1)[: self._max_det]
        return xyxy[idx], scores[idx], class_ids[idx].astype(np.int32)


def interleave(rows: dict[str, Row], frames: int, warmup: int) -> dict[str, list[Sample]]:
    """Run the rows in turn (A B C A B C ...) so drift and neighbours hit every row alike."""
    for _ in range(warmup):
        for row in rows.values():
            row()
    samples: dict[str, list[Sample]] = {name: [] for name in rows}
    for _ in range(frames):
        for name, row in rows.items():
            samples[name].append(row())
    return samples


@dataclass(frozen=True, slots=True)
class CpuBlock:
    """One row run alone: process CPU time per frame, every thread included (ORT's pool,
    ZeroMQ's I/O). ``time.process_time_ns`` is user + sys of the whole process, as ``os.times``,
    but with nanosecond rather than clock-tick (10 ms) resolution."""

    cpu_ms_per_frame: float
    wall_ms_per_frame: float

    @property
    def cores_busy(self) -> float:
        return self.cpu_ms_per_frame / self.wall_ms_per_frame if self.wall_ms_per_frame else 0.0


def cpu_block(row: Row, frames: int, warmup: int) -> CpuBlock:
    for _ in range(warmup):
        row()
    cpu0, t0 = time.process_time_ns(), time.perf_counter_ns()
    for _ in range(frames):
        row()
    cpu1, t1 = time.process_time_ns(), time.perf_counter_ns()
    return CpuBlock(_ms(cpu0, cpu1) / frames, _ms(t0, t1) / frames)


def time_alone(fn: Callable[[], object], frames: int, warmup: int) -> np.ndarray:
    """Wall ms of ``fn`` in a tight loop: one stage on its own, caches warm."""
    for _ in range(warmup):
        fn()
    out = np.empty(frames)
    for i in range(frames):
        t0 = time.perf_counter_ns()
        fn()
        out[i] = _ms(t0, time.perf_counter_ns())
    return out


def candidates_above(model: LoadedModel, output: np.ndarray) -> int | None:
    """How many anchors score at least ``conf`` (yolov8 heads), the load decode and NMS see."""
    if model.head != "yolov8":
        return None
    return int((output[0, 4:].max(axis=0) >= model.cfg.conf).sum())
