"""Inspection: per-class thresholds, zones and the OK/NG verdict of a frame (``[inspect]``).

An `Inspector` is built once per model from the ``[inspect]`` section: the class names there are
resolved against the model's labels (an unknown one is a `ConfigError` naming it), the per-class
thresholds become the vector the decoder compares candidates with (`edged.decode`), and the
zones a `ZoneMap`. Per frame it takes the decoder's detections, tags each with its zone (dropping
those outside every zone when so configured) and decides which of them make the part NG, all in
buffers made here once: the verdict adds no arrays to a frame.

A classification model's frames are judged by a `ClassInspector` instead: NG when its best class
is an NG class above that class's threshold, ``uncertain`` when its best score is below
``min_confidence`` (a part the model cannot tell, kept for relabelling and rejected by default).
A detector's frame is ``uncertain`` too when its model's output was broken on it and nothing NG
was found.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from edged.anomaly import Anomaly
from edged.classify import Classes
from edged.decode import Detections
from edged.errors import ConfigError
from edged.heads.base import TrueIndex
from edged.messages import Verdict
from edged.segment import Instances
from edged.settings.inspect import InspectConfig
from edged.settings.numerals import INDEX_DIGITS, whole_number
from edged.zones import NO_ZONE, ZoneMap, ZoneRaster

_OUTSIDE = np.array(NO_ZONE, dtype=np.intp)  # 0-d operands: a Python int costs numpy an array per call


@dataclass(frozen=True, slots=True, eq=False)
class Inspected:
    """One frame's inspection; the arrays are views valid until the inspector's next frame.

    ``detections`` are what is published (those outside every zone gone when zones drop them);
    ``zones`` (n,) their zone index into `Inspector.zone_names`, `NO_ZONE` for none;
    ``ng`` (n,) which of them make the frame NG; ``within`` (n,) which are of an NG class but
    within its size limits (a segmentation model's, with ``max_length_*`` or ``max_area_*``).
    """

    detections: Detections
    zones: np.ndarray
    ng: np.ndarray
    verdict: Verdict
    within: np.ndarray


class Inspector:
    """``[inspect]`` for one model: thresholds for its decoder, zones and NG rules for its frames."""

    def __init__(
        self,
        cfg: InspectConfig,
        labels: Sequence[str],
        num_classes: int,
        conf: float,
        max_det: int,
        *,
        masks: bool = False,
    ) -> None:
        """``masks``: the model's findings have masks (a segmentation model), which the size limits
        (``max_length_*``, ``max_area_*``) measure; a detector's are refused, not silently ignored."""
        resolve = _ClassNames(labels, num_classes)
        self.thresholds = [conf] * num_classes
        for name, threshold in cfg.class_conf.items():
            self.thresholds[resolve("class_conf", name)] = threshold
        ng_ids = range(num_classes) if cfg.ng_classes is None else [resolve("ng_classes", n) for n in cfg.ng_classes]
        min_area = [0.0] * num_classes
        for name, area in cfg.min_area.items():
            min_area[resolve("min_area", name)] = area
        self.mm_per_px = cfg.mm_per_px
        self._limits = _size_limits(cfg, resolve, num_classes)
        if cfg.min_confidence is not None:
            resolve.problem(f"inspect.min_confidence {_NOT_FOR_BOXES}")
        for key in () if masks else SIZE_LIMITS:
            if getattr(cfg, key):
                resolve.problem(
                    f"inspect.{key} is for segmentation and anomaly models (a mask's size); a detection model's "
                    "smallest box that makes a part NG is inspect.min_area"
                )
        resolve.raise_problems()
        self.zone_names: tuple[str, ...] = tuple(cfg.zones)
        overlap = cfg.match == "overlap"
        self._zones = ZoneMap(cfg.zones, max_det, overlap=overlap) if cfg.zones else None
        self._raster = ZoneRaster(cfg.zones) if cfg.zones else None  # a segmentation model's instances, by mask
        # When zones drop what is outside them: the detections' buffers, and a zone map and buffers
        # for the near misses (dropped outside the zones too) while the detections' zones are in use.
        self._drop: tuple[_InsideOnly, ZoneMap, _InsideOnly] | None = None
        if cfg.zones and cfg.outside_zones == "drop":
            self._drop = (_InsideOnly(max_det), ZoneMap(cfg.zones, max_det, overlap=overlap), _InsideOnly(max_det))
        self._ng_class = np.zeros(num_classes, dtype=np.bool_)
        self._ng_class[list(ng_ids)] = True
        self._min_area = np.array(min_area, dtype=np.float32)
        self._frame_area = np.ones((), dtype=np.float32)  # in pixels, of the last frame size
        # Per kept detection (at most max_det).
        self._no_zone = np.full(max_det, NO_ZONE, dtype=np.intp)
        self._ids = np.empty(max_det, dtype=np.intp)  # class ids as indices: int32 ones would be converted
        self._sides = np.empty((max_det, 2), dtype=np.float32)
        self._area = np.empty(max_det, dtype=np.float32)
        self._need = np.empty(max_det, dtype=np.float32)
        self._ng = np.empty(max_det, dtype=np.bool_)
        self._test = np.empty(max_det, dtype=np.bool_)
        self._within = np.zeros(max_det, dtype=np.bool_)

    def __call__(self, detections: Detections, frame_w: int, frame_h: int) -> Inspected:
        """Zones, then the verdict: NG when a detection of an NG class, inside a zone (when zones
        are set), is at least its class's min_area; else uncertain when the model's output was
        broken on the frame (`_broken`), else OK."""
        m = len(detections)
        zones = self._no_zone[:m]
        if self._zones is not None:
            zones = self._zones(detections.xyxy, frame_w, frame_h)
            if self._raster is not None and isinstance(detections, Instances):
                self._raster(detections.masks, zones, frame_w, frame_h)
            if self._drop is not None:
                inside, near_zones, near_inside = self._drop
                near = detections.near
                if near is not None:
                    near, _ = near_inside(near, near_zones(near.xyxy, frame_w, frame_h), None)
                detections, zones = inside(detections, zones, near)
                m = len(detections)
        ng, test, area, need, ids = self._ng[:m], self._test[:m], self._area[:m], self._need[:m], self._ids[:m]
        np.copyto(ids, detections.class_ids)
        np.take(self._ng_class, ids, out=ng, mode="clip")
        if self._zones is not None:
            np.not_equal(zones, _OUTSIDE, out=test)
            np.logical_and(ng, test, out=ng)
        sides = self._sides[:m]
        np.subtract(detections.xyxy[:, 2:], detections.xyxy[:, :2], out=sides)
        np.multiply(sides[:, 0], sides[:, 1], out=area)
        self._frame_area[()] = frame_w * frame_h
        np.divide(area, self._frame_area, out=area)
        np.take(self._min_area, ids, out=need, mode="clip")
        np.greater_equal(area, need, out=test)
        np.logical_and(ng, test, out=ng)
        within = self._within[:m]
        within.fill(False)
        if self._limits is not None and isinstance(detections, Instances):
            _tolerate(detections, ng, within, self._limits)
        verdict: Verdict = "ng" if np.count_nonzero(ng) else "uncertain" if _broken(detections) else "ok"
        return Inspected(detections, zones, ng, verdict, within)

    def zone_name(self, zone: int) -> str | None:
        return None if zone == NO_ZONE else self.zone_names[zone]


def _broken(result: Detections | Anomaly) -> bool:
    """The model's output held NaN, infinite values or scores outside 0..1 on this frame: they are
    dropped (a detector's before NMS, an anomaly model's score), so a defect they stood for is not
    judged, and the part is not OK but one the model could not tell (`uncertain`: NG on the reject
    line by default)."""
    return bool(result.nonfinite or result.scores_above_one)


@dataclass(frozen=True, slots=True, eq=False)
class Judged:
    """One classified frame's inspection: its verdict, and the best class's threshold."""

    classes: Classes
    verdict: Verdict
    threshold: float | None  # None when the model gave no probability


class ClassInspector:
    """``[inspect]`` for a classification model: its NG classes, their thresholds and ``min_confidence``."""

    def __init__(self, cfg: InspectConfig, labels: Sequence[str], num_classes: int, conf: float) -> None:
        resolve = _ClassNames(labels, num_classes)
        self.thresholds = [conf] * num_classes
        for name, threshold in cfg.class_conf.items():
            self.thresholds[resolve("class_conf", name)] = threshold
        self._ng = {resolve("ng_classes", n) for n in cfg.ng_classes or ()}
        resolve.raise_problems()
        problems = []
        if cfg.ng_classes is None:
            known = ", ".join(labels) if labels else f"class ids 0..{num_classes - 1}"
            problems.append(
                f"inspect.ng_classes: a classification model's verdict needs the classes that make a part NG "
                f"(its classes: {known})"
            )
        for key in ("zones", "min_area", *SIZE_LIMITS):
            if getattr(cfg, key):
                problems.append(
                    f"inspect.{key}: a classification model has no boxes to place or measure; "
                    "inspect.roi sets the region it classifies"
                )
        if problems:
            raise ConfigError(None, problems)
        self._min_confidence = cfg.min_confidence

    def __call__(self, classes: Classes) -> Judged:
        """NG for an NG class above its threshold, uncertain below ``min_confidence`` or without any
        probability, else OK."""
        top = classes.top
        if top is None:
            return Judged(classes, "uncertain", None)
        class_id, score = top
        threshold = self.thresholds[class_id]
        if self._min_confidence is not None and score < self._min_confidence:
            return Judged(classes, "uncertain", threshold)
        return Judged(classes, "ng" if class_id in self._ng and score > threshold else "ok", threshold)


SIZE_LIMITS = ("max_length_mm", "max_area_mm2", "max_length_px", "max_area_px")
_NOT_FOR_BOXES = "is for classification models; a detector's threshold is model.conf, or inspect.class_conf per class"


def _tolerate(instances: Instances, ng: np.ndarray, within: np.ndarray, limits: tuple[list[float], list[float]]) -> None:
    """Mark the NG instances within every size limit of their class (per class, the longest and the
    largest in frame pixels), and take them out of ``ng``; a class without limits tolerates none,
    and an instance without a mask has no size."""
    lengths, areas = limits
    ids = instances.class_ids.tolist()
    for i, ((length, _), area) in enumerate(zip(instances.sides, instances.area_px, strict=True)):
        c = ids[i]
        limited = lengths[c] < math.inf or areas[c] < math.inf  # a class without limits tolerates nothing
        if ng[i] and limited and length <= lengths[c] and area <= areas[c]:
            within[i] = True
            ng[i] = False


class _InsideOnly:
    """Keeps the detections inside a zone, in order, copied into buffers of its own."""

    def __init__(self, capacity: int) -> None:
        self._in_zone = np.empty(capacity, dtype=np.bool_)
        self._index_of = TrueIndex(capacity)
        self._xyxy = np.empty((capacity, 4), dtype=np.float32)
        self._scores = np.empty(capacity, dtype=np.float32)
        self._class_ids = np.empty(capacity, dtype=np.int32)
        self._zone_ids = np.empty(capacity, dtype=np.intp)
        self._masks = np.empty((0, 0, 0), dtype=np.bool_)  # a segmentation model's kept masks (`_instances`)

    def __call__(self, detections: Detections, zones: np.ndarray, near: Detections | None) -> tuple[Detections, np.ndarray]:
        """The detections of ``zones`` other than `NO_ZONE`, with their zones; ``near`` their near misses."""
        inside = self._in_zone[: len(detections)]
        np.not_equal(zones, _OUTSIDE, out=inside)
        index = self._index_of(inside)
        n = index.shape[0]
        xyxy, scores, ids, zone_ids = self._xyxy[:n], self._scores[:n], self._class_ids[:n], self._zone_ids[:n]
        np.take(detections.xyxy, index, axis=0, out=xyxy, mode="clip")
        np.take(detections.scores, index, out=scores, mode="clip")
        np.take(detections.class_ids, index, out=ids, mode="clip")
        np.take(zones, index, out=zone_ids, mode="clip")
        if isinstance(detections, Instances):
            return self._instances(detections, index, xyxy, scores, ids, near), zone_ids
        return Detections(xyxy, scores, ids, detections.scores_above_one, detections.nonfinite, near), zone_ids

    def _instances(
        self,
        instances: Instances,
        index: np.ndarray,
        xyxy: np.ndarray,
        scores: np.ndarray,
        ids: np.ndarray,
        near: Detections | None,
    ) -> Instances:
        """The kept instances with their masks, outlines and sizes: those with a mask come first, so the
        kept ones with a mask are the first of ``index``. Their masks are copied into a buffer of this
        object's, grown (once per count and size) to the most seen."""
        kept = index.tolist()
        q = sum(1 for j in kept if j < len(instances.polygons))
        shape = instances.masks.shape
        if self._masks.shape[1:] != shape[1:] or self._masks.shape[0] < q:
            self._masks = np.empty((max(q, self._masks.shape[0]), *shape[1:]), dtype=np.bool_)
        masks = self._masks[:q]
        np.take(instances.masks, index[:q], axis=0, out=masks, mode="clip")
        found = (
            tuple(instances.polygons[j] for j in kept[:q]),
            tuple(instances.area_px[j] for j in kept[:q]),
            tuple(instances.sides[j] for j in kept[:q]),
            instances.thinned,  # counted for the frame, those outside the zones too
        )
        return Instances(xyxy, scores, ids, instances.scores_above_one, instances.nonfinite, near, masks, *found)


def _size_limits(cfg: InspectConfig, resolve: _ClassNames, num_classes: int) -> tuple[list[float], list[float]] | None:
    """Per class, the longest and the largest defect tolerated, in frame pixels (inf: no limit); None without any.

    A limit in mm too large for a float once in pixels (``max_length_mm = 1e308`` at 0.05 mm per pixel)
    is the largest float, not inf: inf means no limit, which tolerates nothing, the opposite of what it says."""
    lengths, areas = [math.inf] * num_classes, [math.inf] * num_classes
    scale = cfg.mm_per_px
    if scale is None and (cfg.max_length_mm or cfg.max_area_mm2):
        resolve.problem("inspect.max_length_mm and max_area_mm2 need the camera's scale, inspect.mm_per_px")
        scale = 1.0
    for key, limits, factor, out in (
        ("max_length_px", cfg.max_length_px, 1.0, lengths),
        ("max_area_px", cfg.max_area_px, 1.0, areas),
        ("max_length_mm", cfg.max_length_mm, 1 / (scale or 1.0), lengths),
        ("max_area_mm2", cfg.max_area_mm2, 1 / (scale or 1.0) ** 2, areas),
    ):
        for name, limit in limits.items():
            out[resolve(key, name)] = min(limit * factor, sys.float_info.max)
    return (lengths, areas) if any(map(math.isfinite, lengths + areas)) else None


class _ClassNames:
    """Resolves the labels (or class ids) named in ``[inspect]``, collecting every unknown one."""

    def __init__(self, labels: Sequence[str], num_classes: int) -> None:
        self._ids = {label: i for i, label in enumerate(labels)}
        self._num_classes = num_classes
        self._labels = labels
        self._problems: list[str] = []

    def __call__(self, key: str, name: str) -> int:
        if name in self._ids:
            return self._ids[name]
        class_id = whole_number(name, INDEX_DIGITS)
        if class_id is not None and class_id < self._num_classes:
            return class_id
        known = ", ".join(self._labels) if self._labels else f"none named; class ids 0..{self._num_classes - 1}"
        self._problems.append(f"inspect.{key}: {name!r} is not a class of the model (its classes: {known})")
        return 0

    def problem(self, text: str) -> None:
        self._problems.append(text)

    def raise_problems(self) -> None:
        if self._problems:
            raise ConfigError(None, self._problems)


class _AnomalyClass(_ClassNames):
    """An anomaly model's one class, 'anomaly', the only name its ``[inspect]`` keys take."""

    def __init__(self) -> None:
        super().__init__(("anomaly",), 1)

    def __call__(self, key: str, name: str) -> int:
        if name != "anomaly":
            self.problem(f"inspect.{key}: an anomaly model has the one class 'anomaly', not {name!r}")
        return 0


# The [inspect] keys that mean nothing for an anomaly model, and why: set, they would be silently ignored.
_NOT_FOR_ANOMALY = {
    "class_conf": "is for detection models; an anomaly model's threshold is model.anomaly_threshold",
    "ng_classes": "is for detection models; an anomaly model's threshold is model.anomaly_threshold",
    "min_confidence": "is for classification models; an anomaly model's verdict is its score against "
    "model.anomaly_threshold",
}


@dataclass(frozen=True, slots=True, eq=False)
class AnomalyInspected:
    """One anomaly frame's inspection; the arrays are views valid until the inspector's next frame.

    ``zones`` (k,) each region's zone index into `AnomalyInspector.zone_names` (`NO_ZONE` for none);
    ``ng`` (k,) which regions count against the part; ``within`` (k,) which would but are within the
    size limits (``max_length_*``, ``max_area_*`` of 'anomaly'); ``reason_region`` the region the NG
    reason names (the largest that counts; 0 when it has none).
    """

    result: Anomaly
    zones: np.ndarray
    ng: np.ndarray
    verdict: Verdict
    reason_region: int
    within: np.ndarray


class AnomalyInspector:
    """``[inspect]`` for an anomaly model: NG when the image score is above the threshold (reason
    "anomaly score") and a region counts against the part, or when it has no region at all (a high
    score with nothing to place is still an anomaly). A region counts when it lies in a zone (with
    zones), is at least ``min_area`` and is not within every size limit (``max_length_*``,
    ``max_area_*``) of the class ``anomaly``; its regions all outside the zones, too small or
    within the limits make the frame OK (a spot under 1 mm2 is dust), unless some were past
    ``model.max_det`` (`Anomaly.cut`): those are not judged, so they count against the part. A
    score the decoder dropped (not finite, or outside 0..1) makes the part uncertain. Lengths are
    traced only with a length limit (`Anomaly.sides`: the message reuses them)."""

    thresholds = None  # the threshold is model.anomaly_threshold: an anomaly decoder takes no class thresholds

    def __init__(self, cfg: InspectConfig, max_regions: int) -> None:
        unused = [f"inspect.{key} {why}" for key, why in _NOT_FOR_ANOMALY.items() if getattr(cfg, key)]
        if unused:
            raise ConfigError(None, unused)
        resolve = _AnomalyClass()
        for name in cfg.min_area:
            resolve("min_area", name)
        limits = _size_limits(cfg, resolve, 1)
        resolve.raise_problems()
        self._max_length, self._max_area = (limits[0][0], limits[1][0]) if limits else (math.inf, math.inf)
        self.zone_names: tuple[str, ...] = tuple(cfg.zones)
        self.mm_per_px = cfg.mm_per_px
        self._zones = ZoneMap(cfg.zones, max_regions, overlap=cfg.match == "overlap") if cfg.zones else None
        self._need = np.array(cfg.min_area.get("anomaly", 0.0), dtype=np.float32)
        self._area = np.empty(max_regions, dtype=np.float32)
        self._no_zone = np.full(max_regions, NO_ZONE, dtype=np.intp)
        self._ng = np.empty(max_regions, dtype=np.bool_)
        self._big = np.empty(max_regions, dtype=np.bool_)
        self._within = np.zeros(max_regions, dtype=np.bool_)
        self._frame_area = np.ones((), dtype=np.float32)

    def __call__(self, result: Anomaly, frame_w: int, frame_h: int) -> AnomalyInspected:
        k = result.scores.shape[0]
        zones, ng, big = self._no_zone[:k], self._ng[:k], self._big[:k]
        if self._zones is not None:
            zones = self._zones(result.xyxy, frame_w, frame_h)
            np.not_equal(zones, _OUTSIDE, out=ng)
        else:
            ng.fill(True)
        self._frame_area[()] = frame_w * frame_h
        area = self._area[:k]
        np.divide(result.area_px, self._frame_area, out=area)
        np.greater_equal(area, self._need, out=big)
        np.logical_and(ng, big, out=ng)
        within = self._within[:k]
        within.fill(False)
        if k and (self._max_area != math.inf or self._max_length != math.inf):
            self._tolerate(result, ng, within)
        counting = ng.tolist()  # a list: numpy's any and argmax would each make an array
        counts = True in counting
        verdict: Verdict = "ng" if result.anomalous and (k == 0 or counts or result.cut) else "ok"
        if _broken(result):  # no score to judge by (a dropped score is never anomalous)
            verdict = "uncertain"
        return AnomalyInspected(result, zones, ng, verdict, counting.index(True) if counts else 0, within)

    def _tolerate(self, result: Anomaly, ng: np.ndarray, within: np.ndarray) -> None:
        """Mark the counting regions within every size limit, and take them out of ``ng``."""
        lengths = [s[0] for s in result.sides()] if self._max_length != math.inf else None
        for i, area in enumerate(result.area_px.tolist()):
            if ng[i] and area <= self._max_area and (lengths is None or lengths[i] <= self._max_length):
                within[i] = True
                ng[i] = False

    def zone_name(self, zone: int) -> str | None:
        return None if zone == NO_ZONE else self.zone_names[zone]
