"""Decode: turn a detector's raw output tensor into detections in frame pixels.

This stage owns everything between the ONNX output and the detections handed on: recognising
the head format from the model's output shape and ultralytics metadata, the score threshold,
NMS (see `edged.nms`), mapping boxes back through the preprocess `BoxMap`, and dropping
anything a broken or hostile model emits (non-finite values, empty boxes, unknown classes).
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, get_args

import numpy as np

from edged.geometry import BoxMap
from edged.nms import batched_nms, nms

HeadFormat = Literal["yolov8", "yolov5", "end2end"]
HEAD_FORMATS: tuple[HeadFormat, ...] = get_args(HeadFormat)

_LAYOUTS = "[1, 4+nc, N] (yolov8), [1, N, 5+nc] (yolov5) or [1, K, 6] (end2end)"
_MAX_LITERAL_CHARS = 1_000_000

Dim = int | str | None
# (K, 4) float64 x1 y1 x2 y2 in input pixels, (K,) scores, (K,) integer class ids.
_Candidates = tuple[np.ndarray, np.ndarray, np.ndarray]


class HeadError(ValueError):
    """The model's output does not match a supported detection head."""


@dataclass(frozen=True, slots=True, eq=False)
class Detections:
    """Detections of one frame as columns; row i of each array is one detection.

    ``xyxy`` (N, 4) float32 x1 y1 x2 y2 in frame pixels, inside the frame with x2 > x1, y2 > y1;
    ``scores`` (N,) float32, descending; ``class_ids`` (N,) int32. Decode returns read-only
    arrays so one result can be shared by every consumer without copies.
    """

    xyxy: np.ndarray
    scores: np.ndarray
    class_ids: np.ndarray

    def __len__(self) -> int:
        return int(self.scores.shape[0])


def parse_names(metadata: Mapping[str, str]) -> list[str] | None:
    """Class names indexed by class id from ultralytics' ``names`` metadata; None if unusable.

    The value is a Python literal written by the exporter (``"{0: 'person', 1: 'car'}"``, or a
    list from older exports). It comes from an untrusted model file, hence ``ast.literal_eval``.
    Ids must be exactly 0..n-1 so that a class id can index the list.
    """
    value = _literal(metadata.get("names"))
    if isinstance(value, dict):
        value = _names_from_dict(value)
    if not isinstance(value, (list, tuple)) or not value:
        return None
    names = [name for name in value if isinstance(name, str)]
    return names if len(names) == len(value) else None


def detect_head(
    output_shapes: Sequence[Sequence[Dim]], metadata: Mapping[str, str]
) -> tuple[HeadFormat, int]:
    """Pick the head format and class count from the output shapes and ultralytics metadata.

    A symbolic dimension (str or None, as ONNX Runtime reports dynamic axes) is taken as the
    candidate count. [1, A, B] with A < B is yolov8; with A > B it is end2end when B == 6 and
    the metadata rules out a 1-class yolov5 (NMS flag, names other than one, or a 'task' key:
    only the ultralytics package writes one, and it never exports the yolov5 layout), else
    yolov5. Known names must agree with the shape. Raises `HeadError` naming the shape otherwise.
    """
    if len(output_shapes) != 1:
        shown = ", ".join(_fmt(shape) for shape in output_shapes) or "none"
        raise HeadError(f"expected exactly one detection output {_LAYOUTS}; got {shown}")
    shape = list(output_shapes[0])
    task = metadata.get("task")
    if task not in (None, "detect"):
        raise HeadError(
            f"model task {task!r} is not supported (output {_fmt(shape)}); only 'detect' is"
        )
    names = parse_names(metadata)
    n_names = None if names is None else len(names)
    features, candidates_in_rows = _feature_dim(shape)
    if not candidates_in_rows:
        return _columns_head(shape, features, n_names, _says_end2end(metadata))
    not_yolov5 = task is not None or (n_names is not None and n_names != 1)
    return _rows_head(shape, features, n_names, _says_end2end(metadata), not_yolov5)


