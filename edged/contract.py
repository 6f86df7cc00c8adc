"""The layout contract: what the model wants versus what a frame is.

Built once at start-up from the ONNX input (name, shape, dtype), the model's metadata and the
config. Every disagreement is a `ContractError` naming both sides, because a silent mismatch (BGR
fed to an RGB model, NHWC read as NCHW) does not crash: it produces plausible, wrong boxes.
Before that, `pinned_dimensions` says what the symbolic dimensions of a dynamic export are fixed
to (batch 1, height and width the configured or exported input size), so the contract always
sees a fixed shape.
Per frame, `frame_problem` is a cheap check that returns a reason instead of raising, so the
pipeline can count and skip the frame.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from edged.config import MAX_INPUT_SIDE, ModelConfig
from edged.errors import ContractError
from edged.heads.anomaly import AnomalyHead
from edged.heads.registry import Format
from edged.settings.numerals import whole_number

Layout = Literal["nchw", "nhwc"]
ChannelOrder = Literal["rgb", "bgr"]
Resize = Literal["letterbox", "stretch", "crop", "antialias"]  # antialias: an anomalib export's, see edged.heads.anomaly
_LAYOUTS: dict[str, Layout] = {"nchw": "nchw", "nhwc": "nhwc"}
_ORDERS: dict[str, ChannelOrder] = {"rgb": "rgb", "bgr": "bgr"}

_ORT_DTYPES: dict[str, type[np.generic]] = {
    "tensor(float)": np.float32,
    "tensor(float16)": np.float16,
    "tensor(uint8)": np.uint8,
}


@dataclass(frozen=True, slots=True)
class InputContract:
    """Everything preprocess needs to fill the model's input tensor correctly."""

    input_name: str
    shape: tuple[int, int, int, int]
    dtype: type[np.generic]
    layout: Layout
    channel_order: ChannelOrder
    resize: Resize
    scale: float
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    order_declared_by: str = "model.channel_order"  # where ``channel_order`` comes from: nothing measures it

    @property
    def height(self) -> int:
        return self.shape[2] if self.layout == "nchw" else self.shape[1]

    @property
    def width(self) -> int:
        return self.shape[3] if self.layout == "nchw" else self.shape[2]

    def describe(self, *, order_source: bool = False) -> str:
        """The contract in one line; ``order_source``: the channel order with where it is declared (``edged check``)."""
        order = f"{self.channel_order} (declared: {self.order_declared_by})" if order_source else self.channel_order
        normalise = (
            "pixels as they are (the model normalises inside)"
            if self.dtype is np.uint8
            else f"scale={self.scale:.6g} mean={list(self.mean)} std={list(self.std)}"
        )
        return (
            f"{self.input_name} {list(self.shape)} {np.dtype(self.dtype).name} {self.layout} "
            f"{order} {self.resize} {normalise}"
        )


@dataclass(frozen=True, slots=True)
class FrameSpec:
    """What a source declared its frames to be; frames that differ are rejected."""

    width: int
    height: int
    channel_order: ChannelOrder


Dim = int | str | None  # as ONNX Runtime reports an input dimension: a size, a symbol, or unnamed
_IMGSZ = re.compile(r"\s*\[?\s*(\d+)\s*(?:,\s*(\d+)\s*)?\]?\s*")  # ultralytics writes '[640, 640]'


def pinned_dimensions(
    name: str,
    shape: Sequence[Dim],
    metadata: Mapping[str, str],
    imgsz: tuple[int, int] | None,
    trained: tuple[int, int] | None = None,
) -> dict[str, int]:
    """The sizes to fix the input's symbolic dimensions to, by name: batch 1, height and width the input size.

    The input size is ``model.imgsz`` ([h, w], as ultralytics orders it), else the model's
    ``imgsz`` metadata, else ``trained``: the size an anomalib export was trained at (its map's,
    `edged.heads.anomaly.trained_size`). Raises `ContractError` when the height or width is symbolic
    and none gives a size, when the size is not a multiple of the model's stride, or when
    ``model.imgsz`` is not the trained size.
    """
    if len(shape) != 4:
        return {}  # not an image tensor: build_contract says so
    _check_trained_size(name, imgsz, trained, "config model.imgsz")
    pins = {shape[0]: 1} if isinstance(shape[0], str) else {}
    spatial = (2, 3) if shape[1] == 3 else (1, 2) if shape[3] == 3 else ()
    if not any(isinstance(shape[axis], str) for axis in spatial):
        return pins
    size = imgsz or _metadata_imgsz(metadata) or trained
    if size is None:
        raise ContractError(
            f"input {name!r} has a dynamic height and width {list(shape)} and the model has no imgsz metadata; "
            "set model.imgsz to the size to serve it at (e.g. 640 or [384, 640])"
        )
    where = "config model.imgsz" if imgsz else "the model's imgsz metadata" if size != trained else "its trained size"
    _check_stride(size, metadata.get("stride"), where)
    for axis, value in zip(spatial, size, strict=True):
        dim = shape[axis]
        if isinstance(dim, str):
            if pins.setdefault(dim, value) != value:
                raise ContractError(
                    f"input {name!r} {list(shape)} gives one name {dim!r} to dimensions of different sizes, "
                    f"but {where} is {list(size)}"
                )
    return pins


