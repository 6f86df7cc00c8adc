"""Preprocess: frame -> the model's input tensor, in place.

All buffers are allocated once, when the plan is made from the contract and the frame size:
the uint8 canvas (pre-filled with the letterbox grey), the view of it that receives the resized
image, uint8 channel planes, and one normalisation table per channel. A frame then costs one
``cv2.resize`` straight into the canvas view, one ``cv2.split`` that reorders channels into the
model's layout (NCHW; a uint8 model's tensor takes the planes directly, an NHWC model in the
other colour order gets one ``cv2.cvtColor``), and one ``cv2.LUT`` per plane that looks each
byte's normalised value up and writes it into the input tensor. The table holds the exact value
for each of the 256 bytes, so the tensor is bit for bit what ultralytics feeds the model, where
a multiplication by 1/255 is wrong in the last bit for half of them. For the usual float32 NCHW
model, whose table is each byte over 255, one ``cv2.divide`` per plane writes the same values
faster, where OpenCV's division is checked to give them (`_divides_exactly`). The letterbox padding never
changes, so it is converted once, with the plan; each frame converts only the rows and columns
of its content (for 16:9 into a square input, 56 % of the tensor). Nothing is allocated per frame.

A classifier is fed ultralytics' classification preprocessing instead (``crop``, `BoxMap.crop`):
torchvision resizes the frame with Pillow's antialiased bilinear filter, in Pillow's fixed-point
arithmetic, then takes the centre. `CropResample` computes exactly those bytes, and only the ones
the crop keeps, into the canvas; the rest of the path is the same. An anomalib export is fed by
`AntialiasPreprocessor` (``antialias``): the whole frame stretched with PyTorch's antialiased
bilinear resize in float32, as anomalib trains (`preprocessor` picks the one the contract asks for).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import cv2
import numpy as np

from edged.contract import ChannelOrder, InputContract
from edged.geometry import BoxMap

LETTERBOX_FILL = 114  # ultralytics' padding value; models trained there expect it
PRECISION_BITS = 22  # Pillow's fixed-point weights of 8-bit resampling: 32 - 8 - 2
_HALF_UNIT = np.array(1 << (PRECISION_BITS - 1), dtype=np.int32)  # 0-d operands allocate nothing per call
_BITS = np.array(PRECISION_BITS, dtype=np.int32)
_BLACK, _WHITE = np.array(0, dtype=np.int32), np.array(255, dtype=np.int32)
Region = tuple[slice, slice]  # rows, columns of the model's input
WHOLE: Region = (slice(None), slice(None))


def normalisation_table(contract: InputContract) -> np.ndarray:
    """(3, 256): the model's input value for each byte value of each channel, in the model's order.

    Each entry is ``(v * scale - mean) / std`` computed in float64 and rounded once to the input's
    type. For the default scale 1/255 that is exactly what ultralytics computes, float32 ``v / 255``
    (and ``v.half() / 255`` for a float16 input): the tests check all 256 values.
    """
    values = np.arange(256, dtype=np.float64)[None, :] * contract.scale
    table: np.ndarray = (values - np.asarray(contract.mean)[:, None]) / np.asarray(contract.std)[:, None]
    return table.astype(contract.dtype)


@dataclass(frozen=True, slots=True)
class _Pass:
    """The views one conversion pass reads and writes, cut to a region of the input."""

    canvas: np.ndarray  # HWC uint8 in the source's channel order
    split_into: list[np.ndarray]  # NCHW: uint8 planes in the model's order, listed in the source's order
    swap_into: np.ndarray | None  # NHWC in the other colour order: where cvtColor writes the swapped pixels
    copy_into: np.ndarray | None  # NHWC uint8 in the same colour order: the tensor, copied into
    lookups: list[tuple[np.ndarray, np.ndarray, np.ndarray]]  # float inputs: (uint8 pixels, table, tensor)
    divisor: float | None  # the table is each byte over this, as cv2.divide computes it: divided, not looked up


class Preprocessor:
    """Writes frames of one size into a preallocated input tensor according to the contract."""

    def __init__(self, contract: InputContract, frame_w: int, frame_h: int, source_order: ChannelOrder = "bgr") -> None:
        self.contract = contract
        self.source_order = source_order
        plan = {"letterbox": BoxMap.letterbox, "stretch": BoxMap.stretch, "crop": BoxMap.crop}[contract.resize]
        self.box_map = plan(frame_w, frame_h, contract.width, contract.height)
        self.tensor = np.zeros(contract.shape, dtype=contract.dtype)
        self._canvas = np.full((contract.height, contract.width, 3), LETTERBOX_FILL, np.uint8)
        m = self.box_map
        self._crop = CropResample(m) if contract.resize == "crop" else None
        content: Region = (
            WHOLE if self._crop else (slice(m.pad_y, m.pad_y + m.resized_h), slice(m.pad_x, m.pad_x + m.resized_w))
        )
        self._content = self._canvas[content]
        self._needs_resize = (m.resized_w, m.resized_h) != (frame_w, frame_h)
        self._swap = contract.channel_order != source_order
        self._float = contract.dtype is not np.uint8
        self._tables = self._lookup_tables(contract)
        self._divisor = divisor_of(contract) if contract.layout == "nchw" else None
        if contract.layout == "nchw":
            # uint8 planes in the model's colour order, filled by one cv2.split; a uint8 model's
            # tensor is itself the planes.
            planes = np.empty((3, contract.height, contract.width), np.uint8) if self._float else self.tensor[0]
            whole, frame = (self._nchw_pass(region, planes) for region in (WHOLE, content))
        else:
            # A float model in the other colour order reads the swapped pixels from their own buffer.
            swapped = np.empty((contract.height, contract.width, 3), np.uint8) if self._float and self._swap else None
            whole, frame = (self._nhwc_pass(region, swapped) for region in (WHOLE, content))
        if not (_divides_exactly(whole) and _divides_exactly(frame)):
            whole, frame = replace(whole, divisor=None), replace(frame, divisor=None)
        # The padding, once. Until the first frame the tensor is an empty letterboxed image, which
        # is also what the engine's warm-up run sees.
        self._convert(whole)
        self._frame_pass = frame

    def _lookup_tables(self, c: InputContract) -> np.ndarray | None:
        """The normalisation table as cv2.LUT reads it: one row per NCHW plane, or (1, 256, 3) for NHWC.

        OpenCV before 5 has no float16 lookup, so a float16 table is looked up as its uint16 bit
        patterns into a uint16 view of the tensor: the same bytes, on any OpenCV.
        """
        if not self._float:
            return None
        table = normalisation_table(c)
        if c.dtype is np.float16:
            table = table.view(np.uint16)
        return table if c.layout == "nchw" else np.ascontiguousarray(table.T[None])

    def _target(self) -> np.ndarray:
        """The tensor as cv2.LUT writes it: a float16 tensor takes its table's bit patterns through a uint16 view."""
        return self.tensor.view(np.uint16) if self.contract.dtype is np.float16 else self.tensor

    def _nchw_pass(self, region: Region, planes: np.ndarray) -> _Pass:
        """Views (no copies) over one region: the canvas, the planes in the model's order, the tensor planes."""
        rows, cols = region
        planes = planes[:, rows, cols]
        split_into = [planes[i] for i in ((2, 1, 0) if self._swap else (0, 1, 2))]
        lookups = []
        if self._tables is not None:
            target = self._target()
            lookups = [(planes[i], self._tables[i], target[0, i, rows, cols]) for i in range(3)]
        return _Pass(self._canvas[rows, cols], split_into, None, None, lookups, self._divisor)

    def _nhwc_pass(self, region: Region, swapped: np.ndarray | None) -> _Pass:
        """Views (no copies) over one region: the canvas, the swapped pixels if any, the tensor."""
        rows, cols = region
        canvas, target = self._canvas[rows, cols], self._target()[0, rows, cols]
        if self._tables is None:  # uint8: the tensor takes the pixels, swapped or as they are
            return _Pass(canvas, [], target if self._swap else None, None if self._swap else target, [], None)
        if swapped is None:
            return _Pass(canvas, [], None, None, [(canvas, self._tables, target)], None)
        swapped = swapped[rows, cols]
        return _Pass(canvas, [], swapped, None, [(swapped, self._tables, target)], None)

    def __call__(self, image: np.ndarray) -> np.ndarray:
        """Fill the input tensor from a frame of the planned size and order; returns the tensor."""
        if self._crop is not None:
            self._crop(image, self._content)
        elif self._needs_resize:
            cv2.resize(
                image, (self.box_map.resized_w, self.box_map.resized_h), dst=self._content, interpolation=cv2.INTER_LINEAR
            )
        else:
            np.copyto(self._content, image)
        self._convert(self._frame_pass)
        return self.tensor

    @staticmethod
    def _convert(p: _Pass) -> None:
        """Canvas -> tensor over one region: layout, colour order, then the normalisation lookup."""
        if p.split_into:
            cv2.split(p.canvas, p.split_into)  # channel swap + layout, into the planes
        if p.swap_into is not None:
            cv2.cvtColor(p.canvas, cv2.COLOR_BGR2RGB, dst=p.swap_into)  # either way round: it swaps 0 and 2
        if p.copy_into is not None:
            np.copyto(p.copy_into, p.canvas)
        for pixels, table, out in p.lookups:
            if p.divisor is None:
                cv2.LUT(pixels, table, dst=out)
            else:
                # OpenCV's stubs list no number as divisor; the binding takes one, as a single-channel Scalar.
                cv2.divide(pixels, p.divisor, dst=out, dtype=cv2.CV_32F)  # type: ignore[call-overload]


