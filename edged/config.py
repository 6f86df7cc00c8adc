"""Settings: the one source of truth for every key edged reads.

Loaded from a TOML file and overridden by ``EDGED_*`` environment variables (``__`` separates
nesting levels, e.g. ``EDGED_MODEL__CONF=0.4``). Every section forbids unknown keys so a typo is
an error at start-up, not a silently ignored setting. ``load_config`` turns pydantic's errors into
one line per problem with its key path and a hint; the CLI exits 78 (EX_CONFIG) on them.
"""

from __future__ import annotations

import codecs
import difflib
import json
import logging
import operator
import os
import re
import stat
import sys
from collections import Counter
from collections.abc import Mapping, Sequence
from functools import cache, reduce
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeAlias, TypeVar, get_args

from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict, SettingsError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 on older boards
    import tomli as tomllib

from edged.errors import ConfigError, EdgedError, KeyFileError, out_of_room, printable
from edged.settings.endpoints import (
    Place,
    bind_problem,
    bound_host,
    ipc_folder_problem,
    on_the_network,
    same_place,
    zmq_place,
)
from edged.settings.evidence import CONFIG_FOLDER, DEFAULT_NOTE, EvidenceConfig, dir_problem
from edged.settings.http import HttpConfig, listen_address
from edged.settings.inspect import InspectConfig
from edged.settings.journal import JournalConfig, default_path
from edged.settings.modbus import ADDRESSES, BLOCK, ModbusConfig
from edged.settings.mqtt import MqttConfig
from edged.settings.opcua import OpcuaConfig, listen_host_port, node_id_clashes
from edged.settings.reject import RejectConfig
from edged.settings.section import Section
from edged.settings.service_dirs import service_dir, service_dirs
from edged.settings.sources import KINDS, SourceBase, SyntheticSourceConfig, TriggerMode, mask_credentials

DEFAULT_CONFIG_PATH = Path("/etc/edged/edged.toml")
ENV_PREFIX = "EDGED_"  # EDGED_<SECTION>__<KEY> overrides a key

log = logging.getLogger(__name__)
SectionT = TypeVar("SectionT", bound=BaseModel)


# ---- sources ----------------------------------------------------------------------------------

if TYPE_CHECKING:
    # A union assembled at run time is no static type: a type checker sees the base every kind extends.
    SourceConfig: TypeAlias = SourceBase
else:
    SourceConfig = Annotated[reduce(operator.or_, KINDS.values()), Field(discriminator="type")]


# ---- model, inference -------------------------------------------------------------------------

# The head formats by name; edged.heads.registry.FORMATS holds their classes, which the settings do not import.
HeadName = Literal["yolov8", "yolov5", "end2end", "rtdetr", "segment", "classify", "anomaly"]
EngineName = Literal["onnxruntime", "openvino"]  # edged.engines.ENGINES holds their modules
Precision = Literal["f32", "bf16", "f16", "int8"]
# What ONNX Runtime can be asked for: it runs the graph's own types (f32, or int8 in a quantised model).
ORT_PRECISIONS = ("f32", "int8")

# One side of a model input in pixels; the bound keeps a typo from allocating gigabytes.
MAX_INPUT_SIDE = 8192
InputSide = Annotated[int, Field(gt=0, le=MAX_INPUT_SIDE)]


CONTROL_ENDPOINT = "ipc:///run/edged/control.sock"


class CandidateConfig(Section):
    """A model on trial beside the live one (``[model.candidate]``): it sees a sample of the live
    frames, publishes nothing, and goes live only through ``edged promote``."""

    path: Path = Field(description="The candidate ONNX model file.")
    labels: Path | None = Field(None, description="Its class names, one per line; default: its metadata.")
    conf: float | None = Field(None, gt=0, le=1, description="Its minimum detection score; default: model.conf.")
    iou: float | None = Field(None, gt=0, le=1, description="Its NMS IoU; default: model.iou.")
    anomaly_threshold: float | None = Field(
        None,
        ge=0,
        le=1,
        description="An anomaly candidate's image threshold (its own scale: `edged calibrate` it as the live "
        "model's); default: model.anomaly_threshold.",
    )
    pixel_threshold: float | None = Field(
        None, ge=0, le=1, description="An anomaly candidate's pixel threshold; default: model.pixel_threshold."
    )
    signature: Path | None = Field(
        None, description="Its signature file (with model.require_signature); default: its path + .sig."
    )
    sample_every: int = Field(
        5, ge=1, le=100000, description="Every Nth live frame of a camera is offered to the candidate."
    )
    min_frames: int = Field(100, ge=1, description="Gate: frames the candidate must have run on before promotion.")
    min_agreement: float = Field(
        0.98, ge=0, le=1, description="Gate: the share of compared frames on which both models agree."
    )
    max_missing: float = Field(
        0.02,
        ge=0,
        le=1,
        description="Gate: for each class, the share of the live model's boxes the candidate may miss.",
    )
    control: str = Field(
        CONTROL_ENDPOINT,
        description="The ipc:// socket edged promote and edged rollback reach the daemon on (mode 0660).",
    )
    evidence_dir: Path | None = Field(
        None,
        description="Frames on which the models disagree are saved here, per camera and day as evidence is: the "
        "image, the live model's label and a JSON of both models' boxes; none when unset. A folder of its own: "
        "one that shares a camera's evidence folder is refused.",
    )

    @field_validator("control")
    @classmethod
    def _ipc(cls, v: str) -> str:
        if not v.startswith("ipc://") or len(v) <= len("ipc://"):
            raise ValueError("the control socket must be an ipc:// path: only local users may promote a model")
        if v.startswith("ipc://@"):
            raise ValueError(
                "the control socket must be a path, not an abstract name (@): one has no file mode, so every "
                "local user could promote a model"
            )
        if (problem := bind_problem(v)) is not None:
            raise ValueError(problem)
        return v


