"""Property tests of the config loader: whatever a file or the environment holds, the daemon gets
a valid `Settings` or a `ConfigError` whose every line names the key at fault, never a traceback.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import assume, event, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError

from edged.config import (  # TOML read as edged reads it, on every Python it supports
    ModelConfig,
    ProviderConfig,
    PublishConfig,
    RuntimeConfig,
    ServiceConfig,
    Settings,
    ThermalConfig,
    _format_error,
    load_config,
    tomllib,
)
from edged.errors import ConfigError
from edged.settings.sources import KINDS, FileSourceConfig, GstreamerSourceConfig, ImagesSourceConfig, RtspSourceConfig

SECTIONS: dict[str, tuple[type[BaseModel], ...]] = {
    "source": tuple(KINDS.values()),
    "model": (ModelConfig,),
    "runtime": (RuntimeConfig,),
    "publish": (PublishConfig,),
    "thermal": (ThermalConfig,),
    "service": (ServiceConfig,),
}
KEYS = sorted({(section, key) for section, models in SECTIONS.items() for m in models for key in m.model_fields})
PATH_KEYS = sorted(
    {
        (section, key)
        for section, models in SECTIONS.items()
        for m in models
        for key, field in m.model_fields.items()
        if "Path" in str(field.annotation)
    }
)
REQUIRED: dict[type[BaseModel], dict[str, str]] = {
    ModelConfig: {"path": "m"},
    FileSourceConfig: {"path": "v"},
    ImagesSourceConfig: {"path": "i"},
    RtspSourceConfig: {"url": "rtsp://camera.local/stream"},
    GstreamerSourceConfig: {"pipeline": "videotestsrc"},
}
DEFAULTS = {  # every key's default as TOML would give it: valid values, so valid configs come up too
    (section, key): value
    for section, models in SECTIONS.items()
    for m in models
    for key, value in json.loads(m.model_validate(REQUIRED.get(m, {})).model_dump_json()).items()
    if value is not None and (section != "source" or key in ("type", "camera_id"))
}
KEY_PATH = re.compile(r"^(\(top level\)|[^\s.:][^:]*): \S")
PROPERTY = settings(max_examples=150, deadline=None)


class Raw(str):
    """A TOML fragment written as is (what a serialiser would never produce, a person might)."""


HOSTILE_TEXT = st.sampled_from(
    [
        "",
        " ",
        "\x00",
        "a" * 5000,
        "../../etc/passwd",
        "/dev/null",
        "/",
        "~",
        "%s%n",
        "{}",
        "[",
        "null",
        "nan",
        "-inf",
        "1e999",
        "0x10",
        "tcp://",
        "ipc://",
        "tcp://0.0.0.0:5556",
        "ipc:///" + "d/" * 80 + "s",
        "CPUExecutionProvider",
        "synthetic",
        "v4l2",
        "auto",
        "ü\u202e\ufeff",
        "\U0001f600",
    ]
)
SCALARS = st.one_of(
    st.text(max_size=20),
    HOSTILE_TEXT,
    st.booleans(),
    st.integers(),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.sampled_from([2**63, -(2**63) - 1, 10**400]),
    st.floats(),
    st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 5e-324, 1e308]),
    st.dates(),
    st.datetimes(timezones=st.just(dt.timezone.utc)),
)
HOSTILE_PATHS = st.sampled_from(
    [
        "a" * 5000,
        "x/" * 2100,
        "\x00",
        "",
        ".",
        "/",
        "/dev/null",
        "/proc/self/status",
        "~/x",
        "relative/dir",
    ]
)
RAW = st.sampled_from([Raw("9" * 5000), Raw("1e99999"), Raw("0x7fffffffffffffff"), Raw("-nan"), Raw("1979-05-27")])
NAMES = st.one_of(
    st.from_regex(r"[A-Za-z_][A-Za-z0-9_-]{0,12}", fullmatch=True),
    st.sampled_from(["ü", "a b", "1", "-", "type", "path", "name", "options"]),
)


def _nested(scalars: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.recursive(
        scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(NAMES, inner, max_size=4), max_leaves=12
    )


VALUES = _nested(SCALARS)  # always valid TOML
VALUES_OR_RAW = _nested(SCALARS | RAW)  # sometimes not


def _string(text: str) -> str:
    return json.dumps(text, ensure_ascii=False).replace("\x7f", "\\u007f")  # JSON escapes are TOML's too


def toml(value: Any) -> str:
    if isinstance(value, Raw):
        return str(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if isinstance(value, float):
        return "nan" if math.isnan(value) else repr(value)
    if isinstance(value, str):
        return _string(value)
    if isinstance(value, (dt.date, dt.datetime)):
        return value.isoformat()
    if isinstance(value, list):
        return "[" + ", ".join(toml(v) for v in value) + "]"
    return "{" + ", ".join(f"{_string(k)} = {toml(v)}" for k, v in value.items()) + "}"


def toml_document(doc: dict[str, Any]) -> str:
    """Top-level keys first, then one [table] per section that is a table."""
    lines = [f"{_string(k)} = {toml(v)}" for k, v in doc.items() if not isinstance(v, dict)]
    for name, table in doc.items():
        if isinstance(table, dict):
            lines.append(f"[{_string(name)}]")
            lines += [f"{_string(k)} = {toml(v)}" for k, v in table.items()]
    return "\n".join(lines) + "\n"


@st.composite
def documents(draw: st.DrawFn, model_path: str) -> dict[str, Any]:
    """A valid base config with a few keys set to random, hostile or unknown values."""
    doc: dict[str, Any] = {"model": {"path": model_path}, "thermal": {"enabled": False}}
    for _ in range(draw(st.integers(0, 4))):
        kind = draw(st.sampled_from(["default", "known", "known", "path", "unknown", "section"]))
        if kind == "default":
            section, key = draw(st.sampled_from(sorted(DEFAULTS)))
            table = doc.setdefault(section, {})
            if isinstance(table, dict):
                table[key] = DEFAULTS[section, key]
        elif kind == "path":
            section, key = draw(st.sampled_from(PATH_KEYS))
            table = doc.setdefault(section, {})
            if isinstance(table, dict):
                table[key] = draw(HOSTILE_PATHS)
        elif kind == "known":
            section, key = draw(st.sampled_from(KEYS))
            table = doc.setdefault(section, {})
            if isinstance(table, dict):
                table[key] = draw(VALUES_OR_RAW)
        elif kind == "unknown":
            section = draw(st.sampled_from([None, *SECTIONS]))
            target = doc if section is None else doc.setdefault(section, {})
            if isinstance(target, dict):
                target[draw(NAMES)] = draw(VALUES_OR_RAW)
        else:
            doc[draw(st.sampled_from(list(SECTIONS)))] = draw(VALUES_OR_RAW)
    return doc


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("config")
    (path / "model.onnx").write_bytes(b"not checked here")
    return path


@pytest.fixture(scope="module", autouse=True)
def clean_environment() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        for name in [n for n in os.environ if n.startswith("EDGED_")]:
            mp.delenv(name)
        yield


def _allowed_roots(doc: dict[str, Any]) -> set[str]:
    return set(Settings.model_fields) | set(doc)


def _check_problems(error: ConfigError, doc: dict[str, Any]) -> None:
    assert error.problems, "a ConfigError must say what is wrong"
    for line in error.problems:
        assert "\n" not in line, line
        match = KEY_PATH.match(line)
        assert match, f"problem without a key path: {line!r}"
        path = match.group(1)
        assert path == "(top level)" or re.split(r"[.\[]", path)[0] in _allowed_roots(doc), line


@PROPERTY
@given(data=st.data())
def test_any_toml_file_gives_settings_or_config_errors_with_key_paths(workdir: Path, data: st.DataObject) -> None:
    doc = data.draw(documents(str(workdir / "model.onnx")))
    text = toml_document(doc)
    try:
        tomllib.loads(text)
    except ValueError:  # only a raw fragment can make it unreadable: one file-level line then
        with pytest.raises(ConfigError, match="not valid TOML"):
            load_config(_write(workdir, text))
        return
    try:
        loaded = load_config(_write(workdir, text))
    except ConfigError as e:
        event("config error")
        _check_problems(e, doc)
    else:
        event("valid settings")
        assert isinstance(loaded, Settings)


def _write(workdir: Path, text: str) -> Path:
    path = workdir / "edged.toml"
    path.write_text(text, encoding="utf-8")
    return path


PYTHON_VALUES = _nested(SCALARS | st.none() | st.binary(max_size=8) | st.tuples(st.floats(), st.floats(), st.floats()))


@PROPERTY
@given(
    section=st.sampled_from(list(SECTIONS)),
    values=st.dictionaries(NAMES, PYTHON_VALUES, max_size=4),
    replace=PYTHON_VALUES,
    whole=st.booleans(),
)
def test_settings_from_python_values_validate_or_name_the_key(
    workdir: Path, section: str, values: dict[str, Any], replace: Any, whole: bool
) -> None:
    data: dict[str, Any] = {"model": {"path": str(workdir / "model.onnx")}}
    data[section] = replace if whole else {**data.get(section, {}), **values}
    try:
        Settings(**data)
    except ValidationError as e:
        _check_problems(ConfigError(None, [_format_error(err, {}) for err in e.errors()]), data)


KNOWN_NAMES = set(Settings.model_fields) | set(ProviderConfig.model_fields) | {key for _, key in KEYS}


def _with_unknown(where: str, line: str, model_path: str) -> str:
    """A valid config plus ``line`` (an unknown key) at the level ``where`` names."""
    model = f"[model]\npath = {_string(model_path)}\n"
    return {
        "": line + model,
        "model.": model + line,
        "source.": '[source]\ntype = "v4l2"\n' + line + model,
        "runtime.providers.0.": model + '[[runtime.providers]]\nname = "CPUExecutionProvider"\n' + line,
        "publish.": model + "[publish]\n" + line,
        "thermal.": model + "[thermal]\n" + line,
    }[where]


@pytest.mark.parametrize("where", ["", "model.", "source.", "runtime.providers.0.", "publish.", "thermal."])
@settings(max_examples=15, deadline=None)
@given(name=st.from_regex(r"[A-Za-z_\u00fc][A-Za-z0-9 _\u00fc-]{0,12}", fullmatch=True), value=VALUES)
def test_an_unknown_key_at_any_level_is_named(workdir: Path, where: str, name: str, value: Any) -> None:
    assume(name not in KNOWN_NAMES)
    text = _with_unknown(where, f"{_string(name)} = {toml(value)}\n", str(workdir / "model.onnx"))
    with pytest.raises(ConfigError) as raised:
        load_config(_write(workdir, text))
    assert any(
        line.startswith(f"{where}{name}: Extra inputs are not permitted (unknown key") for line in raised.value.problems
    ), raised.value.problems


ENV_VALUES = st.one_of(
    st.text(max_size=20),
    HOSTILE_TEXT,
    st.sampled_from(
        [
            "[",
            "]",
            "{",
            '{"a": 1}',
            "[1, 2]",
            '["tcp://127.0.0.1:1"]',
            "true",
            "1e999",
            "-1",
            "0",
            "null",
            '""',
            '[{"name": "CPUExecutionProvider"}]',
            '{"type": "v4l2"}',
        ]
    ),
).filter(lambda v: "\x00" not in v)


@PROPERTY
@given(key=st.sampled_from(KEYS), whole_section=st.booleans(), value=ENV_VALUES)
def test_environment_overrides_give_settings_or_config_errors(
    workdir: Path, key: tuple[str, str], whole_section: bool, value: str
) -> None:
    config = _write(workdir, toml_document({"model": {"path": str(workdir / "model.onnx")}, "thermal": {"enabled": False}}))
    name = f"EDGED_{key[0].upper()}" if whole_section else f"EDGED_{key[0].upper()}__{key[1].upper()}"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(name, value)
        try:
            loaded = load_config(config)
        except ConfigError as e:
            _check_problems(e, {key[0]: None})
        else:
            assert isinstance(loaded, Settings)
