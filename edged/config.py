"""Settings: the one source of truth for every key edged reads.

Loaded from a TOML file and overridden by ``EDGED_*`` environment variables (``__`` separates
nesting levels, e.g. ``EDGED_MODEL__CONF=0.4``). Every section forbids unknown keys so a typo is
an error at start-up, not a silently ignored setting. ``load_config`` turns pydantic's errors into
one line per problem with its key path and a hint; the CLI exits 78 (EX_CONFIG) on them.
"""

from __future__ import annotations

import operator
import os
import re
import sys
from functools import reduce
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeAlias

from pydantic import Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict, SettingsError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 on older boards
    import tomli as tomllib

from edged.errors import ConfigError
from edged.heads import HEADS
from edged.keys import key_file_problems
from edged.sections import Section
from edged.sources import SOURCES
from edged.sources.base import mask_credentials
from edged.sources.synthetic import SyntheticSourceConfig
from edged.zones import polygon_problem

DEFAULT_CONFIG_PATH = Path("/etc/edged/edged.toml")


# ---- sources ----------------------------------------------------------------------------------

if TYPE_CHECKING:
    from edged.sources.base import SourceBase

    # A union assembled at run time is no static type: a type checker sees the base every kind extends.
    SourceConfig: TypeAlias = SourceBase
else:
    SourceConfig = Annotated[reduce(operator.or_, (config for config, _ in SOURCES.values())), Field(discriminator="type")]


# ---- model, inference -------------------------------------------------------------------------

if TYPE_CHECKING:
    # A Literal assembled at run time is no static type: a type checker sees plain str.
    HeadChoice: TypeAlias = str
else:
    HeadChoice = Literal[tuple(["auto", *HEADS])]

# One side of a model input in pixels; the bound keeps a typo from allocating gigabytes.
InputSide = Annotated[int, Field(gt=0, le=8192)]


class ModelConfig(Section):
    path: Path = Field(description="ONNX model file.")
    labels: Path | None = Field(None, description="Class names, one per line; default: model metadata.")
    layout: Literal["auto", "nchw", "nhwc"] = Field(
        "auto", description="Input layout; auto infers it from where the size-3 axis sits."
    )
    channel_order: Literal["rgb", "bgr"] = Field(
        "rgb", description="Channel order the model was trained on; checked against its metadata (Ultralytics: rgb)."
    )
    resize: Literal["letterbox", "stretch"] = Field(
        "letterbox", description="letterbox keeps the aspect ratio (pad 114); stretch fills the input."
    )
    imgsz: tuple[InputSide, InputSide] | None = Field(
        None,
        description="Input size [h, w] (one number: square) a dynamic-size export is served at; "
        "default: the model's imgsz metadata. A fixed-size model must agree.",
    )
    scale: float = Field(1 / 255, gt=0, description="Pixel values are multiplied by this first.")
    mean: tuple[float, float, float] = Field((0.0, 0.0, 0.0), description="Per channel, after scale.")
    std: tuple[float, float, float] = Field((1.0, 1.0, 1.0), description="Per channel, after mean.")
    head: HeadChoice = Field("auto", description="Output head format; auto reads it from shapes and metadata.")
    conf: float = Field(0.25, gt=0, le=1, description="Minimum score of a published detection.")
    iou: float = Field(0.45, gt=0, le=1, description="IoU above which NMS suppresses a box.")
    max_det: int = Field(100, ge=1, le=10000, description="Most detections kept per frame.")
    agnostic_nms: bool = Field(False, description="Suppress overlapping boxes across classes too.")

    @field_validator("imgsz", mode="before")
    @classmethod
    def _square(cls, v: Any) -> Any:
        """One number is a square input, as ultralytics reads ``imgsz=640``."""
        return (v, v) if isinstance(v, int) and not isinstance(v, bool) else v

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
        description="Execution providers in order of preference; missing ones fall back down the list.",
    )
    intra_op_threads: int = Field(
        0, ge=0, le=MAX_THREADS, description="0 = one per physical core of the CPUs this process may use."
    )
    inter_op_threads: int = Field(1, ge=0, le=MAX_THREADS, description="Only used by parallel execution.")
    graph_optimization: Literal["disable", "basic", "extended", "all"] = Field(
        "all", description="ONNX Runtime graph optimisation level."
    )
    optimized_model_path: Path | None = Field(
        None, description="Cache of the optimised graph: written on first start, loaded after."
    )
    spinning: Spinning = Field(
        "during-run",
        description="Idle ORT threads: 'off' sleep at once; 'during-run' spin while an inference runs "
        "and sleep when it ends; 'always' spin between frames too (ORT's default: most heat).",
    )
    capture_priority: CapturePriority = Field(
        "low",
        description="The capture thread's scheduling: 'normal'; 'low', nice +10: it yields cores to "
        "inference; 'idle', SCHED_IDLE: it never preempts inference, but starves on a board kept busy.",
    )

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
        description="ZeroMQ endpoints the PUB socket binds (tcp:// or ipc://).",
    )
    topic_prefix: str = Field(
        "edged",
        min_length=1,
        pattern=r"^[A-Za-z0-9_./-]+$",
        description="Topics are PREFIX/detections/CAMERA and PREFIX/status/CAMERA.",
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
        return v


# ---- inspect, trigger --------------------------------------------------------------------------

Threshold = Annotated[float, Field(gt=0, le=1)]
ZoneName = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]