class ModelConfig(Section):
    path: Path = Field(description="ONNX model file.")
    engine: EngineName = Field(
        "onnxruntime", description="Inference runtime: onnxruntime, or openvino (the optional openvino extra)."
    )
    precision: Precision = Field(
        "f32",
        description="f32: boxes equal to the exported model's; bf16/f16: OpenVINO computes at that precision where "
        "the device supports it (faster, boxes within a pixel or so); int8: an `edged quantize` model.",
    )
    device: str = Field(
        "CPU",
        min_length=1,
        description="OpenVINO device: CPU, GPU (an Intel iGPU), AUTO; ONNX Runtime's are runtime.providers.",
    )
    labels: Path | None = Field(None, description="Class names, one per line; default: model metadata.")
    layout: Literal["auto", "nchw", "nhwc"] = Field(
        "auto", description="Input layout; auto infers it from where the size-3 axis sits."
    )
    channel_order: Literal["rgb", "bgr"] = Field(
        "rgb", description="Channel order the model was trained on; checked against its metadata (Ultralytics: rgb)."
    )
    resize: Literal["letterbox", "stretch", "crop"] = Field(
        "letterbox",
        description="letterbox keeps the aspect ratio (pad 114); stretch fills the input; crop (classification "
        "models, as ultralytics feeds them) resizes the shortest side to the input and takes its centre.",
    )
    imgsz: tuple[InputSide, InputSide] | None = Field(
        None,
        description="Input size [h, w] (one number: square) a dynamic-size export is served at; "
        "default: the model's imgsz metadata. A fixed-size model must agree.",
    )
    scale: float = Field(1 / 255, gt=0, description="Pixel values are multiplied by this first.")
    mean: tuple[float, float, float] = Field((0.0, 0.0, 0.0), description="Per channel, after scale.")
    std: tuple[float, float, float] = Field((1.0, 1.0, 1.0), description="Per channel, after mean.")
    head: Literal["auto", HeadName] = Field(
        "auto", description="Output head format; auto reads it from shapes and metadata."
    )
    conf: float = Field(0.25, gt=0, le=1, description="Minimum score of a published detection.")
    iou: float = Field(0.45, gt=0, le=1, description="IoU above which NMS suppresses a box.")
    max_det: int = Field(100, ge=1, le=10000, description="Most detections kept per frame.")
    top_k: int = Field(5, ge=1, le=1000, description="Classification models: the best classes each message lists.")
    retina_masks: bool = Field(
        False,
        description="Segmentation models: make the masks at the frame size, as ultralytics' retina_masks option "
        "does, rather than at the input size mapped to the frame.",
    )
    max_masks: int = Field(
        20,
        ge=1,
        le=10000,
        description="Segmentation models: the detections per frame whose masks are made, each costing one frame's "
        "pixels in bytes (0.9 MB at 1280x720); those past it are published without a mask.",
    )
    max_outline_points: int = Field(
        2000,
        ge=8,
        le=5000,
        description="Segmentation and anomaly models: the most points of one mask's or region's outline "
        "(`polygon`); a longer one is thinned by an even stride, a mask in more pieces than fit keeps its largest, "
        "and the frame counts outline_thinned (its area, length and width stay the whole mask's). Each point is up "
        "to 17 bytes of every message and label: 2000 x 20 masks is 680 kB a frame, and edged's subscribers refuse "
        "a message over 1 MiB (`edged check` warns where max_masks x max_outline_points can pass it). 2000 holds a "
        "smooth outline as large as a 1280x720 frame; 4200 one of a 3840x2160 frame.",
    )
    agnostic_nms: bool = Field(False, description="Suppress overlapping boxes across classes too.")
    anomaly_threshold: float | None = Field(
        None,
        ge=0,
        le=1,
        description="Anomaly models: the image score above which a frame is anomalous, on the export's normalised "
        "scale (0.5 is the threshold it was exported with, `edged calibrate` proposes one); default: the export's.",
    )
    pixel_threshold: float | None = Field(
        None,
        ge=0,
        le=1,
        description="Anomaly models: the map value above which a pixel belongs to a region, on the export's "
        "normalised scale; default: the export's mask (0.5).",
    )
    require_signature: bool = Field(
        False,
        description="Serve only a model whose signature (edged sign) verifies with signature_key, "
        "checked at start and on every reload before the model is loaded. A model keeping weights in "
        "external data files is refused, and the model caches (runtime.optimized_model_path, OpenVINO's "
        "compiled models) are not used: the signature covers the model file alone.",
    )
    signature_key: Path | None = Field(None, description="The ed25519 public key (PEM) model signatures must verify with.")
    signature: Path | None = Field(None, description="The model's signature file; default: the model's path + .sig.")
    candidate: CandidateConfig | None = Field(
        None, description="A model on trial on the live frames, promoted with edged promote; none when unset."
    )

    @field_validator("imgsz", mode="before")
    @classmethod
    def _square(cls, v: Any) -> Any:
        """One number is a square input, as ultralytics reads ``imgsz=640``."""
        return (v, v) if isinstance(v, int) and not isinstance(v, bool) else v

    @model_validator(mode="after")
    def _signature_key(self) -> ModelConfig:
        if self.require_signature and self.signature_key is None:
            raise ValueError("require_signature needs signature_key: the public key signatures must verify with")
        return self

    @model_validator(mode="after")
    def _engine_options(self) -> ModelConfig:
        if self.engine == "onnxruntime" and self.precision not in ORT_PRECISIONS:
            raise ValueError(
                f"model.precision = {self.precision!r} needs model.engine = 'openvino'; onnxruntime runs "
                f"{' or '.join(ORT_PRECISIONS)} (the model's own types)"
            )
        if self.engine == "onnxruntime" and self.device != "CPU":
            raise ValueError(
                "model.device chooses OpenVINO's device (model.engine = 'openvino'); onnxruntime's are runtime.providers"
            )
        return self

    @field_validator("std")
    @classmethod
    def _std_nonzero(cls, v: tuple[float, float, float]) -> tuple[float, float, float]:
        if any(s == 0 for s in v):
            raise ValueError("std values must be non-zero (they divide every pixel)")
        return v


class ProviderConfig(Section):
    name: str = Field(description="ONNX Runtime execution provider, e.g. CPUExecutionProvider.")
    options: dict[str, str | int | float | bool] = Field(
        default_factory=dict, description="Provider options passed to ONNX Runtime as given."
    )


Spinning = Literal["off", "during-run", "always"]
CapturePriority = Literal["normal", "low", "idle"]


MAX_THREADS = 256  # bound of the thread-count settings, far above any board edged runs on


def check_thread_option(threads: int) -> None:
    """Raise ValueError unless a command's ``--threads`` is a valid runtime.intra_op_threads."""
    if not 0 <= threads <= MAX_THREADS:
        raise ValueError(f"--threads must be 0 (one per physical core) to {MAX_THREADS}, got {threads}")


class RuntimeConfig(Section):
    providers: list[ProviderConfig] = Field(
        default_factory=lambda: [ProviderConfig(name="CPUExecutionProvider")],
        min_length=1,
        description="Execution providers in order of preference; missing ones fall back down the list, and one failing "
        "20 frames in a row is dropped until a restart or a reload that changes this list.",
    )
    intra_op_threads: int = Field(
        0, ge=0, le=MAX_THREADS, description="0 = one per physical core of the CPUs this process may use."
    )
    inter_op_threads: int = Field(1, ge=0, le=MAX_THREADS, description="Only used by parallel execution.")
    graph_optimization: Literal["disable", "basic", "extended", "all"] = Field(
        "all", description="ONNX Runtime graph optimisation level."
    )
    optimized_model_path: Path | None = Field(
        None,
        description="Cache of model.path's optimised graph (a candidate's is not kept): written on first start, "
        "loaded after while it holds what was written; one that cannot be written or read is a warning, never a "
        "refused start.",
    )
    cache_dir: Path | None = Field(
        None,
        description="Folder of OpenVINO's compiled-model cache (a fast cold start); default: the service's "
        "cache directory under systemd ($CACHE_DIRECTORY), else none (compiled at every start).",
    )
    spinning: Spinning = Field(
        "during-run",
        description="Idle ORT threads: 'off' sleep at once; 'during-run' spin while an inference runs "
        "and sleep when it ends; 'always' spin between frames too (ORT's default: most heat).",
    )
    inference_lanes: int = Field(
        2,
        ge=1,
        le=8,
        description="Cameras whose frames run through the model at once, on the one session (at most one per camera).",
    )
    capture_priority: CapturePriority = Field(
        "low",
        description="The capture thread's scheduling: 'normal'; 'low', nice +10: it yields cores to "
        "inference; 'idle', SCHED_IDLE: it never preempts inference, but starves on a board kept busy.",
    )

    def cache_folder(self) -> Path | None:
        """runtime.cache_dir, else the service's cache directory (systemd's ``$CACHE_DIRECTORY``), else none."""
        if self.cache_dir is not None:
            return self.cache_dir
        return service_dir("cache")

    @field_validator("spinning", mode="before")
    @classmethod
    def _spinning_from_bool(cls, v: Any) -> Any:
        """Configs from before the three settings said true (ORT's default) or false."""
        return {True: "always", False: "off"}[v] if isinstance(v, bool) else v


