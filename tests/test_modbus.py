"""The Modbus TCP output's register image and its settings (`edged.modbus`, `edged.settings.modbus`);
the running daemon served to real Modbus clients is tests/test_daemon_modbus.py."""

from __future__ import annotations

import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pymodbus
import pytest
from daemon import free_port, write_config
from onnx_models import fixed_scene
from pymodbus.client import ModbusTcpClient
from pymodbus.exceptions import ConnectionException
from reports import inspecting, ng_report
from test_lograte import Clock
from test_trigger import SCENE
from test_trigger_mqtt import _next
from waiting import wait_for

from edged.config import ConfigError, load_config
from edged.journal import JournalOutput
from edged.modbus import (
    BLOCK,
    INSTALL_PYMODBUS,
    NG,
    NG_COUNT,
    NO_CLASS,
    SEQ,
    VERDICT,
    ModbusOutput,
    Registers,
    part_id_of,
)
from edged.model import load_model
from edged.output import Services
from edged.outputs import Outputs
from edged.settings.modbus import ModbusConfig
from edged.trigger import TriggerServer


@pytest.mark.unit
def test_reads_stay_within_the_blocks_and_only_the_part_id_takes_writes() -> None:
    registers = Registers(100, 2)
    assert registers.read(100, 32) == [0] * 9 + [NO_CLASS] + [0] * 15 + [NO_CLASS] + [0] * 6
    assert registers.read(99, 1) is None and registers.read(131, 2) is None and registers.read(132, 1) is None
    assert registers.write_part_id(112, [1, 2]) and registers.write_part_id(128, [3, 4])
    assert registers.read(112, 2) == [1, 2] and registers.read(128, 2) == [3, 4]
    assert not registers.write_part_id(111, [9, 9]) and not registers.write_part_id(113, [9, 9])
    assert not registers.write_part_id(100, [9]) and not registers.write_part_id(144, [9])
    assert registers.read(112, 3) == [1, 2, 0]  # a refused write wrote nothing


@pytest.mark.unit
def test_a_coil_per_camera_at_its_blocks_start() -> None:
    registers = Registers(0, 3)
    assert [registers.coil_index(a) for a in (0, 1, 15, 16, 32, 48, -1)] == [0, None, None, 1, 2, None, None]
    registers.coils[1] = True
    assert registers.read_coils(15, 3) == [False, True, False]
    assert registers.read_coils(40, 9) is None


@pytest.mark.unit
def test_the_part_id_is_the_32_bit_number_high_word_first_and_0_is_none() -> None:
    assert part_id_of(0, 0) is None
    assert part_id_of(0, 42) == "42"
    assert part_id_of(1, 2) == str(65538)
    assert part_id_of(0xFFFF, 0xFFFF) == "4294967295"


@pytest.mark.unit
def test_a_server_off_loopback_is_refused_unless_allow_remote(tmp_path: Path) -> None:
    fixed_scene(tmp_path / "model.onnx", SCENE)
    doc: dict[str, Any] = {"model": {"path": "model.onnx"}, "modbus": {"listen": "0.0.0.0:5020"}}
    with pytest.raises(ConfigError, match=r"modbus\.allow_remote = true") as e:
        load_config(write_config(tmp_path / "edged.toml", doc))
    assert e.value.exit_code == 78
    doc["modbus"]["allow_remote"] = True
    settings = load_config(write_config(tmp_path / "edged.toml", doc))
    assert settings.modbus is not None and settings.modbus.allow_remote


@pytest.mark.unit
@pytest.mark.parametrize("listen", ["not an address", "127.0.0.1:0", "127.0.0.1:65536"])
def test_a_listen_that_is_not_host_port_is_refused_naming_modbus_listen(tmp_path: Path, listen: str) -> None:
    fixed_scene(tmp_path / "model.onnx", SCENE)
    doc: dict[str, Any] = {"model": {"path": "model.onnx"}, "modbus": {"listen": listen}}
    with pytest.raises(ConfigError) as e:
        load_config(write_config(tmp_path / "edged.toml", doc))
    assert [p for p in e.value.problems if "HOST:PORT" in p] == [
        f"modbus.listen: Value error, {listen!r} is not HOST:PORT with a port from 1 to 65535; got {listen!r}"
    ], e.value.problems


