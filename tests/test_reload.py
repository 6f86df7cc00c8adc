"""SIGHUP's replacement: a good config and model, or an error that leaves the running ones alone."""

from __future__ import annotations

import gc
import logging
import re
import signal
import threading
import time
import urllib.error
import urllib.request
import weakref
from pathlib import Path

import pytest
from daemon import RunningDaemon, free_port, rss_kb, write_config
from filesystems import opening_stalled
from onnx_models import colour_probe, failing_probe, solid_frame
from waiting import wait_for

from edged.config import ModelConfig, ProviderConfig, RuntimeConfig, Settings, load_config
from edged.errors import ConfigError, ModelError
from edged.model import LoadedModel, load_model
from edged.pipeline import Processed, Rejected
from edged.reload import (
    Fallback,
    Loading,
    Reloads,
    Replacement,
    changes,
    dropped_after,
    load_replacement,
)
from edged.shadow import Shadow
from edged.sources.base import Frame

TASKS = Path(__file__).parent / "data" / "tasks"


def _config(path: Path, model: Path, **publish: object) -> Path:
    sections: dict[str, dict[str, object]] = {
        "source": {"type": "synthetic"},
        "model": {"path": str(model)},
        "publish": {"endpoints": ["tcp://127.0.0.1:5999"], **publish},
    }
    return write_config(path, sections)


def _stuck_after(settings: Settings, seconds: float) -> Settings:
    """``settings`` with a load counted as stuck after ``seconds`` (``service.load_stuck_s``)."""
    return settings.model_copy(update={"service": settings.service.model_copy(update={"load_stuck_s": seconds})})


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