def divisor_of(contract: InputContract) -> float | None:
    """What a float32 model's normalisation divides each byte by, when it only divides (scale, no
    mean or std: ultralytics' 1/255), else None: its table is looked up.

    One ``cv2.divide`` per plane computes it three times faster than ``cv2.LUT`` (tens of
    microseconds a frame), where OpenCV's division gives exactly the table (`_divides_exactly`).
    """
    if contract.dtype is not np.float32 or any(contract.mean) or any(s != 1.0 for s in contract.std) or not contract.scale:
        return None
    return 1.0 / contract.scale


def _divides_exactly(p: _Pass) -> bool:
    """Whether OpenCV's division writes exactly the table's values into this pass's views (true when
    it does not divide). Its rounding may depend on the CPU's SIMD, and on which of its loops a
    pixel falls to (a row's tail, an unaligned start), so it is tried once, with the plan, on the
    very views a frame converts, each byte value at many places; the whole conversion that follows
    overwrites what it wrote.
    """
    if p.divisor is None:
        return True
    for pixels, table, out in p.lookups:
        pixels[...] = (np.arange(pixels.size) % 256).reshape(pixels.shape)
        cv2.divide(pixels, p.divisor, dst=out, dtype=cv2.CV_32F)  # type: ignore[call-overload]
        if not np.array_equal(out, table[pixels]):
            return False
    return True