class Decoder:
    """Decodes one head format for one fixed output shape; reuse it for every frame.

    Per-frame work over all N candidates writes into buffers preallocated here; only arrays
    sized by the few candidates above the score threshold are allocated per frame.
    """

    def __init__(
        self,
        head: HeadFormat,
        output_shape: Sequence[int],
        num_classes: int,
        *,
        conf: float = 0.25,
        iou: float = 0.45,
        max_det: int = 100,
        agnostic: bool = False,
    ) -> None:
        if not 0.0 < conf <= 1.0:
            raise ValueError(f"conf must be in (0, 1], got {conf}")
        if not 0.0 < iou <= 1.0:
            raise ValueError(f"iou must be in (0, 1], got {iou}")
        if max_det < 1:
            raise ValueError(f"max_det must be >= 1, got {max_det}")
        self.head: HeadFormat = head
        self.num_classes = num_classes
        self.output_shape = _checked_shape(head, output_shape, num_classes)
        self._conf = float(conf)
        self._iou = float(iou)
        self._max_det = max_det
        self._agnostic = agnostic
        selectors: dict[str, Callable[[np.ndarray], _Candidates]] = {
            "yolov8": self._select_yolov8,
            "yolov5": self._select_yolov5,
            "end2end": self._select_end2end,
        }
        self._select = selectors[head]
        n = self.output_shape[2] if head == "yolov8" else self.output_shape[1]
        self._scores = np.empty(n, dtype=np.float32)
        self._mask = np.empty(n, dtype=np.bool_)

    def decode(self, output: np.ndarray, box_map: BoxMap) -> Detections:
        """Threshold, NMS, keep ``max_det`` best, map to frame pixels and clip.

        Never raises on bad values; raises `HeadError` only when ``output`` is not the float
        array of the shape this decoder was built for. Floating-point warnings are silenced
        because non-finite values are expected from broken models and are filtered out.
        """
        self._check_output(output)
        with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
            xyxy, scores, class_ids = self._select(output[0])
            return self._finish(xyxy, scores, class_ids, box_map)

    def _check_output(self, output: object) -> None:
        """Raise `HeadError` unless ``output`` is a float array of this decoder's shape."""
        if not isinstance(output, np.ndarray):
            got = type(output).__name__
        elif output.shape != self.output_shape or output.dtype.kind != "f":
            got = f"{output.dtype} {_fmt(output.shape)}"
        else:
            return
        raise HeadError(
            f"{self.head} decoder expects a float array {_fmt(self.output_shape)}, got {got}"
        )

    def _select_yolov8(self, pred: np.ndarray) -> _Candidates:
        """(4+nc, N) rows cx cy w h, class scores -> candidates scoring >= conf."""
        class_scores = pred[4:]
        np.max(class_scores, axis=0, out=self._scores)
        np.greater_equal(self._scores, self._conf, out=self._mask)
        idx = np.flatnonzero(self._mask)
        class_ids = class_scores[:, idx].argmax(axis=0)
        return _cxcywh_to_xyxy(pred[:4, idx].T), self._scores[idx], class_ids

    def _select_yolov5(self, pred: np.ndarray) -> _Candidates:
        """(N, 5+nc) columns cx cy w h obj, class probs -> candidates with obj * prob >= conf.

        Class probabilities are at most 1, so objectness >= conf is a cheap first filter.
        """
        np.greater_equal(pred[:, 4], self._conf, out=self._mask)
        rows = pred[np.flatnonzero(self._mask)]
        probs = rows[:, 5:]
        scores = rows[:, 4] * probs.max(axis=1)
        keep = scores >= self._conf
        return _cxcywh_to_xyxy(rows[keep, :4]), scores[keep], probs[keep].argmax(axis=1)

    def _select_end2end(self, pred: np.ndarray) -> _Candidates:
        """(K, 6) columns x1 y1 x2 y2 score class -> candidates with a valid integral class."""
        np.greater_equal(pred[:, 4], self._conf, out=self._mask)
        rows = pred[np.flatnonzero(self._mask)]
        cls = rows[:, 5]
        rows = rows[(cls >= 0) & (cls < self.num_classes) & (cls == np.floor(cls))]
        return rows[:, :4].astype(np.float64), rows[:, 4], rows[:, 5].astype(np.int64)

    def _finish(
        self, xyxy: np.ndarray, scores: np.ndarray, class_ids: np.ndarray, box_map: BoxMap
    ) -> Detections:
        """Map (K, 4) input-pixel boxes to the frame, drop invalid ones, suppress, build result.

        Clipping before NMS keeps the class offset small and means boxes lying wholly in the
        letterbox padding are dropped rather than taking a ``max_det`` slot. NMS judges the
        float32 boxes that are returned, so no returned pair can overlap more than ``iou``.
        """
        pad = np.array([box_map.pad_x, box_map.pad_y] * 2, dtype=np.float64)
        scale = np.array([box_map.scale_x, box_map.scale_y] * 2, dtype=np.float64)
        limit = np.array([box_map.frame_w, box_map.frame_h] * 2, dtype=np.float64)
        boxes = (xyxy - pad) / scale
        ok = np.isfinite(boxes).all(axis=1) & np.isfinite(scores)
        np.clip(boxes, 0.0, limit, out=boxes)
        boxes32 = boxes.astype(np.float32)
        ok &= (boxes32[:, 2] > boxes32[:, 0]) & (boxes32[:, 3] > boxes32[:, 1])
        boxes32, scores, class_ids = boxes32[ok], scores[ok], class_ids[ok]
        if self.head == "end2end":
            keep = np.argsort(-scores, kind="stable")[: self._max_det]
        elif self._agnostic:
            keep = nms(boxes32, scores, self._iou, max_det=self._max_det)
        else:
            keep = batched_nms(boxes32, scores, class_ids, self._iou, max_det=self._max_det)
        return Detections(
            _read_only(boxes32[keep]),
            _read_only(scores[keep].astype(np.float32)),
            _read_only(class_ids[keep].astype(np.int32)),
        )


