"""Preprocess writes exactly what ultralytics' LetterBox + BGR->RGB + /255 produces, in place.

The reference for the normalisation is numpy's float32 ``v / np.float32(255)``: torch's
``im.float() / 255``, as ultralytics' predictor computes it on the CPU, gives the same float32 for
every byte value, and ``im.half() / 255`` (a float16 input) is that value rounded to float16.
"""

from __future__ import annotations

import tracemalloc

import cv2
import numpy as np
import pytest
from allocations import NumpyAllocations

from edged.contract import InputContract
from edged.geometry import BoxMap
from edged.preprocess import Preprocessor, divisor_of, normalisation_table


def contract(
    h: int,
    w: int,
    *,
    layout: str = "nchw",
    order: str = "rgb",
    dtype: type = np.float32,
    resize: str = "letterbox",
    mean=(0.0, 0.0, 0.0),
    std=(1.0, 1.0, 1.0),
) -> InputContract:
    shape = (1, 3, h, w) if layout == "nchw" else (1, h, w, 3)
    return InputContract("images", shape, dtype, layout, order, resize, 1 / 255, mean, std)  # type: ignore[arg-type]


def ultralytics_letterbox(frame: np.ndarray, h: int, w: int) -> np.ndarray:
    """ultralytics.data.augment.LetterBox(auto=False, center=True), step by step, as it is written."""
    shape = frame.shape[:2]
    r = min(h / shape[0], w / shape[1])
    new_unpad = round(shape[1] * r), round(shape[0] * r)
    dw, dh = (w - new_unpad[0]) / 2, (h - new_unpad[1]) / 2
    if shape[::-1] != new_unpad:
        frame = cv2.resize(frame, new_unpad, interpolation=cv2.INTER_LINEAR)
    top, bottom = round(dh - 0.1), round(dh + 0.1)
    left, right = round(dw - 0.1), round(dw + 0.1)
    return cv2.copyMakeBorder(frame, top, bottom, left, right, cv2.BORDER_CONSTANT, value=(114, 114, 114))


@pytest.fixture
def frame() -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, (720, 1280, 3), np.uint8)


@pytest.mark.parametrize(
    ("h", "w", "frame_hw"),
    [
        (640, 640, (720, 1280)),  # landscape camera into a square model: pad top and bottom
        (320, 320, (720, 1280)),  # the demo model's input
        (640, 640, (1280, 720)),  # portrait: pad left and right
        (384, 640, (720, 1280)),  # rectangular input
        (641, 639, (480, 640)),  # odd sizes exercise the -0.1 rounding
    ],
)
def test_letterbox_matches_ultralytics_bit_for_bit(h: int, w: int, frame_hw: tuple[int, int]) -> None:
    image = np.random.default_rng(1).integers(0, 256, (*frame_hw, 3), np.uint8)
    pre = Preprocessor(contract(h, w), frame_hw[1], frame_hw[0])
    expected = ultralytics_letterbox(image, h, w)[..., ::-1].transpose(2, 0, 1)[None].astype(np.float32) / np.float32(255)
    np.testing.assert_array_equal(pre(image), expected)


def test_nhwc_bgr_model_gets_bgr_pixels_in_hwc(frame: np.ndarray) -> None:
    pre = Preprocessor(contract(640, 640, layout="nhwc", order="bgr"), 1280, 720)
    expected = ultralytics_letterbox(frame, 640, 640)[None].astype(np.float32) / np.float32(255)
    np.testing.assert_array_equal(pre(frame), expected)


def test_rgb_source_into_rgb_model_is_not_swapped(frame: np.ndarray) -> None:
    pre = Preprocessor(contract(320, 320), 1280, 720, source_order="rgb")
    expected = ultralytics_letterbox(frame, 320, 320).transpose(2, 0, 1)[None].astype(np.float32) / np.float32(255)
    np.testing.assert_array_equal(pre(frame), expected)


@pytest.mark.parametrize(("layout", "source_order"), [("nchw", "bgr"), ("nchw", "rgb"), ("nhwc", "bgr")])
def test_uint8_model_gets_raw_pixels(frame: np.ndarray, layout: str, source_order: str) -> None:
    pre = Preprocessor(contract(320, 320, dtype=np.uint8, layout=layout), 1280, 720, source_order)  # type: ignore[arg-type]
    out = pre(frame)
    assert out.dtype == np.uint8
    expected = ultralytics_letterbox(frame, 320, 320)
    if source_order == "bgr":
        expected = expected[..., ::-1]
    np.testing.assert_array_equal(out[0], expected.transpose(2, 0, 1) if layout == "nchw" else expected)


def test_float16_and_mean_std(frame: np.ndarray) -> None:
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    pre = Preprocessor(contract(320, 320, dtype=np.float16, mean=mean, std=std), 1280, 720)
    rgb = ultralytics_letterbox(frame, 320, 320)[..., ::-1].astype(np.float32) / 255
    expected = ((rgb - mean) / std).transpose(2, 0, 1)[None]
    out = pre(frame)
    assert out.dtype == np.float16
    np.testing.assert_allclose(out.astype(np.float32), expected, atol=2e-2)