# ---- publish ----------------------------------------------------------------------------------


class PublishConfig(Section):
    endpoints: list[str] = Field(
        default_factory=lambda: ["ipc:///run/edged/detections.sock"],
        min_length=1,
        description="ZeroMQ endpoints the PUB socket binds: tcp://HOST:PORT, HOST an IP address ([v6] in brackets), "
        "* for every address (IPv6 and IPv4), or a host name or interface (a name binds its IPv4 address, or its "
        "IPv6 one where it has none); or ipc://PATH.",
    )
    topic_prefix: str = Field(
        "edged",
        min_length=1,
        max_length=256,
        pattern=r"^[A-Za-z0-9_./-]+$",
        description="Topics are PREFIX/detections/CAMERA, PREFIX/verdict/CAMERA and PREFIX/status/CAMERA.",
    )
    hwm: int = Field(32, ge=1, le=100000, description="Messages queued per subscriber before dropping.")
    status_interval_s: float = Field(1.0, gt=0, le=3600, description="Seconds between status messages.")
    linger_ms: int = Field(200, ge=0, le=10000, description="How long stop waits to flush queued messages.")
    publish_empty: bool = Field(True, description="Publish frames with no detections too.")
    insecure: bool = Field(False, description="Allow plaintext tcp:// on a non-loopback address.")
    curve_server_key: Path | None = Field(
        None, description="This publisher's secret key file (edged keygen); enables CurveZMQ on tcp://."
    )
    curve_clients_dir: Path | None = Field(
        None, validate_default=True, description="Directory of the public .key files of the subscribers allowed to connect."
    )

    @field_validator("curve_clients_dir")
    @classmethod
    def _curve_keys_together(cls, v: Path | None, info: Any) -> Path | None:
        if "curve_server_key" in info.data and (v is None) != (info.data["curve_server_key"] is None):
            raise ValueError("set both publish.curve_server_key and publish.curve_clients_dir, or neither")
        return v

    @field_validator("endpoints")
    @classmethod
    def _known_transport(cls, v: list[str]) -> list[str]:
        for ep in v:
            if not ep.startswith(("tcp://", "ipc://")):
                raise ValueError(f"endpoint {ep!r} must start with tcp:// or ipc://")
            if (problem := bind_problem(ep)) is not None:
                raise ValueError(problem)
        return v

    @model_validator(mode="after")
    def _plaintext_off_loopback(self) -> PublishConfig:
        """Plaintext detections on the network are refused when the configuration loads, so that
        `edged check` finds it and `edged run` exits 78 rather than 1 at bind (a restart loop)."""
        if self.curve_server_key is None and not self.insecure:
            exposed = [ep for ep in self.endpoints if on_the_network(ep)]
            if exposed:
                raise ValueError(
                    f"publish.endpoints {exposed[0]!r} is not a loopback address and would publish unencrypted "
                    "detections to the network: set publish.curve_server_key and publish.curve_clients_dir "
                    "(edged keygen), bind 127.0.0.1 or ipc://, or set publish.insecure = true to accept that"
                )
        return self


# ---- trigger --------------------------------------------------------------------------------


class TriggerConfig(Section):
    """``[trigger]``: free-running frames, or one inspection per request."""

    mode: TriggerMode = Field(
        "free", description="'free' publishes every frame; 'request' inspects one frame per request on trigger.endpoint."
    )
    endpoint: str = Field(
        "tcp://127.0.0.1:5557",
        description="ZeroMQ endpoint requests arrive on (REP/ROUTER), written as publish.endpoints; under "
        "publish.curve_* keys when tcp and set.",
    )
    timeout_s: float = Field(2.0, gt=0, le=60, description="A request is answered within this, with an error if need be.")
    queue: int = Field(4, ge=1, le=64, description="Requests waiting behind the one in progress; beyond it: busy.")
    insecure: bool = Field(
        False,
        description="Take requests without CURVE keys on a tcp endpoint other machines can reach: anyone "
        "there may then trigger inspections and read their verdicts (publish.insecure does not imply it).",
    )

    @field_validator("endpoint")
    @classmethod
    def _known_transport(cls, v: str) -> str:
        if not v.startswith(("tcp://", "ipc://")):
            raise ValueError(f"endpoint {v!r} must start with tcp:// or ipc://")
        if (problem := bind_problem(v)) is not None:
            raise ValueError(problem)
        return v


# ---- thermal ----------------------------------------------------------------------------------


class ThermalConfig(Section):
    enabled: bool = Field(True, description="Watch temperatures and throttling and adapt the rate.")
    root: Path = Field(Path("/"), description="Where /sys and /proc are read; a captured tree in tests.")
    poll_interval_s: float = Field(2.0, gt=0, le=600, description="Seconds between readings.")
    warm_c: float | None = Field(
        None, description="Hottest zone at or above this is warm (default: per board or from trip points)."
    )
    throttled_c: float | None = Field(None, description="Hottest zone at or above this is throttled (default: as warm_c).")
    critical_c: float | None = Field(
        None, description="Hottest zone at or above this is critical: inference pauses (default: as warm_c)."
    )
    hysteresis_c: float = Field(3.0, ge=0, le=30, description="Cooling needed below a threshold to step down.")
    warm_rate: float = Field(0.5, gt=0, le=1, description="Fraction of the full frame rate allowed when warm.")
    throttled_rate: float = Field(0.25, gt=0, le=1, description="Fraction allowed when throttled.")
    use_vcgencmd: bool = Field(True, description="Ask vcgencmd get_throttled where sysfs lacks the flags.")

    @field_validator("throttled_c", "critical_c")
    @classmethod
    def _above_lower_thresholds(cls, v: float | None, info: Any) -> float | None:
        order = ("warm_c", "throttled_c", "critical_c")
        for lower_name in order[: order.index(info.field_name)]:
            lower = info.data.get(lower_name)
            if v is not None and lower is not None and lower >= v:
                raise ValueError(f"must be above thermal.{lower_name} ({lower})")
        return v


# ---- service ----------------------------------------------------------------------------------


