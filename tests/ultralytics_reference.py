"""An independent reference for what ultralytics' predict returns, in numpy and OpenCV only.

Written from ultralytics 8.4's LetterBox, ``non_max_suppression``, torchvision's CPU NMS kernel
and ``ops.scale_boxes``, and the yolov5 repository's ``non_max_suppression`` for its layout, with
none of edged's code, so that the tests can hold edged's boxes to the ones a user validated with
``yolo predict``. The order is the point: threshold, NMS with per-class offsets on the unclipped
boxes in the model's input space, ``max_det``, then scale to the frame and clip. Like ultralytics
it returns boxes that clipping left with zero area.
"""

from __future__ import annotations

from dataclasses import dataclass

import cv2
import numpy as np

MAX_WH = 7680  # ultralytics' per-class offset
MAX_NMS = 30000  # ultralytics' cap on boxes entering NMS


@dataclass(frozen=True)
class Boxes:
    """Detections in frame pixels: xyxy (n, 4) float32, scores (n,) float32, classes (n,) int."""

    xyxy: np.ndarray
    scores: np.ndarray
    classes: np.ndarray

    def with_area(self) -> Boxes:
        """The boxes that clipping did not flatten."""
        keep = (self.xyxy[:, 2] > self.xyxy[:, 0]) & (self.xyxy[:, 3] > self.xyxy[:, 1])
        return Boxes(self.xyxy[keep], self.scores[keep], self.classes[keep])


def letterbox(frame_bgr: np.ndarray, input_hw: tuple[int, int]) -> np.ndarray:
    """The float32 [1, 3, H, W] RGB tensor ultralytics' predictor feeds a fixed-size ONNX model."""
    h, w = frame_bgr.shape[:2]
    height, width = input_hw
    r = min(height / h, width / w)
    new_w, new_h = max(round(w * r), 1), max(round(h * r), 1)
    dw, dh = (width - new_w) / 2, (height - new_h) / 2
    image = frame_bgr if (w, h) == (new_w, new_h) else cv2.resize(frame_bgr, (new_w, new_h), interpolation=cv2.INTER_LINEAR)
    top, bottom, left, right = round(dh - 0.1), round(dh + 0.1), round(dw - 0.1), round(dw + 0.1)
    image = cv2.copyMakeBorder(image, top, bottom, left, right, cv2.BORDER_CONSTANT, value=(114, 114, 114))
    chw = np.ascontiguousarray(image[..., ::-1].transpose(2, 0, 1))
    tensor: np.ndarray = chw.astype(np.float32) / np.float32(255)
    return tensor[None]


def predict(
    output: np.ndarray,
    head: str,
    *,
    input_hw: tuple[int, int],
    frame_hw: tuple[int, int],
    conf: float,
    iou: float,
    max_det: int,
    agnostic: bool = False,
    ratio_pad: tuple[tuple[float, float], tuple[int, int]] | None = None,
) -> Boxes:
    """ultralytics' boxes for one raw model output (batch 1) of a frame of ``frame_hw``.

    ``ratio_pad`` ((gain_y, gain_x), (pad_x, pad_y)) overrides the letterbox's, as in ultralytics.
    """
    rows = _suppressed(output[0], head, conf, iou, max_det, agnostic)
    xyxy = scale_boxes(rows[:, :4], input_hw, frame_hw, ratio_pad)
    return Boxes(xyxy, rows[:, 4].astype(np.float32), rows[:, 5].astype(np.int64))


def _suppressed(pred: np.ndarray, head: str, conf: float, iou: float, max_det: int, agnostic: bool) -> np.ndarray:
    """(n, 6) float32 rows x1 y1 x2 y2 score class in input pixels, as NMS leaves them."""
    pred = pred.astype(np.float32)
    if head == "end2end":  # ultralytics: score above conf, the first max_det rows
        return pred[pred[:, 4] > conf][:max_det]
    if head == "yolov8":  # ultralytics 8.4: [4+nc, N], best class
        x = pred.T[pred[4:].max(0) > conf]
        box, cls = xywh2xyxy(x[:, :4]), x[:, 4:]
    else:  # yolov5 repository: [N, 5+nc], objectness first, then objectness x class probability
        x = pred[pred[:, 4] > conf].copy()
        x[:, 5:] *= x[:, 4:5]
        box, cls = xywh2xyxy(x[:, :4]), x[:, 5:]
    score, j = cls.max(1), cls.argmax(1)
    keep = score > conf
    rows = np.concatenate([box, score[:, None], j[:, None].astype(np.float32)], 1)[keep]
    if head == "yolov5" or len(rows) > MAX_NMS:
        rows = rows[np.argsort(-rows[:, 4], kind="stable")[:MAX_NMS]]
    offset = rows[:, 5:6] * np.float32(0 if agnostic else MAX_WH)
    kept = torchvision_nms(rows[:, :4] + offset, rows[:, 4], iou, max_det)
    suppressed: np.ndarray = rows[kept]
    return suppressed


