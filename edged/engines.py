"""What the pipeline asks of an inference engine, and the registry that opens the one ``model.engine`` names.

An engine loads the model once, pinned to batch 1 and the contract's input size, and `bind` ties
a plan's preallocated input tensor to a `Binding` whose output buffers are allocated once, so a
steady-state `Binding.run` writes into them and allocates nothing. `edged.engine` is ONNX Runtime's
(the default), `edged.engine_openvino` OpenVINO's; each module is imported only when configured,
so a board without openvino never loads it. Another runtime (TensorRT on a Jetson) is one more
module with an ``open_engine`` and one more line in `ENGINES`.
"""

from __future__ import annotations

import hashlib
import importlib
import mmap
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from edged.config import ModelConfig, RuntimeConfig
from edged.cpus import ThreadPlan
from edged.errors import ContractError, ModelError

# model.engine -> the module that holds its ``open_engine``.
ENGINES = {"onnxruntime": "edged.engine", "openvino": "edged.engine_openvino"}
# What edged.engine_openvino's import failure says. edged is not on PyPI, and Debian 12's pip refuses to
# install into the system's Python (PEP 668): into a checkout's virtualenv, or into the .deb's own.
INSTALL_OPENVINO = (
    "in a checkout, .venv/bin/python -m pip install -e '.[openvino]'; with the .deb, "
    "sudo pip --python /usr/lib/edged/venv/bin/python install 'openvino>=2024.0'"
)


@dataclass(frozen=True, slots=True)
class ModelIdentity:
    name: str
    sha256: str

    @property
    def short(self) -> str:
        return f"{self.name}@{self.sha256[:12]}"


@dataclass(frozen=True, slots=True)
class Port:
    """A model input or output as the contract and head detection read it: a symbolic dimension is its
    name, and ``type`` is spelt as ONNX Runtime spells it (``tensor(float)``)."""

    name: str
    shape: list[int | str]
    type: str


# Why a model cache is not used with model.require_signature: what it holds was compiled by edged
# before, and the signature covers the model file alone, so a cache swapped on the disk would run.
UNSIGNED_CACHE = "not used with model.require_signature: the signature does not cover what it holds"

MAX_MODEL_BYTES = 2**31 - 1  # protobuf's limit on one message: an ONNX file past it cannot be parsed


def check_model_size(path: Path, size: int) -> None:
    """`ModelError` for a model file of ``size`` bytes past `MAX_MODEL_BYTES`, said before a byte of
    it is read or hashed: a board has no room for it, and no time to read it on the loop's thread."""
    if size > MAX_MODEL_BYTES:
        raise ModelError(
            f"model {path} holds {size} bytes, more than an ONNX file can ({MAX_MODEL_BYTES}); "
            "a larger model keeps its weights as external data"
        )


def read_model(path: Path) -> tuple[bytes, ModelIdentity]:
    """The model file's bytes, read once, and its identity from those very bytes; `ModelError` where
    it cannot be read, or is larger than an ONNX file can be. An engine runs these bytes, not the
    path again: a file replaced in between (after `edged.signature.verify` checked it) would run
    under the identity of the one checked."""
    try:
        with path.open("rb") as f:
            check_model_size(path, os.fstat(f.fileno()).st_size)
            data = f.read()
    except OSError as e:
        raise ModelError(f"cannot read model {path}: {e.strerror}") from None
    return data, ModelIdentity(path.stem, hashlib.sha256(data).hexdigest())


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


# The operators only a quantised ONNX graph holds: QDQ's QuantizeLinear (and DequantizeLinear,
# DynamicQuantizeLinear) and the QOperator format's QLinearConv, QLinearMatMul and the rest.
QUANTISED_OPERATORS = (b"QuantizeLinear", b"QLinear")
SEARCH_PART_BYTES = 8 << 20  # searched for them a part at a time (`_holds`)


def is_quantised(model: Path | bytes) -> bool:
    """Whether the ONNX model (its file, or the bytes an engine runs, `read_model`) holds a quantised
    operator: its operator names are plain strings in the file."""
    if isinstance(model, bytes):
        return _holds(model)
    with model.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        return _holds(data)


def _parts(data: bytes | mmap.mmap, needle_bytes: int) -> Iterator[tuple[int, int]]:
    """``data`` as (start, end) parts to search for a string of up to ``needle_bytes``, overlapping
    so that one across two parts is found: a search holds Python's lock, and a reload loads on a
    thread beside the loop (`edged.reload.Loading`), whose frames would wait out a whole large
    model's (0.8 s for 1.5 GB) instead of a part's."""
    for start in range(0, len(data), SEARCH_PART_BYTES):
        yield start, start + SEARCH_PART_BYTES + needle_bytes - 1