class ServiceConfig(Section):
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="Log level.")
    max_fps: float = Field(0.0, ge=0, le=1000, description="Cap on processed frames per second; 0 = none.")
    stall_timeout_s: float = Field(10.0, gt=0, le=3600, description="No progress for this long stops the watchdog pings.")
    load_stuck_s: float = Field(
        30.0,
        gt=0,
        le=3600,
        description="A reload's load (or a fallback's to the next provider) still going after this long is said "
        "in the log, and a SIGHUP then loads the configuration again in its place; raise it where a model takes "
        "longer to load (a large model, an engine compiled on the board).",
    )


S = TypeVar("S", bound=BaseModel)


def section(kind: type[S], description: str) -> S:
    """A section with its defaults when the file has none of it, and what it is for."""
    result: S = Field(default_factory=kind, description=description)
    return result


class Settings(BaseSettings):
    """The whole configuration: docs/configuration.md, generated from these models, has every key."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, env_nested_delimiter="__", extra="forbid", frozen=True)

    # Named for its TOML table; a tuple of every camera, one for a single [source] table.
    source: tuple[SourceConfig, ...] = Field(
        default_factory=lambda: (SyntheticSourceConfig(),),
        description="The cameras: one [source] table, or a [[source]] table per camera.",
    )
    model: ModelConfig = Field(
        description="The ONNX model, how frames are fed to it (the layout contract checked at start) and "
        "how its output is decoded."
    )
    runtime: RuntimeConfig = section(
        RuntimeConfig,
        "ONNX Runtime: execution providers, threads, graph optimisation, and how inference and capture share the CPUs.",
    )
    publish: PublishConfig = section(
        PublishConfig, "The ZeroMQ stream: endpoints, topics, per-subscriber queues, the status rate and CurveZMQ keys."
    )
    thermal: ThermalConfig = section(
        ThermalConfig, "The board's temperatures and throttling, and the frame rates kept as it warms up."
    )
    inspect: InspectConfig | None = Field(
        None, description="Per-class thresholds, zones and the OK/NG verdict; none: no verdict."
    )
    trigger: TriggerConfig = section(
        TriggerConfig, "Free-running frames, or one inspection per request on a ZeroMQ endpoint (and the broker)."
    )
    service: ServiceConfig = section(
        ServiceConfig, "The daemon itself: its log level, a cap on the frame rate and the watchdog's stall timeout."
    )
    http: HttpConfig = section(HttpConfig, "The live view, status page, Prometheus metrics and health check, over HTTP.")
    mqtt: MqttConfig | None = Field(None, description="MQTT output beside the ZeroMQ stream; absent: off.")
    modbus: ModbusConfig | None = Field(
        None, description="Modbus TCP server of each camera's state and verdicts, and request coils; absent: off."
    )
    evidence: EvidenceConfig | None = Field(None, description="Evidence images; off without the section.")
    opcua: OpcuaConfig | None = Field(None, description="OPC UA server of each camera's verdicts; absent: off.")
    journal: JournalConfig = section(
        JournalConfig, "The verdict journal: every verdict recorded on the board, sent to MQTT from it; on by default."
    )
    reject: RejectConfig | None = Field(
        None, description="The GPIO line pulsed when a judged part reaches the ejector; absent: none."
    )

    @field_validator("source", mode="before")
    @classmethod
    def _one_or_many(cls, v: Any) -> Any:
        """A single ``[source]`` table is a board with one camera."""
        return [v] if isinstance(v, (dict, BaseModel)) else v

    @field_validator("source")
    @classmethod
    def _unique_cameras(cls, v: tuple[SourceBase, ...]) -> tuple[SourceBase, ...]:
        """At least one camera; topics, status messages and logs tell cameras apart by ``camera_id`` alone."""
        if not v:
            raise ValueError("no camera: give a [source] table, or one [[source]] table per camera")
        seen: set[str] = set()
        for cfg in v:
            if cfg.camera_id in seen:
                raise ValueError(
                    f"camera_id {cfg.camera_id!r} is used by more than one [[source]]: each camera needs its own"
                )
            seen.add(cfg.camera_id)
        return v

    @field_validator("trigger")
    @classmethod
    def _trigger_off_loopback(cls, v: TriggerConfig, info: Any) -> TriggerConfig:
        """A request socket on the network without keys lets anyone trigger inspections and read
        their verdicts: refused unless ``trigger.insecure`` accepts exactly that, where a camera takes
        requests. The socket is bound only then: an unused endpoint exposes nothing (edged 0.4.0 ran
        with one, and an upgrade must not stop that board), and a reload into request mode is refused."""
        publish = info.data.get("publish")  # absent when its own keys are wrong: reported there
        keyed = publish is not None and publish.curve_server_key is not None
        sources = info.data.get("source")  # absent when a camera is wrong: reported there
        modes = {v.mode} if sources is None else {v.mode if cfg.trigger is None else cfg.trigger for cfg in sources}
        if "request" in modes and not keyed and not v.insecure and on_the_network(v.endpoint):
            raise ValueError(
                f"trigger.endpoint {v.endpoint!r} is not a loopback address and publish.curve_server_key "
                "and publish.curve_clients_dir are not set, so anyone who reaches it could trigger "
                "inspections and read their verdicts: set those keys, bind 127.0.0.1 or ipc://, or set "
                "trigger.insecure = true to accept that"
            )
        return v

    @model_validator(mode="after")
    def _reject_lines(self) -> Settings:
        """Every camera's reject line is complete, has a verdict to act on, and is its own: two
        cameras on one line would fight over it (the second request of a line fails as busy)."""
        problems: list[str] = []
        owners: dict[tuple[str, int | str], str] = {}
        for cfg in self.source:
            reject = self.reject_for(cfg)
            if reject is None:
                continue
            named = f" (camera {cfg.camera_id})" if len(self.source) > 1 else ""
            problems += [problem + named for problem in reject.missing()]
            if self.inspection(cfg) is None:
                problems.append(
                    f"reject: camera {cfg.camera_id} has no verdict to act on: add [inspect] or [source.inspect]"
                )
            for line in (reject.line, reject.alarm_line):
                if line is None:
                    continue
                other = owners.setdefault((reject.chip, line), cfg.camera_id)
                if other != cfg.camera_id:
                    problems.append(
                        f"reject: cameras {other} and {cfg.camera_id} both drive line {line!r} of {reject.chip}: "
                        "give each camera its own [source.reject] line"
                    )
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @model_validator(mode="after")
    def _modbus_blocks(self) -> Settings:
        """Every camera's block of registers has an address: past 65535 a PLC could not read it."""
        if self.modbus is None:
            return self
        room = ADDRESSES - BLOCK * len(self.source)  # the highest base that fits them all
        if self.modbus.base > room:
            fix = (
                f"lower modbus.base to {room} or less"
                if room >= 0
                else f"Modbus serves {ADDRESSES // BLOCK} cameras at most"
            )
            raise ValueError(
                f"modbus: {len(self.source)} cameras' blocks of {BLOCK} registers from modbus.base "
                f"{self.modbus.base} run past the last address, {ADDRESSES - 1}: {fix}"
            )
        return self

    @model_validator(mode="after")
    def _opcua_node_ids(self) -> Settings:
        """With [opcua] every camera's node ids are its own: `edged.settings.opcua.node_id_clashes`."""
        if self.opcua is not None and (problems := node_id_clashes(self.camera_ids())):
            raise ValueError(f"opcua: {'; '.join(problems)}: give such a camera another camera_id")
        return self

    @model_validator(mode="after")
    def _one_place_each(self) -> Settings:
        """No two of edged's sockets and servers listen at one place: the second bind failed as if another
        program held it, a start that exit 1 and systemd's restarts could never mend, or a server that
        tried again for ever."""
        places: list[tuple[str, str, Place]] = []
        problems: list[str] = []
        bound = cache(bound_host)  # each host name looked up once, however many places share its port
        for key, written, place in self._listening():
            for other_key, other, other_place in places:
                if same_place(place, other_place, bound):
                    problems.append(
                        f"{key}: {written!r} is named twice: remove one"
                        if (key, written) == (other_key, other)
                        else f"{key}: {written!r} would listen where {other_key} {other!r} does, and could not bind "
                        "there: give each its own port (or path)"
                    )
                    break
            else:
                places.append((key, written, place))
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def _listening(self) -> list[tuple[str, str, Place]]:
        """Each place edged listens at, with its key and the address as written: its ZeroMQ sockets'
        (`zeromq_endpoints`; a port ZeroMQ chooses left out) and its servers'."""
        listening = [(key, endpoint, place) for key, endpoint in self.zeromq_endpoints() if (place := zmq_place(endpoint))]
        servers = [
            ("http.listen", self.http.listen, listen_address),
            ("modbus.listen", self.modbus.listen if self.modbus else "", listen_address),
            ("opcua.listen", self.opcua.listen if self.opcua else "", listen_host_port),
        ]
        for key, written, read in servers:
            if written:
                host, port = read(written)
                listening.append((key, written, (host, str(port))))
        return listening

    def zeromq_endpoints(self) -> list[tuple[str, str]]:
        """The ZeroMQ endpoints edged binds, each with its key: the request socket only with a camera in
        request mode, the control socket only with a candidate."""
        endpoints = [("publish.endpoints", endpoint) for endpoint in self.publish.endpoints]
        if self.requesting():
            endpoints.append(("trigger.endpoint", self.trigger.endpoint))
        if self.model.candidate is not None:
            endpoints.append(("model.candidate.control", self.model.candidate.control))
        return endpoints

    def camera(self, camera_id: str) -> SourceBase | None:
        """The camera called ``camera_id``, if this configuration has it."""
        return next((cfg for cfg in self.source if cfg.camera_id == camera_id), None)

    def max_fps(self, cfg: SourceBase) -> float:
        """A camera's rate cap: its own ``max_fps``, else ``service.max_fps`` (0: none)."""
        return cfg.max_fps if cfg.max_fps is not None else self.service.max_fps

    def lanes(self) -> int:
        """The inference lanes in use: as many as ``runtime.inference_lanes`` asks, one per camera at most."""
        return min(self.runtime.inference_lanes, len(self.source))

    def inspect_for(self, cfg: SourceBase) -> InspectConfig | None:
        """A camera's inspection: the keys of its [source.inspect] table (and its ``zones``) in place of
        those keys of [inspect], the others from there; None: the camera is not inspected."""
        if cfg.inspect is None and cfg.zones is None:
            return self.inspect
        own = _given(cfg.inspect) if cfg.inspect is not None else {}
        if cfg.zones is not None:
            own["zones"] = cfg.zones
        return _overlay(self.inspect or InspectConfig(), own)

    def evidence_for(self, cfg: SourceBase) -> EvidenceConfig | None:
        """A camera's evidence: none with ``evidence = false``; the keys of its [source.evidence] table in
        place of those keys of [evidence], the others from there; None: none saved."""
        if isinstance(cfg.evidence, bool):
            return self.evidence if cfg.evidence else None
        if self.evidence is None:  # its table whole: the keys it does not give have the defaults it was loaded with
            return cfg.evidence
        return _overlay(self.evidence, _given(cfg.evidence))

    def evidence_dir_default(self, cfg: SourceBase) -> bool:
        """Whether a camera's evidence folder is the default: neither its [source.evidence] table nor
        [evidence] gives ``dir``."""
        tables = (self.evidence, cfg.evidence if isinstance(cfg.evidence, EvidenceConfig) else None)
        return not any(table is not None and "dir" in table.model_fields_set for table in tables)

    def reject_for(self, cfg: SourceBase) -> RejectConfig | None:
        """A camera's reject line: the keys of its [source.reject] table in place of those keys of
        [reject], the others from there; None: the camera drives none."""
        if cfg.reject is None:
            return self.reject
        if self.reject is None:
            return cfg.reject
        return _overlay(self.reject, _given(cfg.reject))

    def rejecting(self) -> list[str]:
        """The cameras that drive a reject line, in config order."""
        return [cfg.camera_id for cfg in self.source if self.reject_for(cfg) is not None]

    def trigger_mode(self, cfg: SourceBase) -> TriggerMode:
        """A camera's trigger mode: its own ``trigger``, else ``trigger.mode``."""
        return cfg.trigger if cfg.trigger is not None else self.trigger.mode

    def inspection(self, cfg: SourceBase) -> InspectConfig | None:
        """What a camera's frames are inspected with: `inspect_for`, the defaults when requests are
        answered with verdicts (request mode without inspection: any detection is NG), or None."""
        inspect = self.inspect_for(cfg)
        if inspect is None and self.trigger_mode(cfg) == "request":
            inspect = InspectConfig()
        return inspect

    def camera_zones(self) -> dict[str, dict[str, list[tuple[float, float]]]]:
        """Each camera's inspection zones by camera id, in the order of the ``[[source]]`` tables: what
        its live view draws."""
        return {cfg.camera_id: (i.zones if (i := self.inspection(cfg)) else {}) for cfg in self.source}

    def camera_ids(self) -> list[str]:
        return [cfg.camera_id for cfg in self.source]

    def requesting(self) -> list[str]:
        """The cameras in request mode, in config order."""
        return [cfg.camera_id for cfg in self.source if self.trigger_mode(cfg) == "request"]

    def inspected(self) -> list[str]:
        """The cameras with a verdict (their own or the board's ``[inspect]``), in config order."""
        return [cfg.camera_id for cfg in self.source if self.inspection(cfg) is not None]

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Environment beats the file: the file's values arrive as init kwargs.
        return env_settings, init_settings


