"""SIGHUP's replacement: a good config and model, or an error that leaves the running ones alone."""

from __future__ import annotations

import gc
import logging
import threading
import weakref
from pathlib import Path

import pytest
from daemon import write_config
from filesystems import opening_stalled
from onnx_models import colour_probe, failing_probe, solid_frame
from waiting import wait_for

from edged.config import Settings, load_config
from edged.errors import ConfigError, ModelError
from edged.model import LoadedModel
from edged.pipeline import Processed, Rejected
from edged.reload import Loading, Reloads, Replacement, changes, load_replacement
from edged.sources.base import Frame


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
    replacement = load_replacement(path, running)
    assert replacement.settings.model.conf == 0.9 and replacement.model.cfg.conf == 0.9
    assert replacement.settings.publish == running.publish  # the bound socket cannot change: the running settings stay


def test_a_moved_control_socket_is_said_to_need_a_restart_and_the_bound_one_kept(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    probe = colour_probe(tmp_path / "probe.onnx")
    path = _config(tmp_path / "edged.toml", probe)
    text = path.read_text()
    path.write_text(f"{text}[model.candidate]\npath = {str(probe)!r}\ncontrol = 'ipc://{tmp_path}/a.sock'\n")
    running = load_config(path)
    path.write_text(f"{text}[model.candidate]\npath = {str(probe)!r}\ncontrol = 'ipc://{tmp_path}/b.sock'\n")
    with caplog.at_level(logging.WARNING, logger="edged.reload"):
        replacement = load_replacement(path, running)
    assert "model.candidate.control changed: restart edged to apply it" in caplog.text
    assert replacement.settings.model.candidate == running.model.candidate


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


def _loaded(loading: Loading, wake: threading.Event) -> Replacement | str | None:
    assert wake.wait(60), "the load never said it ended"
    return loading.outcome()


def test_a_reload_loads_on_its_own_thread_and_says_when_it_ends_loaded_or_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    probe = colour_probe(tmp_path / "probe.onnx")
    path = _config(tmp_path / "edged.toml", probe)
    running = load_config(path)
    loops: list[threading.Thread] = []

    def candidate(settings: Settings, live: LoadedModel) -> None:
        loops.append(threading.current_thread())

    wake = threading.Event()
    loaded = _loaded(Loading(path, running, wake, requests=False, trial_for=candidate), wake)
    assert isinstance(loaded, Replacement) and loaded.settings.model.path == probe
    assert loops and loops[0] is not threading.main_thread()  # the candidate's trial loads there too
    path.write_text(path.read_text().replace("[model]", "[model]\nconff = 0.9"))
    wake.clear()
    refused = _loaded(Loading(path, running, wake, requests=False, trial_for=candidate), wake)
    assert isinstance(refused, str) and "conff" in refused

    def faulty(settings: Settings, live: LoadedModel) -> None:
        raise ZeroDivisionError("division by zero")

    _config(path, probe)
    wake.clear()
    with caplog.at_level(logging.ERROR, logger="edged.reload"):
        fault = _loaded(Loading(path, running, wake, requests=False, trial_for=faulty), wake)
    assert fault == "unexpected ZeroDivisionError: division by zero"
    assert "reload failed" in caplog.text and "Traceback" in caplog.text  # an error of edged's own, said whole


def test_a_reload_still_loading_after_a_while_is_said(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # The reloads after it wait for it, and promote and rollback are refused: the log says why.
    path = _config(tmp_path / "edged.toml", colour_probe(tmp_path / "probe.onnx"))
    running, wake = load_config(path), threading.Event()
    with caplog.at_level(logging.WARNING, logger="edged.reload"), opening_stalled(path) as waiting:
        loading = Loading(path, running, wake, requests=False, trial_for=lambda s, m: None, warn_after_s=0.1)
        assert wait_for(waiting, timeout_s=20)
        assert wait_for(lambda: "has been loading for 0 s" in caplog.text, timeout_s=20)
        assert loading.outcome() is None
    assert isinstance(_loaded(loading, wake), Replacement)
    caplog.clear()
    _loaded(Loading(path, running, wake, requests=False, trial_for=lambda s, m: None, warn_after_s=0.5), wake)
    timer = threading.Timer  # the warning's: gone with the load
    assert wait_for(lambda: not any(isinstance(t, timer) for t in threading.enumerate()), timeout_s=10)
    assert "has been loading" not in caplog.text


def test_a_load_taken_and_dropped_is_freed_at_once_with_its_models(tmp_path: Path) -> None:
    # A timer holding a method of the load made a cycle: each model a reload replaced stayed in
    # memory (100 MB apiece for a large one) until the garbage collector came round.
    path = _config(tmp_path / "edged.toml", colour_probe(tmp_path / "probe.onnx"))
    running, wake = load_config(path), threading.Event()
    gc.disable()
    try:
        loading = Loading(path, running, wake, requests=False, trial_for=lambda s, m: None)
        assert isinstance(_loaded(loading, wake), Replacement)
        gone = weakref.ref(loading)
        del loading
        assert wait_for(lambda: gone() is None, timeout_s=10)  # once its thread and timer have ended
    finally:
        gc.enable()


def test_a_sighup_while_a_reload_loads_waits_for_it_then_loads_the_newest_configuration(tmp_path: Path) -> None:
    probe = colour_probe(tmp_path / "probe.onnx")
    path = _config(tmp_path / "edged.toml", probe)
    running, told = load_config(path), []
    wake, sighup = threading.Event(), threading.Event()
    reloads = Reloads(path, wake, lambda: told.append("RELOADING=1"), requests=False, trial_for=lambda s, m: None)
    assert reloads.take(sighup, running) is None and not reloads.loading  # no SIGHUP, nothing to load
    with opening_stalled(probe) as waiting:  # the first load has read the configuration, and waits on its model
        sighup.set()
        assert reloads.take(sighup, running) is None and reloads.loading and not sighup.is_set()
        assert wait_for(waiting, timeout_s=20)
        path.write_text(path.read_text().replace("[model]", "[model]\nconf = 0.9"))
        sighup.set()
        assert reloads.take(sighup, running) is None and reloads.loading and sighup.is_set()  # one load at a time
        assert told == ["RELOADING=1"]
    taken: list[Replacement] = []
    while len(taken) < 2:
        if (got := reloads.take(sighup, running)) is None:
            assert wake.wait(60), "a load never said it ended"
            wake.clear()
        else:
            assert isinstance(got, Replacement)
            taken.append(got)
    assert [r.settings.model.conf for r in taken] == [running.model.conf, 0.9]  # each in turn, the newest last
    assert told == ["RELOADING=1"] * 2 and not reloads.loading and not sighup.is_set()


def _frame(bgr: tuple[int, int, int], frame_id: int = 7) -> Frame:
    return Frame(solid_frame(bgr), frame_id, 0, 0, "bgr")


def test_the_trial_runs_the_new_model_and_its_plan_on_the_frame(tmp_path: Path) -> None:
    path = _config(tmp_path / "edged.toml", colour_probe(tmp_path / "probe.onnx"))
    replacement = load_replacement(path, load_config(path))
    outcome = replacement.trial("cam0", _frame((0, 0, 255)))
    assert isinstance(outcome, Processed) and outcome.frame.frame_id == 7
    assert outcome.plan.model is replacement.model and len(outcome.result) == 1


def test_a_model_that_loads_but_fails_on_the_frame_fails_its_trial_with_the_reason(tmp_path: Path) -> None:
    path = _config(tmp_path / "edged.toml", failing_probe(tmp_path / "always.onnx", brighter_than=-1.0))
    reason = load_replacement(path, load_config(path)).trial("cam0", _frame((0, 0, 0)))
    assert isinstance(reason, str) and "fails on its first run" in reason  # the plan's warm-up
    _config(path, failing_probe(tmp_path / "bright.onnx"))
    replacement = load_replacement(path, load_config(path))
    assert isinstance(replacement.trial("cam0", _frame((0, 0, 0))), Processed)
    reason = replacement.trial("cam0", _frame((255, 255, 255)))  # warm-up passed, this frame's run fails
    assert isinstance(reason, str) and reason.startswith("inference failed: ")


def test_an_unfit_frame_leaves_the_trial_to_the_next_frame(tmp_path: Path) -> None:
    path = _config(tmp_path / "edged.toml", colour_probe(tmp_path / "probe.onnx"))
    replacement = load_replacement(path, load_config(path))
    assert isinstance(replacement.trial("cam0", _frame((0, 0, 255))), Processed)
    outcome = replacement.trial("cam0", Frame(solid_frame((0, 0, 255)), 8, 0, 0, "rgb"))  # the source said bgr
    assert isinstance(outcome, Rejected) and outcome.reason.startswith("bad_frame_")


def test_what_a_reload_changes_is_said_by_camera_and_key_never_by_value(tmp_path: Path) -> None:
    probe = colour_probe(tmp_path / "probe.onnx")

    def settings(sources: list[dict[str, object]], conf: float) -> Settings:
        path = write_config(tmp_path / "edged.toml", {"source": sources, "model": {"path": str(probe), "conf": conf}})
        return load_config(path)

    top, side = {"type": "synthetic", "camera_id": "top"}, {"type": "synthetic", "camera_id": "side"}
    running = settings([top, side], 0.25)
    new = settings([{**top, "fps": 5.0}, {"type": "synthetic", "camera_id": "back"}], 0.5)
    assert changes(running, new) == "cameras kept top; added back; removed side; changed model.conf, source.top.fps"
    assert changes(running, running) == "cameras kept top, side; no other setting changed"
    assert "0.5" not in changes(running, new)
