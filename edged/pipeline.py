"""The per-frame path: contract check -> preprocess -> inference -> decode -> inspect -> message.

A `FramePipeline` is planned for one frame size: the input tensor, its binding to the model and
the decoder scratch are all allocated there, once, and `process` only fills and reads them.
`FramePath` owns the plans of one camera: it checks each frame against what the source declared,
re-plans a camera after a lasting size change, keeps a plan per size for a source whose frames
legitimately vary (an image folder), inspects the detections when ``[inspect]`` is set
(`edged.verdict`), and builds the wire messages. The daemon, `check`, `eval` and
`bench` all go through these two classes, so they run exactly the same path.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from edged.anomaly import Anomaly, AnomalyDecoder
from edged.classify import Classes, Classifier
from edged.config import Settings
from edged.contract import ChannelOrder, FrameSpec, frame_problem
from edged.decode import Decoder, Detections
from edged.errors import ConfigError, ContractError, InferenceError, ModelError
from edged.geometry import BoxMap
from edged.identity import Identity
from edged.messages import DetectionsMessage, Reason, ThermalState, Timings, VerdictMessage
from edged.model import LoadedModel
from edged.preprocess import preprocessor
from edged.segment import Segmenter
from edged.settings.sources import MAX_HEIGHT, MAX_WIDTH, SourceBase
from edged.sources.base import MAX_PIXELS, Frame
from edged.sources.registry import sizes_vary
from edged.stats import VerdictRecord
from edged.verdict import AnomalyInspected, AnomalyInspector, ClassInspector, Inspected, Inspector, Judged

log = logging.getLogger(__name__)

REPLAN_AFTER = 5  # consecutive frames of one new size before a camera's buffers are re-planned
# Plans kept at once for a source whose frame sizes vary. A plan holds the input tensor, the output
# buffers and the decode scratch (about 16 MB for a 640x640 model with 80 classes), so four bound
# that to about 65 MB while a folder mixing a few cameras' sizes never re-plans; beyond four sizes
# the least recently used plan is dropped, and made again (one warm-up run) when its size returns.
MAX_PLANS = 4
# The frame pixels those plans may be made for in all: one largest frame's (`MAX_PIXELS`, 7680x4320,
# the most any source gives). Some buffers are frame-sized: an anomaly model's maps and regions (7.5 bytes
# a pixel, 250 MB at 7680x4320), a segmentation model's masks and their scratch (``model.max_masks``
# and 4 more bytes a pixel, 800 MB at 7680x4320 by default); four plans of such frames held 3.2 GB.
PLAN_PIXELS = MAX_PIXELS


@dataclass(frozen=True, slots=True)
class StageTimes:
    preprocess_ms: float
    inference_ms: float
    decode_ms: float
    masks_ms: float = 0.0  # of decode_ms, a segmentation model's masks, outlines and sizes


def roi_problem(roi: tuple[int, int, int, int] | None, frame_w: int, frame_h: int) -> str | None:
    """Why a classifier's ``inspect.roi`` cannot be cut from a frame of this size; None when it can."""
    if roi is not None and (roi[2] > frame_w or roi[3] > frame_h):
        return f"inspect.roi {list(roi)} does not fit in a {frame_w}x{frame_h} frame: set it inside the frame"
    return None