def _given(section: BaseModel) -> dict[str, Any]:
    """The keys of ``section`` its table gave, with their values."""
    return {key: getattr(section, key) for key in section.model_fields_set}


def _overlay(section: SectionT, keys: Mapping[str, Any]) -> SectionT:
    """``section`` with ``keys`` in place of its own, validated as a whole."""
    return type(section).model_validate({**dict(section), **keys})


_SOURCE_TYPES = ", ".join(KINDS)
_HINTS = {
    "missing": "required key is missing",
    "union_tag_invalid": f"source.type must be one of {_SOURCE_TYPES}",
    "union_tag_not_found": f"set source.type to one of {_SOURCE_TYPES}",
    "literal_error": "not one of the allowed values",
}
MAX_CONFIG_BYTES = 1 << 20  # a config file is a few KB; a bigger one is a wrong path, not a config


def _section_at(loc: Sequence[str | int]) -> type[BaseModel] | None:
    """The model whose keys live at ``loc`` (as pydantic reports it: the source's tag included), if any."""
    model: type[BaseModel] = Settings
    parts = [p for p in loc if not isinstance(p, int)]
    while parts:
        part = parts.pop(0)
        if model is Settings and part == "source":
            kind = KINDS.get(parts.pop(0)) if parts else None
            if kind is None:
                return None
            model = kind
            continue
        field = model.model_fields.get(part)
        nested = _models_in(field.annotation) if field else []
        if not nested:
            return None
        model = nested[0]
    return model


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models an annotation holds: ``ProviderConfig`` from ``list[ProviderConfig]``."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in get_args(annotation) for m in _models_in(arg)]


