"""Settings: the example file documents every key, env overrides, paths, and error reporting."""

from __future__ import annotations

import codecs
import logging
import math
import os
import re
from pathlib import Path
from typing import get_args

import pytest
from daemon import run_cli
from filesystems import no_descriptor_left
from pydantic import BaseModel

from edged.config import (  # TOML read as edged reads it, on every Python it supports
    Settings,
    load_config,
    tomllib,
)
from edged.errors import ConfigError, EdgedError
from edged.keys import create_key_pair
from edged.settings.endpoints import ours_to_make
from edged.settings.sources import KINDS, FileSourceConfig, ImagesSourceConfig, SourceBase, SyntheticSourceConfig

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
        key = re.match(r"^#?\s*([a-z][a-z0-9_]*)\s*=", line)
        if key:
            keys.add(f"{section}.{key.group(1)}")
    return keys


def test_example_config_documents_every_key() -> None:
    documented = _documented(EXAMPLE.read_text())
    expected = _keys(Settings) - {"source", "model", "runtime", "publish", "thermal", "service"}
    expected |= {"runtime.providers.name", "runtime.providers.options"}
    expected -= {"runtime.providers"}
    for config in KINDS.values():
        expected |= {f"source.{name}" for name in config.model_fields}
    missing = expected - documented
    assert not missing, f"config/edged.toml does not document: {sorted(missing)}"


def test_example_config_is_valid_as_shipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = tmp_path / "demo.onnx"
    model.write_bytes(b"x")
    monkeypatch.setenv("EDGED_MODEL__PATH", str(model))
    settings = load_config(EXAMPLE)
    assert settings.source[0].type == "synthetic" and settings.model.path == model
    assert settings.publish.endpoints == ["ipc:///run/edged/detections.sock"]
    # Every value in the example equals the default, so the file documents the defaults.
    data = tomllib.loads(EXAMPLE.read_text())
    defaults = Settings.model_validate({"model": {"path": str(model)}})
    for section, values in data.items():
        for key, value in values.items():
            if section == "model" and key == "path":
                continue
            actual = getattr(defaults.source[0] if section == "source" else getattr(defaults, section), key)
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


def test_a_missing_file_named_by_a_relative_path_says_where_it_was_read_from(tmp_path: Path) -> None:
    # The demo's configuration copied to another folder: its ../models paths found nothing there.
    (tmp_path / "x").mkdir()
    path = _write(tmp_path / "x", '[model]\npath = "../models/m.onnx"\n[source]\ntype = "file"\npath = "/gone.mp4"\n')
    with pytest.raises(ConfigError) as e:
        load_config(path)
    said = f'("../models/m.onnx" in the configuration file is read from its folder, {tmp_path / "x"})'
    assert e.value.problems[0] == f"model.path: model file {tmp_path / 'models' / 'm.onnx'} does not exist {said}"
    assert e.value.problems[1] == "source.path: video file /gone.mp4 does not exist"  # absolute: nothing to add


