"""The OpenVINO engine (`edged.engines`, model.engine = "openvino"): a compiled model and its infer requests.

The ONNX file is read by OpenVINO, its input reshaped to batch 1 and the contract's size, and
compiled for ``model.device`` (CPU, GPU for an Intel iGPU, AUTO) at ``model.precision``, always
given explicitly: OpenVINO's CPU plugin otherwise computes in bf16 wherever the CPU has it, and
boxes would differ from the exported model's. int8 is a quantised model (`edged quantize`) whose
quantised operators OpenVINO runs in int8, the rest in f32. A precision the device lacks is refused
with the ones it has. The compiled model is cached in the cache folder (`RuntimeConfig.cache_folder`),
so a second start skips compiling; edged records what OpenVINO wrote there and removes what is no
longer so before OpenVINO reads it (`CompiledCache`). Each plan's `OpenVinoBinding` is an infer
request whose input and output tensors share the plan's numpy buffers, so a steady-state run copies
and allocates nothing.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import stat
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from edged.config import ModelConfig, RuntimeConfig
from edged.contract import pinned_dimensions
from edged.cpus import ThreadPlan
from edged.engines import (
    INSTALL_OPENVINO,
    UNSIGNED_CACHE,
    Port,
    check_int8,
    file_sha256,
    first_line,
    is_quantised,
    read_model,
)
from edged.errors import ConfigError, InferenceError, MissingDependency, ModelError
from edged.files import read_regular, remove_parts, write_durably
from edged.heads.anomaly import anomalib_size

# The openvino package imports its model converter, whose usage telemetry, unless a file under $HOME
# says no, makes a client id there and counts every import; as the service, which may not write there,
# it logs three warnings at each start. edged converts nothing: without the telemetry package the
# converter takes its own stub, which records and sends nothing.
sys.modules.setdefault("openvino_telemetry", None)  # type: ignore[arg-type]  # None: refused when imported
try:
    import openvino as ov
    import openvino.properties as props
    import openvino.properties.hint as hints
except ImportError as e:  # the optional extra is not installed
    raise MissingDependency(f'model.engine = "openvino" needs the openvino package ({e}): {INSTALL_OPENVINO}') from None

log = logging.getLogger(__name__)

# model.precision -> the inference precision hint, and the capability (OPTIMIZATION_CAPABILITIES) it needs.
PRECISIONS = {
    "f32": (ov.Type.f32, "FP32"),
    "bf16": (ov.Type.bf16, "BF16"),
    "f16": (ov.Type.f16, "FP16"),
    "int8": (ov.Type.f32, "INT8"),
}
# OpenVINO element types as ONNX Runtime names them, the spelling `edged.contract` reads.
_ONNX_TYPES = {"f32": "tensor(float)", "f16": "tensor(float16)", "u8": "tensor(uint8)"}
# Devices made of others: AUTO picks one, MULTI:CPU,GPU and HETERO:GPU,CPU combine them.
VIRTUAL_DEVICES = ("AUTO", "MULTI", "HETERO", "BATCH")
# Inside the cache folder: a folder per model (`ModelIdentity.short`) of its compiled models.
CACHE_FOLDER = "openvino"
CACHE_RECORD = "edged-cache.json"  # in a model's folder: the digest of each compiled model as OpenVINO wrote it
RECORD_BYTES = 1 << 20  # a record names a compiled model per device and setting: a few hundred bytes each
# The models whose compiled models are kept: the live one, a candidate, the one kept for rollback, and
# one more. A line that changes its model every week would otherwise fill its card over the years.
KEEP_MODELS = 4


def open_engine(cfg: ModelConfig, runtime: RuntimeConfig, *, record_placement: bool, lanes: int) -> OpenVinoEngine:
    """`edged.engines.open_engine` for OpenVINO (``record_placement``: the runtime model is always there)."""
    return OpenVinoEngine(cfg, runtime, lanes=lanes)


def _onnx_type(element: Any) -> str:
    name = str(element.to_string())
    return _ONNX_TYPES.get(name, f"tensor({name})")


def _ports(nodes: Sequence[Any], prefix: str) -> list[Port]:
    """Inputs or outputs as `Port`s: a dynamic dimension is named by its port and axis."""
    ports = []
    for n, node in enumerate(nodes):
        name = node.get_any_name() if node.get_names() else f"{prefix}{n}"
        shape: list[int | str] = [
            dim.get_length() if dim.is_static else f"{name}_{axis}" for axis, dim in enumerate(node.get_partial_shape())
        ]
        ports.append(Port(name, shape, _onnx_type(node.get_element_type())))
    return ports


class OpenVinoEngine:
    """One batch-1 model compiled for one device at one precision."""

    def __init__(self, cfg: ModelConfig, runtime: RuntimeConfig, *, lanes: int = 1) -> None:
        self.model_path = cfg.path
        self.cfg = runtime
        self.device = cfg.device
        self.precision = cfg.precision
        self.signed = cfg.require_signature
        data, self.identity = read_model(cfg.path)  # compiled from these bytes
        self.core = ov.Core()
        hint, capability = PRECISIONS[cfg.precision]
        self._check_device(capability)
        try:
            model = self.core.read_model(data)
        except Exception as e:  # OpenVINO raises RuntimeError and its own frontend errors
            raise ModelError(f"openvino cannot load {cfg.path}: {first_line(e)}") from None
        check_int8(cfg.path, cfg.precision, is_quantised(data))
        self.metadata = _metadata(model)
        # Named as read: compiling merges names onto a tensor (anomalib's pred_score may come out as clamp_1).
        outputs = _ports(model.outputs, "output")
        self._pin(model, cfg.imgsz, outputs)
        cache = CompiledCache.open(self._cache_dir())
        self.cache = cache.folder if cache is not None else None
        config: dict[str, Any] = {
            hints.inference_precision: hint,
            hints.performance_mode: hints.PerformanceMode.LATENCY,
        }
        if lanes > 1:  # one stream per lane, so lanes run at once as they do on one ORT session
            config[props.streams.num] = lanes
        if runtime.intra_op_threads:
            config[props.inference_num_threads] = runtime.intra_op_threads
        if self.cache is not None:
            config[props.cache_dir] = str(self.cache)
        try:
            self.compiled = self.core.compile_model(model, self.device, config)
        except Exception as e:
            raise ModelError(f"openvino cannot compile {cfg.path} for {self.device}: {first_line(e)}") from None
        if cache is not None:
            cache.record(len(data))
        self.input_meta = _ports(self.compiled.inputs, "input")
        compiled = _ports(self.compiled.outputs, "output")
        self.output_meta = [replace(port, name=read.name) for port, read in zip(compiled, outputs, strict=True)]
        self.providers: list[tuple[str, dict[str, Any]]] = [(self.device, {})]
        self.threads = self._thread_plan()
        log.info("inference threads: %s", self.threads.summary)

    def _check_device(self, capability: str) -> None:
        """Refuse a device OpenVINO does not have, or a precision it cannot run, naming what it has."""
        available = self.core.available_devices
        names = set(available) | {name.split(".")[0] for name in available}  # GPU for GPU.0
        if self.device.split(":")[0] not in VIRTUAL_DEVICES and self.device not in names:
            raise ConfigError(
                None,
                [f"model.device: OpenVINO has no device {self.device!r} here; it has {', '.join([*available, 'AUTO'])}"],
            )
        try:
            capabilities = list(self.core.get_property(self.device, "OPTIMIZATION_CAPABILITIES"))
        except RuntimeError:  # MULTI:... and HETERO:... answer only once compiled: they refuse what they cannot run then
            return
        if capability not in capabilities:
            supported = [p for p, (_, cap) in PRECISIONS.items() if cap in capabilities]
            raise ConfigError(
                None,
                [
                    f"model.precision: {self.device} cannot run {self.precision!r} (its capabilities: "
                    f"{', '.join(capabilities)}); it runs {', '.join(supported)}"
                ],
            )

    def _pin(self, model: Any, imgsz: tuple[int, int] | None, outputs: Sequence[Port]) -> None:
        """Reshape a dynamic input to batch 1 and the input size (`edged.contract.pinned_dimensions`)."""
        if not model.inputs:
            return
        port = _ports(model.inputs, "input")[0]
        trained = anomalib_size([(o.name, o.shape) for o in outputs])
        pins = pinned_dimensions(port.name, port.shape, self.metadata, imgsz, trained)
        if pins:
            shape = [pins[d] if isinstance(d, str) else d for d in port.shape]
            log.info("pinning the dynamic input dimensions: %s", shape)
            model.reshape({model.inputs[0]: ov.PartialShape(shape)})

    def _cache_dir(self) -> Path | None:
        """This model's folder of compiled models: one per model, so that only its own are checked at a start."""
        folder = self.cfg.cache_folder()
        if self.signed and self.cfg.cache_dir is not None:
            log.warning("runtime.cache_dir %s is %s", self.cfg.cache_dir, UNSIGNED_CACHE)
        if folder is None or self.signed:
            return None
        return folder / CACHE_FOLDER / self.identity.short

    def _property(self, name: str) -> Any:
        """A property of the compiled model, or None where its device does not tell (AUTO keeps some to itself)."""
        try:
            return self.compiled.get_property(name)
        except RuntimeError:
            return None

    def _thread_plan(self) -> ThreadPlan:
        threads, streams = self._property(props.inference_num_threads), self._property(props.streams.num)
        if threads is None or streams is None:
            return ThreadPlan(self.cfg.intra_op_threads, f"chosen by OpenVINO's {self.device} device")
        how = "as configured" if self.cfg.intra_op_threads else "OpenVINO's choice"
        return ThreadPlan(int(threads), f"{threads} in {streams} stream(s), {how}")

    @property
    def provider(self) -> str:
        return f"OpenVINO {self.device}"

    def bind(self, input_tensor: np.ndarray) -> OpenVinoBinding:
        return OpenVinoBinding(self.compiled, input_tensor)

    def infer(self, input_tensor: np.ndarray) -> list[np.ndarray]:
        """The compiled model called on ``input_tensor``, outputs allocated by OpenVINO."""
        return list(self.compiled({0: input_tensor}, share_inputs=True).to_tuple())

    def report(self) -> list[tuple[str, str]]:
        """The device and plugin, the precision asked for and the precisions the nodes really run in, the cache."""
        used = ", ".join(str(d) for d in self.compiled.get_property("EXECUTION_DEVICES"))
        plugins = self.core.get_versions(self.device)
        lines = [
            ("engine", f"openvino {ov.__version__}"),
            ("device", f"{self.device}: runs on {used} ({self.core.get_property(used.split(',')[0], 'FULL_DEVICE_NAME')})"),
            *(("plugin", f"{name}: {v.description} {v.build_number}") for name, v in plugins.items()),
            ("precision", f"{self.precision}: inference precision {self._precision_used()}"),
        ]
        runs = self.runtime_precisions()
        if runs:
            lines.append(("", "nodes run in " + ", ".join(f"{p}: {n}" for p, n in runs.most_common())))
        where = str(self.cache) if self.cache is not None else "none (set runtime.cache_dir for a faster start)"
        if self.signed:
            where = f"none: {UNSIGNED_CACHE}"
        lines += [("cache", where), ("threads", self.threads.summary)]
        return lines

    def _precision_used(self) -> str:
        hint = self._property(hints.inference_precision)
        return str(hint.to_string()) if hint is not None else f"chosen by {self.device}"

    def runtime_precisions(self) -> Counter[str]:
        """Nodes of the compiled model per precision it runs them in (empty where the device does not say)."""
        try:
            ops = self.compiled.get_runtime_model().get_ops()
        except RuntimeError:
            return Counter()
        infos = [op.get_rt_info() for op in ops]
        return Counter(str(info["runtimePrecision"].astype(str)) for info in infos if "runtimePrecision" in info)