def _unknown_key_hint(loc: Sequence[str | int]) -> str:
    """Why a key is not accepted: another camera kind's key, a likely misspelling, or plainly unknown."""
    key, section = str(loc[-1]), _section_at(loc[:-1])
    kind = loc[1] if len(loc) == 3 and loc[0] == "source" else None
    if kind is not None and section is not None:
        owners = [other for other, config in KINDS.items() if key in config.model_fields]
        if owners:
            return (
                f"source.{key} does not apply to source type {kind!r} (it is a key of {', '.join(owners)}); "
                f"the keys of {kind!r} are: {', '.join(section.model_fields)}"
            )
    close = difflib.get_close_matches(key, list(section.model_fields), n=1) if section else []
    if close:
        return f"unknown key: did you mean {close[0]}?"
    return "unknown key: check its spelling against config/edged.toml"


_UNION_MEMBER = re.compile(r"(?:constrained-)?(int|float|str|bool)")
_MEMBER_TYPES: dict[str, type] = {"int": int, "float": float, "str": str, "bool": bool}


def _one_per_union(errors: Sequence[Any]) -> list[Any]:
    """A key that takes one of several kinds (reject.line: an offset or a name) fails once per kind,
    each at its own path (line.constrained-int, line.constrained-str); the user gave one value, so
    one problem is said at the key's path: that of the value's own kind, else the first."""

    def member(err: Any) -> str | None:
        found = _UNION_MEMBER.fullmatch(str(err["loc"][-1])) if len(err["loc"]) > 1 else None
        return found.group(1) if found else None

    parents = Counter(tuple(err["loc"][:-1]) for err in errors if member(err) is not None)
    kept: dict[tuple[Any, ...], Any] = {}
    for err in errors:
        kind, key = member(err), tuple(err["loc"][:-1])
        if kind is None or parents[key] < 2:  # a table key named int or str is no union member
            own_slot = (len(kept), *err["loc"])
            kept[own_slot] = err
        elif key not in kept or type(err.get("input")) is _MEMBER_TYPES[kind]:
            kept[key] = {**err, "loc": key}
    return list(kept.values())


_KEY_SAID = re.compile(r"^Value error, (?P<text>(?P<key>[a-z_]+(?:\.[a-z_]+)*): .*)$")
_KEYS_NAMED = re.compile(r"(?:^|; | where )([a-z_]+(?:\.[a-z_]+)+)[: ]")  # the keys a check across sections names


def _format_error(err: Any, variables: Mapping[tuple[str, ...], str], *, cameras: bool = False) -> str:
    """One problem as one line: the key path as the user writes it, pydantic's message, a hint, and
    the ``EDGED_*`` variable the value came from when it did not come from the file.

    ``cameras``: the sources were given as ``[[source]]`` tables, so a source key is named with
    its table's index (``source[1].path``); a single ``[source]`` table's keys are ``source.path``.
    """
    raw_loc = tuple(p for p in err["loc"] if not str(p).startswith("function-"))
    # Which reading of a camera's evidence key (true/false or a table) applies is pydantic's, not the user's.
    raw_loc = tuple(
        p for i, p in enumerate(raw_loc) if not (i and raw_loc[i - 1] == "evidence" and p in ("switch", "table"))
    )
    index = raw_loc[1] if raw_loc[:1] == ("source",) and len(raw_loc) > 1 and isinstance(raw_loc[1], int) else None
    if index is not None:
        raw_loc = raw_loc[:1] + raw_loc[2:]
    loc = ".".join(str(p) for p in raw_loc)
    # Discriminated unions put the tag in the path (source.file.path): keep the user's view.
    for tag in KINDS:
        loc = loc.replace(f"source.{tag}.", "source.")
    if cameras and index is not None:
        loc = f"source[{index}]" + loc.removeprefix("source")
    hint = _unknown_key_hint(raw_loc) if err["type"] == "extra_forbidden" else _HINTS.get(err["type"], "")
    # pydantic quotes some values in its message (a union's tag): escape what would break the line.
    msg = "".join(c if c.isprintable() else repr(c)[1:-1] for c in err["msg"])
    said = _KEY_SAID.match(msg) if not loc and err["type"] == "value_error" else None
    if said and said["key"].split(".")[0] in Settings.model_fields:  # a check across sections names its keys
        named = {tuple(key.split(".")) for key in _KEYS_NAMED.findall(said["text"])}
        origin = [name for path, name in variables.items() if any(key[: len(path)] == path for key in named)]
        return said["text"] + (f" (from the environment: {', '.join(origin)})" if origin else "")
    text = f"{loc or '(top level)'}: {msg}"
    if hint and hint not in msg:
        text += f" ({hint})"
    value = err.get("input")
    tables = isinstance(value, dict) or (isinstance(value, list) and value and all(isinstance(v, dict) for v in value))
    if "input" in err and err["type"] != "missing" and not tables:  # tables are the file itself: not echoed
        text += f"; got {mask_credentials(repr(err['input']))}"
    user_loc = tuple(loc.lower().split(".")) if loc else ()
    origin = [name for path, name in variables.items() if user_loc[: len(path)] == path]
    if origin:
        text += f" (from the environment: {origin[0]})"
    return text


def _environment() -> dict[tuple[str, ...], str]:
    """Key path (lower case, as pydantic-settings matches them) -> name of each ``EDGED_*`` variable."""
    return {
        tuple(name[len(ENV_PREFIX) :].lower().split("__")): name
        for name in os.environ
        if name.upper().startswith(ENV_PREFIX)
    }


def _known_variables() -> list[str]:
    """Every ``EDGED_*`` name that sets a key, without the prefix: a whole section, or one key of it."""
    names = []
    for section, field in Settings.model_fields.items():
        names.append(section.upper())
        models = list(KINDS.values()) if section == "source" else _models_in(field.annotation)
        names += [f"{section.upper()}__{key.upper()}" for m in models for key in m.model_fields]
    return sorted(set(names))


