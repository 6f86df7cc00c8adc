"""The ONNX Runtime engine (`edged.engines`, model.engine = "onnxruntime"): the session, its providers, its IOBinding.

The session is created once (twice for a dynamic export: the second time with its symbolic input
dimensions pinned, through ONNX Runtime's free-dimension overrides, to batch 1 and the input size
the contract chose, so the graph is optimised for that one shape). Each plan binds its own input and output buffers to it (a
`Binding`, allocated once after a warm-up run that also fixes any symbolic output size), so a
steady-state run writes straight into those buffers and allocates nothing. Requested providers
that this onnxruntime build lacks fall back down the configured list with a warning;
``placement()`` reports where ORT actually put each node: from ORT's own assignment record where
it keeps one (onnxruntime 1.26 and later), else from ORT's profile of the nodes that ran, which
every onnxruntime edged supports writes. The optimised-model cache (``runtime.optimized_model_path``)
only saves time: ORT saves it beside its place, it is renamed there once on the disk, and its stamp
records its digest, so one a power cut or a failing card damaged is rebuilt, never run; one that
cannot be written or read is a warning, and the model is served without it, never refused.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import weakref
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from edged.config import ModelConfig, ProviderConfig, RuntimeConfig
from edged.contract import pinned_dimensions
from edged.cpus import plan_threads
from edged.engines import (
    MAX_MODEL_BYTES,
    UNSIGNED_CACHE,
    check_int8,
    file_sha256,
    first_line,
    is_quantised,
    read_model,
)
from edged.errors import InferenceError, ModelError
from edged.files import fsync_folder, part_file, read_regular, remove_parts, write_durably
from edged.heads.anomaly import anomalib_size

log = logging.getLogger(__name__)

# The assignment record (`get_provider_graph_assignment_info`) arrived in onnxruntime 1.26; the
# Jetson and Raspberry Pi wheels boards run are often older.
HAS_ASSIGNMENT_RECORD = hasattr(ort.InferenceSession, "get_provider_graph_assignment_info")

STAMP_BYTES = 1 << 16  # an optimised-model cache's stamp: a few hundred bytes
CACHE_DIGEST = "cache_sha256"  # in the stamp: the digest of the cache as written

_OPT_LEVELS = {
    "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}


@dataclass(frozen=True, slots=True)
class Placement:
    """Nodes per execution provider, and what ORT's answer counted (said beside the counts)."""

    nodes: dict[str, int]
    basis: str


def resolve_providers(
    requested: list[ProviderConfig], available: list[str]
) -> tuple[list[tuple[str, dict[str, Any]]], list[str]]:
    """Keep the requested providers this build has, in order; CPU always ends the list.

    Returns the providers for ORT and one warning per provider that had to be dropped.
    """
    chosen: list[tuple[str, dict[str, Any]]] = []
    warnings = []
    for p in requested:
        if p.name in available:
            chosen.append((p.name, dict(p.options)))
        else:
            warnings.append(
                f"execution provider {p.name} is not in this onnxruntime build (it has "
                f"{', '.join(available)}); falling back to the next one in runtime.providers"
            )
    if not any(name == "CPUExecutionProvider" for name, _ in chosen):
        chosen.append(("CPUExecutionProvider", {}))
    return chosen, warnings


def open_engine(cfg: ModelConfig, runtime: RuntimeConfig, *, record_placement: bool, lanes: int) -> Engine:
    """`edged.engines.open_engine` for ONNX Runtime: model.precision f32 or int8 is the graph's own."""
    if cfg.require_signature and runtime.optimized_model_path is not None:
        log.warning("runtime.optimized_model_path %s is %s", runtime.optimized_model_path, UNSIGNED_CACHE)
        runtime = runtime.model_copy(update={"optimized_model_path": None})
    engine = Engine(cfg.path, runtime, imgsz=cfg.imgsz, record_placement=record_placement, lanes=lanes)
    check_int8(cfg.path, cfg.precision, engine.precision == "int8")
    return engine


