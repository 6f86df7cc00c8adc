"""Preprocess: frame -> the model's input tensor, in place.

All buffers are allocated once, when the plan is made from the contract and the frame size:
the uint8 canvas (pre-filled with the letterbox grey), the view of it that receives the resized
image, uint8 channel planes, and the per-channel gain and bias. A frame then costs one
``cv2.resize`` straight into the canvas view, one ``cv2.split`` that reorders channels into the
model's layout (NCHW; a uint8 model's tensor takes the planes directly), and one contiguous pass
per plane that casts and normalises into the input
tensor (``cv2.multiply`` for float32, four times faster than numpy's mixed-type loop). Nothing is
allocated per frame.
"""

from __future__ import annotations

import cv2
import numpy as np

from edged.contract import ChannelOrder, InputContract
from edged.geometry import BoxMap

LETTERBOX_FILL = 114  # ultralytics' padding value; models trained there expect it


class Preprocessor:
    """Writes frames of one size into a preallocated input tensor according to the contract."""

    def __init__(
        self, contract: InputContract, frame_w: int, frame_h: int, source_order: ChannelOrder = "bgr"
    ) -> None:
        self.contract = contract
        self.source_order = source_order
        plan = BoxMap.letterbox if contract.resize == "letterbox" else BoxMap.stretch
        self.box_map = plan(frame_w, frame_h, contract.width, contract.height)
        self.tensor = np.zeros(contract.shape, dtype=contract.dtype)  # defined for the warm-up run
        self._canvas = np.full((contract.height, contract.width, 3), LETTERBOX_FILL, np.uint8)
        m = self.box_map
        self._content = self._canvas[m.pad_y : m.pad_y + m.resized_h, m.pad_x : m.pad_x + m.resized_w]
        self._needs_resize = (m.resized_w, m.resized_h) != (frame_w, frame_h)
        self._source_view, self._target = self._layout_views(contract)
        self._gain, self._bias = self._normalisation(contract)
        self._planes, self._plane_views = self._split_planes(contract)
        self._scaled_planes = self._plane_jobs(contract)

    def _layout_views(self, c: InputContract) -> tuple[np.ndarray, np.ndarray]:
        """Views (no copies) that turn the HWC canvas into the model's channel order and layout."""
        canvas = self._canvas
        if c.layout == "nchw":
            source, target = canvas.transpose(2, 0, 1), self.tensor[0]
            channel_axis = 0
        else:
            source, target = canvas, self.tensor[0]
            channel_axis = 2
        # Colour conversion only where the orders differ; reversing the channel axis is a
        # stride trick, not a copy.
        if c.channel_order != self.source_order:
            source = np.flip(source, axis=channel_axis)
        return source, target

    def _split_planes(self, c: InputContract) -> tuple[np.ndarray | None, list[np.ndarray]]:
        """For NCHW: uint8 planes in the model's channel order, filled by one cv2.split.

        Splitting into contiguous planes first and then normalising them in one contiguous
        pass is faster than numpy reading the interleaved canvas through a transposed view.
        A uint8 model's input tensor is itself the planes.
        """
        if c.layout != "nchw":
            return None, []
        planes = self.tensor[0] if c.dtype is np.uint8 else np.empty((3, c.height, c.width), np.uint8)
        views = [planes[i] for i in range(3)]
        if c.channel_order != self.source_order:
            views.reverse()
        return planes, views

    def _plane_jobs(self, c: InputContract) -> list[tuple[np.ndarray, np.ndarray, float]] | None:
        """(plane, tensor plane, gain) for float32 NCHW: OpenCV converts and scales in one pass.

        OpenCV has no float16 arithmetic, so float16 tensors keep the numpy pass.
        """
        if self._planes is None or self._gain is None or c.dtype is not np.float32:
            return None
        gains = [float(g) for g in self._gain.ravel()]
        return list(zip(self._planes, self._target, gains, strict=True))

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
            cv2.resize(image, (self.box_map.resized_w, self.box_map.resized_h),
                       dst=self._content, interpolation=cv2.INTER_LINEAR)
        else:
            np.copyto(self._content, image)
        if self._planes is not None:
            cv2.split(self._canvas, self._plane_views)  # channel swap + layout, into the planes
        if self._gain is None:  # a uint8 model reads the pixels as they are
            if self._planes is None:
                np.copyto(self._target, self._source_view)
            return self.tensor
        if self._planes is not None:
            if self._scaled_planes is not None:
                for plane, out, gain in self._scaled_planes:
                    cv2.multiply(plane, 1.0, dst=out, scale=gain, dtype=cv2.CV_32F)
            else:
                np.multiply(self._planes, self._gain, out=self._target)
        else:
            # One pass: strided uint8 read (channel swap), cast, scale, write.
            np.multiply(self._source_view, self._gain, out=self._target)
        if self._bias is not None:
            np.subtract(self._target, self._bias, out=self._target)
        return self.tensor
