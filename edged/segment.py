"""Segment: the masks of a segmentation model's detections, as ultralytics' predict makes them.

The detections are decode's (`edged.decode`), exactly as for a detector. Then, for the kept ones
only, as ultralytics' ``process_mask`` and ``scale_masks`` do: each one's 32 coefficients times the
prototypes, upsampled (bilinear) to the input, thresholded at 0 (a sigmoid of 0.5), cropped to its
box in the input, and mapped to the frame (the letterbox padding cut off, bilinear to the frame
size, thresholded at 0.5). The outline is ultralytics' ``masks.xy``: the input-size mask's external
contours (joined into one when there are several, as its ``merge_multi_segment`` does), scaled to
the frame. Its area is the frame mask's pixels, its length and width the sides of the outline's
minimum-area rectangle. A detection whose mask is empty in the input is dropped, as ultralytics drops it.

With ``model.retina_masks`` (ultralytics' option of that name, its ``process_mask_native``) the
masks are made at the frame size instead: the prototypes' logits upsampled (by 1, 2 or 4, the least
that cuts the letterbox padding on whole pixels), the padding cut, resized to the frame, thresholded
at 0 and cropped to the box in the frame; the outline is then the frame mask's.

The masks of up to ``model.max_masks`` detections per frame are kept, in buffers made with the
plan: each costs one frame of bytes (0.9 MB at 1280x720); detections past them are published
without a mask. Buffers past `MASK_BUFFER_BUDGET` are refused before they are made (`mask_bytes`).
The outlines are written into buffers made with the plan too: what a frame still allocates is
OpenCV's contours (`Segmenter._outline` says why).

An outline holds at most ``model.max_outline_points`` points (`Segmenter._thinned`): a mask that a
broken or badly trained export, or a textured part, breaks into thousands of pieces would otherwise
make an outline of tens of thousands of points, messages of many MB a frame (held ``publish.hwm``
times over for a slow subscriber) and seconds of joining pieces. Such an outline keeps the mask's
largest pieces, thinned by an even stride, and is counted (``outline_thinned``); the area, length
and width are still the whole mask's.

A NaN or infinite prototype makes the mask of every kept detection empty, which would drop them
all unseen: the frame counts the prototypes' non-finite values with the output's (`Detections.nonfinite`),
so that it is judged and counted as one whose output held NaN.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import cv2
import numpy as np

from edged.decode import Decoder, Detections
from edged.errors import HeadError, ModelError
from edged.geometry import BoxMap
from edged.heads.base import TrueIndex, rows
from edged.heads.segment import MASK_COEFFICIENTS, SegmentHead
from edged.messages import Detection, in_mm

Region = tuple[slice, slice]  # rows, columns of a mask: it is 0 outside them
NOWHERE: Region = (slice(0, 0), slice(0, 0))
_ZERO = np.array(0.0, dtype=np.float32)  # 0-d operands: a Python float costs numpy an array per call
_HALF = np.array(0.5, dtype=np.float32)

# The most bytes a segmenter's mask buffers may take for one frame size (`mask_bytes` of each of
# ``model.max_masks``). A fixed budget, not the memory free, so that `edged check` and `edged run`
# refuse the same configuration on every board and at any moment; 1 GiB, a quarter of a 4 GB board,
# holds over 1000 masks at 1280x720 and over 120 at 3840x2160, far more than a frame has defects.
MASK_BUFFER_BUDGET = 1 << 30


@dataclass(frozen=True, slots=True, eq=False)
class Instances(Detections):
    """Detections with masks: for the first ``len(polygons)`` of them, ``masks`` (m, H, W) bool in the
    frame (views of the segmenter's buffers, valid until its next frame), ``polygons`` in frame pixels,
    ``area_px`` and ``sides`` (m, 2), the length then the width of the minimum-area rectangle;
    ``thinned``: the outlines cut to ``model.max_outline_points``."""

    masks: np.ndarray = field(default_factory=lambda: np.zeros((0, 0, 0), np.bool_))
    polygons: tuple[np.ndarray, ...] = ()
    area_px: tuple[int, ...] = ()
    sides: tuple[tuple[float, float], ...] = ()
    thinned: int = 0

    def problems(self) -> list[tuple[str, int]]:
        """The output's problems, and the outlines thinned (``outline_thinned``), counted and logged alike."""
        found = Detections.problems(self)
        return [*found, ("outline_thinned", self.thinned)] if self.thinned else found

    def dataset_label(self, width: int, height: int) -> str:
        """ultralytics' segmentation label: per detection its class and outline, normalised to the
        frame (a detection without a mask, its box's corners)."""
        lines = []
        for i, ((x1, y1, x2, y2), c) in enumerate(zip(self.xyxy.tolist(), self.class_ids.tolist(), strict=True)):
            points = self.polygons[i].tolist() if i < len(self.polygons) else []
            if len(points) < 3:
                points = [[x1, y1], [x2, y1], [x2, y2], [x1, y2]]
            lines.append(f"{c} " + " ".join(f"{x / width:.6f} {y / height:.6f}" for x, y in points) + "\n")
        return "".join(lines)

    def message_fields(
        self,
        label: Callable[[int], str],
        zones: Sequence[str | None] | None,
        thresholds: Sequence[float | None] | None,
        *,
        notes: Sequence[str | None] | None = None,
        mm_per_px: float | None = None,
    ) -> dict[str, Any]:
        """Each detection with its ``polygon``, ``area_px``, ``length_px`` and ``width_px``, and in mm
        with the camera's ``mm_per_px``."""
        fields = Detections.message_fields(self, label, zones, thresholds, notes=notes)
        detections: list[Detection] = fields["detections"]
        for i, polygon in enumerate(self.polygons):
            length, width = self.sides[i]
            sizes: dict[str, Any] = {
                "polygon": [(round(x, 1), round(y, 1)) for x, y in polygon.tolist()],
                "area_px": self.area_px[i],
                "length_px": round(length, 1),
                "width_px": round(width, 1),
            }
            if mm_per_px is not None:
                sizes["area_mm2"] = in_mm(self.area_px[i] * mm_per_px * mm_per_px)
                sizes["length_mm"] = in_mm(length * mm_per_px)
                sizes["width_mm"] = in_mm(width * mm_per_px)
            detections[i] = detections[i].model_copy(update=sizes)
        return {**fields, "task": "segment"}


class Segmenter:
    """Decodes a segmentation model's frame: its detections (`Decoder`), then their masks."""

    def __init__(
        self,
        decoder: Decoder,
        prototypes: np.ndarray,
        num_classes: int,
        max_masks: int,
        max_det: int,
        *,
        retina: bool = False,
        max_outline_points: int,
    ) -> None:
        """``prototypes`` is the bound prototypes output [1, 32, h, w], refreshed in place each frame;
        ``retina``: masks made at the frame size (``model.retina_masks``); ``max_outline_points``: the
        most points of one outline (``model.max_outline_points``)."""
        self._retina = retina
        self._max_points = max_outline_points
        self._every = np.empty((0, 2), dtype=np.float32)  # a thinned mask's every outline point (`_thinned`)
        self._cut: tuple[float, float] | None = None  # the last outline's whole sides when it was thinned
        head = decoder.head
        if not isinstance(head, SegmentHead):
            raise HeadError(f"masks need a segment head's mask coefficients; the model's head is {head.name}")
        self._decoder, self._head = decoder, head
        _, c, mh, mw = prototypes.shape
        self._prototypes = prototypes[0].reshape(c, mh * mw)
        self._mh, self._mw = mh, mw
        self._coefficient_rows = slice(4 + num_classes, 4 + num_classes + MASK_COEFFICIENTS)
        self._max_masks = max_masks
        self._planned: BoxMap | None = None
        self._sum = np.empty((), dtype=np.float32)  # the kept detections' mask logits, added up (`_nonfinite`)
        self.masks_ms = 0.0  # the last frame's masks, outlines and sizes: `edged bench` shows it
        # The detections left when those with an empty mask are dropped, in buffers of their own.
        self._keep = np.empty(max_det, dtype=np.bool_)
        self._index_of = TrueIndex(max_det)
        self._xyxy = np.empty((max_det, 4), dtype=np.float32)
        self._scores = np.empty(max_det, dtype=np.float32)
        self._ids = np.empty(max_det, dtype=np.int32)

    @property
    def detector(self) -> Decoder:
        """The decoder of the detections, before their masks: `edged eval` reads its kept candidates."""
        return self._decoder

    def _plan(self, box_map: BoxMap) -> None:
        """The buffers of one input and frame size, made with the first frame of that size;
        `ModelError` before any is made when ``max_masks`` of them would not fit in `MASK_BUFFER_BUDGET`:
        numpy would fail on them with a traceback, or take the board's memory."""
        h, w, m = box_map.input_h, box_map.input_w, box_map
        self._refuse_past_budget(m)
        mh, mw = self._mh, self._mw
        self._columns = np.empty(self._max_masks, dtype=np.intp)
        self._coefficients = np.empty(MASK_COEFFICIENTS * self._max_masks, dtype=np.float32)  # as (32, m): see `rows`
        self._logits = np.empty((self._max_masks, mh * mw), dtype=np.float32)
        self._up = np.empty((h, w), dtype=np.float32)
        # An input a whole number of times the prototypes each way (4 for ultralytics' exports): a
        # mask is upsampled over its box's part alone (`_mask`), the same values as over the whole.
        sy, rest_y = divmod(h, self._mh)
        sx, rest_x = divmod(w, self._mw)
        self._step = (sy, sx) if rest_y == 0 and rest_x == 0 else None
        self._mask_in = np.empty((h, w), dtype=np.bool_)
        self._content = (slice(m.pad_y, m.pad_y + m.resized_h), slice(m.pad_x, m.pad_x + m.resized_w))
        self._content_f = np.empty((m.resized_h, m.resized_w), dtype=np.float32)
        self._frame_f = np.empty((m.frame_h, m.frame_w), dtype=np.float32)
        # A frame a whole number of times the letterboxed content each way: a mask is mapped over
        # its box's part of the frame alone (`_mask`), the same values as over the whole frame.
        ky, rest_y = divmod(m.frame_h, m.resized_h)
        kx, rest_x = divmod(m.frame_w, m.resized_w)
        self._whole = (ky, kx) if rest_y == 0 and rest_x == 0 else None
        # Each frame mask is 0 but where its last mask was written (`_written`): only that part is
        # cleared for the next, not the whole frame (0.9 MB at 1280x720) per mask.
        self._masks = np.zeros((self._max_masks, m.frame_h, m.frame_w), dtype=np.bool_)
        self._written: list[Region] = [NOWHERE] * self._max_masks
        # The outlines, (p, 2) float32 each, in frame pixels: room for an outline as long as the mask
        # it is found on is round, and more, once, when a longer one comes, up to max_outline_points.
        outline_h, outline_w = (m.frame_h, m.frame_w) if self._retina else (h, w)
        room = min(2 * (outline_h + outline_w), self._max_points)
        self._points = np.empty((self._max_masks, room, 2), dtype=np.float32)
        self._pad = np.array((m.pad_x, m.pad_y), dtype=np.float32)
        self._gain = np.array((m.scale_x, m.scale_y), dtype=np.float32)
        self._limit = np.array((m.frame_w, m.frame_h), dtype=np.float32)
        if self._retina:  # as ultralytics' process_mask_native and scale_masks
            gain = min(4 * mh / m.frame_h, 4 * mw / m.frame_w)
            pad = (4 * mh - max(round(m.frame_h * gain), 1)) | (4 * mw - max(round(m.frame_w * gain), 1))
            f = 4 // math.gcd(4, pad | pad // 2)
            self._native = np.empty((f * mh, f * mw), dtype=np.float32)
            gain = min(f * mh / m.frame_h, f * mw / m.frame_w)
            new_h, new_w = max(round(m.frame_h * gain), 1), max(round(m.frame_w * gain), 1)
            top, left = round((f * mh - new_h) / 2 - 0.1), round((f * mw - new_w) / 2 - 0.1)
            self._native_content = (slice(top, top + new_h), slice(left, left + new_w))
            # A frame a whole number of times the native content each way: a mask is made over its
            # box's part of the frame alone (`_native_mask`), the same values as over the whole.
            ky, rest_y = divmod(m.frame_h, new_h)
            kx, rest_x = divmod(m.frame_w, new_w)
            self._native_whole = (f, ky, kx) if rest_y == 0 and rest_x == 0 else None
        self._planned = box_map

    def _refuse_past_budget(self, m: BoxMap) -> None:
        """`ModelError` naming ``model.max_masks``, the frame size and the memory its masks would take,
        when that is more than `MASK_BUFFER_BUDGET`."""
        if (problem := self.budget_problem(m)) is not None:
            raise ModelError(problem)

    def budget_problem(self, m: BoxMap) -> str | None:
        """Why ``model.max_masks`` masks of frames mapped by ``m`` cannot be made (`mask_budget_problem`);
        None where they can: a look at a frame size without planning for it (`edged check`)."""
        return mask_budget_problem(self._max_masks, m, self._mh * self._mw, retina=self._retina)

    def decode(self, output: np.ndarray, box_map: BoxMap) -> Instances:
        """The frame's detections, the first ``max_masks`` with their masks."""
        det = self._decoder.decode(output, box_map)
        t0 = time.perf_counter_ns()
        if box_map is not self._planned:
            self._plan(box_map)
        head = self._head
        m = min(len(det), self._max_masks)
        slots = self._decoder.kept()[:m]
        # np.take copies into a temporary unless `out` is contiguous: (32, m) made from a flat buffer.
        columns, coefficients = self._columns[:m], rows(self._coefficients, MASK_COEFFICIENTS, m)
        np.take(head.selected, slots, out=columns, mode="clip")
        np.take(output[0, self._coefficient_rows], columns, axis=1, out=coefficients, mode="clip")
        logits = self._logits[:m]
        with np.errstate(invalid="ignore", over="ignore"):  # a broken model's NaN or inf: `_nonfinite` counts it
            np.matmul(coefficients.T, self._prototypes, out=logits)
        boxes = rows(head.boxes, 4, head.selected.shape[0])  # the candidates' x1 y1 x2 y2 in the input
        keep = self._keep[: len(det)]
        keep.fill(True)
        polygons: list[np.ndarray] = []
        areas: list[int] = []
        sides: list[tuple[float, float]] = []
        thinned = 0
        for i, slot in enumerate(slots.tolist()):
            n = len(polygons)  # the buffers this detection's mask and outline go into
            frame_mask = self._masks[n]
            frame_mask[self._written[n]].fill(False)  # all 0 again
            self._written[n] = NOWHERE
            if self._retina:
                in_frame = self._native_mask(logits[i], det.xyxy[i].tolist(), box_map, frame_mask)
                area = int(np.count_nonzero(frame_mask[in_frame]))
                if not area:
                    keep[i] = False
                    continue
                polygon = self._outline(frame_mask, in_frame, n, in_input=False)
            else:
                made = self._mask(logits[i], boxes[:, slot].tolist(), box_map, frame_mask)
                if made is None:
                    keep[i] = False
                    continue
                in_input, in_frame = made
                area = int(np.count_nonzero(frame_mask[in_frame]))
                polygon = self._outline(self._mask_in, in_input, n, in_input=True)
            self._written[n] = in_frame
            polygons.append(polygon)
            areas.append(area)
            sides.append(_sides(polygon) if self._cut is None else self._cut)
            thinned += self._cut is not None
        nonfinite = det.nonfinite
        if np.count_nonzero(keep) < keep.shape[0]:  # a mask came out empty: broken prototypes? (none: nothing paid)
            with np.errstate(invalid="ignore", over="ignore"):
                nonfinite += self._nonfinite(logits)
        index = self._index_of(keep)
        k = index.shape[0]
        xyxy, scores, ids = self._xyxy[:k], self._scores[:k], self._ids[:k]
        np.take(det.xyxy, index, axis=0, out=xyxy, mode="clip")
        np.take(det.scores, index, out=scores, mode="clip")
        np.take(det.class_ids, index, out=ids, mode="clip")
        masks = self._masks[: len(polygons)]
        found = (tuple(polygons), tuple(areas), tuple(sides), thinned)
        self.masks_ms = (time.perf_counter_ns() - t0) / 1e6
        return Instances(xyxy, scores, ids, det.scores_above_one, nonfinite, det.near, masks, *found)

    def _nonfinite(self, logits: np.ndarray) -> int:
        """The prototypes' NaN or infinite values when the kept detections' mask ``logits`` hold some
        (each logit adds up a pixel of every prototype, so one such value spoils every mask), else 0.

        Asked only when a mask came out empty. Their sum is finite unless one of them is not, or finite
        ones overflow it: one pass over what the masks are made from, and no array. Only then are the
        prototypes counted. A NaN among the mask coefficients is the output's, counted by decode.
        Called with floating-point warnings silenced: these values are what it looks for.
        """
        np.add.reduce(logits, axis=None, out=self._sum)
        if math.isfinite(float(self._sum)):
            return 0
        return int(self._prototypes.size - np.count_nonzero(np.isfinite(self._prototypes)))

    def _mask(self, logits: np.ndarray, box: list[float], m: BoxMap, mask: np.ndarray) -> tuple[Region, Region] | None:
        """One detection's mask at the input size (``_mask_in``) and in the frame (``mask``), as
        ultralytics' ``scale_image`` maps it; None, ``mask`` left as it was, when it is empty. Else
        the parts of the input and of the frame outside which each is 0 (``mask`` is all 0 when
        it is called).

        Outside its box the input-size mask is 0, and so is the frame's beyond the pixels
        interpolated from the box's: where the frame is a whole number of times the content, the
        resize covers the box's part of the frame alone (two content pixels of 0 round it, so that
        the edges interpolate what the whole frame's resize would), not the whole frame.
        """
        x1, y1, x2, y2 = box
        c0, c1 = max(math.ceil(x1), 0), min(math.ceil(x2), m.input_w)  # pixel c is in the box when x1 <= c < x2
        r0, r1 = max(math.ceil(y1), 0), min(math.ceil(y2), m.input_h)
        self._mask_in.fill(False)
        if c1 <= c0 or r1 <= r0:
            return None
        np.greater(self._upsampled(logits, m, r0, r1, c0, c1), _ZERO, out=self._mask_in[r0:r1, c0:c1])
        if not np.count_nonzero(self._mask_in[r0:r1, c0:c1]):
            return None
        in_input = (slice(r0, r1), slice(c0, c1))
        if self._whole is None:
            np.copyto(self._content_f, self._mask_in[self._content])
            cv2.resize(self._content_f, (m.frame_w, m.frame_h), dst=self._frame_f, interpolation=cv2.INTER_LINEAR)
            np.greater(self._frame_f, _HALF, out=mask)
            return in_input, (slice(None), slice(None))
        (ky, kx), rows, cols = self._whole, self._content[0], self._content[1]
        top, bottom = max(r0 - rows.start - 2, 0), min(r1 - rows.start + 2, m.resized_h)
        left, right = max(c0 - cols.start - 2, 0), min(c1 - cols.start + 2, m.resized_w)
        if bottom <= top or right <= left:  # the box is on the padding alone: nothing in the frame
            return in_input, NOWHERE
        h, w = bottom - top, right - left
        content = self._content_f.reshape(-1)[: h * w].reshape(h, w)
        np.copyto(content, self._mask_in[rows.start + top : rows.start + bottom, cols.start + left : cols.start + right])
        frame = self._frame_f.reshape(-1)[: h * ky * w * kx].reshape(h * ky, w * kx)
        cv2.resize(content, (w * kx, h * ky), dst=frame, interpolation=cv2.INTER_LINEAR)
        in_frame = (slice(top * ky, bottom * ky), slice(left * kx, right * kx))
        np.greater(frame, _HALF, out=mask[in_frame])
        return in_input, in_frame

    def _upsampled(self, logits: np.ndarray, m: BoxMap, r0: int, r1: int, c0: int, c1: int) -> np.ndarray:
        """The mask's logits upsampled (bilinear) to the input size, rows ``r0:r1`` and columns ``c0:c1``.

        Where the input is a whole number of times the prototypes, only the prototype pixels these
        pixels interpolate between (and one more each side) are upsampled: OpenCV's bilinear weights
        depend on a pixel's place within its prototype pixel alone, so the values are those of the
        whole upsampled mask, at a fraction of its cost for a small box.
        """
        small = logits.reshape(self._mh, self._mw)
        if self._step is None:
            cv2.resize(small, (m.input_w, m.input_h), dst=self._up, interpolation=cv2.INTER_LINEAR)
            return self._up[r0:r1, c0:c1]
        sy, sx = self._step
        top, bottom = _source_span(r0, r1, sy, self._mh)
        left, right = _source_span(c0, c1, sx, self._mw)
        return _upsampled_part(small[top:bottom, left:right], sy, sx, (top, left), (r0, r1, c0, c1), self._up)

    def _native_mask(self, logits: np.ndarray, box: list[float], m: BoxMap, mask: np.ndarray) -> Region:
        """One detection's mask made at the frame size into ``mask`` (all 0 when it is called),
        cropped to its box in the frame, which it returns.

        Where the frame is a whole number of times the native content, only the box's part of the
        frame is made, from the native pixels it interpolates between, made in turn from the
        prototype pixels those interpolate between (`_upsampled_part`): the same values.
        """
        x1, y1, x2, y2 = box
        c0, c1 = max(math.ceil(x1), 0), min(math.ceil(x2), m.frame_w)
        r0, r1 = max(math.ceil(y1), 0), min(math.ceil(y2), m.frame_h)
        if c1 <= c0 or r1 <= r0:
            return NOWHERE
        small, native, (rows, cols) = logits.reshape(self._mh, self._mw), self._native, self._native_content
        if self._native_whole is None:
            if native.shape == small.shape:
                np.copyto(native, small)
            else:
                cv2.resize(small, native.shape[::-1], dst=native, interpolation=cv2.INTER_LINEAR)
            cv2.resize(native[rows, cols], (m.frame_w, m.frame_h), dst=self._frame_f, interpolation=cv2.INTER_LINEAR)
            np.greater(self._frame_f[r0:r1, c0:c1], _ZERO, out=mask[r0:r1, c0:c1])
            return slice(r0, r1), slice(c0, c1)
        f, ky, kx = self._native_whole
        top, bottom = _source_span(r0, r1, ky, rows.stop - rows.start)  # in the native content
        left, right = _source_span(c0, c1, kx, cols.stop - cols.start)
        n0, n1, n2, n3 = rows.start + top, rows.start + bottom, cols.start + left, cols.start + right  # in native
        if f == 1:
            part = small[n0:n1, n2:n3]
        else:
            a, b = _source_span(n0, n1, f, self._mh)
            c, d = _source_span(n2, n3, f, self._mw)
            part = _upsampled_part(small[a:b, c:d], f, f, (a, c), (n0, n1, n2, n3), native)
        values = _upsampled_part(part, ky, kx, (top, left), (r0, r1, c0, c1), self._frame_f)
        np.greater(values, _ZERO, out=mask[r0:r1, c0:c1])
        return slice(r0, r1), slice(c0, c1)

    def _outline(self, mask: np.ndarray, inside: Region, k: int, *, in_input: bool) -> np.ndarray:
        """ultralytics' ``masks.xy`` of `mask` (the input-size mask, or with retina masks the frame's),
        which is 0 outside ``inside``: its outline in frame pixels, (p, 2) float32, written into the
        `k`-th outline buffer; thinned past max_outline_points (`_thinned`, which sets ``_cut``). The
        contours are traced over ``inside`` and a pixel of 0 round it, which finds those of the whole mask.

        OpenCV returns contours only as new arrays: findContours is called once per mask, and its
        arrays (one per contour, and the hierarchy) are all a one-piece mask costs after warm-up. A
        mask in several pieces also costs what joining them costs (`merge_segments`), as many
        arrays as pieces; the outline buffers grow, once, for an outline longer than any before.
        """
        rows, cols = inside
        top, left = max(rows.start - 1, 0), max(cols.start - 1, 0)
        around = mask[top : rows.stop + 1, left : cols.stop + 1].view(np.uint8)
        contours, _ = cv2.findContours(around, cv2.RETR_EXTERNAL, cv2.CHAIN_APPROX_SIMPLE, offset=(left, top))
        self._cut = None
        if not contours:
            return self._points[k, :0]
        # Joined, n pieces are their points and 2 more per join (`merge_segments`): known before joining.
        total = sum(map(len, contours))
        if total + 2 * (len(contours) - 1) > self._max_points:
            return self._thinned(contours, total, k, in_input=in_input)
        points = merge_segments([c.reshape(-1, 2) for c in contours]) if len(contours) > 1 else contours[0].reshape(-1, 2)
        xy = self._room(k, len(points))
        np.copyto(xy, points, casting="unsafe")
        self._to_frame(xy, in_input=in_input)
        return xy

    def _thinned(self, contours: Sequence[np.ndarray], total: int, k: int, *, in_input: bool) -> np.ndarray:
        """The outline of a mask whose joined contours (``total`` points) are more than max_outline_points:
        its largest pieces (`_largest`), joined, then every s-th point, the least s that fits. Its sides,
        ``_cut``, are those of every point of every piece, as if none were cut.

        Only the pieces kept are joined: joining thousands of pieces (a fragmented mask) would take
        seconds a frame. Its every point goes into a buffer of its own, grown to the most seen, so that a long
        one-piece outline (a large mask at a large frame size) creates no array but OpenCV's.
        """
        if self._every.shape[0] < total:
            self._every = np.empty((total, 2), dtype=np.float32)
        every = self._every[:total]
        np.concatenate(contours, out=every.reshape(total, 1, 2), casting="unsafe")
        self._to_frame(every, in_input=in_input)
        self._cut = _sides(every)
        pieces = _largest(contours, self._max_points)
        points = merge_segments(pieces) if len(pieces) > 1 else pieces[0]
        stride = -(-len(points) // self._max_points)
        xy = self._room(k, -(-len(points) // stride))
        np.copyto(xy, points[::stride], casting="unsafe")
        self._to_frame(xy, in_input=in_input)
        return xy

    def _room(self, k: int, n: int) -> np.ndarray:
        """The first ``n`` points of the `k`-th outline buffer, the buffers grown (at most to
        max_outline_points) when they hold fewer."""
        if n > self._points.shape[1]:
            self._points = np.empty((self._max_masks, min(2 * n, self._max_points), 2), dtype=np.float32)
        return self._points[k, :n]

    def _to_frame(self, xy: np.ndarray, *, in_input: bool) -> None:
        """Outline points, in place, from the mask's pixels to the frame's (letterbox undone), clipped to it."""
        if in_input:
            np.subtract(xy, self._pad, out=xy)
            np.divide(xy, self._gain, out=xy)
        np.clip(xy, _ZERO, self._limit, out=xy)


def mask_bytes(m: BoxMap, prototype_pixels: int, *, retina: bool) -> int:
    """The bytes of one mask's buffers for frames of ``m``: its frame mask, its logits, its outline's
    first room (`Segmenter._plan`, less under a lower max_outline_points), its coefficients and candidate column."""
    outline_h, outline_w = (m.frame_h, m.frame_w) if retina else (m.input_h, m.input_w)
    return m.frame_h * m.frame_w + 4 * prototype_pixels + 16 * (outline_h + outline_w) + 4 * MASK_COEFFICIENTS + 8


def mask_budget_problem(max_masks: int, m: BoxMap, prototype_pixels: int, *, retina: bool) -> str | None:
    """Why ``max_masks`` masks of frames mapped by ``m`` (from prototypes of ``prototype_pixels``) cannot
    be made, naming ``model.max_masks``, the frame size and the memory they would take: more than
    `MASK_BUFFER_BUDGET`; None where they can."""
    each = mask_bytes(m, prototype_pixels, retina=retina)
    if max_masks * each <= MASK_BUFFER_BUDGET:
        return None
    fit = MASK_BUFFER_BUDGET // each
    fix = f"set model.max_masks to {fit} or less" if fit else "send smaller frames"
    return (
        f"model.max_masks = {max_masks} would need {max_masks * each / 2**30:.1f} GiB of mask buffers "
        f"for {m.frame_w}x{m.frame_h} frames ({each / 1e6:.1f} MB a mask), more than the "
        f"{MASK_BUFFER_BUDGET / 2**30:g} GiB edged allows them: {fix}"
    )


def _source_span(start: int, stop: int, k: int, size: int) -> tuple[int, int]:
    """The source pixels that output pixels ``start:stop`` of a ``k``-fold bilinear upsampling of
    ``size`` pixels interpolate between, and one more each side."""
    return max(start // k - 1, 0), min((stop - 1) // k + 2, size)


def _upsampled_part(
    source: np.ndarray, ky: int, kx: int, origin: tuple[int, int], part: tuple[int, int, int, int], scratch: np.ndarray
) -> np.ndarray:
    """Rows ``r0:r1`` and columns ``c0:c1`` (``part``) of an image upsampled (bilinear) ``ky`` by
    ``kx`` times, from ``source``: its pixels from ``origin`` (row, column) on, `_source_span` of them.

    OpenCV's bilinear weights depend on an output pixel's place within its source pixel alone, and
    the pixel round the span keeps the image's edges out of it, so the values are those of the whole
    image upsampled, bit for bit. Written into ``scratch``, which must hold the whole image.
    """
    (top, left), (r0, r1, c0, c1) = origin, part
    h, w = source.shape[0] * ky, source.shape[1] * kx
    out = scratch.reshape(-1)[: h * w].reshape(h, w)
    cv2.resize(source, (w, h), dst=out, interpolation=cv2.INTER_LINEAR)
    return out[r0 - top * ky : r1 - top * ky, c0 - left * kx : c1 - left * kx]


def _sides(polygon: np.ndarray) -> tuple[float, float]:
    """The length and width of the outline's minimum-area rectangle, the longer first."""
    if len(polygon) == 0:
        return 0.0, 0.0
    (_, _), (w, h), _ = cv2.minAreaRect(polygon)
    return (float(max(w, h)), float(min(w, h)))


def _largest(contours: Sequence[np.ndarray], limit: int) -> list[np.ndarray]:
    """The pieces with the most points, as (p, 2), while joined they are at most ``limit`` points (the
    largest one whatever its size), in the contours' order: the outline ultralytics would join of them."""
    lengths = list(map(len, contours))
    kept: list[int] = []
    joined = -2
    for i in sorted(range(len(contours)), key=lengths.__getitem__, reverse=True):
        joined += lengths[i] + 2
        if kept and joined > limit:
            break
        kept.append(i)
    return [contours[i].reshape(-1, 2) for i in sorted(kept)]


def merge_segments(segments: list[np.ndarray]) -> np.ndarray:
    """Several contours joined into one outline, each to the next at their closest points, as
    ultralytics' ``merge_multi_segment`` joins them (there and back, so the outline is closed)."""
    segments = [np.asarray(s).reshape(-1, 2) for s in segments]
    idx_list: list[list[int]] = [[] for _ in segments]
    for i in range(1, len(segments)):
        distances = ((segments[i - 1][:, None, :] - segments[i][None, :, :]) ** 2).sum(-1)
        idx1, idx2 = divmod(int(distances.argmin()), distances.shape[1])
        idx_list[i - 1].append(idx1)
        idx_list[i].append(idx2)
    merged: list[np.ndarray] = []
    for k in range(2):
        if k == 0:
            for i, idx in enumerate(idx_list):
                if len(idx) == 2 and idx[0] > idx[1]:
                    idx = [len(segments[i]) - 1 - x for x in idx]
                    segments[i] = segments[i][::-1, :]
                # rolled to start at idx[0], and closed: np.roll then the first point again
                segments[i] = np.concatenate((segments[i][idx[0] :], segments[i][: idx[0] + 1]))
                if i in {0, len(idx_list) - 1}:
                    merged.append(segments[i])
                else:
                    idx = [0, idx[1] - idx[0]]
                    merged.append(segments[i][idx[0] : idx[1] + 1])
        else:
            for i in range(len(idx_list) - 1, -1, -1):
                if i not in {0, len(idx_list) - 1}:
                    idx = idx_list[i]
                    nidx = abs(idx[1] - idx[0])
                    merged.append(segments[i][nidx:])
    return np.concatenate(merged)