@pytest.mark.unit
@pytest.mark.parametrize(
    ("cameras", "base", "fix"),
    [
        (256, 61440, None),
        (257, 61440, "lower modbus.base to 61424 or less"),
        (4097, 0, "Modbus serves 4096 cameras at most"),
    ],
)
def test_blocks_past_the_last_address_are_refused_saying_how_to_fit_them(
    tmp_path: Path, cameras: int, base: int, fix: str | None
) -> None:
    """A PLC cannot address a register past 65535: a camera's block there was served to no one."""
    fixed_scene(tmp_path / "model.onnx", SCENE)
    source = [{"type": "synthetic", "camera_id": f"c{i}"} for i in range(cameras)]
    doc: dict[str, Any] = {"model": {"path": "model.onnx"}, "source": source, "modbus": {"base": base}}
    if fix is None:
        assert load_config(write_config(tmp_path / "edged.toml", doc)).modbus is not None
        return
    with pytest.raises(ConfigError) as e:
        load_config(write_config(tmp_path / "edged.toml", doc))
    assert e.value.exit_code == 78
    assert e.value.problems == [
        f"modbus: {cameras} cameras' blocks of 16 registers from modbus.base {base} run past the last address, 65535: {fix}"
    ], e.value.problems


def _modbus_problems(tmp_path: Path) -> list[str]:
    fixed_scene(tmp_path / "model.onnx", SCENE)
    with pytest.raises(ConfigError) as e:
        load_config(write_config(tmp_path / "edged.toml", {"model": {"path": "model.onnx"}, "modbus": {}}))
    return e.value.problems


@pytest.mark.unit
def test_without_pymodbus_a_modbus_section_is_a_config_error_saying_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "pymodbus.server", None)  # as if pymodbus were not installed
    problems = _modbus_problems(tmp_path)
    assert any(p.startswith("modbus: ") and INSTALL_PYMODBUS in p for p in problems), problems
    assert ".venv/bin/python -m pip install -e '.[modbus]'" in INSTALL_PYMODBUS


@pytest.mark.unit
def test_a_pymodbus_older_than_3_16_is_refused_with_the_version_found(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pymodbus, "__version__", "3.6.9")
    problems = _modbus_problems(tmp_path)
    assert any("needs pymodbus 3.16 or a later 3.x, this Python has 3.6.9" in p for p in problems), problems


def test_a_full_server_reclaims_the_place_silent_longest_only_once_it_is_reclaim_idle_s_silent() -> None:
    clock = Clock(1000.0)  # what the server times each connection's silence by
    port = free_port()
    cfg = ModbusConfig(listen=f"127.0.0.1:{port}", max_connections=2, reclaim_idle_s=10)
    output = ModbusOutput(cfg, ["cam"], [], [], clock=clock)
    silent = plc = None
    try:
        silent = _first_connection(port)
        plc = ModbusTcpClient("127.0.0.1", port=port, timeout=10, retries=0)
        assert plc.connect()
        assert wait_for(lambda: output.clients == 2, 10)
        clock.now += 5
        assert not plc.read_holding_registers(0, count=BLOCK, device_id=1).isError()  # heard at +5
        clock.now += 4  # the silent one 9 s silent: not yet
        with socket.create_connection(("127.0.0.1", port), timeout=10) as early:
            assert early.recv(1) == b""
        assert (output.refused, output.reclaimed) == (1, 0)
        clock.now += 2  # 11 s silent, the PLC 6 s
        with ModbusTcpClient("127.0.0.1", port=port, timeout=10, retries=0) as newcomer:
            assert not newcomer.read_holding_registers(0, count=BLOCK, device_id=1).isError()
            assert silent.recv(1) == b"", "the connection silent longest made room"
            assert (output.refused, output.reclaimed) == (1, 1)
            with socket.create_connection(("127.0.0.1", port), timeout=10) as late:  # the rest heard within 10 s
                assert late.recv(1) == b""
            assert (output.refused, output.reclaimed) == (2, 1)
            assert not plc.read_holding_registers(0, count=BLOCK, device_id=1).isError()
    finally:
        for s in (silent, plc):
            if s is not None:
                s.close()
        output.close()


