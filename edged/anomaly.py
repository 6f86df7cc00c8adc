"""Decode an anomaly model's outputs (`edged.heads.anomaly`): the image verdict and the regions of its map.

The score, label, map and mask are anomalib's own, computed inside its export; edged reads them and
only adds what anomalib leaves to its user: thresholds set in config (``model.anomaly_threshold``,
``model.pixel_threshold``, on the export's normalised scale, where 0.5 is the threshold it was
exported with), and the regions: the connected components (8-connected) of the mask, as boxes in
frame pixels with their area and their highest map value, largest first, at most ``model.max_det``.
Without thresholds in config the label and mask are the export's, so they are exactly anomalib's.

A score that is no normalised score (NaN, infinite, or outside 0..1: an export without anomalib's
normalisation) is dropped and counted as the model's problem, as a detector's bad scores are: the
frame is not anomalous (with ``[inspect]``, uncertain) and its message carries no score. So is a map
that regions are made from with a value outside 0..1 anywhere (anomalib clamps its normalised map to
0..1): its regions' peaks would be no normalised scores, so the frame has no regions, its map's
values counted (`AnomalyDecoder._map_problems`), and with ``[inspect]`` it is uncertain. Regions past
``model.max_det`` (the smallest) are counted (``cut``): the inspector cannot judge them, so a part
with any is not found within its size limits (`edged.verdict.AnomalyInspector`).

Labelling the mask's components measures their areas and bounding rectangles
(`_Components.find`); only the kept regions are worked on after it, each within its rectangle (its
mask, its peak, its outline). A frame so costs a few passes over its mask's bounding rectangle and
its kept regions' rectangles, not a pass over the whole map per region: seconds, on a noisy map of
thousands of specks.

A frame works in buffers made once per plan: the mask, the component labels, a component's mask,
the regions' boxes, areas and scores; and in buffers that grow (at least doubled) when a frame has
more components than they hold: their areas and rectangles and the keys they are sorted by. So a
frame allocates no array, except one with more components than the buffers hold (they grow) and
one with more regions than ``model.max_det`` (numpy's partition makes two arrays of 8 bytes). The
regions' outlines are traced once a frame, only when first asked for (by length limits in
``[inspect]``, or for the message's polygons and lengths): OpenCV's contours are arrays of their
own, the rest is done in buffers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import cv2
import numpy as np

from edged.errors import HeadError
from edged.geometry import BoxMap
from edged.heads.anomaly import THRESHOLD, sizes_differ, trained_size
from edged.heads.base import fmt_shape
from edged.messages import AnomalyRegion, in_mm
from edged.task import output_problems


@dataclass(frozen=True, slots=True, eq=False)
class Anomaly:
    """One frame's anomaly result (`edged.task.TaskResult`); its arrays are views of its decoder's
    buffers, valid until the decoder's next frame.

    ``xyxy`` (k, 4) float32 region boxes in frame pixels, ``area_px`` (k,) their areas in frame
    pixels, ``scores`` (k,) their highest map values, ``ids`` (k,) their component labels in the
    decoder's map-sized component image, largest region first; ``outlines_of`` traces and measures
    their outlines (`outlines`, `sides`), once a frame.
    """

    score: float
    anomalous: bool
    threshold: float
    xyxy: np.ndarray
    area_px: np.ndarray
    scores: np.ndarray
    ids: np.ndarray
    box_map: BoxMap
    outlines_of: _Outlines
    nonfinite: int = 0
    scores_above_one: int = 0  # a finite score outside 0..1: not the export's normalised score, so dropped
    anomaly_map: np.ndarray | None = None  # the model's map output, [h, w], when it has one
    heat: np.ndarray | None = None  # the decoder's uint8 buffer the map is scaled into for `heatmap`
    near: bool = False  # not anomalous, but its score within the decoder's near margin below the threshold
    cut: int = 0  # regions past model.max_det, the smallest: not among those kept, so never judged
    max_points: int = 2000  # model.max_outline_points: a longer outline is published thinned (`polygons`)

    def __len__(self) -> int:
        """Its regions; an anomalous frame without one still counts as a finding."""
        return max(int(self.scores.shape[0]), int(self.anomalous))

    def problems(self) -> list[tuple[str, int]]:
        """The output's problems, and the outlines thinned (``outline_thinned``), counted and logged alike: the
        outlines are traced for it, which the message's polygons would have done anyway."""
        found = output_problems(self.nonfinite, self.scores_above_one)
        thinned = sum(len(outline) > self.max_points for outline in self.outlines()) if self.ids.shape[0] else 0
        return [*found, ("outline_thinned", thinned)] if thinned else found

    def near_misses(self) -> int:
        """One for a part scored just below the threshold (``near``): the part worth labelling."""
        return int(self.near)

    def heatmap(self) -> np.ndarray | None:
        """The anomaly map as uint8 (0..255 for the normalised 0..1), in the decoder's buffer."""
        if self.anomaly_map is None or self.heat is None:
            return None
        cv2.convertScaleAbs(self.anomaly_map, dst=self.heat, alpha=255.0)
        return self.heat

    def outlines(self) -> list[np.ndarray]:
        """Each region's outline (its largest outer contour), (n, 1, 2) int32 in map pixels; traced
        on the first call of the frame, the same list after."""
        return self.outlines_of.outlines(self.ids)

    def sides(self) -> list[tuple[float, float]]:
        """Each region's length and width: the sides of its outline's minimum-area rectangle, in frame
        pixels (found on the outline mapped to the frame, so right under any map-to-frame scale), the
        longer first."""
        return self.outlines_of.sides(self.ids, self.box_map)

    def polygons(self) -> list[list[tuple[float, float]]]:
        """Each region's outline in frame pixels, one longer than ``max_points`` (the ragged edge of a noisy
        map: thousands of points) thinned by an even stride as a segmentation outline is; its sizes stay
        the whole outline's (`sides`)."""
        sx, sy = self.box_map.scale_x, self.box_map.scale_y
        shown = []
        for outline in self.outlines():
            points = outline.reshape(-1, 2)
            if points.shape[0] > self.max_points:
                points = points[:: -(-points.shape[0] // self.max_points)]
            shown.append([(round(x / sx, 1), round(y / sy, 1)) for x, y in points.tolist()])
        return shown

    def dataset_label(self, width: int, height: int) -> str:
        """One ``0 x1 y1 x2 y2 ...`` line per region, its outline normalised to the frame: ultralytics'
        segmentation labels, class 0 the anomaly. An outline of fewer than 3 points (a region one
        pixel wide or tall) is no polygon, and ultralytics would read two points as a box: its box's
        corners instead, as `edged.segment.Instances.dataset_label` does."""
        lines = []
        for outline, (x1, y1, x2, y2) in zip(self.polygons(), self.xyxy.tolist(), strict=True):
            points = outline if len(outline) >= 3 else [(x1, y1), (x2, y1), (x2, y2), (x1, y2)]
            lines.append("0 " + " ".join(f"{x / width:.6f} {y / height:.6f}" for x, y in points) + "\n")
        return "".join(lines)

    def dataset_class(self) -> None:
        return None  # its label is a file (`dataset_label`)

    def message_fields(
        self,
        label: Callable[[int], str],
        zones: Sequence[str | None] | None,
        thresholds: Sequence[float | None] | None,
        *,
        notes: Sequence[str | None] | None = None,
        mm_per_px: float | None = None,
    ) -> dict[str, Any]:
        """``task``, ``anomaly_score``, ``anomalous``, ``threshold`` and ``regions`` (each region's
        sizes in mm with the camera's ``mm_per_px``, and its note from the inspector: 'within
        limits'); ``detections`` is empty, and ``anomaly_score`` absent when the score was dropped
        (`problems`; a map's problems drop its regions, not a good score): the message holds only scores in 0..1."""
        boxes, areas, scores = self.xyxy.tolist(), self.area_px.tolist(), self.scores.tolist()
        in_zones = zones or [None] * len(scores)
        in_notes = notes or [None] * len(scores)
        mm = mm_per_px
        return {
            "task": "anomaly",
            "detections": [],
            "anomaly_score": round(self.score, 6) if 0.0 <= self.score <= 1.0 else None,  # a NaN too: dropped
            "anomalous": self.anomalous,
            "threshold": self.threshold,
            "regions": [
                AnomalyRegion(
                    box=(round(b[0], 1), round(b[1], 1), round(b[2], 1), round(b[3], 1)),
                    area_px=round(a, 1),
                    max_score=round(s, 4),
                    polygon=outline,
                    zone=z,
                    length_px=round(length, 1),
                    width_px=round(width, 1),
                    area_mm2=None if mm is None else in_mm(a * mm * mm),
                    length_mm=None if mm is None else in_mm(length * mm),
                    width_mm=None if mm is None else in_mm(width * mm),
                    note=note,
                )
                for b, a, s, z, note, outline, (length, width) in zip(
                    boxes, areas, scores, in_zones, in_notes, self.polygons(), self.sides(), strict=True
                )
            ],
        }


class AnomalyDecoder:
    """Reads one anomaly model's outputs for one plan; reuse it for every frame."""

    def __init__(
        self,
        outputs: Sequence[tuple[str, Sequence[int]]],
        *,
        threshold: float | None = None,
        pixel_threshold: float | None = None,
        max_regions: int = 100,
        near_margin: float | None = None,
        max_outline_points: int = 2000,
    ) -> None:
        """``outputs``: the bound outputs' (name, shape), in the session's order; ``near_margin``: how
        far below the threshold a score makes a near miss (evidence saved under ``ng+near``);
        ``max_outline_points``: the most points of a published outline; `HeadError` when the map and the
        mask differ in size (`edged.heads.anomaly.sizes_differ`)."""
        if (problem := sizes_differ(outputs)) is not None:
            raise HeadError(problem)
        self._index = {name: i for i, (name, _) in enumerate(outputs)}
        self._shapes = [tuple(shape) for _, shape in outputs]
        size = trained_size(outputs)
        self._threshold = threshold
        self.threshold = THRESHOLD if threshold is None else threshold
        self._near_from = math.inf if near_margin is None else self.threshold - near_margin
        self._pixel_threshold = None if pixel_threshold is None else np.array(pixel_threshold, dtype=np.float32)
        has_mask = "pred_mask" in self._index or ("anomaly_map" in self._index and pixel_threshold is not None)
        h, w = size if size is not None and has_mask else (0, 0)
        self._regions = h > 0
        self._mask = np.zeros((h, w), dtype=np.uint8)
        self._above = self._mask.view(np.bool_)
        self._components = _Components(h, w)
        self._max_regions = max_regions
        self._max_points = max_outline_points
        self._cut = 0  # the last frame's regions past max_regions
        self._xyxy = np.empty((max_regions, 4), dtype=np.float32)
        self._area = np.empty(max_regions, dtype=np.float32)
        self._scores = np.empty(max_regions, dtype=np.float32)
        self._ids = np.empty(max_regions, dtype=np.int32)
        self._heat = np.empty(size if size is not None else (0, 0), dtype=np.uint8)
        self._outlines = _Outlines(self._components)
        self._low, self._high = np.empty((), dtype=np.float32), np.empty((), dtype=np.float32)  # `_map_problems`

    def decode(self, outputs: Sequence[np.ndarray], box_map: BoxMap) -> Anomaly:
        """The frame's score, verdict and regions; `HeadError` only when ``outputs`` are not the
        arrays this decoder was built for."""
        shapes = [o.shape for o in outputs]
        if shapes != self._shapes:
            shown = ", ".join(fmt_shape(s) for s in shapes)
            raise HeadError(f"anomaly decoder expects outputs {[fmt_shape(s) for s in self._shapes]}, got {shown}")
        score = float(outputs[self._index["pred_score"]].flat[0])
        nonfinite = 0 if math.isfinite(score) else 1
        outside = int(not nonfinite and not 0.0 <= score <= 1.0)
        if nonfinite or outside:  # no score to judge by: dropped and counted (`Anomaly.problems`)
            anomalous = False
        elif self._threshold is not None or "pred_label" not in self._index:
            anomalous = score > self.threshold
        else:
            anomalous = bool(outputs[self._index["pred_label"]].flat[0])
        self._cut = 0
        k = 0
        if self._regions:
            broken = self._map_problems(outputs)
            nonfinite, outside = nonfinite + broken[0], outside + broken[1]
            k = 0 if broken != (0, 0) else self._find_regions(outputs, box_map)
        self._outlines.clear()
        return Anomaly(
            score,
            anomalous,
            self.threshold,
            self._xyxy[:k],
            self._area[:k],
            self._scores[:k],
            self._ids[:k],
            box_map,
            self._outlines,
            nonfinite,
            outside,
            outputs[self._index["anomaly_map"]][0, 0] if "anomaly_map" in self._index else None,
            self._heat,
            near=not (anomalous or outside) and score >= self._near_from,
            cut=self._cut,
            max_points=self._max_points,
        )

    def _map_problems(self, outputs: Sequence[np.ndarray]) -> tuple[int, int]:
        """The map's NaN or infinite values, and its finite values outside 0..1; (0, 0) without a map.

        A region's peak is published as a score in 0..1 and anomalib clamps its normalised map to that:
        a value outside it (an export without anomalib's normalisation, a broken one) would make a
        message no reader accepts, so the frame's regions are dropped and these counted. Its lowest
        and highest values take two passes and no array; only a map found broken is counted.
        """
        if "anomaly_map" not in self._index:
            return 0, 0
        values = outputs[self._index["anomaly_map"]]
        np.minimum.reduce(values, axis=None, out=self._low)
        np.maximum.reduce(values, axis=None, out=self._high)
        if 0.0 <= float(self._low) and float(self._high) <= 1.0:  # false for a NaN
            return 0, 0
        finite = np.isfinite(values)
        outside = np.count_nonzero(finite & ((values < 0.0) | (values > 1.0)))
        return int(values.size - np.count_nonzero(finite)), int(outside)

    def _find_regions(self, outputs: Sequence[np.ndarray], box_map: BoxMap) -> int:
        """Fill the region buffers from the mask (the export's, or the map above ``model.pixel_threshold``)."""
        anomaly_map = outputs[self._index["anomaly_map"]][0, 0] if "anomaly_map" in self._index else None
        if self._pixel_threshold is not None and anomaly_map is not None:
            np.greater(anomaly_map, self._pixel_threshold, out=self._above)
        else:
            np.copyto(self._mask, outputs[self._index["pred_mask"]][0, 0], casting="unsafe")
        if not cv2.countNonZero(self._mask):
            return 0
        kept = self._components.find(self._mask, self._max_regions)
        self._cut = self._components.count - len(kept)
        sx, sy = box_map.scale_x, box_map.scale_y
        for k, region in enumerate(kept):
            x, y, bw, bh, area = self._components.stats(region)
            box = self._xyxy[k]
            box[0], box[1], box[2], box[3] = x / sx, y / sy, (x + bw) / sx, (y + bh) / sy
            self._area[k] = area / (sx * sy)
            self._ids[k] = region
            if anomaly_map is None:
                self._scores[k] = 1.0
                continue
            selected, _ = self._components.select(region)
            self._scores[k] = cv2.minMaxLoc(anomaly_map[y : y + bh, x : x + bw], mask=selected)[1]  # the region's peak
        return len(kept)


_ONE_BY_ONE = 4
"""Up to this many regions are measured one by one, a pass over the mask's bounding rectangle each:
OpenCV's stats pass, which measures the background's every pixel too, costs about eight of them."""


class _Components:
    """The connected regions (8-connected) of the decoder's mask: their labels in a buffer of the
    map's size, their areas and bounding rectangles, and one region's mask at a time, cut to its
    rectangle. Apart from the decoder so that `_Outlines` can select regions without holding the
    decoder: a cycle kept each dropped decoder's buffers until the cyclic collector came round, tens
    of MB for a tool reading images of many sizes."""

    def __init__(self, h: int, w: int) -> None:
        self.labels = np.zeros((h, w), dtype=np.int32)  # the last frame's only within its mask's bounding rectangle
        self.count = 0  # the last frame's regions
        self._corner = (0, 0)  # where the last frame's labelling began: the stats' rectangles are from there
        self._in_region = np.empty(h * w, dtype=np.bool_)  # a region's mask, shaped to the rectangle it is cut to
        self._region = np.zeros((), dtype=np.int32)  # 0-d operand: a Python int costs numpy an array per call
        self._key_area = np.array(-(1 << 32), dtype=np.int64)
        self._key_label = np.array(0xFFFFFFFF, dtype=np.int64)
        self._grow(_ONE_BY_ONE + 1)

    def _grow(self, n: int) -> None:
        """Buffers for ``n`` labels (the background's included): the stats (OpenCV's layout) and
        centroids, the sort keys, and the labels themselves as int64 to build the keys from."""
        self._stats = np.empty((n, 5), dtype=np.int32)
        self._centroids = np.empty((n, 2), dtype=np.float64)  # unused, but OpenCV writes them
        self._keys = np.empty(n, dtype=np.int64)
        self._numbers = np.arange(n, dtype=np.int64)

    def find(self, mask: np.ndarray, most: int) -> list[int]:
        """Label ``mask``'s regions and measure them; the labels of the ``most`` largest, largest first
        and equal areas in label order.

        Only the mask's bounding rectangle is labelled, from even coordinates: OpenCV's 8-connected
        labelling (BBDT, CCL_GRANA, or the default Spaghetti alike) works in 2 x 2 blocks and numbers
        the regions in the order of their first block, so the map's blocks give the map's labels.
        More regions than `_ONE_BY_ONE` are labelled again with OpenCV's stats: it writes them into
        buffers only of exactly their count of rows (it makes new arrays otherwise), which the first
        pass counts. BBDT's stats pass costs a third of Spaghetti's."""
        x, y, w, h = cv2.boundingRect(mask)
        x0, y0, w, h = x & ~1, y & ~1, w + (x & 1), h + (y & 1)
        around, labels = mask[y0 : y0 + h, x0 : x0 + w], self.labels[y0 : y0 + h, x0 : x0 + w]
        n = cv2.connectedComponentsWithAlgorithm(around, 8, cv2.CV_32S, cv2.CCL_GRANA, labels)[0]
        self.count, self._corner = n - 1, (x0, y0)
        if self.count <= _ONE_BY_ONE:
            for region in range(1, n):
                selected = self._cut(region, x0, y0, w, h)
                row = self._stats[region]
                row[0], row[1], row[2], row[3] = cv2.boundingRect(selected)
                row[4] = cv2.countNonZero(selected)
        else:
            if n > self._stats.shape[0]:
                self._grow(max(n, 2 * self._stats.shape[0]))
            stats, centroids = self._stats[:n], self._centroids[:n]
            cv2.connectedComponentsWithStatsWithAlgorithm(around, 8, cv2.CV_32S, cv2.CCL_GRANA, labels, stats, centroids)
        keys = self._keys[: self.count]  # -area in the high 32 bits, the label in the low: ascending is the order
        np.copyto(keys, self._stats[1:n, cv2.CC_STAT_AREA])
        np.multiply(keys, self._key_area, out=keys)
        np.add(keys, self._numbers[1:n], out=keys)
        kept = keys[: min(most, self.count)]
        if kept.shape[0] < self.count:
            keys.partition(kept.shape[0] - 1)  # the largest first, in O(regions), unordered
        kept.sort()
        np.bitwise_and(kept, self._key_label, out=kept)
        regions: list[int] = kept.tolist()
        return regions

    def stats(self, region: int) -> tuple[int, int, int, int, int]:
        """Region ``region``'s bounding rectangle (x, y, width, height) in the map and its area, in map pixels."""
        x, y, w, h, area = self._stats[region].tolist()
        return x + self._corner[0], y + self._corner[1], w, h, area

    def select(self, region: int) -> tuple[np.ndarray, tuple[int, int]]:
        """The mask of region ``region`` over its bounding rectangle (`_cut`), and the rectangle's
        top-left corner in the map."""
        x, y, w, h, _ = self.stats(region)
        return self._cut(region, x, y, w, h), (x, y)

    def _cut(self, region: int, x: int, y: int, w: int, h: int) -> np.ndarray:
        """The uint8 mask (0 or 1) of region ``region`` within the map's rectangle (x, y, w, h), in this
        object's buffer."""
        selected = self._in_region[: w * h].reshape(h, w)
        self._region[()] = region
        np.equal(self.labels[y : y + h, x : x + w], self._region, out=selected)
        return selected.view(np.uint8)


class _Outlines:
    """One frame's region outlines and their sizes, worked out once, when first asked for. Each is
    traced within its region's rectangle (offset back to map pixels), so it costs the rectangle, not
    the map; OpenCV's contours are arrays of its own (findContours makes them), each outline mapped
    to the frame for its rectangle in a buffer grown (once per longer outline) to the longest seen."""

    def __init__(self, components: _Components) -> None:
        """``components``: the decoder's regions, one selected at a time."""
        self._components = components
        self._scale = np.ones(2, dtype=np.float32)
        self._points = np.empty((0, 2), dtype=np.float32)
        self._outlines: list[np.ndarray] | None = None
        self._sides: list[tuple[float, float]] | None = None

    def clear(self) -> None:
        """Forget the last frame's outlines: a new frame's regions are in the decoder's buffers."""
        self._outlines = self._sides = None

    def outlines(self, ids: np.ndarray) -> list[np.ndarray]:
        if self._outlines is None:
            self._outlines = []
            for region in ids.tolist():
                selected, corner = self._components.select(region)
                contours, _ = cv2.findContours(selected, cv2.RETR_EXTERNAL, cv2.CHAIN_APPROX_SIMPLE, offset=corner)
                self._outlines.append(max(contours, key=len) if contours else np.zeros((0, 1, 2), dtype=np.int32))
        return self._outlines

    def sides(self, ids: np.ndarray, box_map: BoxMap) -> list[tuple[float, float]]:
        if self._sides is None:
            self._scale[0], self._scale[1] = box_map.scale_x, box_map.scale_y
            self._sides = [self._rectangle(outline.reshape(-1, 2)) for outline in self.outlines(ids)]
        return self._sides

    def _rectangle(self, outline: np.ndarray) -> tuple[float, float]:
        """The sides of ``outline``'s minimum-area rectangle once mapped to frame pixels, the longer first."""
        n = outline.shape[0]
        if n == 0:
            return 0.0, 0.0
        if self._points.shape[0] < n:
            self._points = np.empty((n, 2), dtype=np.float32)
        points = self._points[:n]
        np.copyto(points, outline, casting="unsafe")
        np.divide(points, self._scale, out=points)
        (_, _), (w, h), _ = cv2.minAreaRect(points)
        return float(max(w, h)), float(min(w, h))
