"""Decode: turn a detector's raw output tensor into detections in frame pixels.

This stage owns everything between the ONNX output and the detections handed on: recognising
the head format from the model's output shape and ultralytics metadata, the score threshold,
NMS (see `edged.nms`), mapping boxes back through the preprocess `BoxMap`, and dropping
anything a broken or hostile model emits (non-finite values, empty boxes, unknown classes).
It runs per frame, so it works in buffers allocated once per decoder and creates no arrays.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, get_args

import numpy as np

from edged.errors import HeadError
from edged.geometry import BoxMap
from edged.nms import GreedyNms

HeadFormat = Literal["yolov8", "yolov5", "end2end"]
HEAD_FORMATS: tuple[HeadFormat, ...] = get_args(HeadFormat)

_LAYOUTS = "[1, 4+nc, N] (yolov8), [1, N, 5+nc] (yolov5) or [1, K, 6] (end2end)"
_MAX_LITERAL_CHARS = 1_000_000

Dim = int | str | None

_ZERO = np.array(0.0, dtype=np.float32)  # 0-d operands: a Python float costs numpy an array per call
_HALF = np.array(0.5, dtype=np.float32)
_NEG_INF = np.array(-np.inf, dtype=np.float32)
_ONE = np.array(1.0, dtype=np.float32)
_ONE_SLOT = np.array(1, dtype=np.intp)


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


def detect_head(output_shapes: Sequence[Sequence[Dim]], metadata: Mapping[str, str]) -> tuple[HeadFormat, int]:
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
        raise HeadError(f"model task {task!r} is not supported (output {_fmt(shape)}); only 'detect' is")
    names = parse_names(metadata)
    n_names = None if names is None else len(names)
    features, candidates_in_rows = _feature_dim(shape)
    if not candidates_in_rows:
        return _columns_head(shape, features, n_names, _says_end2end(metadata))
    not_yolov5 = task is not None or (n_names is not None and n_names != 1)
    return _rows_head(shape, features, n_names, _says_end2end(metadata), not_yolov5)


class Decoder:
    """Decodes one head format for one fixed output shape; reuse it for every frame.

    Every buffer a frame needs is allocated here, sized for the worst case of every candidate
    passing the threshold (about twice the output tensor for yolov8 and yolov5 heads);
    `decode` only slices and fills them, so after the first frame decoding creates no numpy
    arrays. The result is a set of read-only views of this decoder's buffers: it is valid until
    the next `decode` call, so a consumer that keeps one copies its arrays.
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
        selectors: dict[str, Callable[[np.ndarray], int]] = {
            "yolov8": self._select_yolov8,
            "yolov5": self._select_yolov5,
            "end2end": self._select_end2end,
        }
        self._select = selectors[head]
        _, n, features = self.output_shape
        if head == "yolov8":
            n, features = features, n
        class_scratch = 0 if head == "end2end" else n * num_classes
        self._conf = np.array(conf, dtype=np.float32)
        self._num_classes = np.array(num_classes, dtype=np.float32)
        self._nms = GreedyNms(n, None if head == "end2end" else iou, max_det=max_det, agnostic=agnostic)
        self._as_f32: np.ndarray | None = None  # a float32 copy of a float16/float64 output
        # Over all N candidates: the threshold and the index of the ones that pass it.
        self._best_scores = np.empty(n, dtype=np.float32)
        self._passed = np.empty(n, dtype=np.bool_)
        self._failed = np.empty(n, dtype=np.bool_)
        self._passed_int = np.empty(n, dtype=np.intp)
        self._slot = np.empty(n, dtype=np.intp)
        self._arange = np.arange(n, dtype=np.intp)
        self._index = np.empty(n + 1, dtype=np.intp)
        # Over the k candidates that passed (flat, so that a [:k] slice reshapes contiguously).
        self._gathered = np.empty(n * features, dtype=np.float32)
        self._class_scores = np.empty(class_scratch, dtype=np.float32)
        self._boxes = np.empty(4 * n, dtype=np.float32)
        self._half = np.empty(2 * n, dtype=np.float32)
        self._scores = np.empty(n, dtype=np.float32)
        self._nms_scores = np.empty(n, dtype=np.float32)
        self._class_ids = np.empty(n, dtype=np.intp)
        self._valid = np.empty(n, dtype=np.bool_)
        self._checks = np.empty((8, n), dtype=np.bool_)  # the tests of `_finish`, one row each
        # Frame mapping of the last BoxMap seen, as (4, 1) columns for x1 y1 x2 y2.
        self._mapped: BoxMap | None = None
        self._pad = np.zeros((4, 1), dtype=np.float32)
        self._scale = np.ones((4, 1), dtype=np.float32)
        self._limit = np.zeros((4, 1), dtype=np.float32)
        # The result: at most max_det rows.
        most = min(max_det, n)
        self._keep = np.empty(most, dtype=np.intp)
        self._kept_columns = np.empty(4 * most, dtype=np.float32)
        self._xyxy = np.empty((most, 4), dtype=np.float32)
        self._kept_scores = np.empty(most, dtype=np.float32)
        self._kept_ids = np.empty(most, dtype=np.intp)
        self._kept_ids32 = np.empty(most, dtype=np.int32)
        # What consumers see: read-only views made once; their slices are read-only too.
        self._shown = tuple(_read_only(a.view()) for a in (self._xyxy, self._kept_scores, self._kept_ids32))

    def decode(self, output: np.ndarray, box_map: BoxMap) -> Detections:
        """Threshold, NMS, keep ``max_det`` best, map to frame pixels and clip.

        Never raises on bad values; raises `HeadError` only when ``output`` is not the float
        array of the shape this decoder was built for. Floating-point warnings are silenced
        because non-finite values are expected from broken models and are filtered out.
        """
        self._check_output(output)
        with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
            k = self._select(self._float32(output)[0])
            return self._finish(k, box_map)

    def _check_output(self, output: object) -> None:
        """Raise `HeadError` unless ``output`` is a float array of this decoder's shape."""
        if not isinstance(output, np.ndarray):
            got = type(output).__name__
        elif output.shape != self.output_shape or output.dtype.kind != "f":
            got = f"{output.dtype} {_fmt(output.shape)}"
        else:
            return
        raise HeadError(f"{self.head} decoder expects a float array {_fmt(self.output_shape)}, got {got}")

    def _float32(self, output: np.ndarray) -> np.ndarray:
        """``output`` itself when float32, else converted into a buffer made on the first frame."""
        if output.dtype == np.float32:
            return output
        if self._as_f32 is None:
            self._as_f32 = np.empty(self.output_shape, dtype=np.float32)
        np.copyto(self._as_f32, output)
        return self._as_f32

    def _select_yolov8(self, pred: np.ndarray) -> int:
        """(4+nc, N) rows cx cy w h, class scores -> k candidates whose best class scores >= conf."""
        nc = self.num_classes
        np.max(pred[4:], axis=0, out=self._best_scores)
        np.greater_equal(self._best_scores, self._conf, out=self._passed)
        index = self._passed_index()
        k = index.shape[0]
        boxes = _rows(self._boxes, 4, k)
        np.take(pred[:4], index, axis=1, out=boxes, mode="clip")
        _cxcywh_to_xyxy(boxes, _rows(self._half, 2, k))
        np.take(self._best_scores, index, out=self._scores[:k], mode="clip")
        by_class = _rows(self._gathered, nc, k)
        np.take(pred[4:], index, axis=1, out=by_class, mode="clip")
        by_candidate = _rows(self._class_scores, k, nc)
        np.copyto(by_candidate, by_class.T)  # argmax along a contiguous axis allocates nothing
        np.argmax(by_candidate, axis=1, out=self._class_ids[:k])
        return k

    def _select_yolov5(self, pred: np.ndarray) -> int:
        """(N, 5+nc) columns cx cy w h obj, class probs -> k candidates with obj >= conf.

        Class probabilities are at most 1, so objectness >= conf is a cheap first filter; the
        score, objectness x best probability, is held to conf in `_finish`.
        """
        np.greater_equal(pred[:, 4], self._conf, out=self._passed)
        index = self._passed_index()
        k = index.shape[0]
        rows = _rows(self._gathered, k, pred.shape[1])
        np.take(pred, index, axis=0, out=rows, mode="clip")
        probs = _rows(self._class_scores, k, self.num_classes)
        np.copyto(probs, rows[:, 5:])
        scores = self._scores[:k]
        np.max(probs, axis=1, out=scores)
        np.multiply(scores, rows[:, 4], out=scores)
        np.argmax(probs, axis=1, out=self._class_ids[:k])
        boxes = _rows(self._boxes, 4, k)
        np.copyto(boxes, rows[:, :4].T)
        _cxcywh_to_xyxy(boxes, _rows(self._half, 2, k))
        return k

    def _select_end2end(self, pred: np.ndarray) -> int:
        """(K, 6) columns x1 y1 x2 y2 score class -> k candidates; a class that is not an
        integer in [0, nc) gets score -inf, which `_finish` drops."""
        np.greater_equal(pred[:, 4], self._conf, out=self._passed)
        index = self._passed_index()
        k = index.shape[0]
        rows = _rows(self._gathered, k, 6)
        np.take(pred, index, axis=0, out=rows, mode="clip")
        np.copyto(_rows(self._boxes, 4, k), rows[:, :4].T)
        scores, cls, whole = self._scores[:k], rows[:, 5], self._half[:k]
        np.copyto(scores, rows[:, 4])
        np.copyto(self._class_ids[:k], cls, casting="unsafe")  # garbage for a NaN class, dropped below
        valid, check = self._valid[:k], self._failed[:k]
        np.greater_equal(cls, _ZERO, out=valid)
        np.less(cls, self._num_classes, out=check)
        np.logical_and(valid, check, out=valid)
        np.floor(cls, out=whole)
        np.equal(whole, cls, out=check)
        np.logical_and(valid, check, out=valid)
        np.logical_not(valid, out=check)
        np.copyto(scores, _NEG_INF, where=check)
        return k

    def _passed_index(self) -> np.ndarray:
        """Ascending indices of the candidates marked in ``self._passed``, a view of ``self._index``.

        A running count gives each passing candidate its slot; every failing one gets slot -1,
        the spare slot at the end. This is ``np.flatnonzero`` without allocating its result.
        """
        slot, passed = self._slot, self._passed_int  # one dtype: mixing bool in would allocate
        np.copyto(passed, self._passed)
        np.add.accumulate(passed, out=slot)
        k = int(slot[-1])
        np.multiply(slot, passed, out=slot)
        np.subtract(slot, _ONE_SLOT, out=slot)
        self._index[slot] = self._arange
        return self._index[:k]

    def _finish(self, k: int, box_map: BoxMap) -> Detections:
        """Map the k candidates' boxes to the frame, drop invalid ones, suppress, build result.

        A candidate is dropped (its score set to -inf) when its box is not finite, its score is
        below conf or above 1 (counted: scores are probabilities), or its box is empty after
        clipping to the frame. Clipping before NMS means boxes lying wholly in the letterbox
        padding never take a ``max_det`` slot, and NMS judges the float32 boxes that are
        returned, so no returned pair overlaps more than ``iou``.
        """
        boxes, scores, valid = _rows(self._boxes, 4, k), self._scores[:k], self._valid[:k]
        checks, invalid = self._checks[:, :k], self._failed[:k]
        pad, scale, limit = self._frame_mapping(box_map)
        np.subtract(boxes, pad, out=boxes)
        np.divide(boxes, scale, out=boxes)
        np.isfinite(boxes, out=checks[:4])
        np.clip(boxes, _ZERO, limit, out=boxes)
        np.greater(boxes[2:], boxes[:2], out=checks[4:6])
        np.greater_equal(scores, self._conf, out=checks[6])  # also false for NaN
        np.greater(scores, _ONE, out=invalid)  # +inf included
        above_one = int(np.count_nonzero(invalid))
        np.logical_not(invalid, out=checks[7])
        np.logical_and.reduce(checks, axis=0, out=valid)
        np.logical_not(valid, out=invalid)
        np.copyto(scores, _NEG_INF, where=invalid)
        nms_scores = self._nms_scores[:k]
        np.copyto(nms_scores, scores)
        n = self._nms(boxes, nms_scores, self._class_ids[:k], self._keep)
        return self._result(n, boxes, scores, above_one)

    def _frame_mapping(self, box_map: BoxMap) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(pad, scale, limit) columns for ``box_map``, refilled only when the map changes."""
        if box_map is not self._mapped:
            self._pad[:, 0] = (box_map.pad_x, box_map.pad_y) * 2
            self._scale[:, 0] = (box_map.scale_x, box_map.scale_y) * 2
            self._limit[:, 0] = (box_map.frame_w, box_map.frame_h) * 2
            self._mapped = box_map
        return self._pad, self._scale, self._limit

    def _result(self, n: int, boxes: np.ndarray, scores: np.ndarray, above_one: int) -> Detections:
        """The n kept candidates as read-only views of the result buffers."""
        keep, columns, xyxy = self._keep[:n], _rows(self._kept_columns, 4, n), self._xyxy[:n]
        np.take(boxes, keep, axis=1, out=columns, mode="clip")
        np.copyto(xyxy, columns.T)
        np.take(scores, keep, out=self._kept_scores[:n], mode="clip")
        np.take(self._class_ids, keep, out=self._kept_ids[:n], mode="clip")  # into int32 it would allocate
        np.copyto(self._kept_ids32[:n], self._kept_ids[:n])
        xyxy_shown, scores_shown, ids_shown = self._shown
        return Detections(xyxy_shown[:n], scores_shown[:n], ids_shown[:n], above_one)


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
    if len(shape) != 3 or any(isinstance(e, int) and e != d for e, d in zip(pattern, shape, strict=True)):
        raise HeadError(f"{head} head with {num_classes} classes expects output {_fmt(pattern)}, got {_fmt(shape)}")
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
    raise HeadError(f"output {_fmt(shape)}: cannot tell candidates from features; expected {_LAYOUTS}")


def _columns_head(shape: list[Dim], features: int, n_names: int | None, end2end: bool) -> tuple[HeadFormat, int]:
    """[1, 4+nc, N]: the yolov8 layout, the only one with candidates as columns."""
    if end2end:
        raise HeadError(f"metadata says NMS is inside the model, but output {_fmt(shape)} is not [1, K, 6]")
    if features < 5:
        raise HeadError(f"output {_fmt(shape)} has {features} rows; a yolov8 head [1, 4+nc, N] needs >= 5")
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
            raise HeadError(f"output {_fmt(shape)} is an end2end head, but 'names' metadata is missing")
        return "end2end", n_names
    if end2end:
        raise HeadError(f"metadata says NMS is inside the model, but output {_fmt(shape)} is not [1, K, 6]")
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


def _cxcywh_to_xyxy(boxes: np.ndarray, half: np.ndarray) -> None:
    """(4, k) rows cx cy w h -> x1 y1 x2 y2 in place, as ultralytics computes them; ``half`` is (2, k) scratch."""
    np.multiply(boxes[2:], _HALF, out=half)
    np.add(boxes[:2], half, out=boxes[2:])
    np.subtract(boxes[:2], half, out=boxes[:2])


def _rows(flat: np.ndarray, rows: int, columns: int) -> np.ndarray:
    """A contiguous (rows, columns) view of the start of a flat scratch buffer."""
    return flat[: rows * columns].reshape(rows, columns)


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