class CompiledCache:
    """One model's folder of OpenVINO's compiled models (``*.blob``), checked before OpenVINO reads it.

    OpenVINO writes a compiled model in place without syncing it to the disk, and runs any blob of the
    right name and header it finds: one a power cut left cut short, or with zeros in it, would be read
    back, and a damaged one run. So edged records each blob's digest once OpenVINO has written it and
    it is on the disk (`CACHE_RECORD`, `record`), and before compiling removes every blob that is not
    as recorded (`open`). The cache only saves time: any of this that fails is a warning, and the
    model is compiled without it.
    """

    def __init__(self, folder: Path, recorded: dict[str, str], checked: dict[str, tuple[str, tuple[int, ...]]]) -> None:
        self.folder = folder
        self._recorded = recorded
        self._checked = checked  # blob -> its digest and `_version` as checked by `open`

    @classmethod
    def open(cls, folder: Path | None) -> CompiledCache | None:
        """``folder`` made, and cleared of every blob not as recorded; None (said) where it cannot be."""
        if folder is None:
            return None
        record = folder / CACHE_RECORD
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(OSError):  # a read-only cache prepared in an image is still read
                os.utime(folder)  # used now: the models used longest ago go first (`_prune`)
                _prune(folder)
            remove_parts(record)  # a record a power cut left half written beside it
            recorded = _read_record(record)
            checked, removed = {}, []
            for blob in sorted(folder.glob("*.blob")):
                status = blob.lstat()
                digest = file_sha256(blob) if stat.S_ISREG(status.st_mode) else None  # a pipe would hold the start up
                if digest is not None and recorded is not None and recorded.get(blob.name) == digest:
                    checked[blob.name] = (digest, _version(status))
                else:
                    blob.unlink()
                    removed.append(blob.name)
        except OSError as e:
            log.warning(
                "runtime.cache_dir: no OpenVINO model cache in %s (%s): the model is compiled at every start",
                folder,
                e.strerror or e,
            )
            return None
        if removed:
            why = "is not as it was written (cut short or damaged, as by a power cut)"
            if recorded is None:
                why = f"cannot be checked: {record} cannot be read (cut short or damaged)"
            log.warning(
                "runtime.cache_dir: OpenVINO's compiled model %s in %s %s: removed, the model is compiled again",
                ", ".join(removed),
                folder,
                why,
            )
        return cls(folder, recorded or {}, checked)

    def record(self, model_bytes: int) -> None:
        """The digest of each blob in the folder, those OpenVINO wrote on the disk first; a warning where
        OpenVINO could write none for lack of room (``model_bytes``: it needs about as much) or a
        read-only disk, or the record cannot be written."""
        try:
            blobs = {}
            for blob in sorted(self.folder.glob("*.blob")):
                status = blob.lstat()
                checked = self._checked.get(blob.name)
                if not stat.S_ISREG(status.st_mode):
                    continue  # not OpenVINO's: removed at the next start
                if checked is not None and checked[1] == _version(status):
                    blobs[blob.name] = checked[0]
                    continue
                with blob.open("rb") as f:
                    os.fsync(f.fileno())
                blobs[blob.name] = file_sha256(blob)
            if not blobs and (why := _unwritable(self.folder, model_bytes)):
                log.warning(
                    "runtime.cache_dir: OpenVINO could not write its compiled model in %s (%s): the model is "
                    "compiled at every start",
                    self.folder,
                    why,
                )
            if blobs != self._recorded:
                write_durably(self.folder / CACHE_RECORD, (json.dumps(blobs, indent=1) + "\n").encode())
        except OSError as e:
            log.warning(
                "runtime.cache_dir: cannot record OpenVINO's compiled model in %s (%s): it is compiled again at "
                "the next start",
                self.folder,
                e.strerror or e,
            )