def test_environment_overrides_nested_keys_and_keeps_the_rest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _write(tmp_path, '[model]\npath = "m.onnx"\nconf = 0.3\n[source]\ntype = "synthetic"\nfps = 3\n')
    monkeypatch.setenv("EDGED_MODEL__CONF", "0.6")
    monkeypatch.setenv("EDGED_SOURCE__FPS", "12")
    settings = load_config(path)
    assert settings.model.conf == 0.6 and settings.model.path == tmp_path / "m.onnx"
    assert isinstance(settings.source[0], SyntheticSourceConfig) and settings.source[0].fps == 12


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ('[model]\npath = "m.onnx"\n[sorce]\ntype = "file"\n', "sorce: Extra inputs are not permitted"),
        ('[model]\npath = "m.onnx"\n[source]\ntype = "usb"\n', "source.type must be one of"),
        ('[model]\npath = "m.onnx"\n[source]\ntype = "file"\n', "source.path: Field required"),
        ('[model]\npath = "m.onnx"\n[source]\ntype = "file"\npath = "gone.mp4"\n', "source.path: video file"),
        ('[model]\npath = "m.onnx"\nstd = [1, 0, 1]\n', "model.std: Value error, std values must be non-zero"),
        ('[model]\npath = "m.onnx"\n[publish]\nendpoints = ["udp://x:1"]\n', "must start with tcp:// or ipc://"),
        *(  # libzmq refused these at bind (exit 1), or bound another port than the one written (99999 % 65536)
            (f'[model]\npath = "m.onnx"\n[publish]\nendpoints = ["{ep}"]\n', f"publish.endpoints: Value error, '{ep}' has")
            for ep in ("tcp://127.0.0.1", "tcp://127.0.0.1:99999", "tcp://127.0.0.1:!", "tcp://127.0.0.1:²")
        ),
        ('[model]\npath = "m.onnx"\n[trigger]\nendpoint = "ipc://*"\n', "trigger.endpoint: Value error, 'ipc://*' names"),
        ('[model]\npath = "m.onnx"\n[model.candidate]\npath = "m.onnx"\ncontrol = "ipc://*"\n', "'ipc://*' names no path"),
        (
            '[model]\npath = "m.onnx"\n[source]\ntype = "synthetic"\ncamera_id = "a b"\n',
            "source.camera_id: String should match",
        ),
        *(
            (f'[model]\npath = "m.onnx"\n[source]\ntype = "synthetic"\ncamera_id = "{dots}"\n', "must not be only dots")
            for dots in (".", "..")
        ),
        ('[model]\npath = "m.onnx"\n[inspect.zones]\n".." = [[0, 0], [1, 0], [1, 1]]\n', "must not be only dots"),
        ('[model]\npath = "m.onnx"\n[source]\nfps = 3\n', "set source.type to one of"),
        ("[source]\n", "model: Field required"),
        ('[model]\npath = "m.onnx"\nlabels = "nope.txt"\n', "model.labels: labels file"),
        ('[model]\npath = "m.onnx"\n[thermal]\nwarm_c = 80\ncritical_c = 70\n', "thermal.critical_c"),
        ('[model]\npath = "m.onnx"\n[http]\nlisten = "8080"\n', "http.listen: Value error, '8080' is not HOST:PORT"),
        ('[model]\npath = "m.onnx"\n[http]\nlisten = "127.0.0.1:²"\n', "http.listen: Value error, '127.0.0.1:²' is not"),
        ('[model]\npath = "m.onnx"\n[http]\nlisten = "board.local:8080"\n', "is not an IP address or localhost"),
        ('[model]\npath = "m.onnx"\n[http]\nlisten = "0.0.0.0:8080"\n', "http.token_file: Value error, http.listen"),
        ('[model]\npath = "m.onnx"\n[http]\nlisten = "[::]:8080"\n', "is not a loopback address"),
        ('[model]\npath = "m.onnx"\n[http]\nlisten = "0.0.0.0:8080"\ntoken_file = "t"\n', "/t does not exist"),
        *(
            (f'[model]\npath = "m.onnx"\n[http]\nallowed_hosts = ["{host}"]\n', "http.allowed_hosts: Value error")
            for host in ("line3-pi:8080", "http://line3-pi", "", "*.plant1.example")
        ),
    ],
)
def test_problems_name_their_key(tmp_path: Path, text: str, problem: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(_write(tmp_path, text))
    assert any(problem in p for p in info.value.problems), info.value.problems


def test_a_trigger_endpoint_off_loopback_needs_the_curve_keys_or_its_own_insecure(tmp_path: Path) -> None:
    # Anyone who reaches it could trigger inspections and read their verdicts: publish.insecure,
    # which opens the stream, does not open it too.
    for endpoint in ("tcp://0.0.0.0:5557", "tcp://*:5557", "tcp://[::]:5557", "tcp://192.0.2.7:5557"):
        trigger = f'[trigger]\nmode = "request"\nendpoint = "{endpoint}"\n'
        for text in (trigger, trigger + "[publish]\ninsecure = true\n"):
            with pytest.raises(ConfigError) as info:
                load_config(_write(tmp_path, '[model]\npath = "m.onnx"\n' + text))
            [problem] = info.value.problems
            assert problem.startswith(f"trigger: Value error, trigger.endpoint {endpoint!r} is not a loopback"), problem
            assert "set trigger.insecure = true" in problem and "publish.insecure" not in problem, problem
        opted_in = load_config(_write(tmp_path, '[model]\npath = "m.onnx"\n' + trigger + "insecure = true\n"))
        assert opted_in.trigger.insecure and opted_in.trigger.endpoint == endpoint
    for endpoint in ("tcp://127.0.0.1:5557", "tcp://[::1]:5557", "tcp://localhost:5557", "ipc:///run/edged/t.sock"):
        assert load_config(_write(tmp_path, f'[model]\npath = "m.onnx"\n[trigger]\nendpoint = "{endpoint}"\n'))
    create_key_pair(tmp_path, "server")
    (tmp_path / "clients").mkdir()
    keys = '[publish]\ncurve_server_key = "server.key_secret"\ncurve_clients_dir = "clients"\n'
    secured = '[model]\npath = "m.onnx"\n[trigger]\nendpoint = "tcp://0.0.0.0:5557"\n' + keys
    assert not load_config(_write(tmp_path, secured)).trigger.insecure


def test_an_unused_trigger_endpoint_off_loopback_loads_and_a_camera_taking_requests_refuses_it(tmp_path: Path) -> None:
    # Free-running, nothing binds it: edged 0.4.0 ran such a board, and an upgrade exited 78 on it.
    model = '[model]\npath = "m.onnx"\n'
    trigger = '[trigger]\nendpoint = "tcp://0.0.0.0:5557"\n'
    requests = '[trigger]\nmode = "request"\nendpoint = "tcp://0.0.0.0:5557"\n'

    def cameras(top: str, side: str) -> str:
        return "".join(
            f'[[source]]\ntype = "synthetic"\ncamera_id = "{name}"\n' + (f'trigger = "{mode}"\n' if mode else "")
            for name, mode in (("top", top), ("side", side))
        )

    for free in (model + trigger, cameras("", "free") + model + trigger, cameras("free", "free") + model + requests):
        settings = load_config(_write(tmp_path, free))
        assert settings.requesting() == [] and settings.trigger.endpoint == "tcp://0.0.0.0:5557"
    for taking in (model + requests, cameras("", "request") + model + trigger, cameras("free", "") + model + requests):
        with pytest.raises(ConfigError) as info:
            load_config(_write(tmp_path, taking))
        [problem] = info.value.problems
        assert problem.startswith("trigger: Value error, trigger.endpoint 'tcp://0.0.0.0:5557' is not a loopback"), problem


@pytest.mark.integration
def test_plaintext_publish_endpoints_off_loopback_are_refused_at_load_with_exit_78(tmp_path: Path) -> None:
    # `edged check` said ok and `edged run` exited 1 at bind: a restart loop under systemd.
    model = '[model]\npath = "m.onnx"\n'
    for endpoint in ("tcp://0.0.0.0:5556", "tcp://*:5556", "tcp://192.0.2.7:5556"):
        text = f'{model}[publish]\nendpoints = ["ipc:///run/edged/d.sock", "{endpoint}"]\n'
        with pytest.raises(ConfigError) as info:
            load_config(_write(tmp_path, text))
        [problem] = info.value.problems
        assert f"publish.endpoints {endpoint!r} is not a loopback address" in problem, problem
        assert "publish.insecure = true" in problem and "edged keygen" in problem, problem
        assert load_config(_write(tmp_path, text + "insecure = true\n")).publish.insecure
    create_key_pair(tmp_path, "server")
    (tmp_path / "clients").mkdir()
    keys = 'curve_server_key = "server.key_secret"\ncurve_clients_dir = "clients"\n'
    assert load_config(_write(tmp_path, f'{model}[publish]\nendpoints = ["tcp://0.0.0.0:5556"]\n{keys}'))
    check = run_cli("check", "--config", str(_write(tmp_path, f'{model}[publish]\nendpoints = ["tcp://*:5556"]\n')))
    assert check.returncode == 78 and "publish.endpoints" in check.stderr, check.stderr


def test_an_ipc_socket_folder_is_made_only_under_the_runtime_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # edged running as root made /nonexistent/dir for ipc:///nonexistent/dir/t.sock.
    runtime = tmp_path / "run"
    monkeypatch.setenv("RUNTIME_DIRECTORY", str(runtime))
    missing = tmp_path / "nonexistent" / "dir"
    refused = (
        f'[model]\npath = "m.onnx"\n[publish]\nendpoints = ["ipc://{missing}/d.sock"]\n'
        f'[trigger]\nmode = "request"\nendpoint = "ipc://{missing}/t.sock"\n'
    )
    with pytest.raises(ConfigError) as info:
        load_config(_write(tmp_path, refused))
    why = f"the folder {missing} does not exist, and edged makes folders only under its runtime directory ({runtime})"
    assert info.value.problems == [
        f"publish.endpoints: ipc://{missing}/d.sock: {why}: create it, or put the socket there",
        f"trigger.endpoint: ipc://{missing}/t.sock: {why}: create it, or put the socket there",
    ]
    assert not (tmp_path / "nonexistent").exists()
    free_running = refused.replace('mode = "request"', 'mode = "free"')  # nothing binds trigger.endpoint then
    with pytest.raises(ConfigError) as info:
        load_config(_write(tmp_path, free_running))
    assert [p.split(":")[0] for p in info.value.problems] == ["publish.endpoints"]
    escaping = f'[model]\npath = "m.onnx"\n[publish]\nendpoints = ["ipc://{runtime}/../elsewhere/d.sock"]\n'
    with pytest.raises(ConfigError, match="elsewhere does not exist"):
        load_config(_write(tmp_path, escaping))
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ConfigError, match="a-file is not a folder"):
        load_config(
            _write(tmp_path, f'[model]\npath = "m.onnx"\n[publish]\nendpoints = ["ipc://{tmp_path}/a-file/d.sock"]\n')
        )
    with pytest.raises(ConfigError, match="a path cannot hold a NUL character"):
        load_config(_write(tmp_path, '[model]\npath = "m.onnx"\n[publish]\nendpoints = ["ipc:///run/a\\u0000b/d.sock"]\n'))
    ours = refused.replace(str(missing), str(runtime / "line3"))
    assert load_config(_write(tmp_path, ours)).trigger.endpoint == f"ipc://{runtime}/line3/t.sock"
    assert not runtime.exists()  # made when the socket is bound, not when the settings load
    monkeypatch.delenv("RUNTIME_DIRECTORY")
    assert load_config(_write(tmp_path, '[model]\npath = "m.onnx"\n'))  # /run/edged: the default's, edged's own