def pillow_bilinear(in_size: int, out_size: int, outputs: range) -> tuple[np.ndarray, np.ndarray]:
    """Pillow's antialiased bilinear filter from ``in_size`` to ``out_size`` pixels, as its C code
    computes it (``precompute_coeffs``, ``normalize_coeffs_8bpc``): for each output pixel of
    ``outputs``, (taps,) input indices and their int32 fixed-point weights, the unused taps weighing 0.

    Only the outputs asked for: a centre crop keeps the input's size of them. A frame of 7680x1
    pixels, resized for a 224x224 input, is 1720320 pixels long: all of them took 62 MB and 7 s of
    a desktop core (on a board, more than ``service.stall_timeout_s``); 33177600x1 pixels, 47.5 GiB."""
    scale = in_size / out_size
    filterscale = max(scale, 1.0)
    support = filterscale  # the bilinear filter's support is 1
    taps = math.ceil(support) * 2 + 1
    index = np.zeros((len(outputs), taps), dtype=np.intp)
    fixed = np.zeros((len(outputs), taps), dtype=np.int32)
    for i, xx in enumerate(outputs):
        center = (xx + 0.5) * scale
        xmin = max(int(center - support + 0.5), 0)
        count = min(int(center + support + 0.5), in_size) - xmin
        weights = [max(0.0, 1.0 - abs((x + xmin - center + 0.5) / filterscale)) for x in range(count)]
        total = 0.0
        for w in weights:
            total += w
        if total != 0.0:
            weights = [w / total for w in weights]
        index[i, :count] = np.arange(xmin, xmin + count)
        index[i, count:] = xmin
        fixed[i, :count] = [int(0.5 + w * (1 << PRECISION_BITS)) for w in weights]
    return index, fixed


