"""The layout contract: every refusal names both sides; per-frame checks return a reason."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edged.config import ModelConfig
from edged.contract import FrameSpec, batch_dim_to_pin, build_contract, frame_problem
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
    ],
)
def test_refusals_name_the_problem(shape: list, ort_type: str, cfg: dict, meta: dict, message: str) -> None:
    with pytest.raises(ContractError, match=message.replace("(", r"\(").replace(")", r"\)")):
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


def test_symbolic_batch_is_named_for_pinning() -> None:
    assert batch_dim_to_pin(["batch", 3, 640, 640]) == "batch"
    assert batch_dim_to_pin([1, 3, 640, 640]) is None


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
