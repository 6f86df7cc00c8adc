"""Preprocess: frame -> the model's input tensor, in place.

All buffers are allocated once, when the plan is made from the contract and the frame size:
the uint8 canvas (pre-filled with the letterbox grey), the view of it that receives the resized
image, uint8 channel planes, and the per-channel gain and bias. A frame then costs one
``cv2.resize`` straight into the canvas view, one ``cv2.split`` that reorders channels into the
model's layout (NCHW; a uint8 model's tensor takes the planes directly), and one contiguous pass
per plane that casts and normalises into the input tensor (``cv2.multiply`` for float32, four
times faster than numpy's mixed-type loop). The letterbox padding never changes, so it is
converted once, with the plan; each frame converts only the rows and columns of its content
(for 16:9 into a square input, 56 % of the tensor). Nothing is allocated per frame.
"""

from __future__ import annotations

from dataclasses import dataclass

import cv2
import numpy as np

from edged.contract import ChannelOrder, InputContract
from edged.geometry import BoxMap

LETTERBOX_FILL = 114  # ultralytics' padding value; models trained there expect it
Region = tuple[slice, slice]  # rows, columns of the model's input
WHOLE: Region = (slice(None), slice(None))


@dataclass(frozen=True, slots=True)
class _Pass:
    """The views one conversion pass reads and writes, cut to a region of the input."""

    canvas: np.ndarray  # HWC uint8 in the source's channel order
    source: np.ndarray  # the same pixels seen in the model's layout and channel order (no copy)
    target: np.ndarray  # the input tensor, batch dropped
    planes: np.ndarray | None  # NCHW: uint8 planes in the model's channel order
    split_into: list[np.ndarray]  # those planes in the source's order, for cv2.split
    scaled: list[tuple[np.ndarray, np.ndarray, float]] | None  # float32 NCHW: (plane, tensor plane, gain)


class Preprocessor:
    """Writes frames of one size into a preallocated input tensor according to the contract."""

    def __init__(self, contract: InputContract, frame_w: int, frame_h: int, source_order: ChannelOrder = "bgr") -> None:
        self.contract = contract
        self.source_order = source_order
        plan = BoxMap.letterbox if contract.resize == "letterbox" else BoxMap.stretch
        self.box_map = plan(frame_w, frame_h, contract.width, contract.height)
        self.tensor = np.zeros(contract.shape, dtype=contract.dtype)
        self._canvas = np.full((contract.height, contract.width, 3), LETTERBOX_FILL, np.uint8)
        m = self.box_map
        content: Region = (slice(m.pad_y, m.pad_y + m.resized_h), slice(m.pad_x, m.pad_x + m.resized_w))
        self._content = self._canvas[content]
        self._needs_resize = (m.resized_w, m.resized_h) != (frame_w, frame_h)
        self._gain, self._bias = self._normalisation(contract)
        self._planes = self._plane_buffer(contract)
        # The padding, once. Until the first frame the tensor is an empty letterboxed image, which
        # is also what the engine's warm-up run sees.
        self._convert(self._pass(WHOLE))
        self._frame_pass = self._pass(content)

    def _plane_buffer(self, c: InputContract) -> np.ndarray | None:
        """For NCHW: uint8 planes in the model's channel order, filled by one cv2.split.

        Splitting into contiguous planes first and then normalising them in one contiguous
        pass is faster than numpy reading the interleaved canvas through a transposed view.
        A uint8 model's input tensor is itself the planes.
        """
        if c.layout != "nchw":
            return None
        return self.tensor[0] if c.dtype is np.uint8 else np.empty((3, c.height, c.width), np.uint8)

    def _pass(self, region: Region) -> _Pass:
        """Views (no copies) of the canvas, planes and tensor over one region of the input."""
        c, rows, cols = self.contract, *region
        canvas, swap = self._canvas[rows, cols], c.channel_order != self.source_order
        if c.layout == "nchw":
            source, target, channel_axis = canvas.transpose(2, 0, 1), self.tensor[0][:, rows, cols], 0
        else:
            source, target, channel_axis = canvas, self.tensor[0][rows, cols], 2
        # Colour conversion only where the orders differ; reversing the channel axis is a
        # stride trick, not a copy.
        if swap:
            source = np.flip(source, axis=channel_axis)
        planes = None if self._planes is None else self._planes[:, rows, cols]
        split_into = [] if planes is None else [planes[i] for i in ((2, 1, 0) if swap else (0, 1, 2))]
        scaled = None
        # float32 NCHW: OpenCV converts and scales each plane in one pass. OpenCV has no float16
        # arithmetic, so float16 tensors keep the numpy pass.
        if planes is not None and self._gain is not None and c.dtype is np.float32:
            scaled = list(zip(planes, target, [float(g) for g in self._gain.ravel()], strict=True))
        return _Pass(canvas, source, target, planes, split_into, scaled)

    def _normalisation(self, c: InputContract) -> tuple[np.ndarray | None, np.ndarray | None]:
        if c.dtype is np.uint8:
            return None, None
        shape = (3, 1, 1) if c.layout == "nchw" else (3,)
        std = np.asarray(c.std, np.float64)
        gain = (c.scale / std).reshape(shape).astype(c.dtype)
        bias = (np.asarray(c.mean, np.float64) / std).reshape(shape).astype(c.dtype)
        return gain, (bias if bias.any() else None)

    def __call__(self, image: np.ndarray) -> np.ndarray:
        """Fill the input tensor from a frame of the planned size and order; returns the tensor."""
        if self._needs_resize:
            cv2.resize(
                image, (self.box_map.resized_w, self.box_map.resized_h), dst=self._content, interpolation=cv2.INTER_LINEAR
            )
        else:
            np.copyto(self._content, image)
        self._convert(self._frame_pass)
        return self.tensor

    def _convert(self, p: _Pass) -> None:
        """Canvas -> tensor over one region: layout, channel order, cast and normalisation."""
        if p.planes is not None:
            cv2.split(p.canvas, p.split_into)  # channel swap + layout, into the planes
        if self._gain is None:  # a uint8 model reads the pixels as they are
            if p.planes is None:
                np.copyto(p.target, p.source)
            return
        if p.scaled is not None:
            for plane, out, gain in p.scaled:
                cv2.multiply(plane, 1.0, dst=out, scale=gain, dtype=cv2.CV_32F)
        elif p.planes is not None:
            np.multiply(p.planes, self._gain, out=p.target)
        else:
            # One pass: strided uint8 read (channel swap), cast, scale, write.
            np.multiply(p.source, self._gain, out=p.target)
        if self._bias is not None:
            np.subtract(p.target, self._bias, out=p.target)