class CropResample:
    """The bytes of a frame resized as Pillow does (bilinear, antialiased) and centre-cropped, as
    `BoxMap.crop` says, into a (h, w, 3) uint8 canvas: the crop's columns are resampled along each
    row first, rounded to bytes, then its rows along each column, as Pillow's two passes are. All
    in int32 buffers made here: a frame allocates nothing."""

    def __init__(self, m: BoxMap) -> None:
        w, h = m.input_w, m.input_h
        left, top = -m.pad_x, -m.pad_y
        self._horizontal = m.resized_w != m.frame_w
        self._vertical = m.resized_h != m.frame_h
        cols, col_weights = pillow_bilinear(m.frame_w, m.resized_w, range(left, left + w))
        rows, row_weights = pillow_bilinear(m.frame_h, m.resized_h, range(top, top + h))
        if not self._horizontal:
            cols = np.arange(left, left + w, dtype=np.intp)[:, None]
        if not self._vertical:
            rows = np.arange(top, top + h, dtype=np.intp)[:, None]
        # The frame rows the crop reads: only they are resampled along the row.
        self._first, last = int(rows.min()), int(rows.max()) + 1
        self._frame = np.empty((last - self._first, m.frame_w, 3), dtype=np.int32)
        self._row_taps = [np.ascontiguousarray(rows[:, k] - self._first) for k in range(rows.shape[1])]
        self._col_taps = [np.ascontiguousarray(cols[:, k]) for k in range(cols.shape[1])]
        self._row_weights = [np.ascontiguousarray(row_weights[:, k, None, None]) for k in range(row_weights.shape[1])]
        self._col_weights = [np.ascontiguousarray(col_weights[None, :, k, None]) for k in range(col_weights.shape[1])]
        self._across = np.empty((last - self._first, w, 3), dtype=np.int32)  # after the row pass
        self._row_gather = np.empty_like(self._across)
        self._out = np.empty((h, w, 3), dtype=np.int32)
        self._col_gather = np.empty_like(self._out)

    def __call__(self, image: np.ndarray, canvas: np.ndarray) -> None:
        """Resample and crop ``image`` (the planned frame size) into ``canvas``."""
        frame = self._frame
        np.copyto(frame, image[self._first : self._first + frame.shape[0]])
        across = self._across
        if self._horizontal:
            self._taps(frame, self._col_taps, self._col_weights, 1, self._row_gather, across)
        else:
            np.take(frame, self._col_taps[0], axis=1, out=across, mode="clip")
        if self._vertical:
            self._taps(across, self._row_taps, self._row_weights, 0, self._col_gather, self._out)
        else:
            np.take(across, self._row_taps[0], axis=0, out=self._out, mode="clip")
        np.copyto(canvas, self._out, casting="unsafe")  # bytes already: every value is in 0..255

    @staticmethod
    def _taps(
        source: np.ndarray, taps: list[np.ndarray], weights: list[np.ndarray], axis: int, gather: np.ndarray, out: np.ndarray
    ) -> None:
        """One pass: ``out`` = the weighted sum of ``source``'s taps along ``axis``, rounded and
        clamped to a byte as Pillow's ``clip8``."""
        np.copyto(out, _HALF_UNIT)
        for index, weight in zip(taps, weights, strict=True):
            np.take(source, index, axis=axis, out=gather, mode="clip")
            np.multiply(gather, weight, out=gather)
            np.add(out, gather, out=out)
        np.right_shift(out, _BITS, out=out)
        np.minimum(out, _WHITE, out=out)
        np.maximum(out, _BLACK, out=out)