def test_a_changed_capture_priority_is_said_to_need_a_restart_and_the_running_one_kept(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    probe = colour_probe(tmp_path / "probe.onnx")
    path = _config(tmp_path / "edged.toml", probe)
    running = load_config(path)
    path.write_text(f"{path.read_text()}[runtime]\ncapture_priority = 'idle'\n")
    with caplog.at_level(logging.WARNING, logger="edged.reload"):
        replacement = load_replacement(path, running)
    assert "runtime.capture_priority changed: restart edged to apply it" in caplog.text
    assert replacement.settings.runtime.capture_priority == running.runtime.capture_priority == "low"


def test_a_bad_config_or_model_raises_for_the_daemon_to_keep_what_runs(tmp_path: Path) -> None:
    probe = colour_probe(tmp_path / "probe.onnx")
    path = _config(tmp_path / "edged.toml", probe)
    running = load_config(path)
    path.write_text(path.read_text().replace("[model]", "[model]\nconff = 0.9"))
    with pytest.raises(ConfigError, match="conff"):
        load_replacement(path, running)
    broken = tmp_path / "broken.onnx"
    broken.write_bytes(b"not a model")
    _config(path, broken).write_text(f"{path.read_text()}[evidence]\ndir = {str(tmp_path / 'evidence')!r}\n")
    with pytest.raises(ModelError):
        load_replacement(path, running)
    assert not (tmp_path / "evidence").exists()  # made to compare the cameras' folders, and removed: refused


def _loaded(loading: Loading, wake: threading.Event) -> Replacement | str | None:
    assert wake.wait(60), "the load never said it ended"
    return loading.outcome()


def _next(reloads: Reloads, sighup: threading.Event, running: Settings) -> Replacement | Fallback | str:
    """The loop's turns until the reloads give it something: a replacement, a fallback, or why a reload is refused."""
    got: list[Replacement | Fallback | str] = []

    def turn() -> bool:
        if (outcome := reloads.take(sighup, running)) is not None:
            got.append(outcome)
        return bool(got)

    assert wait_for(turn, timeout_s=60), "the reloads gave nothing"
    return got[0]


def _dropped(reloads: Reloads, sighup: threading.Event, running: Settings, caplog: pytest.LogCaptureFixture) -> int:
    """A turn of the loop with no SIGHUP pending, which gives it nothing: how many loads given up have ended."""
    assert reloads.take(sighup, running) is None
    return caplog.text.count(": dropped\n")


def _reload_threads() -> int:
    return sum(t.name == "edged-reload" for t in threading.enumerate())


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


def test_a_reload_still_loading_after_a_while_is_said_once_with_the_file_it_reads(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Promote and rollback are refused until it ends, and a SIGHUP then loads in its place: the log says so.
    path = _config(tmp_path / "edged.toml", colour_probe(tmp_path / "probe.onnx"))
    running, wake, sighup = _stuck_after(load_config(path), 0.1), threading.Event(), threading.Event()
    reloads = Reloads(path, wake, lambda: None, requests=False, trial_for=lambda s, m: None)
    caplog.set_level(logging.WARNING, logger="edged.reload")
    with opening_stalled(path) as waiting:
        sighup.set()
        assert reloads.take(sighup, running) is None
        assert wait_for(waiting, timeout_s=20)
        assert wait_for(lambda: reloads.take(sighup, running) is None and "has been loading" in caplog.text, 20)
        assert reloads.take(sighup, running) is None and reloads.loading
    said = rf"has been loading for \d+ s, at configuration {re.escape(str(path))} \(a file on a slow or stalled disk\?\)"
    assert re.search(said, caplog.text)
    assert "promote and rollback are refused until it ends; a SIGHUP now loads the configuration again" in caplog.text
    assert isinstance(_next(reloads, sighup, running), Replacement) and caplog.text.count("has been loading") == 1
    caplog.clear()
    in_time = Reloads(path, wake, lambda: None, requests=False, trial_for=lambda s, m: None)
    sighup.set()
    assert isinstance(_next(in_time, sighup, running), Replacement) and not caplog.text


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


def test_a_sighup_while_a_load_is_stuck_loads_in_its_place_and_the_stuck_one_is_dropped_if_it_ends(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A model file on a hung disk: the SIGHUP that points model.path at a good file waited behind it for ever.
    stuck, good = colour_probe(tmp_path / "stuck.onnx"), colour_probe(tmp_path / "good.onnx")
    path = _config(tmp_path / "edged.toml", good)
    running, told = _stuck_after(load_config(path), 1.0), []
    wake, sighup = threading.Event(), threading.Event()
    reloads = Reloads(path, wake, lambda: told.append("RELOADING=1"), requests=False, trial_for=lambda s, m: None)
    _config(path, stuck).write_text(f"{path.read_text()}[evidence]\ndir = {str(tmp_path / 'evidence')!r}\n")
    caplog.set_level(logging.INFO, logger="edged.reload")
    with opening_stalled(stuck) as waiting:
        sighup.set()
        assert reloads.take(sighup, running) is None and reloads.loading
        assert wait_for(waiting, timeout_s=20)
        _config(path, good)
        sighup.set()
        loaded = _next(reloads, sighup, running)
        assert isinstance(loaded, Replacement) and loaded.settings.model.path == good
        assert re.search(rf"the reload has not ended after \d+ s, at model {re.escape(str(stuck))} \(a stalled", caplog.text)
        assert told == ["RELOADING=1"] * 2 and not reloads.loading and not sighup.is_set()
    assert wait_for(lambda: _dropped(reloads, sighup, running, caplog) == 1, timeout_s=60)  # never tried
    assert f"the reload given up at model {stuck} has ended after" in caplog.text and ", loaded: dropped" in caplog.text
    assert not (tmp_path / "evidence").exists()  # made for the load dropped, and removed with it
    assert not reloads.loading and wait_for(lambda: _reload_threads() == 0, timeout_s=10)


def test_a_sighup_while_the_load_given_up_and_the_one_after_it_are_both_stuck_is_refused_saying_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Reload pressed again and again on a hung disk: two loads stuck at most, never one more a press.
    first, second = colour_probe(tmp_path / "first.onnx"), colour_probe(tmp_path / "second.onnx")
    good = colour_probe(tmp_path / "good.onnx")
    path = _config(tmp_path / "edged.toml", good)
    running, told = _stuck_after(load_config(path), 1.0), []
    wake, sighup = threading.Event(), threading.Event()
    reloads = Reloads(path, wake, lambda: told.append("RELOADING=1"), requests=False, trial_for=lambda s, m: None)
    caplog.set_level(logging.INFO, logger="edged.reload")
    with opening_stalled(second) as second_waits:
        with opening_stalled(first) as first_waits:
            _config(path, first)
            sighup.set()
            assert reloads.take(sighup, running) is None
            assert wait_for(first_waits, timeout_s=20)
            _config(path, second)
            sighup.set()
            assert wait_for(lambda: reloads.take(sighup, running) is None and not sighup.is_set(), timeout_s=20)
            assert wait_for(second_waits, timeout_s=20) and reloads.loading and told == ["RELOADING=1"] * 2
            either = f"the load given up before it, at model {first}, has not ended either: a SIGHUP is refused"
            assert wait_for(lambda: reloads.take(sighup, running) is None and either in caplog.text, timeout_s=20)
            _config(path, good)
            for _ in range(50):
                sighup.set()
                refused = _next(reloads, sighup, running)
                assert isinstance(refused, str) and not sighup.is_set()
            assert isinstance(refused, str) and re.search(
                rf"the load under way has not ended after \d+ s, at model {re.escape(str(second))}, nor", refused
            )
            assert f"at model {first} (a stalled disk?): one load is given up at a time" in refused
            assert _reload_threads() == 2 and told == ["RELOADING=1"] * 2
        # The first ends: its outcome is dropped, and a SIGHUP may give up the second in its turn.
        assert wait_for(lambda: _dropped(reloads, sighup, running, caplog) == 1, timeout_s=60)
        sighup.set()
        loaded = _next(reloads, sighup, running)
        assert isinstance(loaded, Replacement) and loaded.settings.model.path == good
        assert re.search(rf"the reload has not ended after \d+ s, at model {re.escape(str(second))}", caplog.text)
    assert wait_for(lambda: _dropped(reloads, sighup, running, caplog) == 2, timeout_s=60)
    assert not reloads.loading and wait_for(lambda: _reload_threads() == 0, timeout_s=10)


def test_a_reload_stuck_on_its_candidates_file_gives_way_the_same(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # The candidate loads with the reload's model, on its thread (`edged.candidate`): stuck alike, given up alike.
    probe, candidate = colour_probe(tmp_path / "probe.onnx"), colour_probe(tmp_path / "candidate.onnx")
    path = _config(tmp_path / "edged.toml", probe)
    plain = path.read_text()
    running, wake, sighup = _stuck_after(load_config(path), 0.5), threading.Event(), threading.Event()

    def trial_for(settings: Settings, live: LoadedModel) -> Shadow | None:
        cfg = settings.model.candidate
        return Shadow(settings, cfg, live) if cfg is not None else None

    reloads = Reloads(path, wake, lambda: None, requests=False, trial_for=trial_for)
    caplog.set_level(logging.INFO, logger="edged.reload")
    path.write_text(f"{plain}[model.candidate]\npath = {str(candidate)!r}\ncontrol = 'ipc://{tmp_path}/c.sock'\n")
    with opening_stalled(candidate) as waiting:
        sighup.set()
        assert reloads.take(sighup, running) is None
        assert wait_for(waiting, timeout_s=20)
        path.write_text(plain)  # the candidate taken out, to go on without it
        sighup.set()
        loaded = _next(reloads, sighup, running)
        assert isinstance(loaded, Replacement) and loaded.settings.model.candidate is None and loaded.shadow is None
        at = rf"the reload has not ended after \d+ s, at candidate model {re.escape(str(candidate))} \(a stalled disk"
        assert re.search(at, caplog.text)
    assert wait_for(lambda: _dropped(reloads, sighup, running, caplog) == 1, timeout_s=60)


def test_the_daemon_loads_a_sighup_in_place_of_a_reload_stuck_on_its_model_and_stops_at_once(tmp_path: Path) -> None:
    """A reload's model file on a hung disk, then a SIGHUP pointing model.path at a good file: the good one
    loads once the stuck one has gone on for ``service.load_stuck_s``, takes over and is published; the stuck one
    is never tried, and SIGTERM while it is stuck exits 0 at once."""
    stuck_s = 3.0
    if int(Path("/proc/sys/fs/lease-break-time").read_text()) < stuck_s + 10:
        pytest.skip("the kernel gives up a file lease before a load counts as stuck: no stuck load to be had")
    running = colour_probe(tmp_path / "running.onnx")
    stuck = colour_probe(tmp_path / "stuck.onnx", metadata={"version": "stuck"})
    good = colour_probe(tmp_path / "good.onnx", metadata={"version": "good"})
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    config = write_config(
        tmp_path / "edged.toml",
        {
            "source": {"type": "synthetic", "fps": 10.0},
            "model": {"path": str(running)},
            "publish": {"endpoints": [endpoint], "status_interval_s": 0.5},
            "thermal": {"enabled": False},
            "service": {"load_stuck_s": stuck_s},
        },
    )
    d = RunningDaemon(config, endpoint)
    try:
        d.collect("detections", 2)
        config.write_text(config.read_text().replace(str(running), str(stuck)))
        with opening_stalled(stuck) as waiting:
            d.signal(signal.SIGHUP)
            assert wait_for(waiting, timeout_s=20), d.log()
            config.write_text(config.read_text().replace(str(stuck), str(good)))
            d.signal(signal.SIGHUP)
            assert wait_for(lambda: "reloaded: model good@" in d.log(), timeout_s=stuck_s + 30), d.log()
            assert {m.model.name for m in d.captured_after(time.time_ns(), 3)} == {"good"}
            said = re.search(rf"the reload has not ended after \d+ s, at model {re.escape(str(stuck))}", d.log())
            assert said is not None and "loaded model stuck@" not in d.log(), d.log()
            assert d.stop(timeout=10) == 0, d.log_path.read_text()
        assert "Traceback" not in d.log_path.read_text()
    finally:
        d.close()


def _healthz(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as e:
        return e.code


def test_a_reload_applies_the_stall_timeout_and_the_log_level(tmp_path: Path) -> None:
    """``service.stall_timeout_s`` and ``service.log_level`` were read once at start: a reload that changed
    only them was taken, said as a change, and ignored until a restart. A camera at 2 fps is healthy under a
    10 s timeout and not under 0.2 s; logging at warning hides the reload's own lines, at info shows them."""
    probe = colour_probe(tmp_path / "probe.onnx")
    endpoint, port = f"tcp://127.0.0.1:{free_port()}", free_port()
    sections: dict[str, dict[str, object]] = {
        "source": {"type": "synthetic", "fps": 2.0, "width": 320, "height": 240},
        "model": {"path": str(probe)},
        "publish": {"endpoints": [endpoint], "status_interval_s": 0.5},
        "thermal": {"enabled": False},
        "http": {"listen": f"127.0.0.1:{port}"},
        "service": {"log_level": "warning", "stall_timeout_s": 10.0},
    }
    config = write_config(tmp_path / "edged.toml", sections)
    d = RunningDaemon(config, endpoint)
    try:
        d.collect("detections", 2)
        assert _healthz(port) == 200
        write_config(config, {**sections, "service": {"log_level": "warning", "stall_timeout_s": 0.2}})
        d.signal(signal.SIGHUP)
        assert wait_for(lambda: _healthz(port) == 503, timeout_s=20), d.log()
        assert "reloaded: model" not in d.log()  # at warning
        write_config(config, {**sections, "service": {"log_level": "info", "stall_timeout_s": 10.0}})
        d.signal(signal.SIGHUP)
        assert wait_for(lambda: "reloaded: model" in d.log(), timeout_s=20), d.log()
        assert "WARNING edged.service: service.log_level: logging at info from now on" in d.log()
        assert wait_for(lambda: _healthz(port) == 200, timeout_s=5), d.log()
        assert d.stop(timeout=10) == 0, d.log_path.read_text()
    finally:
        d.close()


PROVIDERS = [{"name": "AzureExecutionProvider"}, {"name": "CPUExecutionProvider"}]  # Azure takes no node: CPU runs


def _two_providers(tmp_path: Path, model: Path) -> tuple[Path, Settings, LoadedModel]:
    """A configuration whose model runs with two providers, the settings and the model it serves."""
    path = write_config(
        tmp_path / "edged.toml",
        {
            "source": {"type": "synthetic"},
            "model": {"path": str(model)},
            "publish": {"endpoints": ["tcp://127.0.0.1:5999"]},
            "runtime": {"providers": PROVIDERS},
        },
    )
    running = load_config(path)
    return path, running, load_model(running.model, running.runtime, lanes=running.lanes())


def _fallback_threads() -> int:
    return sum(t.name == "edged-provider-fallback" for t in threading.enumerate())


def test_a_fallback_loads_off_the_loops_thread_and_failures_meanwhile_start_no_second_load(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Loaded on the loop's thread, a fallback whose model file stalled held the loop for as long:
    # no frame, no watchdog ping, until systemd killed edged with nothing in the log to say why.
    model = colour_probe(tmp_path / "probe.onnx")
    path, running, live = _two_providers(tmp_path, model)
    assert live.engine.provider == "AzureExecutionProvider"
    wake, sighup = threading.Event(), threading.Event()
    reloads = Reloads(path, wake, lambda: None, requests=False, trial_for=lambda s, m: None)
    caplog.set_level(logging.INFO, logger="edged.reload")
    with opening_stalled(model) as waiting:
        assert reloads.fall_back(running, live, running.source, 20)  # returns while the file is held
        assert wait_for(waiting, timeout_s=20)
        for failures in range(21, 60):  # the frames keep failing while it loads: carry on, load nothing more
            assert reloads.take(sighup, running) is None and reloads.fall_back(running, live, running.source, failures)
        assert _fallback_threads() == 1 and not reloads.loading  # a fallback is no reload: READY=1 is not held back
        said = "inference failed on 20 frames in a row with AzureExecutionProvider: loading model probe@"
        assert caplog.text.count(said) == 1 and "falling back" not in caplog.text
    fallback = _next(reloads, sighup, running)
    assert isinstance(fallback, Fallback) and fallback.replaces() is live
    assert fallback.swap.model.engine.provider == "CPUExecutionProvider"
    assert [p.name for p in fallback.settings.runtime.providers] == ["CPUExecutionProvider"]
    assert fallback.settings.model == running.model and set(fallback.swap.paths) == {"cam0"}
    assert fallback.takes_over(live)
    assert "with AzureExecutionProvider: falling back to CPUExecutionProvider" in caplog.text
    assert not fallback.takes_over(fallback.swap.model)  # a promotion or reload replaced it meanwhile: dropped
    assert "the fallback from AzureExecutionProvider has loaded, but model probe@" in caplog.text
    assert wait_for(lambda: _fallback_threads() == 0, timeout_s=10)


def test_a_sighup_during_a_fallback_waits_for_it_and_loads_once_the_fallback_is_taken(tmp_path: Path) -> None:
    model = colour_probe(tmp_path / "probe.onnx")
    path, running, live = _two_providers(tmp_path, model)
    wake, sighup, told = threading.Event(), threading.Event(), []
    reloads = Reloads(path, wake, lambda: told.append("RELOADING=1"), requests=False, trial_for=lambda s, m: None)
    with opening_stalled(model) as waiting:
        assert reloads.fall_back(running, live, running.source, 20)
        assert wait_for(waiting, timeout_s=20)
        sighup.set()
        assert reloads.take(sighup, running) is None and sighup.is_set() and not told  # one load at a time
    fallback = _next(reloads, sighup, running)  # the fallback first: frames are failing now
    assert isinstance(fallback, Fallback) and reloads.takes_over(fallback, live)
    reloaded = _next(reloads, sighup, fallback.settings)
    assert isinstance(reloaded, Replacement) and told == ["RELOADING=1"] and not sighup.is_set()
    assert [p.name for p in reloaded.settings.runtime.providers] == ["CPUExecutionProvider"]  # the providers it left


def test_a_fallback_due_while_a_reload_loads_waits_for_it_then_loads(tmp_path: Path) -> None:
    running_model, reloaded_model = colour_probe(tmp_path / "running.onnx"), colour_probe(tmp_path / "reloaded.onnx")
    path, running, live = _two_providers(tmp_path, running_model)
    path.write_text(path.read_text().replace(str(running_model), str(reloaded_model)))
    wake, sighup = threading.Event(), threading.Event()
    reloads = Reloads(path, wake, lambda: None, requests=False, trial_for=lambda s, m: None)
    with opening_stalled(reloaded_model) as waiting:
        sighup.set()
        assert reloads.take(sighup, running) is None and reloads.loading
        assert wait_for(waiting, timeout_s=20)
        assert reloads.fall_back(running, live, running.source, 20)  # the loop goes on, and waits for the reload
        assert _fallback_threads() == 0 and reloads.loading
    assert isinstance(_next(reloads, sighup, running), Replacement)  # tried on a frame; refused, say
    assert reloads.fall_back(running, live, running.source, 25)  # its turn now
    fallback = _next(reloads, sighup, running)
    assert isinstance(fallback, Fallback) and fallback.swap.model.engine.provider == "CPUExecutionProvider"


def _reloaded(path: Path, reloads: Reloads, running: Settings, *, take_over: bool = True) -> Replacement:
    """A SIGHUP's replacement, loaded; switched in (`Reloads.took_over`) unless its trial is to refuse it."""
    sighup = threading.Event()
    sighup.set()
    reloaded = _next(reloads, sighup, running)
    assert isinstance(reloaded, Replacement), reloaded
    if take_over:
        reloads.took_over(reloaded)
    return reloaded


def test_a_provider_a_fallback_dropped_stays_dropped_across_reloads_until_runtime_providers_change(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A SIGHUP loaded the configuration's providers again, the failing one first: its trial frame
    # failed there and the reload was refused, so no threshold or zone could change until a restart.
    model = colour_probe(tmp_path / "probe.onnx")
    path, running, live = _two_providers(tmp_path, model)
    configured = path.read_text()
    wake, sighup = threading.Event(), threading.Event()
    candidates: list[list[str]] = []  # the providers each reload's candidate loads with

    def trial_for(settings: Settings, model: LoadedModel) -> None:
        candidates.append([p.name for p in settings.runtime.providers])

    reloads = Reloads(path, wake, lambda: None, requests=False, trial_for=trial_for)
    caplog.set_level(logging.INFO, logger="edged.reload")
    assert reloads.fall_back(running, live, running.source, 20)
    fallback = _next(reloads, sighup, running)
    assert isinstance(fallback, Fallback) and reloads.takes_over(fallback, live)
    said = (
        "runtime.providers unchanged: AzureExecutionProvider stays dropped after inference failed on it, the model "
        "loads on CPUExecutionProvider; restart edged, or change runtime.providers, to try it again"
    )
    assert said not in caplog.text

    path.write_text(configured.replace("[model]\n", "[model]\nconf = 0.9\n"))  # a threshold changed
    threshold = _reloaded(path, reloads, fallback.settings)
    assert threshold.model.engine.provider == "CPUExecutionProvider" and threshold.settings.model.conf == 0.9
    assert [p.name for p in threshold.settings.runtime.providers] == ["CPUExecutionProvider"]
    assert candidates == [["CPUExecutionProvider"]]  # the candidate's trial loads on what is left too
    assert caplog.text.count(said) == 1
    assert changes(fallback.settings, threshold.settings) == "cameras kept cam0; changed model.conf"

    only_azure = configured.replace(', { "name" = "CPUExecutionProvider" }', "")
    assert only_azure != configured
    path.write_text(only_azure)  # the operator's choice: loaded as given, and tried on a frame
    chosen = _reloaded(path, reloads, threshold.settings, take_over=False)  # refused on its trial, say
    assert chosen.model.engine.provider == "AzureExecutionProvider" and chosen.dropped is None
    path.write_text(configured)  # the configuration's providers when Azure was dropped: it stays dropped
    back = _reloaded(path, reloads, threshold.settings)
    assert back.model.engine.provider == "CPUExecutionProvider" and caplog.text.count(said) == 2

    path.write_text(only_azure)
    chosen = _reloaded(path, reloads, back.settings)  # switched in this time: nothing stays dropped
    assert chosen.model.engine.provider == "AzureExecutionProvider"
    path.write_text(configured)  # a change of runtime.providers too
    again = _reloaded(path, reloads, chosen.settings)
    assert again.model.engine.provider == "AzureExecutionProvider" and caplog.text.count(said) == 2
    assert candidates[-1] == ["AzureExecutionProvider", "CPUExecutionProvider"]


def test_a_fallback_that_does_not_take_over_drops_no_provider_and_frees_the_model_it_replaces(
    tmp_path: Path,
) -> None:
    model = colour_probe(tmp_path / "probe.onnx")
    path, running, live = _two_providers(tmp_path, model)
    wake, sighup = threading.Event(), threading.Event()
    reloads = Reloads(path, wake, lambda: None, requests=False, trial_for=lambda s, m: None)
    assert reloads.fall_back(running, live, running.source, 20)
    fallback = _next(reloads, sighup, running)
    assert isinstance(fallback, Fallback)
    promoted = load_model(running.model, running.runtime)  # a promotion replaced the model meanwhile
    assert not reloads.takes_over(fallback, promoted)
    assert _reloaded(path, reloads, running).model.engine.provider == "AzureExecutionProvider"
    # Held weakly, the model a fallback replaces is freed as it is swapped out, before
    # `give_back_freed_memory` returns its memory: the fallback does not keep its sessions.
    assert wait_for(lambda: _fallback_threads() == 0, timeout_s=10)
    replaced = weakref.ref(live)
    del live
    gc.collect()
    assert replaced() is None and fallback.replaces() is None


def test_what_fallbacks_in_turn_drop_adds_up_against_the_configurations_providers() -> None:
    def runtime(*names: str) -> RuntimeConfig:
        return RuntimeConfig(providers=[ProviderConfig(name=name) for name in names])

    configured = runtime("TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider")
    first = dropped_after(
        None, configured, "TensorrtExecutionProvider", runtime("CUDAExecutionProvider", "CPUExecutionProvider")
    )
    second = dropped_after(
        first,
        runtime("CUDAExecutionProvider", "CPUExecutionProvider"),
        "CUDAExecutionProvider",
        runtime("CPUExecutionProvider"),
    )
    assert second.configured == configured.providers and second.names == (
        "TensorrtExecutionProvider",
        "CUDAExecutionProvider",
    )
    kept = second.kept(configured.model_copy(update={"intra_op_threads": 2}))  # another runtime key changed: kept
    assert kept is not None and [p.name for p in kept.providers] == ["CPUExecutionProvider"] and kept.intra_op_threads == 2
    assert second.kept(runtime("CUDAExecutionProvider", "CPUExecutionProvider")) is None  # the list changed


def test_a_fallback_that_cannot_load_is_said_and_stops_the_loop_as_one_with_no_provider_left(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = colour_probe(tmp_path / "probe.onnx")
    path, running, live = _two_providers(tmp_path, model)
    wake, sighup = threading.Event(), threading.Event()
    reloads = Reloads(path, wake, lambda: None, requests=False, trial_for=lambda s, m: None)
    model.write_bytes(b"not a model any more")
    caplog.set_level(logging.INFO, logger="edged.reload")
    assert reloads.fall_back(running, live, running.source, 20)
    stopped: list[bool] = []

    def turn() -> bool:  # what the loop does each turn while the frames keep failing
        assert reloads.take(sighup, running) is None
        if not reloads.fall_back(running, live, running.source, 21):
            stopped.append(True)
        return bool(stopped)

    assert wait_for(turn, timeout_s=60)
    assert caplog.text.count("cannot fall back from AzureExecutionProvider: ") == 1 and "falling back" not in caplog.text
    assert reloads.take(sighup, running) is None  # the next turn
    alone = load_model(ModelConfig(path=colour_probe(tmp_path / "alone.onnx")), RuntimeConfig())
    assert not reloads.fall_back(running, alone, running.source, 20)  # CPU alone: nothing to fall back to
    assert caplog.text.count("to fall back to it") == 1 and not reloads.loading  # nor does it load anything


def test_a_fallback_stuck_on_its_model_file_is_said_stops_the_loop_if_frames_keep_failing_and_a_sighup_gives_it_up(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = colour_probe(tmp_path / "probe.onnx")
    path, running, live = _two_providers(tmp_path, model)
    running = _stuck_after(running, 0.5)
    wake, sighup = threading.Event(), threading.Event()
    reloads = Reloads(path, wake, lambda: None, requests=False, trial_for=lambda s, m: None)
    caplog.set_level(logging.INFO, logger="edged.reload")
    other = colour_probe(tmp_path / "other.onnx")
    with opening_stalled(model) as waiting:
        assert reloads.fall_back(running, live, running.source, 20)
        assert wait_for(waiting, timeout_s=20)
        stuck = "the provider fallback has been loading for"
        assert wait_for(lambda: reloads.take(sighup, running) is None and stuck in caplog.text, timeout_s=20)
        assert f"at model {model} (a file on a slow or stalled disk?): edged stops if inference keeps failing" in caplog.text
        assert not reloads.fall_back(running, live, running.source, 40)  # inference still failing: stop
        path.write_text(path.read_text().replace(str(model), str(other)))
        sighup.set()
        reloaded = _next(reloads, sighup, running)
        assert isinstance(reloaded, Replacement) and reloaded.settings.model.path == other
        assert re.search(rf"the provider fallback has not ended after \d+ s, at model {re.escape(str(model))}", caplog.text)
    assert wait_for(lambda: _dropped(reloads, sighup, running, caplog) == 1, timeout_s=60)
    assert f"the provider fallback given up at model {model} has ended after" in caplog.text
    assert wait_for(lambda: _fallback_threads() == 0, timeout_s=10)


DEMO = Path(__file__).parent.parent / "models" / "demo.onnx"


def test_reloads_give_back_the_memory_their_replaced_models_freed(tmp_path: Path) -> None:
    """The demo model with a candidate, reloaded eight times: glibc kept what each replaced pair of
    sessions freed in the loader's arena, and the process grew 60-80 MB over the first reloads
    (to a plateau); given back after each switch, it grows some 20 MB."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    config = write_config(
        tmp_path / "edged.toml",
        {
            "source": {"type": "synthetic", "width": 1280, "height": 720, "fps": 30.0},
            "model": {"path": str(DEMO), "candidate": {"path": str(DEMO), "control": f"ipc://{tmp_path}/control"}},
            "publish": {"endpoints": [endpoint]},
            "thermal": {"enabled": False},
        },
    )
    d = RunningDaemon(config, endpoint)
    try:
        d.collect("detections", 5)
        before_kb = rss_kb(d.proc.pid)
        for n in range(1, 9):
            d.signal(signal.SIGHUP)
            assert wait_for(lambda n=n: d.log().count("reloaded: model") >= n, timeout_s=60), d.log()
        d.captured_after(time.time_ns(), 5)
        grown_mb = (rss_kb(d.proc.pid) - before_kb) / 1024
        assert grown_mb < 45, f"{grown_mb:.0f} MB more after 8 reloads"
    finally:
        d.close()


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


def test_a_reload_to_a_region_the_cameras_frames_cannot_hold_fails_its_trial_with_the_reason(tmp_path: Path) -> None:
    # Before: every frame was rejected as unfit, and the reload stayed on trial for good.
    path = write_config(
        tmp_path / "edged.toml",
        {
            "source": {"type": "synthetic"},
            "model": {"path": str(TASKS / "cls.onnx")},
            "inspect": {"ng_classes": ["crack"], "roi": [40, 30, 220, 200]},
            "publish": {"endpoints": ["tcp://127.0.0.1:5999"]},
        },
    )
    reason = load_replacement(path, load_config(path)).trial("cam0", _frame((0, 0, 0)))
    assert isinstance(reason, str) and "inspect.roi [40, 30, 220, 200] does not fit in a 128x96 frame" in reason


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
