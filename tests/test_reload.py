"""SIGHUP's replacement: a good config and model, or an error that leaves the running ones alone."""

from __future__ import annotations

from pathlib import Path

import pytest
from daemon import write_config
from onnx_models import colour_probe

from edged.config import load_config
from edged.errors import ConfigError, ModelError
from edged.reload import load_replacement


def _config(path: Path, model: Path, **publish: object) -> Path:
    sections: dict[str, dict[str, object]] = {
        "source": {"type": "synthetic"},
        "model": {"path": str(model)},
        "publish": {"endpoints": ["tcp://127.0.0.1:5999"], **publish},
    }
    return write_config(path, sections)


def test_a_good_config_comes_back_with_its_model_loaded(tmp_path: Path) -> None:
    probe = colour_probe(tmp_path / "probe.onnx")
    path = _config(tmp_path / "edged.toml", probe)
    running = load_config(path)
    _config(path, probe, hwm=64).write_text(path.read_text().replace("[model]", "[model]\nconf = 0.9"))
    new, model = load_replacement(path, running)
    assert new.model.conf == 0.9 and model.cfg.conf == 0.9
    assert new.publish == running.publish  # the bound socket cannot change: the running settings stay


def test_a_bad_config_or_model_raises_for_the_daemon_to_keep_what_runs(tmp_path: Path) -> None:
    probe = colour_probe(tmp_path / "probe.onnx")
    path = _config(tmp_path / "edged.toml", probe)
    running = load_config(path)
    path.write_text(path.read_text().replace("[model]", "[model]\nconff = 0.9"))
    with pytest.raises(ConfigError, match="conff"):
        load_replacement(path, running)
    broken = tmp_path / "broken.onnx"
    broken.write_bytes(b"not a model")
    _config(path, broken)
    with pytest.raises(ModelError):
        load_replacement(path, running)