def _prune(folder: Path) -> None:
    """Of the other models' folders beside ``folder``, those used longest ago past `KEEP_MODELS` in
    all, and the compiled models an earlier edged kept loose there (it no longer reads them), removed;
    said once. One that cannot be removed is left for the next start."""
    loose: list[Path] = []
    folders: list[tuple[int, Path]] = []
    for entry in folder.parent.iterdir():
        status = entry.lstat()
        if stat.S_ISREG(status.st_mode) and entry.suffix == ".blob":
            loose.append(entry)
        elif entry != folder and stat.S_ISDIR(status.st_mode) and (entry / CACHE_RECORD).exists():
            folders.append((status.st_mtime_ns, entry))
    removed = []
    for entry in loose + [entry for _, entry in sorted(folders, reverse=True)[KEEP_MODELS - 1 :]]:
        try:
            if entry in loose:
                entry.unlink()
            else:
                shutil.rmtree(entry)
        except OSError:
            continue
        removed.append(entry.name)
    if removed:
        log.info(
            "runtime.cache_dir: removed the compiled models of %s in %s (the %d models used last are kept)",
            ", ".join(sorted(removed)),
            folder.parent,
            KEEP_MODELS,
        )


def _version(status: os.stat_result) -> tuple[int, ...]:
    """What changes when a file is written again: OpenVINO rewrites a blob in place."""
    return status.st_ino, status.st_size, status.st_mtime_ns, status.st_ctime_ns


