"""The ORT engine: IOBinding into preallocated buffers, provider fallback, placement, caches."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
from pathlib import Path

import cv2
import numpy as np
import onnxruntime as ort
import pytest
from daemon import free_port, run_cli, served_and_stopped, write_config
from filesystems import fill, read_only_folder, tmpfs
from onnx_models import PROBE_BOX, colour_probe, damage_on_disk, dynamic_probe, probe_box, solid_frame

import edged.engine as engine_module
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


@pytest.mark.parametrize("disk", ["full", "read-only"])
def test_placement_from_a_profile_the_temp_folder_cannot_hold_is_said_unknown(
    probe: Path, tmp_path: Path, disk: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before 1.26 (scripts/test-floor) `edged check` reads the placement from ORT's profile in the temp
    folder: before, a full one ended it in a traceback (the profile cut short), a read-only one too."""
    monkeypatch.setattr(engine_module, "HAS_ASSIGNMENT_RECORD", False)
    folder, why = tmp_path / "tmp", "(cut short; 0 bytes free there)"
    with contextlib.ExitStack() as stack:
        if disk == "read-only":
            why = f"({os.strerror(stack.enter_context(read_only_folder(folder)))})"
        else:
            if not stack.enter_context(tmpfs(folder, "size=64k")):
                pytest.skip("a small tmpfs needs root and mount")
            fill(folder / "filler")
        monkeypatch.setattr(tempfile, "tempdir", str(folder))  # the temp folder, as TMPDIR or /tmp would be
        engine = Engine(probe, RuntimeConfig(), record_placement=True)
        assert probe_box(engine) == PROBE_BOX
        (line,) = [value for label, value in engine.report() if label == "placement"]
        assert line.startswith("not known: ") and str(folder) in line and line.endswith(why), line


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