def _first_connection(port: int) -> socket.socket:
    """A connection to the server starting on ``port``, once it listens."""
    deadline = time.monotonic() + 30
    while True:
        try:
            return socket.create_connection(("127.0.0.1", port), timeout=10)
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def served_by_the_new_server(plc: ModbusTcpClient, coil: int, unit: int) -> bool:
    """Whether ``plc`` connects and a read of ``coil`` (mapped by the new server alone) is answered: on a
    loaded machine the server a reload replaced can take the connection in its last moments (its stop
    waited for `CLOSE_TIMEOUT_S`) and then reset it, as a PLC finds it and connects again, to the new one."""
    try:
        return plc.connect() and not plc.read_coils(coil, count=1, device_id=unit).isError()
    except (ConnectionException, OSError):
        plc.close()
        return False


@pytest.mark.integration
def test_a_reload_hands_the_server_that_carries_on_the_verdicts_the_journal_held_and_the_request_in_hand(
    tmp_path: Path,
) -> None:
    """What reaches the server a reload replaces after it was replaced (a verdict the journal was
    still recording, a request's answer) reaches the registers the PLC reads now, and a request in
    hand keeps its coil at 1 there until its answer."""
    port, unit = free_port(), 7
    doc = inspecting(
        tmp_path,
        trigger={"mode": "request", "endpoint": f"ipc://{tmp_path / 'trigger.sock'}"},
        modbus={"listen": f"127.0.0.1:{port}", "unit_id": unit},
    )
    settings = load_config(write_config(tmp_path / "edged.toml", doc))
    doc["modbus"]["base"] = 100
    moved = load_config(write_config(tmp_path / "edged.toml", doc))
    outputs = Outputs(settings, Services(lambda: None, threading.Event()))
    trigger = TriggerServer(settings.trigger, settings.publish, settings.requesting())
    outputs.carry_requests(trigger)
    journal, old = outputs.get(JournalOutput), outputs.get(ModbusOutput)
    assert journal is not None and old is not None
    try:
        with ModbusTcpClient("127.0.0.1", port=port, timeout=10, retries=0) as plc:
            assert wait_for(plc.connect, 30)
            assert not plc.write_coil(0, True, device_id=unit).isError()
        request = _next(trigger, "cam0")  # in hand: the loop takes a frame for it
        report = ng_report(load_model(settings.model, settings.runtime), "cam0", 0)
        old.frame(report)  # held until the journal has recorded it
        served = old.requests
        outputs.reload(moved)  # the daemon's reload: the server moves
        new = outputs.get(ModbusOutput)
        assert new is not None and new is not old
        with ModbusTcpClient("127.0.0.1", port=port, timeout=10, retries=0) as plc:
            assert wait_for(lambda: served_by_the_new_server(plc, 100, unit), 30)
            assert plc.read_coils(100, count=1, device_id=unit).bits[0], "the request in hand lost its coil"
            journal.deliver_recorded()
            assert report.verdict is not None
            trigger.answer(request, report.verdict)
            words = plc.read_holding_registers(100, count=BLOCK, device_id=unit).registers
            assert words[VERDICT] == NG and words[SEQ : SEQ + 2] == [0, 0] and words[NG_COUNT : NG_COUNT + 2] == [0, 1]
            assert not plc.read_coils(100, count=1, device_id=unit).bits[0]
        assert wait_for(lambda: new.requests == served + 4, 10), (served, new.requests)  # since start, the probe too
        assert new.report("cam0").fields["modbus"].triggers == 1
    finally:
        outputs.close()
        trigger.close()
