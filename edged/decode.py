"""Decode: turn a detector's raw output tensor into detections in frame pixels.

This stage owns everything between the ONNX output and the detections handed on that every head
format shares: the score threshold, NMS (see `edged.nms`), mapping boxes back through the
preprocess `BoxMap`, and dropping anything a broken or hostile model emits (non-finite values,
scores above 1, unknown classes). What differs per format, recognising it and selecting its
candidates, lives in `edged.heads`. It runs per frame, so it works in buffers allocated once per
decoder and creates no arrays.

With a ``near_margin`` (evidence saved under ``ng+near``) the decoder also finds the near misses:
candidates within the margin below their class's threshold that no better box suppresses. They are
found in a second NMS pass over candidates down to ``threshold - near_margin`` and handed on as
`Detections.near`, never mixed into the detections: those come from the first pass exactly as
without a margin.

The order is ultralytics' predict, step for step, so that the boxes are the ones a user validated
there: threshold and NMS on the unclipped boxes in the model's input space, then ``max_det``,
then mapping to the frame and clipping. Only where ultralytics returns a box that clipping left
with zero area (one wholly outside the frame, flattened onto its edge) does edged drop it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from edged.errors import HeadError
from edged.geometry import BoxMap
from edged.heads.base import Head, TrueIndex, fmt_shape, rows
from edged.heads.registry import head_named
from edged.messages import Detection
from edged.nms import GreedyNms
from edged.task import output_problems

_ZERO = np.array(0.0, dtype=np.float32)  # 0-d operands: a Python float costs numpy an array per call
_NEG_INF = np.array(-np.inf, dtype=np.float32)
_ONE = np.array(1.0, dtype=np.float32)


@dataclass(frozen=True, slots=True, eq=False)
class Detections:
    """Detections of one frame as columns; row i of each array is one detection.

    ``xyxy`` (N, 4) float32 x1 y1 x2 y2 in frame pixels, inside the frame with x2 > x1, y2 > y1;
    ``scores`` (N,) float32, descending; ``class_ids`` (N,) int32. Decode returns read-only
    views of its own buffers so one result can be shared by every consumer without copies; they
    hold until the decoder's next frame, so a consumer that keeps a result copies the arrays.
    """

    xyxy: np.ndarray
    scores: np.ndarray
    class_ids: np.ndarray
    # Candidates dropped because their score was above 1: not a probability, so the model's head
    # or the input normalisation is wrong; the daemon counts and reports it.
    scores_above_one: int = 0
    # NaN or infinite values anywhere in the output: a NaN score never passes the threshold, so
    # without this count a model broken that way would publish nothing, silently.
    nonfinite: int = 0
    # With a near margin: the candidates within it below their class's threshold that survived
    # NMS among every candidate down to that margin; they are not detections, only a reason to
    # keep the frame as evidence. None when the decoder looks for none.
    near: Detections | None = None

    def __len__(self) -> int:
        return int(self.scores.shape[0])

    # ---- as the detection task's result (`edged.task.TaskResult`) ------------------------------

    def problems(self) -> list[tuple[str, int]]:
        return output_problems(self.nonfinite, self.scores_above_one)

    def near_misses(self) -> int:
        return len(self.near) if self.near is not None else 0

    def dataset_label(self, width: int, height: int) -> str:
        """One ``class cx cy w h`` line per detection, normalised to the frame: what ultralytics trains on."""
        lines = []
        for (x1, y1, x2, y2), c in zip(self.xyxy.tolist(), self.class_ids.tolist(), strict=True):
            cx, cy, w, h = (x1 + x2) / 2 / width, (y1 + y2) / 2 / height, (x2 - x1) / width, (y2 - y1) / height
            lines.append(f"{c} {cx:.6f} {cy:.6f} {w:.6f} {h:.6f}\n")
        return "".join(lines)

    def dataset_class(self) -> None:
        return None

    def heatmap(self) -> None:
        return None

    def message_fields(
        self,
        label: Callable[[int], str],
        zones: Sequence[str | None] | None,
        thresholds: Sequence[float | None] | None,
        *,
        notes: Sequence[str | None] | None = None,
        mm_per_px: float | None = None,
    ) -> dict[str, Any]:
        """``detections``. Each column becomes a Python list in one ``tolist`` call, rather than one
        numpy scalar per value: that halves the cost of building the message."""
        boxes, scores, class_ids = self.xyxy.tolist(), self.scores.tolist(), self.class_ids.tolist()
        n = len(class_ids)
        marks = zip(zones or [None] * n, thresholds or [None] * n, notes or [None] * n, strict=True)
        return {
            "detections": [
                Detection(
                    class_id=c,
                    label=label(c),
                    score=round(s, 4),
                    box=(round(b[0], 1), round(b[1], 1), round(b[2], 1), round(b[3], 1)),
                    zone=z,
                    threshold=round(t, 4) if t is not None else None,
                    note=note,
                )
                for b, s, c, (z, t, note) in zip(boxes, scores, class_ids, marks, strict=True)
            ]
        }


class Decoder:
    """Decodes one head format for one fixed output shape; reuse it for every frame.

    Every buffer a frame needs is allocated here and in the head, sized for the worst case of
    every candidate passing the threshold (about twice the output tensor for yolov8 and yolov5
    heads); `decode` only slices and fills them, so after the first frame decoding creates no
    numpy arrays. The result is a set of read-only views of this decoder's buffers: it is valid
    until the next `decode` call, so a consumer that keeps one copies its arrays.
    """

    def __init__(
        self,
        head: str,
        output_shape: Sequence[int],
        num_classes: int,
        *,
        conf: float = 0.25,
        iou: float = 0.45,
        max_det: int = 100,
        agnostic: bool = False,
        thresholds: Sequence[float] | None = None,
        near_margin: float | None = None,
    ) -> None:
        if not 0.0 < conf <= 1.0:
            raise ValueError(f"conf must be in (0, 1], got {conf}")
        if thresholds is not None and (len(thresholds) != num_classes or not all(0.0 < t <= 1.0 for t in thresholds)):
            raise ValueError(f"thresholds must be {num_classes} values in (0, 1], got {list(thresholds)}")
        if near_margin is not None and not 0.0 < near_margin <= 1.0:
            raise ValueError(f"near_margin must be in (0, 1], got {near_margin}")
        if not 0.0 < iou <= 1.0:
            raise ValueError(f"iou must be in (0, 1], got {iou}")
        if max_det < 1:
            raise ValueError(f"max_det must be >= 1, got {max_det}")
        # Per class: a candidate is kept when its score is above its class's threshold. The head's
        # first cut is the lowest of them, so with one threshold for all this is ultralytics' conf.
        self._thresholds = np.array(thresholds if thresholds is not None else [conf] * num_classes, dtype=np.float32)
        # A near miss scores above its class's threshold less the margin (and above 0: an empty
        # candidate is no miss); the head's first cut is then the lowest of those.
        self._near_thresholds: np.ndarray | None = None
        cut = self._thresholds
        if near_margin is not None:
            cut = self._near_thresholds = np.maximum(self._thresholds - np.float32(near_margin), _ZERO)
        self._head = head_named(head)(output_shape, num_classes, min(cut.tolist(), default=conf))
        n = self._head.capacity
        self._candidate_thresholds = np.empty(n, dtype=np.float32)
        self._nms = GreedyNms(n, iou if self._head.needs_nms else None, max_det=max_det, agnostic=agnostic)
        self._as_f32: np.ndarray | None = None  # a float32 copy of a float16/float64 output
        self._finite = np.empty(self._head.output_shape, dtype=np.bool_)  # which output values are finite
        # Over the k candidates the head selected: the tests of `_finish`, one row each.
        self._checks = np.empty((6, n), dtype=np.bool_)
        self._valid = np.empty(n, dtype=np.bool_)
        self._invalid = np.empty(n, dtype=np.bool_)
        self._nms_scores = np.empty(n, dtype=np.float32)
        # Frame mapping of the last BoxMap seen, as (4, 1) columns for x1 y1 x2 y2.
        self._mapped: BoxMap | None = None
        self._pad = np.zeros((4, 1), dtype=np.float32)
        self._scale = np.ones((4, 1), dtype=np.float32)
        self._limit = np.zeros((4, 1), dtype=np.float32)
        most = min(max_det, n)
        self._keep = np.empty(most, dtype=np.intp)  # what NMS kept, best first
        self._kept = _KeptRows(most)
        # The near-miss pass, only with a near margin: what its NMS kept, which of those are below
        # their threshold, and those mapped to the frame.
        self._near_keep = np.empty(most if near_margin is not None else 0, dtype=np.intp)
        self._near_kept_thresholds = np.empty_like(self._near_keep, dtype=np.float32)
        self._near_kept_scores = np.empty_like(self._near_keep, dtype=np.float32)
        self._below = np.empty_like(self._near_keep, dtype=np.bool_)
        self._below_index = TrueIndex(self._near_keep.shape[0])
        self._near_only = np.empty_like(self._near_keep)
        self._near_kept = _KeptRows(self._near_keep.shape[0])

    @property
    def head(self) -> Head:
        return self._head

    def kept(self) -> np.ndarray:
        """The head's candidate slots (its ``boxes``, ``scores`` and ``class_ids`` columns) of the last
        frame's detections, in their order: a view, valid until the next frame."""
        return self._kept.slots

    def decode(self, output: np.ndarray, box_map: BoxMap) -> Detections:
        """Threshold, NMS and ``max_det`` in input space, then map to frame pixels and clip.

        Never raises on bad values; raises `HeadError` only when ``output`` is not the float
        array of the shape this decoder was built for. Floating-point warnings are silenced
        because non-finite values are expected from broken models and are filtered out.
        """
        self._check_output(output)
        with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
            values = self._float32(output)
            np.isfinite(values, out=self._finite)
            nonfinite = self._finite.size - int(np.count_nonzero(self._finite))
            k = self._head.select(values[0])
            return self._finish(k, box_map, nonfinite)

    def _check_output(self, output: object) -> None:
        """Raise `HeadError` unless ``output`` is a float array of this decoder's shape."""
        expected = self._head.output_shape
        if not isinstance(output, np.ndarray):
            got = type(output).__name__
        elif output.shape != expected or output.dtype.kind != "f":
            got = f"{output.dtype} {fmt_shape(output.shape)}"
        else:
            return
        raise HeadError(f"{self._head.name} decoder expects a float array {fmt_shape(expected)}, got {got}")

    def _float32(self, output: np.ndarray) -> np.ndarray:
        """``output`` itself when float32, else converted into a buffer made on the first frame."""
        if output.dtype == np.float32:
            return output
        if self._as_f32 is None:
            self._as_f32 = np.empty(self._head.output_shape, dtype=np.float32)
        np.copyto(self._as_f32, output)
        return self._as_f32

    def _finish(self, k: int, box_map: BoxMap, nonfinite: int) -> Detections:
        """Drop the k selected candidates that are not detections, suppress, map what is kept.

        A candidate is dropped (its score set to -inf) when its box is not finite, or its score
        is not above its class's threshold or is above 1 (counted: scores are probabilities). Empty or inverted
        boxes stay in, as in ultralytics: they overlap nothing, but they hold a ``max_det`` slot.
        """
        head = self._head
        boxes, scores, valid = rows(head.boxes, 4, k), head.scores[:k], self._valid[:k]
        checks, invalid = self._checks[:, :k], self._invalid[:k]
        np.isfinite(boxes, out=checks[:4])
        candidate_thresholds = self._candidate_thresholds[:k]
        np.take(
            self._thresholds, head.class_ids[:k], out=candidate_thresholds, mode="clip"
        )  # a bad class: dropped by its head
        np.greater(scores, _ONE, out=invalid)  # +inf included
        above_one = int(np.count_nonzero(invalid))
        np.logical_not(invalid, out=checks[5])
        near = None
        if self._near_thresholds is not None:
            near = self._near_misses(k, self._near_thresholds, box_map)
        np.greater(scores, candidate_thresholds, out=checks[4])  # also false for NaN
        np.logical_and.reduce(checks, axis=0, out=valid)
        np.logical_not(valid, out=invalid)
        np.copyto(scores, _NEG_INF, where=invalid)
        nms_scores = self._nms_scores[:k]
        np.copyto(nms_scores, scores)
        n = self._nms(boxes, nms_scores, head.class_ids[:k], self._keep)
        xyxy, kept_scores, kept_ids = self._kept(self._keep[:n], boxes, scores, head.class_ids, self._frame_mapping(box_map))
        return Detections(xyxy, kept_scores, kept_ids, above_one, nonfinite, near)

    def _near_misses(self, k: int, near_thresholds: np.ndarray, box_map: BoxMap) -> Detections:
        """The near misses among the k candidates (their finite and at-most-1 checks already made).

        NMS runs over every candidate above its near threshold, so a weaker box around an object
        already detected is suppressed by it, not taken for a near miss; what it keeps below the
        class's threshold are the near misses.
        """
        head = self._head
        boxes, scores, valid, checks = rows(head.boxes, 4, k), head.scores[:k], self._valid[:k], self._checks[:, :k]
        candidate_near = self._nms_scores[:k]  # scratch until the NMS scores are filled below
        np.take(near_thresholds, head.class_ids[:k], out=candidate_near, mode="clip")
        np.greater(scores, candidate_near, out=checks[4])
        np.logical_and.reduce(checks, axis=0, out=valid)
        nms_scores = self._nms_scores[:k]
        np.copyto(nms_scores, _NEG_INF)
        np.copyto(nms_scores, scores, where=valid)
        n = self._nms(boxes, nms_scores, head.class_ids[:k], self._near_keep)
        keep, below = self._near_keep[:n], self._below[:n]
        kept_thresholds, kept_scores = self._near_kept_thresholds[:n], self._near_kept_scores[:n]
        np.take(self._candidate_thresholds, keep, out=kept_thresholds, mode="clip")
        np.take(scores, keep, out=kept_scores, mode="clip")
        np.less_equal(kept_scores, kept_thresholds, out=below)
        index = self._below_index(below)
        near_keep = self._near_only[: index.shape[0]]
        np.take(keep, index, out=near_keep, mode="clip")
        xyxy, near_scores, ids = self._near_kept(near_keep, boxes, scores, head.class_ids, self._frame_mapping(box_map))
        return Detections(xyxy, near_scores, ids)

    def _frame_mapping(self, box_map: BoxMap) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(pad, scale, limit) columns for ``box_map`` in the head's box units (input pixels, or
        fractions of the input for a normalised head), refilled only when the map changes."""
        if box_map is not self._mapped:
            unit_x, unit_y = (box_map.input_w, box_map.input_h) if self._head.normalised else (1, 1)
            self._pad[:, 0] = (box_map.pad_x / unit_x, box_map.pad_y / unit_y) * 2
            self._scale[:, 0] = (box_map.scale_x / unit_x, box_map.scale_y / unit_y) * 2
            self._limit[:, 0] = (box_map.frame_w, box_map.frame_h) * 2
            self._mapped = box_map
        return self._pad, self._scale, self._limit


class _KeptRows:
    """What NMS kept of a frame's candidates (at most ``most``), mapped to the frame, as read-only views."""

    def __init__(self, most: int) -> None:
        self._columns = np.empty(4 * most, dtype=np.float32)
        self._sides = np.empty((2, most), dtype=np.bool_)
        self._has_area = np.empty(most, dtype=np.bool_)
        self._index_of = TrueIndex(most)
        self._shown_keep = np.empty(most, dtype=np.intp)
        self._shown_columns = np.empty(4 * most, dtype=np.float32)
        self._xyxy = np.empty((most, 4), dtype=np.float32)
        self._scores = np.empty(most, dtype=np.float32)
        self._ids = np.empty(most, dtype=np.intp)
        self._ids32 = np.empty(most, dtype=np.int32)
        # What consumers see: read-only views made once; their slices are read-only too.
        self._shown = tuple(_read_only(a.view()) for a in (self._xyxy, self._scores, self._ids32))
        self.slots = self._shown_keep[:0]  # the kept rows' candidate slots, in their order (`Decoder.kept`)

    def __call__(
        self,
        keep: np.ndarray,
        boxes: np.ndarray,
        scores: np.ndarray,
        class_ids: np.ndarray,
        mapping: tuple[np.ndarray, np.ndarray, np.ndarray],
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The candidates at ``keep`` mapped as ultralytics' scale_boxes does (less the padding,
        divided by the gain in float32, clipped), those left with an area: xyxy, scores, class ids."""
        n = keep.shape[0]
        columns = rows(self._columns, 4, n)
        np.take(boxes, keep, axis=1, out=columns, mode="clip")
        pad, scale, limit = mapping
        np.subtract(columns, pad, out=columns)
        np.divide(columns, scale, out=columns)
        np.clip(columns, _ZERO, limit, out=columns)
        sides, has_area = self._sides[:, :n], self._has_area[:n]
        np.greater(columns[2:], columns[:2], out=sides)
        np.logical_and(sides[0], sides[1], out=has_area)
        shown = self._index_of(has_area)
        m = shown.shape[0]
        kept, shown_columns = self._shown_keep[:m], rows(self._shown_columns, 4, m)
        np.take(keep, shown, out=kept, mode="clip")
        self.slots = kept
        np.take(columns, shown, axis=1, out=shown_columns, mode="clip")
        np.copyto(self._xyxy[:m], shown_columns.T)
        np.take(scores, kept, out=self._scores[:m], mode="clip")
        np.take(class_ids, kept, out=self._ids[:m], mode="clip")  # into int32 it would allocate
        np.copyto(self._ids32[:m], self._ids[:m])
        xyxy, shown_scores, ids = self._shown
        return xyxy[:m], shown_scores[:m], ids[:m]


def _read_only(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False
    return array