def test_an_ipc_socket_folder_through_a_loop_of_links_is_not_made_and_no_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RUNTIME_DIRECTORY", str(tmp_path))  # the loop lies in the runtime directory
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    loop = f'[model]\npath = "m.onnx"\n[publish]\nendpoints = ["ipc://{tmp_path}/a/d.sock"]\n'
    assert load_config(_write(tmp_path, loop))  # cannot tell at load: the bind says why
    assert not ours_to_make(tmp_path / "a")  # before, following the loop raised RuntimeError: a traceback at bind


@pytest.mark.parametrize(
    ("source", "reason"),
    [
        ('type = "images"\npath = "."', "OpenCV decodes its frames, and OpenCV always delivers bgr"),
        ('type = "file"\npath = "m.onnx"', "OpenCV decodes its frames"),
        ('type = "rtsp"\nurl = "rtsp://cam.local/s"', "OpenCV decodes its frames"),
        ('type = "v4l2"', "OpenCV decodes its frames"),
        ('type = "synthetic"', "its scenes are rendered in bgr"),
    ],
)
def test_rgb_on_a_source_that_only_delivers_bgr_is_refused_with_the_reason(tmp_path: Path, source: str, reason: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(_write(tmp_path, f'[model]\npath = "m.onnx"\n[source]\n{source}\nchannel_order = "rgb"\n'))
    (problem,) = info.value.problems
    assert problem.startswith("source.channel_order: Value error, 'rgb' cannot be right for source type"), problem
    assert reason in problem and "model.channel_order" in problem


@pytest.mark.parametrize("source", ['type = "gstreamer"\npipeline = "videotestsrc"', 'type = "picamera2"'])
def test_rgb_is_accepted_where_the_source_can_deliver_it(source: str) -> None:
    cfg = next(iter(Settings.model_validate({"model": {"path": "m.onnx"}, "source": tomllib.loads(source)}).source))
    assert cfg.channel_order == "bgr"
    kind = type(cfg)
    assert kind.model_validate({**tomllib.loads(source), "channel_order": "rgb"}).channel_order == "rgb"


def test_a_wrong_source_type_lists_every_registered_kind(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(_write(tmp_path, '[model]\npath = "m.onnx"\n[source]\ntype = "usb"\n'))
    assert any(f"source.type must be one of {', '.join(KINDS)}" in p for p in info.value.problems), info.value.problems


# ---- what is at the config path, and the files it names ------------------------------------------


def test_a_directory_at_the_config_path_is_a_config_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path)
    assert info.value.problems == [f"config file {tmp_path} is a directory, not a file"]


def test_a_fifo_at_the_config_path_is_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "edged.toml"
    os.mkfifo(fifo)  # opening it for reading would wait for a writer forever
    with pytest.raises(ConfigError, match="is not a regular file"):
        load_config(fifo)


def test_arrays_nested_too_deeply_to_read_are_a_config_error(tmp_path: Path) -> None:
    # tomllib reads them by recursion: a RecursionError, a traceback and exit 1 at start.
    path = _write(tmp_path, "a = " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.problems == ["not valid TOML: arrays or tables nested too deeply to read"]


def test_a_config_file_saved_with_a_byte_order_mark_is_read_and_one_in_another_encoding_named(tmp_path: Path) -> None:
    """Windows' Notepad saves UTF-8 with a byte-order mark: tomllib refused it as an "invalid statement
    (at line 1, column 1)", which names nothing to be seen there. UTF-16 and Latin-1 bytes were said
    as a UTF-8 codec's position in the file; now by line and column, with what to do."""
    text = '[model]\npath = "m.onnx"\n[source]\ntype = "synthetic"\ncamera_id = "caf\u00e9"\n'
    path = _write(tmp_path, "")
    path.write_bytes(codecs.BOM_UTF8 + text.replace("\n", "\r\n").replace("caf\u00e9", "cafe").encode())
    assert load_config(path).source[0].camera_id == "cafe"
    for data, problem in (
        (text.encode("utf-16"), "not valid TOML: the file is UTF-16: save it as UTF-8"),
        (
            text.encode("latin-1"),
            "not valid TOML: byte 0xe9 at line 5, column 17 is not UTF-8 (Latin-1 or another encoding?): "
            "save the file as UTF-8",
        ),
    ):
        path.write_bytes(data)
        with pytest.raises(ConfigError) as info:
            load_config(path)
        assert info.value.problems == [problem] and info.value.exit_code == 78


def test_running_out_of_file_descriptors_while_reading_is_no_config_error(tmp_path: Path) -> None:
    """The process's want, not the file's: exit 1, which systemd restarts (78 it never would)."""
    path = _write(tmp_path, '[model]\npath = "m.onnx"\n')
    with no_descriptor_left(), pytest.raises(EdgedError) as info:
        load_config(path)
    assert not isinstance(info.value, ConfigError) and info.value.exit_code == 1
    assert str(info.value).startswith(f"config file {path} cannot be read now: Too many open files (the process is short")


def test_a_config_file_too_big_to_be_one_is_refused_unread(tmp_path: Path) -> None:
    path = tmp_path / "edged.toml"
    with path.open("wb") as f:
        f.truncate(64 << 20)
    with pytest.raises(ConfigError, match="is larger than 1048576 bytes"):
        load_config(path)


def test_a_directory_where_the_model_or_labels_should_be_is_named(tmp_path: Path) -> None:
    (tmp_path / "models").mkdir()
    with pytest.raises(ConfigError) as info:
        load_config(_write(tmp_path, '[model]\npath = "models"\nlabels = "models"\n'))
    assert info.value.problems == [
        f"model.path: model file {tmp_path / 'models'} is a directory, not a file",
        f"model.labels: labels file {tmp_path / 'models'} is a directory, not a file",
    ]


# ---- keys of another camera kind, misspellings ---------------------------------------------------


def test_a_key_of_another_source_type_says_so_and_lists_the_keys_that_apply(tmp_path: Path) -> None:
    (tmp_path / "clip.mp4").write_bytes(b"x")
    text = '[model]\npath = "m.onnx"\n[source]\ntype = "file"\npath = "clip.mp4"\ndevice = "/dev/video0"\n'
    with pytest.raises(ConfigError) as info:
        load_config(_write(tmp_path, text))
    (problem,) = info.value.problems
    keys = ", ".join(KINDS["file"].model_fields)
    assert problem.startswith(
        "source.device: Extra inputs are not permitted (source.device does not apply to source type 'file' "
        f"(it is a key of v4l2); the keys of 'file' are: {keys})"
    ), problem
    assert "spelling" not in problem


def test_a_misspelt_key_names_the_closest_one(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(_write(tmp_path, '[model]\npath = "m.onnx"\nconff = 0.3\n[source]\ntype = "synthetic"\nfsp = 3\n'))
    assert info.value.problems == [
        "source.fsp: Extra inputs are not permitted (unknown key: did you mean fps?); got 3",
        "model.conff: Extra inputs are not permitted (unknown key: did you mean conf?); got 0.3",
    ]


# ---- EDGED_* variables ---------------------------------------------------------------------------


def test_a_bad_value_in_a_variable_names_the_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _write(tmp_path, '[model]\npath = "m.onnx"\nconf = 0.3\n')
    monkeypatch.setenv("EDGED_MODEL__CONF", "abc")
    monkeypatch.setenv("EDGED_RUNTIME__PROVIDERS", '[{"nam": "CPUExecutionProvider"}]')
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert sorted(info.value.problems) == [
        "model.conf: Input should be a valid number, unable to parse string as a number; got 'abc' "
        "(from the environment: EDGED_MODEL__CONF)",
        "runtime.providers.0.nam: Extra inputs are not permitted (unknown key: did you mean name?); "
        "got 'CPUExecutionProvider' (from the environment: EDGED_RUNTIME__PROVIDERS)",
        "runtime.providers.0.name: Field required (required key is missing) "
        "(from the environment: EDGED_RUNTIME__PROVIDERS)",
    ]


def test_a_check_across_sections_names_the_variable_of_either_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The file alone had each socket at a place of its own: without the variable's name the problem
    pointed at a file that did not say it."""
    path = _listening(tmp_path, ["tcp://127.0.0.1:5591"], '[http]\nlisten = "127.0.0.1:5592"\n')
    monkeypatch.setenv("EDGED_PUBLISH__ENDPOINTS", '["tcp://127.0.0.1:5592"]')
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.problems == [
        "http.listen: '127.0.0.1:5592' would listen where publish.endpoints 'tcp://127.0.0.1:5592' does, and could "
        "not bind there: give each its own port (or path) (from the environment: EDGED_PUBLISH__ENDPOINTS)"
    ]


def test_a_missing_file_named_with_a_newline_is_one_line_with_the_newline_shown(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A path given in a variable may hold any character: a line feed in it broke the problem in two
    (found by tests/test_config_properties.py's environment property)."""
    path = _write(tmp_path, '[model]\npath = "m.onnx"\n')
    (tmp_path / "m.onnx").write_bytes(b"not checked here")
    monkeypatch.setenv("EDGED_MODEL__LABELS", "\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.problems == ["model.labels: labels file \\n does not exist"]


def test_a_variable_that_is_not_json_for_a_list_names_the_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _write(tmp_path, '[model]\npath = "m.onnx"\n')
    monkeypatch.setenv("EDGED_MODEL__MEAN", "[1, 2")
    monkeypatch.setenv("EDGED_MODEL__LABELS", "labels.txt")  # a plain string beside it, not at fault
    with pytest.raises(ConfigError) as info:
        load_config(path)
    (problem,) = info.value.problems
    assert problem.startswith("model: EDGED_MODEL__MEAN is not the JSON its key needs: Expecting ',' delimiter"), problem


def test_a_variable_the_file_does_not_set_is_not_blamed_on_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _write(tmp_path, '[model]\npath = "m.onnx"\niou = 7\n')
    monkeypatch.setenv("EDGED_MODEL__CONF", "0.5")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.problems == ["model.iou: Input should be less than or equal to 1; got 7"]


@pytest.mark.parametrize(
    ("name", "closest"),
    [
        ("EDGED_MODLE__CONF", "EDGED_MODEL__CONF"),
        ("EDGED_MODEL_CONF", "EDGED_MODEL__CONF"),
        ("edged_sorce__fps", "EDGED_SOURCE__FPS"),
    ],
)
def test_a_misspelt_variable_is_warned_about_naming_the_closest_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, name: str, closest: str
) -> None:
    path = _write(tmp_path, '[model]\npath = "m.onnx"\n')
    monkeypatch.setenv(name, "0.5")
    with caplog.at_level(logging.WARNING, logger="edged.config"):
        settings = load_config(path)
    assert settings.model.conf == 0.25  # pydantic-settings ignores it: hence the warning
    assert [r.getMessage() for r in caplog.records] == [
        f"environment variable {name} sets nothing: no section {name[6:].split('__')[0].lower()!r}; did you mean {closest}?"
    ]


def test_a_variable_like_nothing_edged_reads_is_warned_about_with_the_naming_rule(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("EDGED_WHEELHOUSE", "/srv/wheels")
    with caplog.at_level(logging.WARNING, logger="edged.config"):
        load_config(_write(tmp_path, '[model]\npath = "m.onnx"\n'))
    assert [r.getMessage() for r in caplog.records] == [
        "environment variable EDGED_WHEELHOUSE sets nothing: no section 'wheelhouse' (variables are EDGED_<SECTION>__<KEY>)"
    ]


def test_http_listens_on_loopback_by_default_and_anywhere_with_a_private_token(tmp_path: Path) -> None:
    assert load_config(_write(tmp_path, '[model]\npath = "m.onnx"\n')).http.listen == "127.0.0.1:8080"
    for listen in ("[::1]:8080", "localhost:8080", "127.0.0.2:9000", ""):
        assert (
            load_config(_write(tmp_path, f'[model]\npath = "m.onnx"\n[http]\nlisten = "{listen}"\n')).http.listen == listen
        )
    token = tmp_path / "http.token"
    token.write_text("short\n")
    token.chmod(0o600)
    text = '[model]\npath = "m.onnx"\n[http]\nlisten = "0.0.0.0:8080"\ntoken_file = "http.token"\n'
    with pytest.raises(ConfigError) as info:
        load_config(_write(tmp_path, text))
    assert "at least 16" in str(info.value)
    token.write_text("0123456789abcdef0123\n")
    token.chmod(0o640)
    with pytest.raises(ConfigError) as info:
        load_config(_write(tmp_path, text))
    assert "too open" in str(info.value) and "chmod 600" in str(info.value)
    token.chmod(0o600)
    assert load_config(_write(tmp_path, text)).http.token_file == token


CAMERAS = """
[model]
path = "m.onnx"
[[source]]
type = "images"
camera_id = "top"
path = "top"
max_fps = 5
[[source]]
type = "file"
camera_id = "side"
path = "side.mp4"
"""


def test_source_tables_are_cameras_with_paths_of_their_own_and_their_own_rate_cap(tmp_path: Path) -> None:
    (tmp_path / "m.onnx").write_bytes(b"x")
    (tmp_path / "top").mkdir()
    (tmp_path / "side.mp4").write_bytes(b"x")
    settings = load_config(_write(tmp_path, CAMERAS + "[service]\nmax_fps = 12\n"))
    top, side = settings.source
    assert (top.camera_id, side.camera_id) == ("top", "side")
    assert isinstance(top, ImagesSourceConfig) and isinstance(side, FileSourceConfig)
    assert (top.path, str(side.path)) == (str(tmp_path / "top"), str(tmp_path / "side.mp4"))
    assert (settings.max_fps(top), settings.max_fps(side)) == (5.0, 12.0)
    assert settings.camera("side") is side and settings.camera("front") is None


def test_a_problem_in_one_of_several_cameras_names_its_table(tmp_path: Path) -> None:
    (tmp_path / "top").mkdir()
    text = CAMERAS.replace('path = "side.mp4"', 'path = "side.mp4"\ndevice = "/dev/video0"')
    with pytest.raises(ConfigError) as info:
        load_config(_write(tmp_path, text))
    assert any(p.startswith("source[1].device: Extra inputs are not permitted") for p in info.value.problems), info.value
    with pytest.raises(ConfigError) as info:
        load_config(_write(tmp_path, CAMERAS))
    assert any("video file" in p and p.endswith("(camera side)") for p in info.value.problems), info.value


def test_duplicate_camera_ids_are_a_config_error_naming_the_id(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(_write(tmp_path, CAMERAS.replace('camera_id = "side"', 'camera_id = "top"')))
    assert info.value.exit_code == 78
    assert info.value.problems == [
        "source: Value error, camera_id 'top' is used by more than one [[source]]: each camera needs its own"
    ]


def test_a_variable_for_one_key_of_several_cameras_is_refused_and_a_json_list_replaces_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "m.onnx").write_bytes(b"x")
    path = _write(tmp_path, CAMERAS)
    monkeypatch.setenv("EDGED_SOURCE__FPS", "3")
    with pytest.raises(ConfigError, match="EDGED_SOURCE__FPS cannot override one key of several"):
        load_config(path)
    monkeypatch.delenv("EDGED_SOURCE__FPS")
    monkeypatch.setenv("EDGED_SOURCE", '[{"type": "synthetic", "camera_id": "a"}, {"type": "synthetic", "camera_id": "b"}]')
    assert [cfg.camera_id for cfg in load_config(path).source] == ["a", "b"]


def test_each_camera_takes_its_own_trigger_mode(tmp_path: Path) -> None:
    (tmp_path / "top").mkdir(exist_ok=True)
    (tmp_path / "side.mp4").write_bytes(b"x")
    both = load_config(_write(tmp_path, CAMERAS + '[trigger]\nmode = "request"\n'))
    assert [both.trigger_mode(cfg) for cfg in both.source] == ["request", "request"]
    side_free = CAMERAS.replace('path = "side.mp4"', 'path = "side.mp4"\ntrigger = "free"') + '[trigger]\nmode = "request"\n'
    mixed = load_config(_write(tmp_path, side_free))
    assert [mixed.trigger_mode(cfg) for cfg in mixed.source] == ["request", "free"]
    top_asks = load_config(_write(tmp_path, CAMERAS.replace("max_fps = 5", 'max_fps = 5\ntrigger = "request"')))
    assert [top_asks.trigger_mode(cfg) for cfg in top_asks.source] == ["request", "free"]
    with pytest.raises(ConfigError, match=r"source\[1\]\.trigger: Input should be 'free' or 'request'"):
        load_config(_write(tmp_path, CAMERAS.replace('path = "side.mp4"', 'path = "side.mp4"\ntrigger = "sometimes"')))


# The top camera's own tables: after a [[source]] table, [source.inspect] and [source.evidence] are its subtables.
TOP_OWN = """
[source.inspect]
class_conf = { red = 0.8 }
ng_classes = ["red"]
[source.evidence]
dir = "top-evidence"
save = "all"
"""


def _cameras(tmp_path: Path, text: str) -> Settings:
    (tmp_path / "top").mkdir(exist_ok=True)
    (tmp_path / "side.mp4").write_bytes(b"x")
    return load_config(_write(tmp_path, text))


def test_a_cameras_own_inspect_and_evidence_keys_replace_those_keys_and_inherit_the_rest(tmp_path: Path) -> None:
    top_level = """
[inspect]
class_conf = { blue = 0.6, red = 0.3 }
outside_zones = "keep"
min_area = { blue = 0.01 }
[evidence]
dir = "evidence"
save = "ng+near"
max_per_minute = 7
"""
    settings = _cameras(tmp_path, CAMERAS.replace("max_fps = 5", "max_fps = 5" + TOP_OWN) + top_level)
    top, side = settings.source
    top_inspect, side_inspect = settings.inspect_for(top), settings.inspect_for(side)
    assert top_inspect is not None and side_inspect is not None
    # A key given replaces that whole key (class_conf has no blue any more); the others come from [inspect].
    assert (top_inspect.class_conf, top_inspect.ng_classes) == ({"red": 0.8}, ["red"])
    assert (top_inspect.outside_zones, top_inspect.min_area) == ("keep", {"blue": 0.01})
    assert side_inspect == settings.inspect
    top_evidence, side_evidence = settings.evidence_for(top), settings.evidence_for(side)
    assert top_evidence is not None and side_evidence is not None
    assert (top_evidence.dir, top_evidence.save, top_evidence.max_per_minute) == (tmp_path / "top-evidence", "all", 7)
    assert (side_evidence.dir, side_evidence.save) == (tmp_path / "evidence", "ng+near")
    off = _cameras(tmp_path, CAMERAS.replace('path = "side.mp4"', 'path = "side.mp4"\nevidence = false') + top_level)
    assert off.evidence_for(off.source[1]) is None and off.evidence_for(off.source[0]) == off.evidence


def test_a_camera_with_its_own_tables_is_inspected_and_saves_evidence_without_the_sections(tmp_path: Path) -> None:
    settings = _cameras(tmp_path, CAMERAS.replace("max_fps = 5", "max_fps = 5" + TOP_OWN))
    top, side = settings.source
    assert settings.inspect is None and settings.evidence is None
    top_inspect, top_evidence = settings.inspect_for(top), settings.evidence_for(top)
    assert top_inspect is not None and top_inspect.class_conf == {"red": 0.8}
    assert top_inspect.outside_zones == "drop"  # the default of every key it does not give
    assert top_evidence is not None and (top_evidence.dir, top_evidence.save) == (tmp_path / "top-evidence", "all")
    assert top_evidence.max_bytes == 1_000_000_000
    assert settings.inspect_for(side) is None and settings.evidence_for(side) is None


def test_a_cameras_zones_key_is_short_for_its_inspect_zones(tmp_path: Path) -> None:
    zone = "{ a = [[0, 0], [1, 0], [1, 1]] }"
    zoned = _cameras(
        tmp_path, CAMERAS.replace("max_fps = 5", f"max_fps = 5\nzones = {zone}") + "[inspect]\nmatch = 'overlap'\n"
    )
    table = _cameras(
        tmp_path,
        CAMERAS.replace("max_fps = 5", f"max_fps = 5\n[source.inspect]\nzones = {zone}") + "[inspect]\nmatch = 'overlap'\n",
    )
    for settings in (zoned, table):
        top = settings.inspect_for(settings.source[0])
        assert top is not None and (top.zones, top.match) == ({"a": [(0, 0), (1, 0), (1, 1)]}, "overlap")
        assert settings.inspect_for(settings.source[1]) == settings.inspect
    # Without [inspect], zones make their camera inspected like any key of its own.
    alone = _cameras(tmp_path, CAMERAS.replace("max_fps = 5", f"max_fps = 5\nzones = {zone}"))
    assert alone.inspect_for(alone.source[0]) is not None and alone.inspect_for(alone.source[1]) is None
    with pytest.raises(ConfigError, match=r"camera top gives its zones twice, as zones and as inspect\.zones"):
        _cameras(tmp_path, CAMERAS.replace("max_fps = 5", f"max_fps = 5\nzones = {zone}\n[source.inspect]\nzones = {zone}"))
    with pytest.raises(ConfigError, match="zone 'a' has 2 point"):
        _cameras(tmp_path, CAMERAS.replace("max_fps = 5", "max_fps = 5\nzones = { a = [[0, 0], [1, 0]] }"))


@pytest.mark.parametrize(
    ("table", "problem"),
    [
        ("[source.evidence]\nsave = 'some'", "source[0].evidence.save: Input should be 'ng', 'ng+near' or 'all'"),
        (
            "[source.evidence]\nsav = 'all'",
            "source[0].evidence.sav: Extra inputs are not permitted (unknown key: did you mean save?)",
        ),
        ("evidence = 3", "source[0].evidence: Input should be a valid boolean"),
        (
            "[source.inspect]\nclass_conf = { red = 2 }",
            "source[0].inspect.class_conf.red: Input should be less than or equal to 1",
        ),
        (
            "[source.inspect]\nng_class = ['red']",
            "source[0].inspect.ng_class: Extra inputs are not permitted (unknown key: did you mean ng_classes?)",
        ),
    ],
)
def test_a_bad_key_in_a_cameras_own_table_is_one_problem_naming_it(tmp_path: Path, table: str, problem: str) -> None:
    with pytest.raises(ConfigError) as info:
        _cameras(tmp_path, CAMERAS.replace("max_fps = 5", f"max_fps = 5\n{table}"))
    assert info.value.exit_code == 78
    assert len(info.value.problems) == 1 and info.value.problems[0].startswith(problem), info.value.problems


def test_only_the_keys_that_open_a_camera_tell_whether_it_opens_the_same_way(tmp_path: Path) -> None:
    before = _cameras(tmp_path, CAMERAS).source[0]
    own = "max_fps = 2\nevidence = false\nzones = { a = [[0, 0], [1, 0], [1, 1]] }\n[source.inspect]\nng_classes = ['red']"
    after = _cameras(tmp_path, CAMERAS.replace("max_fps = 5", own)).source[0]
    assert before != after and before.opening() == after.opening()
    assert set(SourceBase.PROCESSING_KEYS) <= set(type(before).model_fields)
    paced = _cameras(tmp_path, CAMERAS.replace("max_fps = 5", "max_fps = 5\nfps = 3")).source[0]
    assert paced.opening() != before.opening()


@pytest.mark.unit
@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("99999", "reject.line: Input should be less than or equal to 65535; got 99999"),
        ('""', "reject.line: String should have at least 1 character; got ''"),
        ("1.5", "reject.line: Input should be a valid integer, got a number with a fractional part; got 1.5"),
    ],
)
def test_a_key_of_an_offset_or_a_name_is_one_problem_of_the_kind_given(tmp_path: Path, value: str, problem: str) -> None:
    config = tmp_path / "edged.toml"  # before: reject.line.constrained-int and reject.line.constrained-str, both
    config.write_text(f'[model]\npath = "m.onnx"\n[inspect]\n[reject]\nline = {value}\ndelay_ms = 100\n')
    with pytest.raises(ConfigError) as e:
        load_config(config)
    assert [p for p in e.value.problems if p.startswith("reject.line")] == [problem], e.value.problems


@pytest.mark.unit
def test_a_check_across_sections_is_reported_at_the_key_it_names(tmp_path: Path) -> None:
    config = tmp_path / "edged.toml"  # before: "(top level): Value error, reject.alarm_line: ..."
    config.write_text(
        '[model]\npath = "m.onnx"\n[inspect]\n[reject]\nline = 3\ndelay_ms = 100\nlate = "alarm"\nalarm_line = 3\n'
    )
    with pytest.raises(ConfigError) as e:
        load_config(config)
    assert "reject.alarm_line: must differ from reject.line" in e.value.problems, e.value.problems


def _round_zone(points: int) -> str:
    """``[inspect.zones]`` with one zone 'part': a circle of ``points`` points, as a traced outline gives."""
    circle = (
        f"[{0.5 + 0.4 * math.cos(2 * math.pi * i / points):.6f}, {0.5 + 0.4 * math.sin(2 * math.pi * i / points):.6f}]"
        for i in range(points)
    )
    return f"[inspect.zones]\npart = [{', '.join(circle)}]\n"


def test_a_zone_of_more_points_than_a_drawn_outline_needs_is_refused_naming_it_and_its_count(tmp_path: Path) -> None:
    # Every pair of a zone's edges was compared: ten thousand points took over a minute to load,
    # past systemd's start timeout, and the unit restarted for ever.
    model = '[model]\npath = "m.onnx"\n'
    assert len(load_config(_write(tmp_path, model + _round_zone(1000))).inspect.zones["part"]) == 1000
    with pytest.raises(ConfigError) as info:
        load_config(_write(tmp_path, model + _round_zone(1001)))
    assert "zone 'part' has 1001 points; a zone may have at most 1000" in str(info.value)
    check = run_cli("check", "--config", str(_write(tmp_path, model + _round_zone(10_000))))
    assert check.returncode == 78 and "zone 'part' has 10000 points; a zone may have at most 1000" in check.stderr


def test_an_empty_list_of_ng_classes_is_refused_for_a_part_could_never_be_ng(tmp_path: Path) -> None:
    # Accepted, it judged every part OK whatever the model found.
    model = '[model]\npath = "m.onnx"\n'
    with pytest.raises(ConfigError) as info:
        load_config(_write(tmp_path, model + "[inspect]\nng_classes = []\n"))
    assert "inspect.ng_classes" in str(info.value) and "no class could make a part NG" in str(info.value)
    assert load_config(_write(tmp_path, model + '[inspect]\nng_classes = ["crack"]\n')).inspect.ng_classes == ["crack"]


def _listening(tmp_path: Path, publish: list[str], more: str = "") -> Path:
    endpoints = ", ".join(f'"{endpoint}"' for endpoint in publish)
    return _write(tmp_path, f'[model]\npath = "m.onnx"\n[publish]\nendpoints = [{endpoints}]\ninsecure = true\n{more}')


@pytest.mark.parametrize(
    ("publish", "more", "problem"),
    [
        (
            ["tcp://127.0.0.1:5591", "tcp://127.0.0.1:5591"],
            "",
            "publish.endpoints: 'tcp://127.0.0.1:5591' is named twice: remove one",
        ),
        (
            ["ipc:///run/edged/d.sock", "ipc:///run/edged/x/../d.sock"],
            "",
            "publish.endpoints: 'ipc:///run/edged/x/../d.sock' would listen where publish.endpoints "
            "'ipc:///run/edged/d.sock' does",
        ),
        (
            ["tcp://*:5591"],
            '[http]\nlisten = "127.0.0.1:5591"\n',
            "http.listen: '127.0.0.1:5591' would listen where publish.endpoints 'tcp://*:5591' does",
        ),
        (
            ["tcp://127.0.0.1:5591"],
            '[http]\nlisten = "localhost:5591"\n',
            "http.listen: 'localhost:5591' would listen where publish.endpoints 'tcp://127.0.0.1:5591' does",
        ),
        (
            ["tcp://0.0.0.0:5591"],
            '[modbus]\nlisten = "127.0.0.1:5591"\n',
            "modbus.listen: '127.0.0.1:5591' would listen where publish.endpoints 'tcp://0.0.0.0:5591' does",
        ),
        (
            ["tcp://[::]:5591"],
            '[opcua]\nlisten = "opc.tcp://[::1]:5591"\n',
            "opcua.listen: 'opc.tcp://[::1]:5591' would listen where publish.endpoints 'tcp://[::]:5591' does",
        ),
        (
            ["tcp://127.0.0.1:5591"],
            '[trigger]\nmode = "request"\nendpoint = "tcp://127.0.0.1:5591"\n',
            "trigger.endpoint: 'tcp://127.0.0.1:5591' would listen where publish.endpoints 'tcp://127.0.0.1:5591' does",
        ),
        (  # IPv6's every address is bound for IPv4 too, by ZeroMQ and by edged's servers
            ["tcp://[::]:5591", "tcp://127.0.0.1:5591"],
            "",
            "publish.endpoints: 'tcp://127.0.0.1:5591' would listen where publish.endpoints 'tcp://[::]:5591' does",
        ),
        (
            ["tcp://0.0.0.0:5591"],
            '[http]\nlisten = "[::]:5591"\ntoken_file = "m.onnx"\n',
            "http.listen: '[::]:5591' would listen where publish.endpoints 'tcp://0.0.0.0:5591' does",
        ),
        (  # an interface is the address libzmq binds for it
            ["tcp://lo:5591", "tcp://0.0.0.0:5591"],
            "",
            "publish.endpoints: 'tcp://0.0.0.0:5591' would listen where publish.endpoints 'tcp://lo:5591' does",
        ),
        (  # an IPv4-mapped address is its IPv4 address
            ["tcp://127.0.0.1:5591"],
            '[modbus]\nlisten = "[::ffff:127.0.0.1]:5591"\nallow_remote = true\n',
            "modbus.listen: '[::ffff:127.0.0.1]:5591' would listen where publish.endpoints 'tcp://127.0.0.1:5591' does",
        ),
    ],
)
def test_two_sockets_at_one_place_are_a_config_error_naming_both(
    tmp_path: Path, publish: list[str], more: str, problem: str
) -> None:
    """The second bind failed as if another program held the place: exit 1, which systemd restarted
    without end, or a live view that tried again for ever, while both were edged's own."""
    with pytest.raises(ConfigError) as info:
        load_config(_listening(tmp_path, publish, more))
    [said] = info.value.problems
    assert said.startswith(problem), said


def test_one_ipc_socket_written_relative_absolute_or_through_a_linked_folder_is_one_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Written two ways, one socket file passed the load, and the second bind failed (exit 1, restarted)."""
    (tmp_path / "run").mkdir()
    (tmp_path / "linked").symlink_to(tmp_path / "run")
    monkeypatch.chdir(tmp_path / "run")
    for other in ("ipc://d.sock", f"ipc://{tmp_path}/linked/d.sock", "ipc://./x/../d.sock"):
        with pytest.raises(ConfigError) as info:
            load_config(_listening(tmp_path, [f"ipc://{tmp_path}/run/d.sock", other]))
        assert f"publish.endpoints: '{other}' would listen where publish.endpoints 'ipc://{tmp_path}/run/d.sock'" in str(
            info.value
        )
    assert load_config(_listening(tmp_path, [f"ipc://{tmp_path}/run/d.sock", "ipc://../d.sock"]))


@pytest.mark.parametrize(
    ("publish", "more"),
    [
        (["tcp://127.0.0.1:5591"], '[http]\nlisten = "127.0.0.2:5591"\n'),
        (["tcp://127.0.0.1:*", "tcp://127.0.0.1:*"], ""),  # ports ZeroMQ chooses as it binds
        (["tcp://127.0.0.1:0", "tcp://*:00"], ""),  # 0 too
        (["tcp://[::1]:5591", "tcp://[::ffff:127.0.0.2]:5591"], ""),
        (["tcp://lo:5591", "tcp://[::1]:5591"], ""),  # an interface binds its IPv4 address
        (["tcp://0.0.0.0:5591"], '[http]\nlisten = "[::1]:5591"\n'),  # IPv4's every address, beside IPv6's loopback
        (["tcp://127.0.0.1:5591", "ipc:///run/edged/5591.sock"], ""),
        (["tcp://127.0.0.1:5591"], '[trigger]\nendpoint = "tcp://127.0.0.1:5591"\n'),  # no camera takes requests
    ],
)
def test_sockets_at_places_of_their_own_load(tmp_path: Path, publish: list[str], more: str) -> None:
    assert load_config(_listening(tmp_path, publish, more))


@pytest.mark.integration
def test_check_refuses_the_live_view_on_the_streams_port_with_exit_78(tmp_path: Path) -> None:
    check = run_cli("check", "--config", str(_listening(tmp_path, ["tcp://*:5591"], '[http]\nlisten = "127.0.0.1:5591"\n')))
    assert check.returncode == 78, check.stderr
    assert "http.listen: '127.0.0.1:5591' would listen where publish.endpoints 'tcp://*:5591' does" in check.stderr
