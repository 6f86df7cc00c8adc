"""The ORT engine: IOBinding into preallocated buffers, provider fallback, placement, caches."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from onnx_models import colour_probe, dynamic_probe

from edged.config import ProviderConfig, RuntimeConfig
from edged.engine import HAS_ASSIGNMENT_RECORD, Engine, resolve_providers
from edged.errors import ContractError, ModelError


@pytest.fixture
def probe(tmp_path: Path) -> Path:
    return colour_probe(tmp_path / "probe.onnx")


def test_outputs_land_in_the_bound_buffers(probe: Path) -> None:
    engine = Engine(probe, RuntimeConfig())
    tensor = np.zeros((1, 3, 64, 64), np.float32)
    binding = engine.bind(tensor)
    buffer = binding.outputs[0]
    tensor[0, 0] = 1.0  # red everywhere: the new input is read without rebinding
    binding.run()
    assert binding.outputs[0] is buffer
    assert buffer[0, 4, 0] == pytest.approx(1.0) and buffer[0, 5, 0] == pytest.approx(0.0)
    tensor[0, 0], tensor[0, 2] = 0.0, 0.5
    binding.run()
    assert buffer[0, 4, 0] == pytest.approx(0.0) and buffer[0, 5, 0] == pytest.approx(0.5)


@pytest.mark.parametrize(
    ("spinning", "allow", "stop"),
    [("off", "0", None), ("during-run", "1", "1"), ("always", "1", None), (False, "0", None), (True, "1", None)],
)
def test_spinning_settings_reach_the_session(probe: Path, spinning: object, allow: str, stop: str | None) -> None:
    # Read back from the live session's options; true/false are the settings' older spelling.
    options = Engine(probe, RuntimeConfig(spinning=spinning)).session.get_session_options()  # type: ignore[arg-type]
    assert options.get_session_config_entry("session.intra_op.allow_spinning") == allow
    assert options.get_session_config_entry("session.inter_op.allow_spinning") == allow
    if stop is None:
        with pytest.raises(RuntimeError, match="does not have configuration"):
            options.get_session_config_entry("session.force_spinning_stop")
    else:
        assert options.get_session_config_entry("session.force_spinning_stop") == stop


def test_dynamic_batch_is_pinned_to_one(tmp_path: Path) -> None:
    engine = Engine(colour_probe(tmp_path / "dyn.onnx", batch="batch"), RuntimeConfig())
    assert engine.input_meta[0].shape == [1, 3, 64, 64]


@pytest.mark.parametrize(
    ("imgsz", "metadata", "shape"),
    [
        ((96, 128), {}, [1, 3, 96, 128]),  # model.imgsz, [h, w]
        (None, {"imgsz": "[64, 96]"}, [1, 3, 64, 96]),  # the size it was exported at
        ((32, 32), {"imgsz": "[64, 96]"}, [1, 3, 32, 32]),  # the config wins
    ],
)
def test_a_dynamic_export_is_pinned_to_batch_1_and_the_input_size(
    tmp_path: Path,
    imgsz: tuple[int, int] | None,
    metadata: dict[str, str],
    shape: list[int],
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO):
        engine = Engine(dynamic_probe(tmp_path / "dyn.onnx", metadata=metadata), RuntimeConfig(), imgsz=imgsz)
    assert engine.input_meta[0].shape == shape
    assert f"batch=1, height={shape[2]}, width={shape[3]}" in caplog.text
    tensor = np.zeros(shape, np.float32)
    tensor[0, 0] = 1.0
    binding = engine.bind(tensor)
    binding.run()
    assert binding.outputs[0][0, 4, 0] == pytest.approx(1.0)


def test_a_dynamic_export_of_unknown_size_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ContractError, match=r"set model\.imgsz") as info:
        Engine(dynamic_probe(tmp_path / "dyn.onnx"), RuntimeConfig())
    assert info.value.exit_code == 78


def test_the_cache_holds_the_unpinned_graph_and_each_start_pins_it(tmp_path: Path) -> None:
    cache = tmp_path / "dyn.opt.onnx"
    model = dynamic_probe(tmp_path / "dyn.onnx")
    Engine(model, RuntimeConfig(optimized_model_path=cache), imgsz=(64, 64))
    assert cache.is_file()
    engine = Engine(model, RuntimeConfig(optimized_model_path=cache), imgsz=(32, 96))
    assert engine.input_meta[0].shape == [1, 3, 32, 96]


def test_missing_provider_falls_back_with_a_warning(probe: Path, caplog: pytest.LogCaptureFixture) -> None:
    cfg = RuntimeConfig(
        providers=[ProviderConfig(name="NoSuchExecutionProvider"), ProviderConfig(name="CPUExecutionProvider")]
    )
    with caplog.at_level(logging.WARNING):
        engine = Engine(probe, cfg)
    assert engine.provider == "CPUExecutionProvider"
    assert "NoSuchExecutionProvider is not in this onnxruntime build" in caplog.text


def test_cpu_always_ends_the_provider_list() -> None:
    chosen, warnings = resolve_providers(
        [ProviderConfig(name="CUDAExecutionProvider", options={"device_id": 0})], ["CPUExecutionProvider"]
    )
    assert chosen == [("CPUExecutionProvider", {})]
    assert len(warnings) == 1 and "CUDAExecutionProvider" in warnings[0]


def test_placement_comes_from_ort_assignment_record_or_else_its_profile(probe: Path) -> None:
    """On onnxruntime 1.26 and later the assignment record; before it (scripts/test-floor) the profile."""
    engine = Engine(probe, RuntimeConfig(), record_placement=True)
    engine.bind(np.zeros((1, 3, 64, 64), np.float32)).run()
    placement = engine.placement()
    assert set(placement.nodes) == {"CPUExecutionProvider"}
    assert placement.nodes["CPUExecutionProvider"] >= 3
    if HAS_ASSIGNMENT_RECORD:
        assert "assignment record" in placement.basis
    else:
        assert f"onnxruntime {ort.__version__} keeps no assignment record" in placement.basis


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"not a model at all", "onnxruntime cannot load"),  # garbage
        (b"", "onnxruntime cannot load"),  # empty file
    ],
)
def test_corrupt_model_is_a_model_error(tmp_path: Path, content: bytes, message: str) -> None:
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(content)
    with pytest.raises(ModelError, match=message):
        Engine(bad, RuntimeConfig())


def test_truncated_model_is_a_model_error(tmp_path: Path, probe: Path) -> None:
    truncated = tmp_path / "truncated.onnx"
    truncated.write_bytes(probe.read_bytes()[: probe.stat().st_size // 2])
    with pytest.raises(ModelError):
        Engine(truncated, RuntimeConfig())


def test_optimised_model_cache_is_written_then_used(probe: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cache = tmp_path / "cache" / "probe.opt.onnx"
    cache.parent.mkdir()
    cfg = RuntimeConfig(optimized_model_path=cache)
    with caplog.at_level(logging.INFO):
        Engine(probe, cfg)
    assert cache.is_file()
    stamp = json.loads(cache.with_name(cache.name + ".json").read_text())
    assert stamp["onnxruntime"] == ort.__version__
    caplog.clear()
    with caplog.at_level(logging.INFO):
        engine = Engine(probe, cfg)
    assert "loading optimised model from cache" in caplog.text
    tensor = np.zeros((1, 3, 64, 64), np.float32)
    engine.bind(tensor).run()  # the cached graph runs

    other = colour_probe(tmp_path / "other.onnx", size=32)  # a different model: the cache is stale
    caplog.clear()
    with caplog.at_level(logging.INFO):
        Engine(other, cfg)
    assert "missing or stale" in caplog.text