class FramePipeline:
    """Preallocated buffers for one frame size, and the three stages that use them."""

    def __init__(
        self,
        model: LoadedModel,
        frame_w: int,
        frame_h: int,
        source_order: ChannelOrder,
        thresholds: list[float] | None = None,
        near_margin: float | None = None,
        roi: tuple[int, int, int, int] | None = None,
    ) -> None:
        """``roi``: the region [x1, y1, x2, y2] of each frame the model sees (a classifier's
        ``inspect.roi``); ValueError when it does not fit in a frame of this size (`FramePath` rejects
        such frames first)."""
        self.model = model
        self.spec = FrameSpec(frame_w, frame_h, source_order)
        # The rows and columns of each frame the model sees: evidence saves them, as what it judged.
        self.region: tuple[slice, slice] = (slice(None), slice(None))
        if roi is not None:
            if (problem := roi_problem(roi, frame_w, frame_h)) is not None:
                raise ValueError(problem)
            x1, y1, x2, y2 = roi
            self.region = (slice(y1, y2), slice(x1, x2))
            frame_w, frame_h = x2 - x1, y2 - y1
        self.preprocess = preprocessor(model.contract, frame_w, frame_h, source_order)
        self.binding = model.engine.bind(self.preprocess.tensor)
        outputs = self.binding.outputs
        self.decoder: Decoder | Classifier | Segmenter | AnomalyDecoder  # an anomaly model's reads every output
        if model.task == "anomaly":
            names = [o.name for o in model.engine.output_meta]
            shapes = [(name, out.shape) for name, out in zip(names, outputs, strict=True)]
            self.decoder = model.anomaly_decoder(shapes, near_margin)
        else:
            prototypes = outputs[1] if model.task == "segment" else None
            self.decoder = model.make_decoder(outputs[0].shape, thresholds, near_margin, prototypes)

    @property
    def box_map(self) -> BoxMap:
        return self.preprocess.box_map

    @property
    def output(self) -> np.ndarray:
        """The raw detection output of the last `process` (float32, refreshed in place)."""
        return self.binding.outputs[0]

    def process(self, image: np.ndarray) -> tuple[Detections | Classes | Anomaly, StageTimes]:
        """Run one checked frame through the model; raises InferenceError from the engine."""
        t0 = time.perf_counter_ns()
        self.preprocess(image[self.region])
        t1 = time.perf_counter_ns()
        self.binding.run()
        t2 = time.perf_counter_ns()
        detections: Detections | Classes | Anomaly
        if isinstance(self.decoder, AnomalyDecoder):
            detections = self.decoder.decode(self.binding.outputs, self.preprocess.box_map)
        else:
            detections = self.decoder.decode(self.binding.outputs[0], self.preprocess.box_map)
        t3 = time.perf_counter_ns()
        masks_ms = self.decoder.masks_ms if isinstance(self.decoder, Segmenter) else 0.0
        return detections, StageTimes((t1 - t0) / 1e6, (t2 - t1) / 1e6, (t3 - t2) / 1e6, masks_ms)


@dataclass(frozen=True, slots=True)
class Processed:
    """One frame through the model; ``result`` (and ``inspected``) hold until the plan's next frame.

    ``result`` is its task's (`edged.task.TaskResult`: detections or a classifier's classes). With
    ``[inspect]`` the detections are the inspected ones (zones applied) and ``verdict_ms`` is capture
    to verdict; without it ``inspected`` is None. ``decoded`` is every detection the decoder kept,
    before zones dropped those outside them from ``result``.
    """

    frame: Frame
    plan: FramePipeline
    result: Detections | Classes | Anomaly
    times: StageTimes
    age_ms: float
    inspected: Inspected | Judged | AnomalyInspected | None = None
    verdict_ms: float = 0.0
    decoded: Detections | None = None

    @property
    def labelled(self) -> Detections | Classes | Anomaly:
        """What the frame's dataset label holds: every detection, those outside the zones too (an object
        the line ignores there is still an object, and a label without it teaches the model it is not)."""
        return self.decoded if self.decoded is not None else self.result


WITHIN_LIMITS = "within limits"  # the note on a defect its class's size limits tolerate

# What a verdict message repeats of its frame's detections message (all of it but ``seq`` and
# what says where it came from).
_PROVENANCE = ("seq", "kind", "schema_version", "model_sha256", "replayed", "board_id", "boot_id", "run_id", "clock_synced")
VERDICT_FIELDS = tuple(name for name in VerdictMessage.model_fields if name not in _PROVENANCE)

# What a model's output can hold that a frame's result is built without: the drop counter each counts
# under, and what the log says (with the camera, how many values, the frame, and the count so far).
OUTPUT_PROBLEMS = {
    "nonfinite_output": "camera %s: the model output %d NaN or infinite value(s) on frame %d, dropped (%d frame(s) "
    "so far): a NaN score never passes the threshold, so the model is broken or overflows on this input (check an "
    "fp16 export, and model.scale, mean and std); `edged check` runs it on a frame from the camera",
    "score_above_one": "camera %s: the model gave %d score(s) outside 0..1 on frame %d, dropped (%d frame(s) so "
    "far): scores must be probabilities, so check model.scale, mean and std against how the model was trained, and "
    "that its head ends in a sigmoid (a classifier's in a softmax)",
    "outline_thinned": "camera %s: %d outline(s) on frame %d had more points than model.max_outline_points, "
    "thinned to it (%d frame(s) so far; the area, length and width are the whole mask's or region's): a mask in "
    "thousands of pieces, or an anomaly region of a ragged edge, comes from a broken or badly trained model, a long "
    "smooth outline from a large mask at a large frame size (raise model.max_outline_points for it)",
}


@dataclass(frozen=True, slots=True)
class Rejected:
    """A frame that was not processed: ``reason`` is the drop counter it counts under."""

    frame: Frame
    reason: str
    detail: str