def _read_record(path: Path) -> dict[str, str] | None:
    """The digests a model's folder's record holds: none where it has no record yet; None where it
    cannot be read as one (its blobs cannot be checked, and are compiled again)."""
    try:
        record = json.loads(read_regular(path, RECORD_BYTES))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict):
        return None
    return {str(name): digest for name, digest in record.items() if isinstance(digest, str)}


def _unwritable(folder: Path, needed: int) -> str | None:
    """Why OpenVINO could not write a compiled model of about ``needed`` bytes in ``folder``, known from
    its filesystem: read-only, or too full; None where it had room (OpenVINO chose not to)."""
    try:
        disk = os.statvfs(folder)
    except OSError:
        return None
    if disk.f_flag & os.ST_RDONLY:
        return "its filesystem is read-only"
    free = disk.f_bavail * disk.f_frsize
    return f"{free} bytes free there" if free < needed else None


class OpenVinoBinding:
    """An infer request reading a plan's input tensor in place and writing into its own output buffers.

    A warm-up run fixes the output sizes; after it, `run` allocates nothing.
    """

    def __init__(self, compiled: Any, tensor: np.ndarray) -> None:
        self._request = compiled.create_infer_request()
        # Tensors over numpy memory (no copy); kept alive with the request.
        self._tensors = [ov.Tensor(tensor, shared_memory=True)]
        self._request.set_input_tensor(self._tensors[0])
        try:
            self._request.infer()
        except Exception as e:
            raise ModelError(f"the model fails on its first run: {first_line(e)}") from None
        self._raw = [np.empty(t.shape, t.data.dtype) for t in self._request.output_tensors]
        for i, buf in enumerate(self._raw):
            self._tensors.append(ov.Tensor(buf, shared_memory=True))
            self._request.set_output_tensor(i, self._tensors[-1])
        self.outputs: list[np.ndarray] = [b if b.dtype == np.float32 else np.empty(b.shape, np.float32) for b in self._raw]

    def run(self) -> None:
        """One inference on the bound input, results in `outputs`; raises InferenceError.

        start_async and wait, not infer: infer builds a dictionary of the results every run.
        """
        try:
            self._request.start_async()
            self._request.wait()
        except Exception as e:
            raise InferenceError(first_line(e)) from None
        for raw, out in zip(self._raw, self.outputs, strict=True):
            if raw is not out:
                np.copyto(out, raw, casting="unsafe")


def _metadata(model: Any) -> dict[str, str]:
    """The ONNX file's metadata, which OpenVINO keeps in the model's ``framework`` runtime info."""
    info = model.get_rt_info()
    if "framework" not in info:
        return {}
    return {key: str(value.astype(str)) for key, value in info["framework"].items()}