def _warn_about_ignored_variables(variables: Mapping[tuple[str, ...], str]) -> None:
    """pydantic-settings ignores an ``EDGED_*`` variable naming no section: a typo that would silently do nothing."""
    known = _known_variables()
    for path, name in sorted(variables.items()):
        if path[0] in Settings.model_fields:
            continue  # its keys are validated like the file's
        # Matched without the prefix every name shares, which would make any two names look alike.
        close = difflib.get_close_matches(name[len(ENV_PREFIX) :].upper(), known, n=1)
        log.warning(
            "environment variable %s sets nothing: no section %r%s",
            name,
            path[0],
            f"; did you mean {ENV_PREFIX}{close[0]}?" if close else f" (variables are {ENV_PREFIX}<SECTION>__<KEY>)",
        )


def _variable_problem(e: SettingsError, variables: Mapping[tuple[str, ...], str]) -> str:
    """An ``EDGED_*`` value for a list or table that is not JSON: name the variable, not the file."""
    field = re.search(r'field "([^"]+)"', str(e))
    section = field.group(1) if field else ""
    names = [name for path, name in variables.items() if path[0] == section]
    cause = e.__cause__
    if isinstance(cause, json.JSONDecodeError):  # it holds the text it failed on: the variable's value
        names = [name for name in names if os.environ[name] == cause.doc] or names
    reason = f": {cause}" if cause else ""
    return (
        f"{section or '(top level)'}: {' or '.join(names) or 'an EDGED_* variable'} is not the JSON "
        f"its key needs{reason} (lists and tables are written as JSON in a variable)"
    )


