"""Geometry shared by preprocess and decode: how frame pixels map onto the model's input.

Preprocess writes the frame into the input tensor through a `BoxMap`; decode maps boxes back
through the same `BoxMap`. Keeping it in one small module means the two stages can never
disagree about letterbox rounding.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BoxMap:
    """Frame -> input transform: ``input = frame * scale + pad`` per axis.

    ``resized_w``/``resized_h`` is the size of the image content inside the input (the rest is
    padding); ``pad_x``/``pad_y`` is where the content starts.
    """

    frame_w: int
    frame_h: int
    input_w: int
    input_h: int
    scale_x: float
    scale_y: float
    pad_x: int
    pad_y: int
    resized_w: int
    resized_h: int

    @classmethod
    def letterbox(cls, frame_w: int, frame_h: int, input_w: int, input_h: int) -> BoxMap:
        """Ultralytics' LetterBox(auto=False, center=True): one scale, centred padding.

        The rounding copies ultralytics exactly (``round(w * r)``, then ``round(dw - 0.1)``
        for the left/top pad) so a model trained there sees the same pixels here; boxes map
        back with the gain of each rounded side, ``resized / frame``, as its ``scale_boxes`` does.
        A side that rounds to 0 (a strip far thinner than the input) keeps one pixel, where
        ultralytics' resize fails.
        """
        r = min(input_h / frame_h, input_w / frame_w)
        resized_w, resized_h = max(1, round(frame_w * r)), max(1, round(frame_h * r))
        dw, dh = (input_w - resized_w) / 2, (input_h - resized_h) / 2
        pad_x, pad_y = round(dw - 0.1), round(dh - 0.1)
        gain_x, gain_y = resized_w / frame_w, resized_h / frame_h
        return cls(frame_w, frame_h, input_w, input_h, gain_x, gain_y, pad_x, pad_y, resized_w, resized_h)

    @classmethod
    def stretch(cls, frame_w: int, frame_h: int, input_w: int, input_h: int) -> BoxMap:
        """Plain resize to the input size (RT-DETR style scale-fill): no padding."""
        return cls(
            frame_w,
            frame_h,
            input_w,
            input_h,
            input_w / frame_w,
            input_h / frame_h,
            0,
            0,
            input_w,
            input_h,
        )

    @classmethod
    def crop(cls, frame_w: int, frame_h: int, input_w: int, input_h: int) -> BoxMap:
        """Ultralytics' classification preprocessing (torchvision ``Resize`` then ``CenterCrop``): a
        square input takes the shortest side resized to it, the longest in proportion (truncated), and
        its centre; another input is filled by a plain resize. ``pad`` is minus the crop's corner."""
        if input_w == input_h:
            short, long = sorted((frame_w, frame_h))
            new_long = int(input_w * long / short)
            resized_w, resized_h = (input_w, new_long) if frame_w <= frame_h else (new_long, input_w)
        else:
            resized_w, resized_h = input_w, input_h
        left, top = round((resized_w - input_w) / 2.0), round((resized_h - input_h) / 2.0)
        gain_x, gain_y = resized_w / frame_w, resized_h / frame_h
        return cls(frame_w, frame_h, input_w, input_h, gain_x, gain_y, -left, -top, resized_w, resized_h)