class Engine:
    """One batch-1 session bound to preallocated buffers."""

    def __init__(
        self,
        model_path: Path,
        cfg: RuntimeConfig,
        *,
        imgsz: tuple[int, int] | None = None,
        record_placement: bool = False,
        lanes: int = 1,
    ) -> None:
        """``imgsz`` ([h, w], model.imgsz) is the size a dynamic export is pinned to; default its metadata.
        ``lanes``: how many threads will run the session at once (`edged.cpus.plan_threads`).

        ``record_placement`` makes `placement` possible: ORT's assignment record, or its profiler
        writing into a directory of its own until `placement` reads it.
        """
        self.model_path = model_path
        self.cfg = cfg
        data, self.identity = read_model(model_path)  # the session is made from these bytes
        self.providers, self.provider_warnings = resolve_providers(cfg.providers, ort.get_available_providers())
        for warning in self.provider_warnings:
            log.warning(warning, extra={"MODEL": self.identity.short})
        self.threads = plan_threads(cfg.intra_op_threads, lanes=lanes)
        log.info("inference threads: %s", self.threads.summary)
        if self.threads.warning:
            log.warning(self.threads.warning)
        self._profile_dir: Path | None = None
        self._unprofiled: str | None = None  # why there is no profile to read the placement from
        if record_placement and not HAS_ASSIGNMENT_RECORD:
            try:
                self._profile_dir = Path(tempfile.mkdtemp(prefix="edged-placement-"))
            except OSError as e:  # no temp folder that takes a file: full, read-only
                where = f" in {Path(e.filename).parent}" if e.filename else ""
                self._unprofiled = f"no folder for ONNX Runtime's profile{where} ({_why(e)})"
        try:
            self.session = self._create_session(data, record_placement, imgsz)
        except BaseException:
            if self._profile_dir is not None:
                shutil.rmtree(self._profile_dir, ignore_errors=True)
            raise
        if self._profile_dir is not None:
            weakref.finalize(self, _discard_profile, self.session, self._profile_dir)
        self.metadata: dict[str, str] = dict(self.session.get_modelmeta().custom_metadata_map)
        self.input_meta = self.session.get_inputs()
        # ONNX Runtime runs the graph's own types: a quantised graph's are int8.
        self.precision = "int8" if is_quantised(data) else "f32"
        self.output_meta = self.session.get_outputs()
        self.output_names = [o.name for o in self.output_meta]

    # ---- session construction ------------------------------------------------------------

    def _session_options(self, record_placement: bool, pins: dict[str, int]) -> ort.SessionOptions:
        so = ort.SessionOptions()
        so.intra_op_num_threads = self.threads.intra_op_threads
        so.inter_op_num_threads = self.cfg.inter_op_threads
        so.graph_optimization_level = _OPT_LEVELS[self.cfg.graph_optimization]
        so.log_severity_level = 3
        spin = "0" if self.cfg.spinning == "off" else "1"
        so.add_session_config_entry("session.intra_op.allow_spinning", spin)
        so.add_session_config_entry("session.inter_op.allow_spinning", spin)
        if self.cfg.spinning == "during-run":
            # Spin between the ops of a run, where waking a sleeping thread costs latency, but not in
            # the gap between frames, where spinning only burns CPU (see BENCHMARKS.md, Spinning).
            so.add_session_config_entry("session.force_spinning_stop", "1")
        if self._profile_dir is not None:
            so.enable_profiling = True
            so.profile_file_prefix = str(self._profile_dir / "placement")
        elif record_placement:
            so.add_session_config_entry("session.record_ep_graph_assignment_info", "1")
        for name, size in pins.items():
            so.add_free_dimension_override_by_name(name, size)
        return so

    def _create_session(self, data: bytes, record_placement: bool, imgsz: tuple[int, int] | None) -> ort.InferenceSession:
        cached = self._from_cache(record_placement)
        if cached is not None:
            session, source, where = cached
        else:
            session, source, where = self._open_caching(data, record_placement), data, self.model_path
        inputs = session.get_inputs()
        if not inputs:
            return session
        metadata = session.get_modelmeta().custom_metadata_map
        trained = anomalib_size([(o.name, o.shape) for o in session.get_outputs()])
        pins = pinned_dimensions(inputs[0].name, inputs[0].shape, metadata, imgsz, trained)
        if pins:
            log.info("pinning the dynamic input dimensions: %s", ", ".join(f"{k}={v}" for k, v in pins.items()))
            session = self._open(source, where, record_placement, pins)
        return session

    def _open(
        self, source: bytes, where: Path, record: bool, pins: dict[str, int], save: Path | None = None
    ) -> ort.InferenceSession:
        """A session of ``source``: the model's bytes, or the optimised-model cache's (``where`` they were
        read from, for the message), external data read beside the model file; the optimised graph
        saved to ``save``."""
        so = self._session_options(record, pins)
        if save is not None:
            so.optimized_model_filepath = str(save)
        so.add_session_config_entry("session.model_external_initializers_file_folder_path", str(self.model_path.parent))
        try:
            return ort.InferenceSession(source, sess_options=so, providers=self.providers)
        except Exception as e:  # ORT raises its own Fail/InvalidProtobuf/NoSuchFile types
            raise ModelError(f"onnxruntime cannot load {where}: {first_line(e)}") from None

    def _from_cache(self, record: bool) -> tuple[ort.InferenceSession, bytes, Path] | None:
        """A session of the optimised graph in the cache (`_cached`), with its bytes and path; None
        where there is none to be trusted, or ORT cannot load it (said: it is rebuilt)."""
        cache, data = self.cfg.optimized_model_path, self._cached()
        if cache is None or data is None:
            return None
        try:
            return self._open(data, cache, record, {}), data, cache
        except ModelError as e:
            log.warning("optimised-model cache: %s; rebuilding it from %s", e, self.model_path)
            return None

    def _cache_stamp(self) -> dict[str, Any]:
        return {
            "model_sha256": self.identity.sha256,
            "onnxruntime": ort.__version__,
            "providers": [name for name, _ in self.providers],
            "graph_optimization": self.cfg.graph_optimization,
        }

    def _cached(self) -> bytes | None:
        """The optimised graph in the cache when its stamp says it was made from this very model, with
        these settings, and it holds the bytes the stamp's digest says it was written with (a power
        cut may leave it cut short, or zeros in it); None where it is not."""
        cache = self.cfg.optimized_model_path
        if cache is None:
            return None
        stamp = _stamp_path(cache)
        try:
            recorded = json.loads(read_regular(stamp, STAMP_BYTES))
            digest = recorded.pop(CACHE_DIGEST) if isinstance(recorded, dict) else None
        except FileNotFoundError:
            log.info("no optimised-model cache at %s yet: building it", cache)
            return None
        except (OSError, ValueError) as e:  # unreadable, cut short, not JSON: as stale
            log.info("optimised-model cache stamp %s cannot be read (%s): rebuilding the cache", stamp, _why(e))
            return None
        if recorded != self._cache_stamp() or not isinstance(digest, str):
            log.info("optimised-model cache %s missing or stale; rebuilding it", cache)
            return None
        try:
            data = read_regular(cache, MAX_MODEL_BYTES)
        except (OSError, ValueError) as e:  # `read_regular`'s refusals name the file
            log.warning("optimised-model cache %s cannot be read (%s): rebuilding it", cache, _why(e))
            return None
        if hashlib.sha256(data).hexdigest() != digest:
            log.warning(
                "optimised-model cache %s is not what %s says was written (cut short or damaged, as by a power "
                "cut): rebuilding it",
                cache,
                stamp,
            )
            return None
        log.info("loading optimised model from cache %s", cache)
        return data

    def _open_caching(self, data: bytes, record: bool) -> ort.InferenceSession:
        """A session of the model's ``data`` whose optimised graph is kept in the cache for the next
        start. The cache only saves time: one that cannot be written is a warning, and the model is
        served without it."""
        cache = self.cfg.optimized_model_path
        if cache is None:
            return self._open(data, self.model_path, record, {})
        try:
            remove_parts(cache)
            remove_parts(_stamp_path(cache))
            fd, part = part_file(cache)
            os.close(fd)
        except OSError as e:
            self._not_cached(cache, _why(e))
            return self._open(data, self.model_path, record, {})
        try:
            session = self._open(data, self.model_path, record, {}, save=part)
        except ModelError as e:  # ORT's own words for a write that failed: "Protobuf serialization failed"
            part.unlink(missing_ok=True)
            session = self._open(data, self.model_path, record, {})  # the model's own error, if it has one
            said = str(e).removeprefix(f"onnxruntime cannot load {self.model_path}: ")
            self._not_cached(cache, f"onnxruntime could not save it: {said}{_free_space(cache.parent)}")
            return session
        try:
            self._keep(part, cache)
        except OSError as e:
            part.unlink(missing_ok=True)
            self._not_cached(cache, _why(e))
        return session

    def _keep(self, part: Path, cache: Path) -> None:
        """The optimised graph ORT saved in ``part`` made the cache: on the disk, renamed into place,
        then its stamp with its digest, so a cache cut short or replaced since is never loaded."""
        with part.open("rb") as f:
            os.fsync(f.fileno())
        digest = file_sha256(part)
        os.replace(part, cache)
        fsync_folder(cache.parent)
        write_durably(_stamp_path(cache), json.dumps({**self._cache_stamp(), CACHE_DIGEST: digest}).encode())

    def _not_cached(self, cache: Path, why: str) -> None:
        log.warning(
            "cannot write the optimised-model cache runtime.optimized_model_path %s (%s): the model is served "
            "without it, and optimised again at the next start",
            cache,
            why,
        )

    # ---- binding ---------------------------------------------------------------------------

    def bind(self, input_tensor: np.ndarray) -> Binding:
        """A binding of ``input_tensor`` to this session, with its own output buffers.

        Each plan holds its own binding, so two plans on one model never read each other's results.
        """
        return Binding(self.session, self.input_meta[0].name, self.output_names, input_tensor)

    def infer(self, input_tensor: np.ndarray) -> list[np.ndarray]:
        """``session.run`` on ``input_tensor``, outputs allocated by ORT."""
        return list(self.session.run(None, {self.input_meta[0].name: input_tensor}))

    @property
    def provider(self) -> str:
        return str(self.session.get_providers()[0])

    def report(self) -> list[tuple[str, str]]:
        """The providers requested, available and used, the threads, and where ORT placed each node."""
        lines = [
            ("engine", f"onnxruntime {ort.__version__}, precision {self.precision} (the graph's own types)"),
            ("providers", f"requested: {', '.join(p.name for p in self.cfg.providers)}"),
            ("", f"available in this build: {', '.join(ort.get_available_providers())}"),
            ("", f"session uses: {', '.join(self.session.get_providers())}"),
            *(("", f"warning: {warning}") for warning in self.provider_warnings),
            ("threads", self.threads.summary),
        ]
        if self.threads.warning:
            lines.append(("", f"warning: {self.threads.warning}"))
        placement = self.placement()
        total = sum(placement.nodes.values())
        for provider, count in sorted(placement.nodes.items(), key=lambda kv: -kv[1]):
            lines.append(("placement", f"{provider}: {count} of {total} nodes"))
        lines.append(("" if placement.nodes else "placement", placement.basis))
        return lines

    def placement(self) -> Placement:
        """Nodes per execution provider as ORT placed them (needs record_placement=True).

        Without the assignment record it ends the profile, so ask once, after the model has run.
        """
        counts: Counter[str] = Counter()
        if self._unprofiled is not None:
            return Placement({}, f"not known: {self._unprofiled}")
        if self._profile_dir is None:
            for subgraph in self.session.get_provider_graph_assignment_info():
                counts[subgraph.ep_name] += len(subgraph.get_nodes())
            return Placement(dict(counts), "as assigned, from ONNX Runtime's assignment record")
        try:
            events = json.loads(Path(self.session.end_profiling()).read_text())
        except (OSError, ValueError) as e:  # a full or read-only disk: the profile is missing, or cut short
            why = _why(e) if isinstance(e, OSError) else f"cut short{_free_space(self._profile_dir)}"
            self._unprofiled = f"ONNX Runtime could not write its profile in {self._profile_dir} ({why})"
            return Placement({}, f"not known: {self._unprofiled}")
        ran = {
            (e["args"]["provider"], e["name"]) for e in events if e.get("cat") == "Node" and "provider" in e.get("args", {})
        }
        counts.update(provider for provider, _ in ran)
        return Placement(
            dict(counts),
            f"as run, from ONNX Runtime's profile: onnxruntime {ort.__version__} keeps no assignment record "
            "(1.26 does), so nodes the first frames did not reach are not counted and a fused subgraph is one node",
        )