def planned(plan: FramePipeline | None, model: LoadedModel, image: np.ndarray, order: ChannelOrder = "bgr") -> FramePipeline:
    """``plan`` when it was made for ``image``'s size and ``order``, else a new one. The tools read
    images of any size one after another and keep only the last size's buffers: a folder of crops
    has as many sizes as images, and a plan kept for each would grow without bound."""
    h, w = image.shape[:2]
    if plan is not None and (plan.spec.width, plan.spec.height, plan.spec.channel_order) == (w, h, order):
        return plan
    return FramePipeline(model, w, h, order)


class FramePath:
    """The path of one camera's frames through one model: check, plan, process, message."""

    def __init__(
        self,
        model: LoadedModel,
        camera_id: str,
        declared_order: ChannelOrder,
        inspector: Inspector | ClassInspector | AnomalyInspector | None = None,
        *,
        sizes_vary: bool = False,
        near_margin: float | None = None,
        roi: tuple[int, int, int, int] | None = None,
    ) -> None:
        """``sizes_vary``: the source declares frames of many sizes (`edged.sources.sizes_vary`);
        ``near_margin``: the decoder also finds near misses (`edged.decode.Detections.near`);
        ``roi``: the region of each frame a classifier sees (``inspect.roi``)."""
        self.roi = roi
        self.model = model
        self.camera_id = camera_id
        self.declared_order = declared_order
        self.inspector = inspector
        self.sizes_vary = sizes_vary
        self.near_margin = near_margin
        # By frame size (width, height), least recently used first; a camera keeps only its current one.
        self._plans: OrderedDict[tuple[int, int], FramePipeline] = OrderedDict()
        self._capacity = MAX_PLANS if sizes_vary else 1
        self._evicted = False
        self._new_size: tuple[tuple[int, int], int] | None = None

    def run(self, frame: Frame) -> Processed | Rejected:
        """Check ``frame`` against the contract and process it, or say why not."""
        plan = self._plan_for(frame)
        if isinstance(plan, Rejected):
            return plan
        try:
            detections, times = plan.process(frame.image)
        except InferenceError as e:
            return Rejected(frame, "inference_error", str(e))
        except ModelError as e:
            if not self.sizes_vary:  # every frame of a camera is this size: the configuration cannot run
                raise
            return self._unplanned(frame, plan, e)
        inspector = self.inspector
        if isinstance(inspector, ClassInspector) and isinstance(detections, Classes):
            judged: Judged | AnomalyInspected = inspector(detections)
            age_ms = (time.monotonic_ns() - frame.t_capture_ns) / 1e6
            return Processed(frame, plan, detections, times, age_ms, judged, age_ms)
        if isinstance(inspector, AnomalyInspector) and isinstance(detections, Anomaly):
            judged = inspector(detections, plan.spec.width, plan.spec.height)
            age_ms = (time.monotonic_ns() - frame.t_capture_ns) / 1e6
            return Processed(frame, plan, detections, times, age_ms, judged, age_ms)
        if isinstance(inspector, Inspector) and isinstance(detections, Detections):
            inspected = inspector(detections, plan.spec.width, plan.spec.height)
            age_ms = (time.monotonic_ns() - frame.t_capture_ns) / 1e6
            return Processed(frame, plan, inspected.detections, times, age_ms, inspected, age_ms, detections)
        return Processed(frame, plan, detections, times, (time.monotonic_ns() - frame.t_capture_ns) / 1e6)

    def _plan_for(self, frame: Frame) -> FramePipeline | Rejected:
        """The plan for this frame: its size's own when sizes vary, else the camera's current one,
        re-planned after a lasting size change."""
        image = frame.image
        size = (image.shape[1], image.shape[0]) if image.ndim >= 2 else (0, 0)
        if (detail := roi_problem(self.roi, *size)) is not None:
            if not self.sizes_vary and (not self._plans or self._lasting_size_change(size)):
                # every frame of the camera is this size: as for masks too large, the configuration cannot run
                raise ContractError(f"{detail} (camera {self.camera_id})")
            return Rejected(frame, "bad_frame_size", detail)
        if not self._plans:  # the first frame plans for its size
            return self._checked(frame, self._add_plan(size))
        current = next(reversed(self._plans.values()))
        problem = frame_problem(image, frame.channel_order, current.spec)
        if problem is None:
            self._new_size = None
            return current
        if problem != "size":
            return self._rejected(frame, current, problem)
        if self.sizes_vary:
            plan = self._plans.get(size)
            if plan is None:
                return self._checked(frame, self._add_plan(size))
            self._plans.move_to_end(size)
            return self._checked(frame, plan)
        if self._lasting_size_change(size):
            log.warning("frame size changed to %dx%d: re-planning buffers", *size, extra={"CAMERA": self.camera_id})
            return self._checked(frame, self._add_plan(size))
        return self._rejected(frame, current, problem)

    def _add_plan(self, size: tuple[int, int]) -> FramePipeline:
        """A new plan for frames of ``size``, dropping the least recently used ones first while the
        plans are `MAX_PLANS` (a camera's one), or they and it would be made for more than
        `PLAN_PIXELS` frame pixels in all."""
        while self._plans and (
            len(self._plans) >= self._capacity or sum(w * h for w, h in self._plans) + size[0] * size[1] > PLAN_PIXELS
        ):
            self._plans.popitem(last=False)
            if self.sizes_vary and not self._evicted:
                self._evicted = True
                log.warning(
                    "more than %d frame sizes, or sizes of over %d pixels together (%dx%d): each size beyond "
                    "them is planned again when it comes back, which costs one extra inference",
                    *(MAX_PLANS, PLAN_PIXELS, MAX_WIDTH, MAX_HEIGHT),
                    extra={"CAMERA": self.camera_id},
                )
        thresholds = self.inspector.thresholds if self.inspector else None
        plan = self._plans[size] = FramePipeline(
            self.model, *size, self.declared_order, thresholds, self.near_margin, self.roi
        )
        return plan

    def _checked(self, frame: Frame, plan: FramePipeline) -> FramePipeline | Rejected:
        """``plan`` when ``frame`` meets its whole contract (the size matched, the channel order may not)."""
        problem = frame_problem(frame.image, frame.channel_order, plan.spec)
        return self._rejected(frame, plan, problem) if problem else plan

    def _unplanned(self, frame: Frame, plan: FramePipeline, error: ModelError) -> Rejected:
        """A frame of a source whose sizes vary (an image folder) that the model cannot run on at its
        size (`edged.segment`'s mask buffers past their budget), its plan dropped: that image is
        skipped and counted as ``bad_frame_size``, not every other image with it (exit 78, which
        systemd does not restart, as for a camera, all of whose frames are that size)."""
        self._plans.pop((plan.spec.width, plan.spec.height), None)
        name = f"{frame.source_file}: " if frame.source_file else ""
        return Rejected(frame, "bad_frame_size", f"{name}{error}")

    def _rejected(self, frame: Frame, plan: FramePipeline, problem: str) -> Rejected:
        spec = plan.spec
        detail = f"not what the source declared ({spec.width}x{spec.height} {self.declared_order})"
        return Rejected(frame, "bad_frame_" + problem, detail)

    def _lasting_size_change(self, size: tuple[int, int]) -> bool:
        seen = self._new_size[1] + 1 if self._new_size and self._new_size[0] == size else 1
        self._new_size = (size, seen)
        return seen >= REPLAN_AFTER

    def message(
        self, done: Processed, *, seq: int, thermal_state: ThermalState, part_id: str | None = None
    ) -> DetectionsMessage:
        """The wire message for one processed frame, its task's fields rendered by its result
        (`edged.task.TaskResult.message_fields`): the one small object a frame allocates."""
        box_map, times, inspector, inspected = done.plan.box_map, done.times, self.inspector, done.inspected
        zones = thresholds = notes = None
        mm_per_px = None
        if isinstance(inspected, AnomalyInspected) and isinstance(inspector, AnomalyInspector):
            zones = [inspector.zone_name(z) for z in inspected.zones.tolist()]
            notes = [WITHIN_LIMITS if w else None for w in inspected.within.tolist()]
            mm_per_px = inspector.mm_per_px
        elif isinstance(inspector, Inspector) and isinstance(inspected, Inspected):
            zones = [inspector.zone_name(z) for z in inspected.zones.tolist()]
            thresholds = [inspector.thresholds[c] for c in inspected.detections.class_ids.tolist()]
            notes = [WITHIN_LIMITS if w else None for w in inspected.within.tolist()]
            mm_per_px = inspector.mm_per_px
        return DetectionsMessage(
            camera_id=self.camera_id,
            seq=seq,
            frame_id=done.frame.frame_id,
            capture_time_ns=done.frame.t_wall_ns,
            frame_size=(box_map.frame_w, box_map.frame_h),
            input_size=(box_map.input_w, box_map.input_h),
            model=self.model.info,
            **done.result.message_fields(self.model.label, zones, thresholds, notes=notes, mm_per_px=mm_per_px),
            timings=Timings(
                preprocess_ms=round(times.preprocess_ms, 3),
                inference_ms=round(times.inference_ms, 3),
                decode_ms=round(times.decode_ms, 3),
                age_ms=round(done.age_ms, 3),
            ),
            thermal_state=thermal_state,
            verdict=inspected.verdict if inspected else None,
            reasons=self.reasons(done),
            verdict_latency_ms=round(done.verdict_ms, 3) if inspected else None,
            part_id=part_id,
            source_file=done.frame.source_file,
        )

    def reasons(self, done: Processed) -> list[Reason]:
        """The detections that made ``done`` NG; none for an OK or uninspected frame."""
        inspector, inspected, label = self.inspector, done.inspected, self.model.label
        if inspector is None or inspected is None or inspected.verdict == "ok":
            return []
        if isinstance(inspected, Judged):  # a classifier: its best class decided
            top = inspected.classes.top
            if top is None:
                return []
            return [Reason(detection=0, class_id=top[0], label=label(top[0]), score=round(top[1], 4), zone=None)]
        if isinstance(inspected, AnomalyInspected):
            assert isinstance(inspector, AnomalyInspector)  # an AnomalyInspected comes from one
            if inspected.verdict == "uncertain":  # its score was dropped (`edged.anomaly`): nothing to give
                return []
            i, zones = inspected.reason_region, inspected.zones.tolist()
            zone = inspector.zone_name(zones[i]) if i < len(zones) else None
            score = round(min(max(inspected.result.score, 0.0), 1.0), 4)
            return [Reason(detection=i, class_id=0, label="anomaly score", score=score, zone=zone)]
        det = inspected.detections
        assert isinstance(inspector, Inspector)  # an Inspected comes from one
        scores, class_ids, zones = det.scores.tolist(), det.class_ids.tolist(), inspected.zones.tolist()
        return [
            Reason(
                detection=i,
                class_id=class_ids[i],
                label=label(class_ids[i]),
                score=round(scores[i], 4),
                zone=inspector.zone_name(zones[i]),
            )
            for i, bad in enumerate(inspected.ng.tolist())
            if bad
        ]

    def verdict_record(self, done: Processed, part_id: str | None) -> VerdictRecord | None:
        """What the status page lists of an inspected frame; None for an uninspected one."""
        if done.inspected is None:
            return None
        frame = done.frame
        return VerdictRecord(frame.t_wall_ns, frame.frame_id, part_id, done.inspected.verdict, tuple(self.reasons(done)))