def test_stretch_fills_the_input_without_padding(frame: np.ndarray) -> None:
    pre = Preprocessor(contract(320, 320, resize="stretch"), 1280, 720)
    resized = cv2.resize(frame, (320, 320), interpolation=cv2.INTER_LINEAR)
    np.testing.assert_array_equal(pre(frame)[0], resized[..., ::-1].transpose(2, 0, 1).astype(np.float32) / np.float32(255))
    assert pre.box_map == BoxMap.stretch(1280, 720, 320, 320)


def test_frame_already_at_input_size_is_copied_not_resized() -> None:
    image = np.random.default_rng(2).integers(0, 256, (64, 64, 3), np.uint8)
    pre = Preprocessor(contract(64, 64), 64, 64)
    np.testing.assert_array_equal(pre(image)[0], image[..., ::-1].transpose(2, 0, 1).astype(np.float32) / np.float32(255))


def test_the_tensor_is_filled_in_place_and_allocates_nothing_per_frame(frame: np.ndarray) -> None:
    pre = Preprocessor(contract(640, 640), 1280, 720)
    tensor = pre.tensor
    pre(frame)  # warm-up
    tracemalloc.start()
    try:
        for _ in range(20):
            out = pre(frame)
        _current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert out is tensor
    # A 640x640 float32 tensor is 4.9 MB; per-frame arrays would show up here as megabytes.
    assert peak < 64 * 1024, f"preprocess allocated {peak} bytes in steady state"


EVERY_PLAN = [
    contract(320, 320),
    contract(320, 320, mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225)),
    contract(320, 320, order="bgr"),
    contract(320, 320, dtype=np.float16),
    contract(320, 320, dtype=np.uint8),
    contract(320, 320, layout="nhwc"),
    contract(320, 320, layout="nhwc", dtype=np.uint8),
    contract(320, 320, layout="nhwc", order="bgr"),
    contract(320, 320, layout="nhwc", dtype=np.float16),
    contract(320, 320, layout="nhwc", dtype=np.uint8, order="bgr"),
    contract(320, 320, resize="stretch"),
]


@pytest.mark.parametrize("plan", EVERY_PLAN)
def test_no_layout_creates_arrays_per_frame(plan: InputContract, frame: np.ndarray) -> None:
    # Every numpy buffer counted, OpenCV's outputs included: a dst= that OpenCV could not use
    # would show up as a new array.
    counter = NumpyAllocations.get()
    assert counter is not None
    pre = Preprocessor(plan, 1280, 720)
    first = pre(frame).copy()
    with counter.counting():
        before = counter.buffers
        out = pre(frame)
        assert counter.buffers == before
    assert out is pre.tensor
    np.testing.assert_array_equal(out, first)


@pytest.mark.parametrize("plan", EVERY_PLAN)
@pytest.mark.parametrize("frame_hw", [(720, 1280), (1280, 720)])  # padding above and below, or beside
def test_a_reused_plan_gives_each_frame_what_a_fresh_plan_does(plan: InputContract, frame_hw: tuple[int, int]) -> None:
    # A frame converts only its content region; the padding was converted with the plan. So a
    # region the frame left out would still hold the first frame's pixels here.
    rng = np.random.default_rng(3)
    first, second = (rng.integers(0, 256, (*frame_hw, 3), np.uint8) for _ in range(2))
    h, w = frame_hw
    reused = Preprocessor(plan, w, h)
    reused(first)
    np.testing.assert_array_equal(reused(second), Preprocessor(plan, w, h)(second))


def every_byte(order: str) -> tuple[np.ndarray, np.ndarray]:
    """A 16x16 BGR frame whose channels each hold all 256 byte values, and its channels in ``order``."""
    v = np.arange(256, dtype=np.uint8).reshape(16, 16)
    frame = np.stack([v, 255 - v, v[::-1]], axis=-1)  # b, g, r
    return frame, frame[..., ::-1] if order == "rgb" else frame


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("order", ["rgb", "bgr"])
def test_every_byte_value_is_float32_v_over_255_exactly(layout: str, order: str) -> None:
    # Multiplying by float32(1/255) is off in the last bit for 126 of the 256 values, which an
    # fp16 cast inside a graph turns into visible score and box differences.
    frame, pixels = every_byte(order)
    out = Preprocessor(contract(16, 16, layout=layout, order=order), 16, 16)(frame)[0]
    expected = pixels.astype(np.float32) / np.float32(255)
    np.testing.assert_array_equal(out.transpose(1, 2, 0) if layout == "nchw" else out, expected)


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("order", ["rgb", "bgr"])
def test_a_float16_input_gets_what_ultralytics_feeds_an_fp16_model(layout: str, order: str) -> None:
    # ultralytics: im.half() / 255, which torch computes in float32 and rounds once to float16.
    frame, pixels = every_byte(order)
    out = Preprocessor(contract(16, 16, layout=layout, order=order, dtype=np.float16), 16, 16)(frame)[0]
    expected = (pixels.astype(np.float32) / np.float32(255)).astype(np.float16)
    assert out.dtype == np.float16
    np.testing.assert_array_equal(
        (out.transpose(1, 2, 0) if layout == "nchw" else out).view(np.uint16), expected.view(np.uint16)
    )