@pytest.mark.parametrize("damage", ["cut short", "zeros"])
def test_a_cache_damaged_on_the_disk_is_rebuilt_never_run(
    probe: Path, tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Its stamp is intact: only the digest it records tells. Before, the cut one stopped the daemon with
    exit 78, and the one with zeros was run: boxes of size 0."""
    cache = tmp_path / "probe.opt.onnx"
    cfg = RuntimeConfig(optimized_model_path=cache)
    Engine(probe, cfg)
    damage_on_disk(cache, damage)
    with caplog.at_level(logging.WARNING):
        engine = Engine(probe, cfg)
    assert probe_box(engine) == PROBE_BOX
    assert [r.getMessage() for r in caplog.records] == [
        f"optimised-model cache {cache} is not what {cache}.json says was written (cut short or damaged, as by "
        "a power cut): rebuilding it"
    ]
    caplog.clear()
    with caplog.at_level(logging.INFO):
        again = Engine(probe, cfg)  # rebuilt whole: loaded, and right
    assert f"loading optimised model from cache {cache}" in caplog.text
    assert probe_box(again) == PROBE_BOX


def _unwritable(where: str, folder: Path) -> tuple[Path, str]:
    """A cache path in ``folder`` that cannot be written as ``where`` says, and the reason the warning gives."""
    if where == "full":
        fill(folder / "filler")
        return folder / "probe.opt.onnx", "onnxruntime could not save it: "
    if where == "no folder":
        return folder / "gone" / "probe.opt.onnx", "(No such file or directory)"
    if where == "a file for its folder":
        (folder / "file").write_text("")
        return folder / "file" / "probe.opt.onnx", "(Not a directory)"
    (folder / "probe.opt.onnx").mkdir()  # a folder for the cache
    return folder / "probe.opt.onnx", "(Is a directory)"


@pytest.mark.parametrize("where", ["full", "read-only", "no folder", "a file for its folder", "a folder for the cache"])
def test_a_cache_that_cannot_be_written_is_said_once_and_the_model_served(
    probe: Path, tmp_path: Path, where: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Before, each stopped the daemon with exit 78, as if the model were broken."""
    folder = tmp_path / "cache"
    with contextlib.ExitStack() as stack:
        if where == "read-only":
            code = stack.enter_context(read_only_folder(folder))
            cache, why = folder / "probe.opt.onnx", f"({os.strerror(code)})"
        else:
            if where == "full" and not stack.enter_context(tmpfs(folder, "size=64k")):
                pytest.skip("a small tmpfs needs root and mount")
            folder.mkdir(exist_ok=True)
            cache, why = _unwritable(where, folder)
        with caplog.at_level(logging.WARNING):
            engine = Engine(probe, RuntimeConfig(optimized_model_path=cache))
        assert probe_box(engine) == PROBE_BOX
        (warning,) = [r.getMessage() for r in caplog.records]
        assert warning.startswith(f"cannot write the optimised-model cache runtime.optimized_model_path {cache} ")
        assert why in warning and warning.endswith("the model is served without it, and optimised again at the next start")
        assert not [p for p in folder.rglob(".*part*")]  # nothing half written left behind


def test_half_written_files_a_power_cut_left_beside_the_cache_are_removed(probe: Path, tmp_path: Path) -> None:
    cache = tmp_path / "probe.opt.onnx"
    left = [tmp_path / ".probe.opt.123-abcdef01.part.onnx", tmp_path / ".probe.opt.onnx.123-abcdef01.part.json"]
    for path in left:
        path.write_bytes(b"\0" * 100)
    Engine(probe, RuntimeConfig(optimized_model_path=cache))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["probe.onnx", "probe.opt.onnx", "probe.opt.onnx.json"]


def _daemon_config(tmp_path: Path, cache: Path, endpoint: str) -> Path:
    (tmp_path / "imgs").mkdir()
    cv2.imwrite(str(tmp_path / "imgs" / "red.png"), solid_frame((0, 0, 255)))
    return write_config(
        tmp_path / "edged.toml",
        {
            "source": {"type": "images", "path": str(tmp_path / "imgs"), "fps": 20.0, "loop": True},
            "model": {"path": str(tmp_path / "probe.onnx")},
            "runtime": {"optimized_model_path": str(cache)},
            "publish": {"endpoints": [endpoint], "status_interval_s": 0.5},
            "thermal": {"enabled": False},
        },
    )


@pytest.mark.integration
@pytest.mark.parametrize("fault", ["full", "read-only", "zeros"])
def test_the_daemon_serves_the_model_whatever_its_cache_disk_does(probe: Path, tmp_path: Path, fault: str) -> None:
    """`edged check` and `edged run` on a cache that cannot be written, or was damaged: one warning, and the
    model's own boxes. Before, the first two exited 78 and the third published boxes of size 0."""
    folder = tmp_path / "cache"
    with contextlib.ExitStack() as stack:
        if fault == "read-only":
            stack.enter_context(read_only_folder(folder))
        elif fault == "full":
            if not stack.enter_context(tmpfs(folder, "size=64k")):
                pytest.skip("a small tmpfs needs root and mount")
            fill(folder / "filler")
        else:
            folder.mkdir()
            Engine(probe, RuntimeConfig(optimized_model_path=folder / "probe.opt.onnx"))
            cache = folder / "probe.opt.onnx"
            damage_on_disk(cache, "zeros")
        endpoint = f"tcp://127.0.0.1:{free_port()}"
        config = _daemon_config(tmp_path, folder / "probe.opt.onnx", endpoint)
        if fault != "zeros":  # check rebuilds a damaged cache: the daemon would find it whole
            checked = run_cli("check", "--config", str(config), "--no-bind", timeout=120)
            assert checked.returncode == 0, checked.stderr
            assert checked.stderr.count("runtime.optimized_model_path") == 1, checked.stderr
        found, log = served_and_stopped(config, endpoint)
        assert found == [("red", (48.0, 20.0, 80.0, 44.0))], log
        said = "is not what" if fault == "zeros" else "cannot write the optimised-model cache"
        assert log.count(said) == 1 and log.count("WARNING") == 1, log
