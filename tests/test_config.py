"""Settings: the example file documents every key, env overrides, paths, and error reporting."""

from __future__ import annotations

import re
from pathlib import Path
from typing import get_args

import pytest
from pydantic import BaseModel

from edged.config import (  # TOML read as edged reads it, on every Python it supports
    Settings,
    load_config,
    tomllib,
)
from edged.errors import ConfigError
from edged.sources import SOURCES
from edged.sources.synthetic import SyntheticSourceConfig

CONFIG_DIR = Path(__file__).parent.parent / "config"
EXAMPLE = CONFIG_DIR / "edged.toml"


def _keys(model: type[BaseModel], prefix: str = "") -> set[str]:
    keys = set()
    for name, field in model.model_fields.items():
        keys.add(prefix + name)
        # An optional section (``X | None``) documents the keys of X.
        annotation = next((a for a in get_args(field.annotation) if a is not type(None)), field.annotation)
        if isinstance(annotation, type) and issubclass(annotation, BaseModel) and name != "source":
            keys |= _keys(annotation, f"{prefix}{name}.")
    return keys


def _documented(text: str) -> set[str]:
    """Keys written in the file, set or commented out, with their section."""
    keys, section = set(), ""
    for line in text.splitlines():
        header = re.match(r"^#?\s*\[\[?([a-z_.]+)\]?\]", line)
        if header:
            section = header.group(1)
            keys.add(section)
            continue
        key = re.match(r"^#?\s*([a-z_]+)\s*=", line)
        if key:
            keys.add(f"{section}.{key.group(1)}")
    return keys


def test_example_config_documents_every_key() -> None:
    documented = _documented(EXAMPLE.read_text())
    expected = _keys(Settings) - {"source", "model", "runtime", "publish", "thermal", "service"}
    expected |= {"runtime.providers.name", "runtime.providers.options"}
    expected -= {"runtime.providers"}
    for config, _ in SOURCES.values():
        expected |= {f"source.{name}" for name in config.model_fields}
    missing = expected - documented
    assert not missing, f"config/edged.toml does not document: {sorted(missing)}"


def test_example_config_is_valid_as_shipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = tmp_path / "demo.onnx"
    model.write_bytes(b"x")
    monkeypatch.setenv("EDGED_MODEL__PATH", str(model))
    settings = load_config(EXAMPLE)
    assert settings.source.type == "synthetic" and settings.model.path == model
    assert settings.publish.endpoints == ["ipc:///run/edged/detections.sock"]
    # Every value in the example equals the default, so the file documents the defaults.
    data = tomllib.loads(EXAMPLE.read_text())
    defaults = Settings.model_validate({"model": {"path": str(model)}})
    for section, values in data.items():
        for key, value in values.items():
            if section == "model" and key == "path":
                continue
            actual = getattr(getattr(defaults, section), key)
            if section == "runtime" and key == "providers":
                assert [p.name for p in actual] == [p["name"] for p in value]
                continue
            assert actual == (type(actual)(value) if isinstance(actual, tuple) else value) or (str(actual) == str(value)), (
                section,
                key,
            )


def _write(tmp_path: Path, text: str) -> Path:
    (tmp_path / "m.onnx").write_bytes(b"x")
    path = tmp_path / "edged.toml"
    path.write_text(text)
    return path


def test_relative_paths_are_relative_to_the_config_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _write(tmp_path, '[model]\npath = "m.onnx"\n')
    monkeypatch.chdir("/")
    assert load_config(path).model.path == tmp_path / "m.onnx"


def test_environment_overrides_nested_keys_and_keeps_the_rest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _write(tmp_path, '[model]\npath = "m.onnx"\nconf = 0.3\n[source]\ntype = "synthetic"\nfps = 3\n')
    monkeypatch.setenv("EDGED_MODEL__CONF", "0.6")
    monkeypatch.setenv("EDGED_SOURCE__FPS", "12")
    settings = load_config(path)
    assert settings.model.conf == 0.6 and settings.model.path == tmp_path / "m.onnx"
    assert isinstance(settings.source, SyntheticSourceConfig) and settings.source.fps == 12


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ('[model]\npath = "m.onnx"\n[sorce]\ntype = "file"\n', "sorce: Extra inputs are not permitted"),
        ('[model]\npath = "m.onnx"\n[source]\ntype = "usb"\n', "source.type must be one of"),
        ('[model]\npath = "m.onnx"\n[source]\ntype = "file"\n', "source.path: Field required"),
        ('[model]\npath = "m.onnx"\n[source]\ntype = "file"\npath = "gone.mp4"\n', "source.path: video file"),
        ('[model]\npath = "m.onnx"\nstd = [1, 0, 1]\n', "model.std: Value error, std values must be non-zero"),
        ('[model]\npath = "m.onnx"\n[publish]\nendpoints = ["udp://x:1"]\n', "must start with tcp:// or ipc://"),
        (
            '[model]\npath = "m.onnx"\n[source]\ntype = "synthetic"\ncamera_id = "a b"\n',
            "source.camera_id: String should match",
        ),
        ('[model]\npath = "m.onnx"\n[source]\nfps = 3\n', "set source.type to one of"),
        ("[source]\n", "model: Field required"),
        ('[model]\npath = "m.onnx"\nlabels = "nope.txt"\n', "model.labels: labels file"),
        ('[model]\npath = "m.onnx"\n[thermal]\nwarm_c = 80\ncritical_c = 70\n', "thermal.critical_c"),
    ],
)
def test_problems_name_their_key(tmp_path: Path, text: str, problem: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(_write(tmp_path, text))
    assert any(problem in p for p in info.value.problems), info.value.problems


def test_a_wrong_source_type_lists_every_registered_kind(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(_write(tmp_path, '[model]\npath = "m.onnx"\n[source]\ntype = "usb"\n'))
    assert any(f"source.type must be one of {', '.join(SOURCES)}" in p for p in info.value.problems), info.value.problems