def antialias_taps(n_in: int, n_out: int) -> tuple[np.ndarray, np.ndarray]:
    """PyTorch's antialiased bilinear resize (``interpolate(mode="bilinear", antialias=True)``, Pillow's
    filter) from ``n_in`` samples to ``n_out``, as taps: (k, n_out) input indices and (k, n_out)
    float32 weights, output i being the sum over j of ``weights[j, i] * input[indices[j, i]]``.

    A triangle filter stretched over the input samples one output sample covers, each output's
    weights normalised to sum to 1; when upsampling it is plain bilinear interpolation. The support
    and the rounding of its ends are PyTorch's, so that the values are the ones anomalib trained on.
    An output with fewer taps than k has the rest pointing at its first with weight 0.
    """
    scale = n_in / n_out
    support, inverse = (scale, 1 / scale) if scale >= 1 else (1.0, 1.0)
    spans = []
    for i in range(n_out):
        center = scale * (i + 0.5)
        lo, hi = max(int(center - support + 0.5), 0), min(int(center + support + 0.5), n_in)
        taps = np.maximum(0.0, 1.0 - np.abs((np.arange(lo, hi) - center + 0.5) * inverse))
        spans.append((lo, taps / taps.sum()))
    k = max(len(taps) for _, taps in spans)
    indices = np.zeros((k, n_out), dtype=np.intp)
    weights = np.zeros((k, n_out), dtype=np.float64)
    for i, (lo, taps) in enumerate(spans):
        indices[:, i] = lo
        indices[: len(taps), i] = np.arange(lo, lo + len(taps))
        weights[: len(taps), i] = taps
    return indices, weights.astype(np.float32)


class AntialiasPreprocessor:
    """Writes frames of one size into the input tensor of an anomalib export: the whole frame
    stretched to the input with an antialiased bilinear resize, RGB values in 0..1, NCHW.

    anomalib trains, validates and predicts on images resized that way; its ONNX export resizes
    without antialiasing, so edged resizes here and feeds the trained size, which the graph's own
    resize then leaves as it is. The resize is separable, with taps made once per frame size
    (`antialias_taps`): each byte is looked up to its float value into a frame-sized plane, which
    is resized down the columns (one gather, scale and add per row tap), then along the rows
    straight into the tensor. Every buffer is made here; a frame allocates nothing.
    """

    def __init__(self, contract: InputContract, frame_w: int, frame_h: int, source_order: ChannelOrder = "bgr") -> None:
        self.contract = contract
        self.source_order = source_order
        h, w = contract.height, contract.width
        self.box_map = BoxMap.stretch(frame_w, frame_h, w, h)
        self.tensor = np.zeros(contract.shape, dtype=contract.dtype)
        rows, row_weights = antialias_taps(frame_h, h)
        self._rows, self._row_weights = rows, row_weights[:, :, None]  # (k, h, 1): scales whole rows
        self._columns, self._column_weights = antialias_taps(frame_w, w)  # (k, w): broadcast over rows
        self._planes = np.empty((3, frame_h, frame_w), np.uint8)
        self._values = np.empty((frame_h, frame_w), np.float32)
        self._half = np.empty((h, frame_w), np.float32)  # resized down the columns
        self._tap_rows = np.empty((h, frame_w), np.float32)
        self._tap_columns = np.empty((h, w), np.float32)
        order = (2, 1, 0) if contract.channel_order != source_order else (0, 1, 2)
        self._split_into = [self._planes[i] for i in order]
        self._tables = normalisation_table(contract)

    def __call__(self, image: np.ndarray) -> np.ndarray:
        """Fill the input tensor from a frame of the planned size and order; returns the tensor."""
        cv2.split(image, self._split_into)
        half, tap_rows, tap_columns = self._half, self._tap_rows, self._tap_columns
        for c in range(3):
            cv2.LUT(self._planes[c], self._tables[c], dst=self._values)
            out = self.tensor[0, c]
            for k in range(self._rows.shape[0]):
                target = half if k == 0 else tap_rows
                np.take(self._values, self._rows[k], axis=0, out=target, mode="clip")
                np.multiply(target, self._row_weights[k], out=target)
                if k:
                    np.add(half, tap_rows, out=half)
            for k in range(self._columns.shape[0]):
                target = out if k == 0 else tap_columns
                np.take(half, self._columns[k], axis=1, out=target, mode="clip")
                np.multiply(target, self._column_weights[k], out=target)
                if k:
                    np.add(out, tap_columns, out=out)
        return self.tensor


def preprocessor(
    contract: InputContract, frame_w: int, frame_h: int, source_order: ChannelOrder
) -> Preprocessor | AntialiasPreprocessor:
    """The preprocessor the contract's resize asks for."""
    if contract.resize == "antialias":
        return AntialiasPreprocessor(contract, frame_w, frame_h, source_order)
    return Preprocessor(contract, frame_w, frame_h, source_order)