class InspectConfig(Section):
    """``[inspect]``: what a part must not show. Labels are checked against the model's when it loads."""

    class_conf: dict[str, Threshold] = Field(
        default_factory=dict, description="Label (or class id) -> minimum score, overriding model.conf for that class."
    )
    zones: dict[ZoneName, list[tuple[float, float]]] = Field(
        default_factory=dict,
        description="Name -> polygon [[x, y], ...] in fractions of the frame (0..1); none: the whole frame.",
    )
    outside_zones: Literal["drop", "keep"] = Field(
        "drop", description="Detections outside every zone: 'drop' them, or 'keep' them with no zone (never NG)."
    )
    match: Literal["centre", "overlap"] = Field(
        "centre", description="A detection is in a zone when its box centre is inside, or with 'overlap' any of its box."
    )
    ng_classes: list[str] | None = Field(
        None, description="Labels (or class ids) that make a part NG; default: every class."
    )
    min_area: dict[str, Annotated[float, Field(ge=0, le=1)]] = Field(
        default_factory=dict,
        description="Label (or class id) -> smallest box, as a fraction of the frame's area, that makes a part NG.",
    )

    @field_validator("zones")
    @classmethod
    def _usable_polygons(cls, v: dict[str, list[tuple[float, float]]]) -> dict[str, list[tuple[float, float]]]:
        problems = [f"zone {name!r} {problem}" for name, points in v.items() if (problem := polygon_problem(points))]
        if problems:
            raise ValueError("; ".join(problems))
        return v


class TriggerConfig(Section):
    """``[trigger]``: free-running frames, or one inspection per request."""

    mode: Literal["free", "request"] = Field(
        "free", description="'free' publishes every frame; 'request' inspects one frame per request on trigger.endpoint."
    )
    endpoint: str = Field(
        "tcp://127.0.0.1:5557",
        description="ZeroMQ endpoint requests arrive on (REP/ROUTER); under publish.curve_* keys when tcp and set.",
    )
    timeout_s: float = Field(2.0, gt=0, le=60, description="A request is answered within this, with an error if need be.")
    queue: int = Field(4, ge=1, le=64, description="Requests waiting behind the one in progress; beyond it: busy.")

    @field_validator("endpoint")
    @classmethod
    def _known_transport(cls, v: str) -> str:
        if not v.startswith(("tcp://", "ipc://")):
            raise ValueError(f"endpoint {v!r} must start with tcp:// or ipc://")
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


