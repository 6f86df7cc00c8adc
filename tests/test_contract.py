"""The layout contract: every refusal names both sides; per-frame checks return a reason."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from edged.config import ModelConfig
from edged.contract import FrameSpec, build_contract, frame_problem, pinned_dimensions
from edged.errors import ContractError

CFG = ModelConfig(path=Path("m.onnx"))


def _build(shape: list, ort_type: str = "tensor(float)", meta: dict | None = None, **cfg: object):
    model_cfg = ModelConfig(path=Path("m.onnx"), **cfg) if cfg else CFG
    return build_contract([("images", shape, ort_type)], meta or {}, model_cfg)


@pytest.mark.parametrize(
    ("shape", "layout", "height", "width"),
    [
        ([1, 3, 640, 480], "nchw", 640, 480),  # channels first
        ([1, 320, 256, 3], "nhwc", 320, 256),  # channels last
        ([1, 3, 64, 64], "nchw", 64, 64),  # square, unambiguous
    ],
)
def test_layout_is_inferred_from_the_channel_axis(shape: list, layout: str, height: int, width: int) -> None:
    c = _build(shape)
    assert (c.layout, c.height, c.width) == (layout, height, width)
    assert c.input_name == "images" and c.dtype is np.float32 and c.channel_order == "rgb"


@pytest.mark.parametrize(
    ("shape", "ort_type", "cfg", "meta", "message"),
    [
        ([4, 3, 64, 64], "tensor(float)", {}, {}, "fixed batch of 4"),
        ([1, 3, 64, 64], "tensor(float)", {"layout": "nhwc"}, {}, "config model.layout says NHWC"),
        ([1, 64, 64, 3], "tensor(float)", {}, {"layout": "nchw"}, "model metadata says NCHW"),
        ([1, 3, 64, 64], "tensor(float)", {"channel_order": "bgr"}, {"color_order": "rgb"}, "'bgr'"),
        ([1, 3, 64, 64], "tensor(double)", {}, {}, "tensor(double)"),
        ([1, 3, 64], "tensor(float)", {}, {}, "not an image tensor"),
        ([1, 1, 64, 64], "tensor(float)", {}, {}, "no axis of 3 colour channels"),
        ([1, 3, "h", "w"], "tensor(float)", {}, {}, "dynamic dimensions"),
        ([1, 3, 64, 3], "tensor(float)", {}, {}, "ambiguous"),  # 3 at both channel positions
        ([1, 3, 64, 64], "tensor(uint8)", {"scale": 1.0}, {}, "model.scale"),  # uint8 normalises inside
        ([1, 3, 64, 64], "tensor(float)", {}, {"color_order": "yuv"}, "neither rgb nor bgr"),
        ([1, 3, 64, 64], "tensor(float)", {"imgsz": 32}, {}, "model.imgsz = [32, 32] but input 'images' is fixed at"),
        ([1, 64, 96, 3], "tensor(float)", {"imgsz": [96, 64]}, {}, "fixed at [1, 64, 96, 3] (64x96)"),
    ],
)
def test_refusals_name_the_problem(shape: list, ort_type: str, cfg: dict, meta: dict, message: str) -> None:
    with pytest.raises(ContractError, match=re.escape(message)):
        _build(shape, ort_type, meta, **cfg)


def test_more_than_one_input_is_refused() -> None:
    inputs = [("images", [1, 3, 8, 8], "tensor(float)"), ("sizes", [1, 2], "tensor(int64)")]
    with pytest.raises(ContractError, match="2 inputs"):
        build_contract(inputs, {}, CFG)


def test_declared_layout_resolves_an_ambiguous_shape() -> None:
    assert _build([1, 3, 64, 3], layout="nhwc").layout == "nhwc"


def test_model_metadata_decides_the_colour_order_unless_config_sets_it() -> None:
    assert _build([1, 3, 8, 8], meta={"color_order": "bgr"}).channel_order == "bgr"
    assert _build([1, 3, 8, 8], meta={"color_order": "BGR"}, channel_order="bgr").channel_order == "bgr"
    assert _build([1, 3, 8, 8], channel_order="bgr").channel_order == "bgr"


@pytest.mark.parametrize(
    ("meta", "cfg", "declared_by"),
    [
        ({"color_order": "bgr"}, {}, "model metadata color_order"),
        ({"author": "Ultralytics"}, {}, "an Ultralytics export"),
        ({}, {"channel_order": "bgr"}, "model.channel_order"),
        ({}, {}, "model.channel_order's default"),
    ],
)
def test_check_says_where_the_colour_order_is_declared(meta: dict, cfg: dict, declared_by: str) -> None:
    contract = _build([1, 3, 8, 8], meta=meta, **cfg)
    assert contract.order_declared_by == declared_by
    assert f" nchw {contract.channel_order} (declared: {declared_by}) letterbox " in contract.describe(order_source=True)
    assert f" nchw {contract.channel_order} letterbox " in contract.describe()


ULTRALYTICS = {"author": "Ultralytics", "description": "Ultralytics YOLOv8n model trained on coco.yaml"}


@pytest.mark.parametrize(
    "meta", [ULTRALYTICS, {"author": "Ultralytics"}, {"description": "Ultralytics YOLO11n model trained on data.yaml"}]
)
def test_an_ultralytics_export_is_rgb_as_if_declared(meta: dict) -> None:
    # Ultralytics writes no color_order, but every model it exports takes RGB.
    assert _build([1, 3, 8, 8], meta=meta).channel_order == "rgb"
    assert _build([1, 3, 8, 8], meta=meta, channel_order="rgb").channel_order == "rgb"
    with pytest.raises(ContractError) as info:
        _build([1, 3, 8, 8], meta=meta, channel_order="bgr")
    assert "model.channel_order = 'bgr'" in str(info.value) and "Ultralytics export" in str(info.value)
    assert "'rgb'" in str(info.value)


def test_an_explicit_color_order_outranks_the_ultralytics_mark() -> None:
    meta = {**ULTRALYTICS, "color_order": "bgr"}
    assert _build([1, 3, 8, 8], meta=meta, channel_order="bgr").channel_order == "bgr"


def test_a_model_of_no_known_origin_takes_the_configured_order() -> None:
    assert _build([1, 3, 8, 8], meta={"author": "someone"}, channel_order="bgr").channel_order == "bgr"


DYNAMIC = ["batch", 3, "height", "width"]


@pytest.mark.parametrize(
    ("shape", "meta", "imgsz", "pins"),
    [
        ([1, 3, 640, 640], {}, None, {}),  # fixed: nothing to pin
        (["batch", 3, 640, 640], {}, None, {"batch": 1}),  # dynamic batch only
        (DYNAMIC, {}, (384, 640), {"batch": 1, "height": 384, "width": 640}),  # model.imgsz is [h, w]
        (DYNAMIC, {"imgsz": "[320, 480]"}, None, {"batch": 1, "height": 320, "width": 480}),  # exported size
        (DYNAMIC, {"imgsz": "[320, 480]"}, (640, 640), {"batch": 1, "height": 640, "width": 640}),  # config wins
        (DYNAMIC, {"imgsz": "640"}, None, {"batch": 1, "height": 640, "width": 640}),
        (["batch", "height", "width", 3], {"imgsz": "[320, 480]"}, None, {"batch": 1, "height": 320, "width": 480}),
        ([1, 3, "size", "size"], {}, (640, 640), {"size": 640}),  # one name for both sides
        (DYNAMIC, {"stride": "32"}, (384, 640), {"batch": 1, "height": 384, "width": 640}),
        # A stride that is no ASCII number is none (before: int() raised on '²', which isdigit() takes,
        # and on 5000 digits: a traceback, exit 1, restarted for ever).
        (DYNAMIC, {"stride": "\u00b2", "imgsz": "[64, 64]"}, None, {"batch": 1, "height": 64, "width": 64}),
        (DYNAMIC, {"stride": "1" * 5000}, (64, 64), {"batch": 1, "height": 64, "width": 64}),
    ],
)
def test_symbolic_dimensions_are_pinned_to_batch_1_and_the_input_size(
    shape: list, meta: dict, imgsz: tuple[int, int] | None, pins: dict
) -> None:
    assert pinned_dimensions("images", shape, meta, imgsz) == pins


@pytest.mark.parametrize(
    ("shape", "meta", "imgsz", "message"),
    [
        (DYNAMIC, {}, None, "no imgsz metadata; set model.imgsz"),
        (DYNAMIC, {"imgsz": "[h, w]"}, None, "no imgsz metadata"),  # malformed reads as absent
        (DYNAMIC, {"stride": "32"}, (300, 640), "model.imgsz [300, 640] is not a multiple of the model's stride 32"),
        (DYNAMIC, {"stride": "32", "imgsz": "[300, 300]"}, None, "set model.imgsz = [320, 320]"),
        ([1, 3, "size", "size"], {}, (384, 640), "one name 'size'"),
        # Sides model.imgsz refuses (before: 30000 allocated 24 GB and more digits than the runtime's
        # integers, or than int() reads, a traceback).
        (DYNAMIC, {"imgsz": "[30000, 30000]"}, None, "imgsz metadata '[30000, 30000]' is past 8192 pixels a side"),
        (DYNAMIC, {"imgsz": "[99999999999999999999999, 64]"}, None, "is past 8192 pixels a side"),
        (DYNAMIC, {"imgsz": "9" * 5000}, None, "is past 8192 pixels a side"),
    ],
)
def test_a_dynamic_input_without_a_usable_size_is_refused(
    shape: list, meta: dict, imgsz: tuple[int, int] | None, message: str
) -> None:
    with pytest.raises(ContractError, match=re.escape(message)) as info:
        pinned_dimensions("images", shape, meta, imgsz)
    assert info.value.exit_code == 78


SPEC = FrameSpec(width=8, height=6, channel_order="bgr")


@pytest.mark.parametrize(
    ("image", "order", "problem"),
    [
        (np.zeros((6, 8, 3), np.uint8), "bgr", None),  # what the source declared
        (np.zeros((6, 8, 3), np.uint8), "rgb", "channel_order"),  # frame says rgb, source declared bgr
        (np.zeros((6, 8, 3), np.float32), "bgr", "dtype"),
        (np.zeros((6, 8), np.uint8), "bgr", "channels"),  # grey frame
        (np.zeros((6, 8, 4), np.uint8), "bgr", "channels"),  # BGRA
        (np.zeros((12, 16, 3), np.uint8), "bgr", "size"),  # renegotiated camera
        (None, "bgr", "not_an_array"),
    ],
)
def test_frame_problem(image: object, order: str, problem: str | None) -> None:
    assert frame_problem(image, order, SPEC) == problem