def _check_trained_size(name: str, size: tuple[int, int] | None, trained: tuple[int, int] | None, where: str) -> None:
    """An anomalib export resizes to its trained size inside, without antialiasing: fed any other size
    it scores differently from what its training measured, so it is fed exactly that size."""
    if size is not None and trained is not None and size != trained:
        raise ContractError(
            f"{where} is {list(size)} but the anomaly model {name!r} was trained at {list(trained)} (the size of "
            "its anomaly map): its graph resizes any other size without antialiasing, which changes its scores; "
            f"edged feeds it {list(trained)}: remove model.imgsz, or export the model at that size"
        )


def _metadata_imgsz(metadata: Mapping[str, str]) -> tuple[int, int] | None:
    """[h, w] from ultralytics' ``imgsz`` metadata ('[640, 640]' or '640'); None when absent or malformed.

    `ContractError` for a side past `MAX_INPUT_SIDE`, as ``model.imgsz`` is refused: the runtime fails
    on one past its integers, and one it takes would have edged allocate gigabytes a frame.
    """
    text = metadata.get("imgsz", "")
    match = _IMGSZ.fullmatch(text)
    if match is None:
        return None
    sides = [match.group(1), match.group(2) or match.group(1)]
    if any(len(side) > 12 or int(side) > MAX_INPUT_SIDE for side in sides):  # int() refuses 4300 digits
        raise ContractError(
            f"the model's imgsz metadata {text[:40]!r} is past {MAX_INPUT_SIDE} pixels a side, the largest input "
            "edged serves: set model.imgsz to the size the model was trained at"
        )
    h, w = map(int, sides)
    return (h, w) if h > 0 and w > 0 else None