def test_the_table_for_the_default_is_float32_v_over_255() -> None:
    table = normalisation_table(contract(8, 8))
    assert table.shape == (3, 256) and table.dtype == np.float32
    np.testing.assert_array_equal(table, np.tile(np.arange(256, dtype=np.float32) / np.float32(255), (3, 1)))


def test_the_default_normalisation_divides_and_others_look_up() -> None:
    assert divisor_of(contract(8, 8)) == 255.0
    assert divisor_of(contract(8, 8, mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))) is None
    assert divisor_of(contract(8, 8, dtype=np.float16)) is None
    assert divisor_of(contract(8, 8, dtype=np.uint8)) is None


def test_where_opencv_divides_inexactly_the_planes_are_looked_up(monkeypatch: pytest.MonkeyPatch) -> None:
    # A CPU whose SIMD division rounds differently (another architecture's, or in a row's tail
    # loop) must not change a bit of the tensor: the division is tried on the plan's own views, on
    # every byte, when the plan is made. Here OpenCV's is one ulp off at the last pixel of a row.
    divide = cv2.divide

    def off_in_the_tail(*args: object, **kwargs: object) -> np.ndarray:
        out = divide(*args, **kwargs)
        np.nextafter(out[..., -1], np.float32(2), out=out[..., -1])
        return out

    monkeypatch.setattr(cv2, "divide", off_in_the_tail)
    frame, pixels = every_byte("rgb")
    out = Preprocessor(contract(16, 16), 16, 16)(frame)[0]
    np.testing.assert_array_equal(out.transpose(1, 2, 0), pixels.astype(np.float32) / np.float32(255))
    letterboxed = Preprocessor(contract(32, 32), 1280, 720)
    np.testing.assert_array_equal(letterboxed(np.zeros((720, 1280, 3), np.uint8))[0, :, 0], np.float32(114) / 255)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_mean_and_std_are_computed_in_float64_and_rounded_once(frame: np.ndarray, dtype: type) -> None:
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    out = Preprocessor(contract(320, 320, mean=mean, std=std, dtype=dtype), 1280, 720)(frame)
    rgb = ultralytics_letterbox(frame, 320, 320)[..., ::-1].transpose(2, 0, 1).astype(np.float64)
    expected = ((rgb * (1 / 255) - np.reshape(mean, (3, 1, 1))) / np.reshape(std, (3, 1, 1))).astype(dtype)
    np.testing.assert_array_equal(out[0], expected)


@pytest.mark.parametrize(
    ("frame_wh", "input_wh", "scale", "pad"),
    [
        ((1280, 720), (640, 640), 0.5, (0, 140)),
        ((1280, 720), (320, 320), 0.25, (0, 70)),
        ((720, 1280), (640, 640), 0.5, (140, 0)),
        ((640, 640), (640, 640), 1.0, (0, 0)),
    ],
)
def test_letterbox_geometry(
    frame_wh: tuple[int, int], input_wh: tuple[int, int], scale: float, pad: tuple[int, int]
) -> None:
    m = BoxMap.letterbox(*frame_wh, *input_wh)
    assert (m.scale_x, m.scale_y, (m.pad_x, m.pad_y)) == (scale, scale, pad)


@pytest.mark.parametrize("frame_wh", [(1, 20000), (20000, 1), (3, 5000)])
def test_a_frame_thinner_than_an_input_pixel_keeps_one_pixel_of_content(frame_wh: tuple[int, int]) -> None:
    # ultralytics rounds its side to 0 and cv2.resize fails; edged keeps a pixel so that any image runs.
    pre = Preprocessor(contract(320, 320), *frame_wh)
    assert min(pre.box_map.resized_w, pre.box_map.resized_h) == 1
    tensor = pre(np.full((frame_wh[1], frame_wh[0], 3), 255, np.uint8))
    assert tensor.max() == 1.0 and tensor.shape == (1, 3, 320, 320)


@pytest.mark.parametrize("frame_wh", [(1, 33177600), (33177600, 1)])
def test_a_centre_crop_resamples_only_what_it_keeps_of_a_frame_thinner_than_an_input_pixel(
    frame_wh: tuple[int, int],
) -> None:
    # Resized for a 64x64 input, such a frame is 2123366400 pixels long: tables for all of them took
    # 47.5 GiB (a MemoryError out of the frame path) and a turn of a Python loop each; the crop keeps 64.
    pre = Preprocessor(contract(64, 64, resize="crop"), *frame_wh)
    assert max(pre.box_map.resized_w, pre.box_map.resized_h) == 64 * 33177600
    frame = np.broadcast_to(np.array([30, 60, 90], np.uint8), (frame_wh[1], frame_wh[0], 3))
    tensor = pre(frame)
    expected = np.array([90, 60, 30], np.float32) / np.float32(255)  # one colour resampled is that colour, in RGB
    np.testing.assert_array_equal(tensor[0], np.broadcast_to(expected[:, None, None], (3, 64, 64)))