def verdict_message(msg: DetectionsMessage, seq: int) -> VerdictMessage | None:
    """The verdict topic's message for a detections message: its fields of it; None without ``[inspect]``."""
    if msg.verdict is None or msg.verdict_latency_ms is None:
        return None
    return VerdictMessage(
        seq=seq,
        model_sha256=msg.model.sha256,
        **Identity.here().fields(),
        **{name: getattr(msg, name) for name in VERDICT_FIELDS},
    )


def frame_path(settings: Settings, model: LoadedModel, source: SourceBase) -> FramePath:
    """The path of camera ``source``'s frames through ``model``, inspected as `inspection` says,
    finding near misses when its evidence is saved under ``ng+near``; raises ConfigError for a
    class named in its inspection that the model does not have (naming the camera when there are
    several)."""
    inspect = settings.inspection(source)
    inspector: Inspector | ClassInspector | AnomalyInspector | None = None
    if inspect is not None:
        try:
            if model.task == "classify":
                inspector = ClassInspector(inspect, model.labels, model.num_classes, model.cfg.conf)
            elif inspect.roi is not None:
                region = "an anomaly model's" if model.task == "anomaly" else "a detector's"
                raise ConfigError(None, [f"inspect.roi is for classification models; {region} region is its zones"])
            elif model.task == "anomaly":
                inspector = AnomalyInspector(inspect, model.cfg.max_det)
            else:
                masks = model.task == "segment"
                cfg = model.cfg
                inspector = Inspector(inspect, model.labels, model.num_classes, cfg.conf, cfg.max_det, masks=masks)
        except ConfigError as e:
            if len(settings.source) == 1:
                raise
            raise ConfigError(e.path, [f"{problem} (camera {source.camera_id})" for problem in e.problems]) from None
    evidence = settings.evidence_for(source)
    near_margin = evidence.near_margin if evidence is not None and evidence.save == "ng+near" else None
    return FramePath(
        model,
        source.camera_id,
        source.channel_order,
        inspector,
        sizes_vary=sizes_vary(source),
        near_margin=near_margin,
        roi=inspect.roi if inspect is not None else None,
    )