def _holds(data: bytes | mmap.mmap) -> bool:
    """A quantised operator's name in ``data``, searched a part at a time (`_parts`)."""
    longest = max(len(name) for name in QUANTISED_OPERATORS)
    return any(data.find(name, start, end) >= 0 for start, end in _parts(data, longest) for name in QUANTISED_OPERATORS)


# A tensor keeping its values in a file beside the model: TensorProto's ``external_data`` (field 13,
# a length-delimited entry: tag 0x6a, then its length as a one- or two-byte varint) whose key is
# ``location`` (field 1, 8 bytes), its value (field 2) following. A metadata entry with that key
# has another tag before it (0x72).
EXTERNAL_KEY = b"\x0a\x08location\x12"


def holds_external_data(data: bytes) -> bool:
    """Whether the ONNX model ``data`` keeps any tensor's values in an external data file; searched
    a part at a time (`_parts`)."""
    for start, end in _parts(data, len(EXTERNAL_KEY)):
        at = data.find(EXTERNAL_KEY, start, end)
        while at >= 0:
            if _tensor_entry(data, at):
                return True
            at = data.find(EXTERNAL_KEY, at + 1, end)
    return False


def _tensor_entry(data: bytes, at: int) -> bool:
    """Whether the ``location`` entry at ``at`` follows TensorProto's external_data tag and length."""
    one_byte_length = at >= 2 and data[at - 2] == 0x6A and data[at - 1] < 0x80
    two_byte_length = at >= 3 and data[at - 3] == 0x6A and data[at - 2] >= 0x80 > data[at - 1]
    return one_byte_length or two_byte_length


def check_int8(path: Path, precision: str, quantised: bool) -> None:
    """Refuse model.precision = int8 on a model that is not ``quantised``: it would run in float unseen."""
    if precision == "int8" and not quantised:
        raise ContractError(
            f"model.precision = 'int8' but {path} is not quantised (no QuantizeLinear or QLinear operator): "
            "make an INT8 model with `edged quantize`, or set model.precision = 'f32'"
        )


def first_line(e: BaseException) -> str:
    """A runtime's exception as one line for edged's own error: runtimes raise pages of context."""
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0][:500]


class PortLike(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def shape(self) -> Sequence[Any]: ...
    @property
    def type(self) -> str: ...


class Binding(Protocol):
    """A plan's input tensor bound to the model, with output buffers of its own (float32)."""

    @property
    def outputs(self) -> list[np.ndarray]: ...

    def run(self) -> None:
        """One inference on the bound input, results in `outputs`; raises InferenceError."""


class InferenceEngine(Protocol):
    """One loaded model, batch 1; the daemon, check, eval and bench see engines only through this."""

    @property
    def model_path(self) -> Path: ...
    @property
    def cfg(self) -> RuntimeConfig: ...
    @property
    def identity(self) -> ModelIdentity: ...
    @property
    def metadata(self) -> dict[str, str]:
        """The model's metadata (ultralytics: names, imgsz, stride...)."""

    @property
    def input_meta(self) -> Sequence[PortLike]: ...
    @property
    def output_meta(self) -> Sequence[PortLike]: ...
    @property
    def providers(self) -> list[tuple[str, dict[str, Any]]]:
        """The backends in order of preference: a fallback after failing frames drops the first."""

    @property
    def provider(self) -> str:
        """What ran the model, as every message names it."""

    @property
    def precision(self) -> str:
        """What it computes in: OpenVINO's model.precision; ONNX Runtime's the graph's own (int8 when quantised)."""

    @property
    def threads(self) -> ThreadPlan: ...

    def bind(self, input_tensor: np.ndarray) -> Binding:
        """A binding of ``input_tensor`` (read in place at every run) with its own output buffers."""

    def infer(self, input_tensor: np.ndarray) -> list[np.ndarray]:
        """One plain run with outputs the runtime allocates: `edged bench`'s floor and naive reference."""

    def report(self) -> list[tuple[str, str]]:
        """What `edged check` says of the engine, (label, line) each: its backends, device, precision, threads."""


class EngineOpener(Protocol):
    def __call__(
        self, cfg: ModelConfig, runtime: RuntimeConfig, *, record_placement: bool, lanes: int
    ) -> InferenceEngine: ...


def open_engine(
    cfg: ModelConfig, runtime: RuntimeConfig, *, record_placement: bool = False, lanes: int = 1
) -> InferenceEngine:
    """The engine ``cfg.engine`` names, its module imported now; ``record_placement`` for `edged check`."""
    opener: EngineOpener = importlib.import_module(ENGINES[cfg.engine]).open_engine
    return opener(cfg, runtime, record_placement=record_placement, lanes=lanes)