class Settings(BaseSettings):
    """The whole configuration; see config/edged.toml for every key with its default."""

    model_config = SettingsConfigDict(env_prefix="EDGED_", env_nested_delimiter="__", extra="forbid", frozen=True)

    source: SourceConfig = Field(default_factory=SyntheticSourceConfig)
    model: ModelConfig
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig)
    publish: PublishConfig = Field(default_factory=PublishConfig)
    thermal: ThermalConfig = Field(default_factory=ThermalConfig)
    inspect: InspectConfig | None = Field(
        None, description="Per-class thresholds, zones and the OK/NG verdict; none: no verdict."
    )
    trigger: TriggerConfig = Field(default_factory=TriggerConfig)
    service: ServiceConfig = Field(default_factory=ServiceConfig)

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


_SOURCE_TYPES = ", ".join(SOURCES)
_HINTS = {
    "extra_forbidden": "unknown key: check its spelling against config/edged.toml",
    "missing": "required key is missing",
    "union_tag_invalid": f"source.type must be one of {_SOURCE_TYPES}",
    "union_tag_not_found": f"set source.type to one of {_SOURCE_TYPES}",
    "literal_error": "not one of the allowed values",
}


def _format_error(err: Any) -> str:
    loc = ".".join(str(p) for p in err["loc"] if not str(p).startswith("function-"))
    # Discriminated unions put the tag in the path (source.file.path): keep the user's view.
    for tag in SOURCES:
        loc = loc.replace(f"source.{tag}.", "source.")
    hint = _HINTS.get(err["type"], "")
    msg = err["msg"]
    text = f"{loc or '(top level)'}: {msg}"
    if hint and hint not in msg:
        text += f" ({hint})"
    if "input" in err and err["type"] != "missing" and not isinstance(err["input"], dict):
        text += f"; got {mask_credentials(repr(err['input']))}"
    return text


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            data: dict[str, Any] = tomllib.load(f)
            return data
    except FileNotFoundError:
        raise ConfigError(path, [f"config file {path} does not exist (pass --config PATH)"]) from None
    except PermissionError:
        raise ConfigError(path, [f"config file {path} is not readable by this user"]) from None
    except ValueError as e:  # TOMLDecodeError, or an integer too long to convert
        raise ConfigError(path, [f"not valid TOML: {e}"]) from None


def _resolve_paths(data: dict[str, Any], base: Path) -> None:
    """Relative paths in a config file are relative to that file, not to the working directory."""
    for section, key in (
        ("model", "path"),
        ("model", "labels"),
        ("source", "path"),
        ("runtime", "optimized_model_path"),
        ("publish", "curve_server_key"),
        ("publish", "curve_clients_dir"),
    ):
        value = data.get(section, {}).get(key) if isinstance(data.get(section), dict) else None
        if isinstance(value, str) and value and not os.path.isabs(value) and "://" not in value:
            data[section][key] = os.path.normpath(base / value)


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except OSError:  # e.g. a name too long for the filesystem
        return False


def _check_files(settings: Settings) -> list[str]:
    problems = []
    if not _is_file(settings.model.path):
        problems.append(f"model.path: model file {settings.model.path} does not exist")
    if settings.model.labels is not None and not _is_file(settings.model.labels):
        problems.append(f"model.labels: labels file {settings.model.labels} does not exist")
    problems += settings.source.file_problems()
    problems += key_file_problems(settings.publish.curve_server_key, settings.publish.curve_clients_dir)
    return problems


def load_config(path: Path | None) -> Settings:
    """Read ``path`` (TOML), apply ``EDGED_*`` overrides, validate everything, and check files exist."""
    data = _read_toml(path) if path is not None else {}
    if path is not None:
        _resolve_paths(data, path.resolve().parent)
    try:
        settings = Settings(**data)
    except ValidationError as e:
        raise ConfigError(path, [_format_error(err) for err in e.errors()]) from None
    except SettingsError as e:  # an EDGED_* variable that is not the JSON its key needs
        field = re.search(r'field "([^"]+)"', str(e))
        where = field.group(1) if field else "(top level)"
        raise ConfigError(path, [f"{where}: {e} (check the EDGED_* variables)"]) from None
    problems = _check_files(settings)
    if problems:
        raise ConfigError(path, problems)
    return settings