def _check_stride(size: tuple[int, int], stride_text: str | None, where: str) -> None:
    """A YOLO graph only runs at multiples of its stride; ultralytics would round up silently."""
    stride = whole_number((stride_text or "").strip(), len(str(MAX_INPUT_SIDE))) or 0
    if stride and any(side % stride for side in size):
        rounded = [-(-side // stride) * stride for side in size]
        raise ContractError(
            f"{where} {list(size)} is not a multiple of the model's stride {stride} (its metadata); "
            f"ultralytics would serve {rounded}: set model.imgsz = {rounded}"
        )


def build_contract(
    inputs: Sequence[tuple[str, Sequence[int | str | None], str]],
    metadata: Mapping[str, str],
    cfg: ModelConfig,
    head: Format | None = None,
    trained: tuple[int, int] | None = None,
) -> InputContract:
    """Check the model's inputs against the config, the metadata and the ``head`` format; ``inputs``
    holds (name, shape, type); ``trained``: an anomaly model's trained size.

    The shape must already have its symbolic dimensions pinned (see `pinned_dimensions`).
    """
    if len(inputs) != 1:
        names = ", ".join(name for name, _, _ in inputs)
        raise ContractError(f"model has {len(inputs)} inputs ({names}); edged feeds exactly one image tensor")
    name, shape, ort_type = inputs[0]
    dtype = _input_dtype(name, ort_type)
    dims = _static_dims(name, shape)
    layout = _layout(name, dims, cfg.layout, metadata.get("layout"))
    _check_imgsz(name, dims, layout, cfg.imgsz)
    order, declared_by = _channel_order(cfg, metadata)
    _check_normalisation(cfg, dtype)
    if head is AnomalyHead:
        order, declared_by = _check_anomalib_input(name, dims, dtype, layout, cfg, trained)
    return InputContract(
        input_name=name,
        shape=dims,
        dtype=dtype,
        layout=layout,
        channel_order=order,
        resize=_resize(cfg, head),
        scale=cfg.scale,
        mean=cfg.mean,
        std=cfg.std,
        order_declared_by=declared_by,
    )


def _input_dtype(name: str, ort_type: str) -> type[np.generic]:
    try:
        return _ORT_DTYPES[ort_type]
    except KeyError:
        allowed = ", ".join(_ORT_DTYPES)
        raise ContractError(f"input {name!r} has type {ort_type}; edged supports {allowed}") from None


def _static_dims(name: str, shape: Sequence[int | str | None]) -> tuple[int, int, int, int]:
    if len(shape) != 4:
        raise ContractError(
            f"input {name!r} has shape {list(shape)}: not an image tensor (expected rank 4, [1, 3, H, W] or [1, H, W, 3])"
        )
    if shape[0] != 1:
        raise ContractError(
            f"input {name!r} has a fixed batch of {shape[0]}; edged runs batch 1: re-export the "
            "model with batch=1 or a dynamic batch"
        )
    dims = [d for d in shape if isinstance(d, int) and d > 0]
    if len(dims) != 4:
        raise ContractError(
            f"input {name!r} has dynamic dimensions {list(shape)} that cannot be pinned (only a named batch, "
            "height and width can); export the model with a fixed input size (e.g. imgsz=640)"
        )
    return (dims[0], dims[1], dims[2], dims[3])


def _layout(name: str, dims: tuple[int, int, int, int], declared: str, meta: str | None) -> Layout:
    inferred: Layout | None
    if dims[1] == 3 and dims[3] != 3:
        inferred = "nchw"
    elif dims[3] == 3 and dims[1] != 3:
        inferred = "nhwc"
    elif dims[1] == 3 and dims[3] == 3:
        inferred = None
    else:
        raise ContractError(
            f"input {name!r} has shape {list(dims)}: no axis of 3 colour channels at position 1 "
            "(NCHW) or 3 (NHWC); edged feeds 3-channel images"
        )
    meta_layout = _LAYOUTS.get(meta.lower()) if meta else None
    for source, value in (("model metadata", meta_layout), ("config model.layout", _auto(declared))):
        if value is not None and inferred is not None and value != inferred:
            raise ContractError(f"{source} says {value.upper()} but input {name!r} shape {list(dims)} is {inferred.upper()}")
    if meta_layout and _auto(declared) and meta_layout != declared:
        raise ContractError(f"config model.layout = {declared!r} contradicts the model metadata layout {meta_layout!r}")
    result = inferred or _auto(declared) or meta_layout
    if result is None:
        raise ContractError(
            f"input {name!r} shape {list(dims)} is ambiguous (3 at both channel positions); set model.layout to nchw or nhwc"
        )
    return result


def _auto(value: str) -> Layout | None:
    return _LAYOUTS.get(value)


def _check_imgsz(name: str, dims: tuple[int, int, int, int], layout: Layout, imgsz: tuple[int, int] | None) -> None:
    """A configured input size must be the model's: a dynamic export was pinned to it, a fixed one must agree."""
    size = (dims[2], dims[3]) if layout == "nchw" else (dims[1], dims[2])
    if imgsz is not None and imgsz != size:
        raise ContractError(
            f"config model.imgsz = {list(imgsz)} but input {name!r} is fixed at {list(dims)} ({size[0]}x{size[1]}); "
            "remove the key, or export the model at that size or with dynamic=True"
        )


def _channel_order(cfg: ModelConfig, metadata: Mapping[str, str]) -> tuple[ChannelOrder, str]:
    """The model's colour order: its color_order metadata, RGB for an Ultralytics export, else the
    config; with where it is declared."""
    meta = metadata.get("color_order")
    meta_order = _ORDERS.get(meta.lower()) if meta else None
    if meta and meta_order is None:
        raise ContractError(f"model metadata color_order={meta!r} is neither rgb nor bgr")
    declared, source = f"declares color_order = {meta_order!r} in its metadata", "model metadata color_order"
    if meta_order is None:
        ultralytics = _ultralytics_mark(metadata)
        if ultralytics is None:
            given = "channel_order" in cfg.model_fields_set
            return cfg.channel_order, "model.channel_order" if given else "model.channel_order's default"
        # Ultralytics writes no color_order, but every model it trains and exports takes RGB.
        meta_order, declared = "rgb", f"is an Ultralytics export ({ultralytics}), which takes 'rgb'"
        source = "an Ultralytics export"
    if "channel_order" in cfg.model_fields_set and cfg.channel_order != meta_order:
        raise ContractError(
            f"config model.channel_order = {cfg.channel_order!r} but the model {declared}; remove the key or fix the model"
        )
    return meta_order, source


def _ultralytics_mark(metadata: Mapping[str, str]) -> str | None:
    """The metadata entry that names Ultralytics as the exporter ("author 'Ultralytics'"), or None."""
    for key in ("author", "description"):
        value = metadata.get(key, "")
        if "ultralytics" in value.lower():
            return f"{key} {value[:60]!r}"
    return None


def _check_anomalib_input(
    name: str,
    dims: tuple[int, int, int, int],
    dtype: type[np.generic],
    layout: Layout,
    cfg: ModelConfig,
    trained: tuple[int, int] | None,
) -> tuple[ChannelOrder, str]:
    """What an anomalib export takes, checked: RGB values in 0..1 as float32 NCHW at its trained size
    (the ImageNet normalisation is inside it); the order and where that is declared."""
    if dtype is not np.float32 or layout != "nchw":
        raise ContractError(
            f"input {name!r} {list(dims)} {np.dtype(dtype).name} {layout.upper()}: an anomalib export takes float32 "
            "NCHW (RGB values in 0..1); re-export it with anomalib's own export"
        )
    _check_trained_size(name, (dims[2], dims[3]), trained, "its input")
    normalised = {"scale", "mean", "std"} & cfg.model_fields_set
    if normalised and (cfg.scale, cfg.mean, cfg.std) != (1 / 255, (0.0, 0.0, 0.0), (1.0, 1.0, 1.0)):
        raise ContractError(
            f"config sets {', '.join(sorted('model.' + k for k in normalised))}, but an anomalib export takes "
            "values in 0..1 and applies the ImageNet mean and std inside: normalising here too feeds it wrong "
            "values; remove the keys"
        )
    if cfg.channel_order != "rgb":
        raise ContractError(
            f"config model.channel_order = {cfg.channel_order!r}, but anomalib trains on RGB images (it reads "
            "them with Pillow) and its export takes RGB; remove the key"
        )
    return "rgb", "an anomalib export, which takes 'rgb'"


def _resize(cfg: ModelConfig, head: Format | None) -> Resize:
    """The preprocessing the head format requires (RT-DETR's stretch, a classifier's crop, as ultralytics
    feeds them), else the config's; crop is a classifier's only."""
    if head is None or head.resize is None:
        if cfg.resize == "crop":
            raise ContractError(
                "config model.resize = 'crop' is classification's preprocessing, but this is a detection model; "
                "remove the key or set it to 'letterbox' or 'stretch'"
            )
        return cfg.resize
    if "resize" in cfg.model_fields_set and cfg.resize != head.resize:
        raise ContractError(
            f"config model.resize = {cfg.resize!r} but a {head.name} model is fed {head.resize!r}, as it was "
            f"trained; remove the key or set it to {head.resize!r}"
        )
    return head.resize


def _check_normalisation(cfg: ModelConfig, dtype: type[np.generic]) -> None:
    if dtype is not np.uint8:
        return
    changed = {"scale", "mean", "std"} & cfg.model_fields_set
    if changed:
        raise ContractError(
            f"the model takes uint8 pixels (it normalises inside), but the config sets "
            f"{', '.join(sorted('model.' + k for k in changed))}; remove them"
        )


def frame_problem(image: object, channel_order: str, spec: FrameSpec) -> str | None:
    """Why a frame must not reach the model, or None; a short reason, used as a counter key."""
    if not isinstance(image, np.ndarray):
        return "not_an_array"
    if image.dtype != np.uint8:
        return "dtype"
    if image.ndim != 3 or image.shape[2] != 3:
        return "channels"
    if image.shape[0] != spec.height or image.shape[1] != spec.width:
        return "size"
    if channel_order != spec.channel_order:
        return "channel_order"
    return None