def _file_problem(path: Path, what: str) -> str | None:
    """Why ``path`` cannot be read as a regular file, or None when it can."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return f"{what} {path} does not exist"
    except (OSError, ValueError) as e:  # too long, a loop of links, an I/O error, a NUL byte
        return f"{what} {path} cannot be read: {_reason(e)}"
    if stat.S_ISDIR(st.st_mode):
        return f"{what} {path} is a directory, not a file"
    if not stat.S_ISREG(st.st_mode):
        return f"{what} {path} is not a regular file"
    if not os.access(path, os.R_OK):
        return f"{what} {path} is not readable by this user"
    return None


def _reason(e: Exception) -> str:
    return getattr(e, "strerror", None) or str(e)


def _read_toml(path: Path) -> dict[str, Any]:
    problem = _file_problem(path, "config file")
    if problem is not None:
        hint = " (pass --config PATH)" if problem.endswith("does not exist") else ""
        raise ConfigError(path, [problem + hint])
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as e:  # out of file descriptors, an I/O error, replaced since the check
        if out_of_room(e):  # the process's want, not the file's: exit 1
            raise EdgedError(
                f"config file {path} cannot be read now: {_reason(e)} (the process is short of descriptors or "
                "memory: LimitNOFILE= too low, or a leak)"
            ) from None
        raise ConfigError(path, [f"config file {path} cannot be read: {_reason(e)}"]) from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(path, [f"config file {path} is larger than {MAX_CONFIG_BYTES} bytes: not a config file"])
    try:
        data: dict[str, Any] = tomllib.loads(_text(raw))
    except ValueError as e:  # TOMLDecodeError, not UTF-8, or an integer too long to convert
        raise ConfigError(path, [f"not valid TOML: {e}"]) from None
    except RecursionError:  # tomllib parses nested arrays and tables by recursion
        raise ConfigError(path, ["not valid TOML: arrays or tables nested too deeply to read"]) from None
    return data


def _text(raw: bytes) -> str:
    """A config file's text. A UTF-8 byte-order mark, as Windows' Notepad saves one, is skipped:
    tomllib refuses it as an "invalid statement" at line 1, column 1, which nothing there shows.
    `ValueError` for a file in another encoding says which byte, by line and column, and how to
    save it (a UTF-16 file is named so)."""
    if raw.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        raise ValueError("the file is UTF-16: save it as UTF-8")
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line, column = raw.count(b"\n", 0, e.start) + 1, e.start - raw.rfind(b"\n", 0, e.start)
        raise ValueError(
            f"byte 0x{raw[e.start]:02x} at line {line}, column {column} is not UTF-8 (Latin-1 or another "
            "encoding?): save the file as UTF-8"
        ) from None


def _resolve_paths(data: dict[str, Any], base: Path) -> dict[str, str]:
    """Relative paths in a config file are relative to that file, not to the working directory.
    Returns each path made so, with what the file said (`_said_relative`)."""
    relative: dict[str, str] = {}

    def resolve(table: Any, key: str) -> None:
        value = table.get(key) if isinstance(table, dict) else None
        if isinstance(value, str) and value and not os.path.isabs(value) and "://" not in value:
            table[key] = os.path.normpath(base / value)
            relative[table[key]] = value

    source = data.get("source")
    for table in [source] if isinstance(source, dict) else source if isinstance(source, list) else []:
        resolve(table, "path")  # [source], or each camera's [[source]]
        resolve(table.get("evidence") if isinstance(table, dict) else None, "dir")  # its [source.evidence]
    for section, key in (
        ("model", "path"),
        ("model", "labels"),
        ("model", "signature_key"),
        ("model", "signature"),
        ("runtime", "optimized_model_path"),
        ("runtime", "cache_dir"),
        ("publish", "curve_server_key"),
        ("publish", "curve_clients_dir"),
        ("http", "token_file"),
        ("mqtt", "password_file"),
        ("mqtt", "ca_file"),
        ("mqtt", "cert_file"),
        ("mqtt", "key_file"),
        ("opcua", "users_file"),
        ("opcua", "cert_dir"),
        ("evidence", "dir"),
        ("journal", "path"),
    ):
        resolve(data.get(section), key)
    model = data.get("model")
    candidate = model.get("candidate") if isinstance(model, dict) else None
    for key in ("path", "labels", "signature", "evidence_dir"):
        resolve(candidate, key)
    return relative


def _said_relative(problem: str, relative: Mapping[str, str], base: Path) -> str:
    """``problem`` with, where it is a missing file the configuration named by a relative path, where
    that path was read from: a copy of a configuration in another folder finds its files no more."""
    for resolved, said in relative.items():
        missing = f" {resolved} does not exist"
        if missing in problem:
            where = f'("{said}" in the configuration file is read from its folder, {base})'
            return problem.replace(missing, f"{missing} {where}")
    return problem


def _socket_folder_problems(settings: Settings) -> list[str]:
    """The ipc:// endpoints edged will bind whose folder is missing outside its runtime directory,
    or is no folder (`edged.settings.endpoints`); the request socket only with a camera in request mode."""
    return [
        f"{key}: {problem}"
        for key, endpoint in settings.zeromq_endpoints()
        if (problem := ipc_folder_problem(endpoint)) is not None
    ]


def _check_files(settings: Settings) -> list[str]:
    # What the cameras, the keys and the broker need (their libraries, zmq's certificates, paho) loads
    # only to check them: the settings themselves import nothing of the runtime.
    from edged.keys import key_file_problems, read_token
    from edged.modbus import dependency_problems as modbus_problems
    from edged.mqtt import broker_problems
    from edged.opcua import opcua_problems
    from edged.sources.registry import config_problems as camera_problems

    problems = [
        f"{key}: {problem}"
        for key, path, what in (
            ("model.path", settings.model.path, "model file"),
            ("model.labels", settings.model.labels, "labels file"),
        )
        if path is not None and (problem := _file_problem(path, what)) is not None
    ]
    for cfg in settings.source:
        named = f" (camera {cfg.camera_id})" if len(settings.source) > 1 else ""
        problems += [problem + named for problem in camera_problems(cfg)]
    problems += key_file_problems(settings.publish.curve_server_key, settings.publish.curve_clients_dir)
    if settings.http.token_file is not None:
        try:
            read_token(settings.http.token_file, "http.token_file")
        except KeyFileError as e:
            problems.append(str(e))
    if settings.mqtt is not None:
        problems += broker_problems(settings.mqtt)
    if settings.opcua is not None:
        problems += opcua_problems(settings.opcua)
    if settings.modbus is not None:
        problems += modbus_problems()
    problems += _journal_problems(settings)
    problems += _evidence_problems(settings)
    if settings.rejecting():
        from edged.reject import gpiod_problem

        if (problem := gpiod_problem()) is not None:
            problems.append(f"reject: {problem}")
    return problems


def _journal_problems(settings: Settings) -> list[str]:
    """A journal path whose folder is missing, or that is a folder or a device: every write would fail
    (or go nowhere) while the daemon runs, so it is refused before it starts."""
    journal = settings.journal
    if not journal.enabled or journal.path is None:
        return []
    if not journal.path.parent.is_dir() and journal.path.parent not in service_dirs("state"):  # systemd makes it
        return [
            f"journal.path: folder {journal.path.parent} does not exist (create it, set journal.path to a file in "
            "an existing folder, or journal.enabled = false)"
        ]
    if journal.path.exists() and not journal.path.is_file():
        return [
            f"journal.path: {journal.path} is not a regular file (a folder or a device); name a file in it, "
            "such as journal.sqlite, or set journal.enabled = false"
        ]
    return []


def _evidence_problems(settings: Settings) -> list[str]:
    """An evidence folder that is a file: every save would fail, so it is refused before the daemon starts."""
    problems: list[str] = []
    for cfg in settings.source:
        evidence = settings.evidence_for(cfg)
        if evidence is None or (problem := dir_problem(evidence.dir)) is None:
            continue
        own = isinstance(cfg.evidence, EvidenceConfig) and "dir" in cfg.evidence.model_fields_set
        key = "source.evidence.dir" if own else "evidence.dir"
        named = f" (camera {cfg.camera_id})" if own and len(settings.source) > 1 else ""
        advice = DEFAULT_NOTE if settings.evidence_dir_default(cfg) else "give a folder"
        line = f"{key}: {problem}; {advice}{named}"
        if line not in problems:
            problems.append(line)
    return problems + _trial_evidence_problems(settings)


def _trial_evidence_problems(settings: Settings) -> list[str]:
    """A shadow trial's evidence folder that is a file, or is, holds or lies in a camera's evidence
    folder: two stores would each prune it from their own running total and describe its dataset."""
    candidate = settings.model.candidate
    if candidate is None or candidate.evidence_dir is None:
        return []
    if (problem := dir_problem(candidate.evidence_dir)) is not None:
        return [f"model.candidate.evidence_dir: {problem}; give a folder"]
    trial, cameras = _real(candidate.evidence_dir), [cfg.camera_id for cfg in settings.source]
    for cfg in settings.source:
        evidence = settings.evidence_for(cfg)
        if evidence is None:
            continue
        live = _real(evidence.dir)
        for camera in cameras:
            if _owns(live, cfg.camera_id, trial / camera) or _owns(trial, camera, live / cfg.camera_id):
                return [
                    f"model.candidate.evidence_dir: {trial} would share camera {cfg.camera_id}'s evidence folder "
                    f"{live / cfg.camera_id}, and two stores would prune it and describe its dataset; give the "
                    "trial a folder of its own, such as one beside the evidence folder"
                ]
    return []


def _real(path: Path) -> Path:
    """``path`` with its links followed; a loop of links as written (its folder cannot be made,
    which the save reports)."""
    try:
        return path.resolve()
    except (OSError, RuntimeError):  # RuntimeError: a loop, before Python 3.13
        return Path(os.path.abspath(path))


def _owns(root: Path, camera_id: str, path: Path) -> bool:
    """Whether ``path`` is in a folder an evidence store at ``root`` keeps for the camera: ``CAMERA``
    or one of its ``CAMERA@TASK-HASH`` (`edged.evidence`)."""
    if not path.is_relative_to(root) or path == root:
        return False
    first = path.relative_to(root).parts[0]
    return first == camera_id or first.startswith(f"{camera_id}@")


def load_config(path: Path | None) -> Settings:
    """Read ``path`` (TOML), apply ``EDGED_*`` overrides, validate everything, and check files exist.

    Any problem, the file's or a variable's, is a `ConfigError`; a variable that names no section is
    logged as a warning with the closest real name, since pydantic-settings would ignore it.
    """
    data = _read_toml(path) if path is not None else {}
    base = path.resolve().parent if path is not None else None  # what relative paths in the file are read from
    relative = _resolve_paths(data, base) if base is not None else {}
    variables = _environment()
    _warn_about_ignored_variables(variables)
    cameras = isinstance(data.get("source"), list) or os.environ.get(f"{ENV_PREFIX}SOURCE", "").lstrip().startswith("[")
    if isinstance(data.get("source"), list):
        per_key = sorted(name for key, name in variables.items() if key[0] == "source" and len(key) > 1)
        if per_key:
            raise ConfigError(
                path,
                [
                    f"source: {', '.join(per_key)} cannot override one key of several [[source]] tables; "
                    f"set {ENV_PREFIX}SOURCE to the whole list as JSON, or change the file"
                ],
            )
    folder = CONFIG_FOLDER.set(base)
    try:
        settings = Settings(**data)
    except ValidationError as e:
        errors = _one_per_union(e.errors())
        raise ConfigError(path, [_format_error(err, variables, cameras=cameras) for err in errors]) from None
    except SettingsError as e:  # an EDGED_* variable that is not the JSON its key needs
        raise ConfigError(path, [_variable_problem(e, variables)]) from None
    finally:
        CONFIG_FOLDER.reset(folder)
    if settings.journal.path is None:
        journal = settings.journal.model_copy(update={"path": default_path(base)})
        settings = settings.model_copy(update={"journal": journal})
    problems = _check_files(settings) + _socket_folder_problems(settings)
    if problems:
        said = [_said_relative(problem, relative, base) for problem in problems] if base else problems
        # One line each, whatever the paths they name hold (a newline in a path given in a variable).
        raise ConfigError(path, [printable(problem) for problem in said])
    return settings