def _checked_shape(head: str, output_shape: Sequence[int], num_classes: int) -> tuple[int, ...]:
    """The concrete output shape, after checking it fits ``head`` with ``num_classes``."""
    if head not in HEAD_FORMATS:
        raise HeadError(f"unknown head format {head!r}; expected one of {HEAD_FORMATS}")
    if num_classes < 1:
        raise HeadError(f"num_classes must be >= 1, got {num_classes}")
    shape = tuple(output_shape)
    if not all(_dim(d) is not None for d in shape):
        raise HeadError(f"decoder needs a concrete output shape, got {_fmt(shape)}")
    expected: dict[str, list[Dim]] = {
        "yolov8": [1, 4 + num_classes, "N"],
        "yolov5": [1, "N", 5 + num_classes],
        "end2end": [1, "K", 6],
    }
    pattern = expected[head]
    if len(shape) != 3 or any(
        isinstance(e, int) and e != d for e, d in zip(pattern, shape, strict=True)
    ):
        raise HeadError(
            f"{head} head with {num_classes} classes expects output {_fmt(pattern)}, "
            f"got {_fmt(shape)}"
        )
    return tuple(int(d) for d in shape)


def _feature_dim(shape: list[Dim]) -> tuple[int, bool]:
    """(feature count, whether candidates are rows) of a rank-3, batch-1 output shape."""
    if len(shape) != 3:
        raise HeadError(f"output {_fmt(shape)} has rank {len(shape)}; expected {_LAYOUTS}")
    batch, a, b = (_dim(d) for d in shape)
    if batch not in (None, 1):
        raise HeadError(f"output {_fmt(shape)} has batch {batch}; expected batch 1")
    if a is not None and (b is None or a < b):
        return a, False
    if b is not None and (a is None or a > b):
        return b, True
    raise HeadError(
        f"output {_fmt(shape)}: cannot tell candidates from features; expected {_LAYOUTS}"
    )