def xywh2xyxy(x: np.ndarray) -> np.ndarray:
    """cx cy w h -> x1 y1 x2 y2, with ultralytics' arithmetic."""
    y = np.empty_like(x)
    half = x[:, 2:] / np.float32(2)
    y[:, :2] = x[:, :2] - half
    y[:, 2:] = x[:, :2] + half
    return y


def torchvision_nms(boxes: np.ndarray, scores: np.ndarray, iou: float, max_det: int) -> np.ndarray:
    """torchvision.ops.nms on the CPU then ``[:max_det]``: float32 IoU ``inter / (area_i + area_j - inter)``
    compared with iou as a double. Kept boxes come best first, so it stops at ``max_det`` of them."""
    x1, y1, x2, y2 = (boxes[:, i] for i in range(4))
    areas = (x2 - x1) * (y2 - y1)
    order = np.argsort(-scores, kind="stable")
    suppressed = np.zeros(len(boxes), bool)
    keep: list[int] = []
    with np.errstate(invalid="ignore", divide="ignore"):
        for position, i in enumerate(order):
            if suppressed[i]:
                continue
            if len(keep) == max_det:
                break
            keep.append(i)
            rest = order[position + 1 :]
            w = np.maximum(np.float32(0), np.minimum(x2[i], x2[rest]) - np.maximum(x1[i], x1[rest]))
            h = np.maximum(np.float32(0), np.minimum(y2[i], y2[rest]) - np.maximum(y1[i], y1[rest]))
            inter = w * h
            overlap = inter / (areas[i] + areas[rest] - inter)
            suppressed[rest[overlap.astype(np.float64) > iou]] = True
    return np.array(keep, dtype=np.int64)


def scale_boxes(
    xyxy: np.ndarray,
    input_hw: tuple[int, int],
    frame_hw: tuple[int, int],
    ratio_pad: tuple[tuple[float, float], tuple[int, int]] | None = None,
) -> np.ndarray:
    """ultralytics 8.4 ``ops.scale_boxes`` then ``clip_boxes``, float32 like its tensors."""
    boxes = xyxy.astype(np.float32)
    if ratio_pad is None:
        gain = min(input_hw[0] / frame_hw[0], input_hw[1] / frame_hw[1])
        new_h, new_w = (max(round(x * gain), 1) for x in frame_hw)
        gain_y, gain_x = new_h / frame_hw[0], new_w / frame_hw[1]
        pad_x, pad_y = round((input_hw[1] - new_w) / 2 - 0.1), round((input_hw[0] - new_h) / 2 - 0.1)
    else:
        (gain_y, gain_x), (pad_x, pad_y) = ratio_pad
    boxes[:, [0, 2]] -= np.float32(pad_x)
    boxes[:, [1, 3]] -= np.float32(pad_y)
    boxes[:, [0, 2]] /= np.float32(gain_x)
    boxes[:, [1, 3]] /= np.float32(gain_y)
    boxes[:, [0, 2]] = boxes[:, [0, 2]].clip(0, frame_hw[1])
    boxes[:, [1, 3]] = boxes[:, [1, 3]].clip(0, frame_hw[0])
    return boxes


def differences(got: Boxes, want: Boxes) -> tuple[list[int], list[int]]:
    """(missing, extra): rows of ``want`` with no match in ``got``, rows of ``got`` matching none.

    A match has the same class, IoU >= 0.99 and a score within 2e-3; each box matches once.
    """
    free = np.ones(len(got.scores), bool)
    missing = []
    for i in range(len(want.scores)):
        candidates = np.flatnonzero(free & (got.classes == want.classes[i]) & (np.abs(got.scores - want.scores[i]) <= 2e-3))
        overlaps = [box_iou(got.xyxy[c], want.xyxy[i]) for c in candidates]
        if overlaps and max(overlaps) >= 0.99:
            free[candidates[int(np.argmax(overlaps))]] = False
        else:
            missing.append(i)
    return missing, np.flatnonzero(free).tolist()


def box_iou(a: np.ndarray, b: np.ndarray) -> float:
    """IoU of two x1 y1 x2 y2 boxes in float64."""
    a, b = a.astype(np.float64), b.astype(np.float64)
    w = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    h = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - w * h
    return w * h / union if union > 0 else 0.0
