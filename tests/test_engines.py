"""The engine registry: every model.engine has a module, each imported only when configured; ORT's precisions."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path
from typing import get_args

import pytest
from onnx_models import colour_probe

from edged.config import EngineName, ModelConfig, RuntimeConfig, load_config
from edged.engines import ENGINES, QUANTISED_OPERATORS, SEARCH_PART_BYTES, is_quantised, open_engine
from edged.errors import EXIT_CONFIG, ConfigError
from edged.model import load_model


def test_every_engine_setting_has_a_module_with_an_opener() -> None:
    assert set(ENGINES) == set(get_args(EngineName))
    assert callable(importlib.import_module(ENGINES["onnxruntime"]).open_engine)


def test_onnxruntime_is_the_default_and_reports_its_providers(tmp_path: Path) -> None:
    engine = open_engine(ModelConfig(path=colour_probe(tmp_path / "probe.onnx")), RuntimeConfig(), record_placement=True)
    assert engine.precision == "f32" and engine.provider == "CPUExecutionProvider"
    lines = dict(engine.report())
    assert lines["engine"].startswith("onnxruntime ") and lines["providers"] == "requested: CPUExecutionProvider"
    assert [list(o.shape) for o in engine.output_meta] == [[1, 6, 8]]


@pytest.mark.parametrize("precision", ["bf16", "f16"])
def test_onnxruntime_refuses_a_precision_only_openvino_computes_in(precision: str, tmp_path: Path) -> None:
    path = tmp_path / "edged.toml"
    path.write_text(f'[model]\npath = "probe.onnx"\nprecision = "{precision}"\n')
    colour_probe(tmp_path / "probe.onnx")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert "needs model.engine = 'openvino'; onnxruntime runs f32 or int8" in str(info.value)


def test_a_device_is_openvinos_setting(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"model\.device chooses OpenVINO's device"):
        ModelConfig(path=tmp_path / "m.onnx", device="GPU")


def test_a_float_model_is_not_quantised_and_its_precision_is_f32(tmp_path: Path) -> None:
    path = colour_probe(tmp_path / "probe.onnx")
    assert not is_quantised(path)
    assert load_model(ModelConfig(path=path), RuntimeConfig()).engine.precision == "f32"


@pytest.mark.integration
def test_openvino_configured_but_not_installed_exits_78_saying_what_to_install(tmp_path: Path) -> None:
    colour_probe(tmp_path / "probe.onnx")
    config = tmp_path / "edged.toml"
    config.write_text('[model]\npath = "probe.onnx"\nengine = "openvino"\n[thermal]\nenabled = false\n')
    # The package made unimportable, as on a board without the extra.
    script = "import sys; sys.modules['openvino'] = None; from edged.cli import main; sys.exit(main(sys.argv[1:]))"
    result = subprocess.run(
        [sys.executable, "-c", script, "run", "--config", str(config)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == EXIT_CONFIG, result.stderr
    assert 'model.engine = "openvino" needs the openvino package' in result.stderr
    assert "sudo pip --python /usr/lib/edged/venv/bin/python install 'openvino>=2024.0'" in result.stderr


def test_a_quantised_operator_is_found_wherever_it_lies_even_across_two_parts_of_the_search() -> None:
    # The search goes a part at a time, so that a large model's does not hold the loop up for long.
    size = 2 * SEARCH_PART_BYTES + 100
    assert not is_quantised(bytes(size))
    for name in QUANTISED_OPERATORS:
        for at in (0, SEARCH_PART_BYTES - len(name) + 1, SEARCH_PART_BYTES - 1, size - len(name)):
            data = bytearray(size)
            data[at : at + len(name)] = name
            assert is_quantised(bytes(data)), (name, at)