def _columns_head(
    shape: list[Dim], features: int, n_names: int | None, end2end: bool
) -> tuple[HeadFormat, int]:
    """[1, 4+nc, N]: the yolov8 layout, the only one with candidates as columns."""
    if end2end:
        raise HeadError(
            f"metadata says NMS is inside the model, but output {_fmt(shape)} is not [1, K, 6]"
        )
    if features < 5:
        raise HeadError(
            f"output {_fmt(shape)} has {features} rows; a yolov8 head [1, 4+nc, N] needs >= 5"
        )
    if n_names is not None and features - 4 != n_names:
        raise HeadError(
            f"output {_fmt(shape)} is a yolov8 head with {features - 4} classes, "
            f"but metadata names {n_names} classes (expected [1, {4 + n_names}, N])"
        )
    return "yolov8", features - 4


def _rows_head(
    shape: list[Dim], features: int, n_names: int | None, end2end: bool, not_yolov5: bool
) -> tuple[HeadFormat, int]:
    """[1, N, C]: end2end when C == 6 and the metadata says so or rules out yolov5, else yolov5."""
    if features == 6 and (end2end or not_yolov5):
        if n_names is None:
            raise HeadError(
                f"output {_fmt(shape)} is an end2end head, but 'names' metadata is missing"
            )
        return "end2end", n_names
    if end2end:
        raise HeadError(
            f"metadata says NMS is inside the model, but output {_fmt(shape)} is not [1, K, 6]"
        )
    if features < 6:
        raise HeadError(f"output {_fmt(shape)} has {features} columns; expected {_LAYOUTS}")
    if n_names is not None and features - 5 != n_names:
        raise HeadError(
            f"output {_fmt(shape)} would be a yolov5 head with {features - 5} classes, "
            f"but metadata names {n_names} classes (expected [1, N, {5 + n_names}])"
        )
    return "yolov5", features - 5


def _says_end2end(metadata: Mapping[str, str]) -> bool:
    """Whether ultralytics metadata says the model already ran NMS (end2end or nms=True)."""
    if str(metadata.get("end2end", "")).strip().lower() in ("true", "1"):
        return True
    args = _literal(metadata.get("args"))
    return isinstance(args, dict) and args.get("nms") is True


def _names_from_dict(value: dict[object, object]) -> list[object] | None:
    """{0: 'a', 1: 'b'} (int or digit-string keys, as JSON writers emit) -> ['a', 'b']."""
    by_id: dict[int, object] = {}
    for key, name in value.items():
        if isinstance(key, str) and key.isascii() and key.isdigit():
            key = int(key)
        if not isinstance(key, int) or isinstance(key, bool):
            return None
        by_id[key] = name
    if sorted(by_id) != list(range(len(value))):
        return None
    return [by_id[i] for i in range(len(by_id))]


def _literal(text: object) -> object:
    """A Python literal parsed without executing anything; None when absent or malformed."""
    if not isinstance(text, str) or len(text) > _MAX_LITERAL_CHARS:
        return None
    try:
        return ast.literal_eval(text)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None


def _cxcywh_to_xyxy(cxcywh: np.ndarray) -> np.ndarray:
    """(K, 4) cx cy w h -> (K, 4) float64 x1 y1 x2 y2."""
    boxes = cxcywh.astype(np.float64)
    half = boxes[:, 2:] / 2.0
    return np.concatenate((boxes[:, :2] - half, boxes[:, :2] + half), axis=1)


def _dim(d: Dim) -> int | None:
    """A concrete positive dimension, or None for a symbolic or nonsensical one."""
    if isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d > 0:
        return int(d)
    return None


def _fmt(shape: Sequence[Dim]) -> str:
    """[1, 84, 8400]-style text for error messages; symbolic dims by name, None as '?'."""
    return "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]"


def _read_only(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False
    return array