class Binding:
    """A preallocated input bound to a session, and output buffers sized by a warm-up run.

    The warm-up fixes any symbolic output size; after it, `run` writes straight into `outputs`
    and allocates nothing.
    """

    def __init__(self, session: ort.InferenceSession, input_name: str, output_names: list[str], tensor: np.ndarray) -> None:
        try:
            warm = session.run(None, {input_name: tensor})
        except Exception as e:
            raise ModelError(f"the model fails on its first run: {first_line(e)}") from None
        self._session = session
        self._binding = session.io_binding()
        # OrtValues wrap the numpy buffers without copying; keep them alive with the binding.
        self._raw = [np.empty_like(w) for w in warm]
        self._values = [ort.OrtValue.ortvalue_from_numpy(tensor)]
        self._binding.bind_ortvalue_input(input_name, self._values[0])
        for name, buf in zip(output_names, self._raw, strict=True):
            self._values.append(ort.OrtValue.ortvalue_from_numpy(buf))
            self._binding.bind_ortvalue_output(name, self._values[-1])
        # Decoders work in float32; other output types get one float32 mirror, copied into.
        self.outputs: list[np.ndarray] = [b if b.dtype == np.float32 else np.empty(b.shape, np.float32) for b in self._raw]
        # Run errors come back as InferenceError and the daemon logs them, rate-limited; ORT's
        # own per-run error log would print every failing frame.
        self._options = ort.RunOptions()
        self._options.log_severity_level = 4
        # ONNX Runtime's Python wrapper reads this key before every IOBinding run; unset, the read
        # raises and catches a C++ exception, 30-100 us a frame. "0" is the value it stands for.
        self._options.add_run_config_entry("gpu_graph_id", "0")

    def run(self) -> None:
        """One inference on the bound input, results in `outputs`; raises InferenceError."""
        try:
            self._session.run_with_iobinding(self._binding, self._options)
        except Exception as e:
            raise InferenceError(first_line(e)) from None
        for raw, out in zip(self._raw, self.outputs, strict=True):
            if raw is not out:
                np.copyto(out, raw, casting="unsafe")


def _why(e: Exception) -> str:
    """An error in a message that names its file already: an OSError's reason alone."""
    return e.strerror if isinstance(e, OSError) and e.strerror else str(e)


def _free_space(folder: Path) -> str:
    """How much room ``folder``'s filesystem has, for a message about a file that could not be written there."""
    try:
        disk = os.statvfs(folder)
    except OSError:
        return ""
    return f"; {disk.f_bavail * disk.f_frsize} bytes free there"


def _stamp_path(cache: Path) -> Path:
    """Beside the optimised-model cache: what it was made from and the digest it was written with."""
    return cache.with_name(cache.name + ".json")


def _discard_profile(session: ort.InferenceSession, directory: Path) -> None:
    """End ORT's profiling (a session still profiling writes its profile when destroyed) and remove the files."""
    session.end_profiling()
    shutil.rmtree(directory, ignore_errors=True)
