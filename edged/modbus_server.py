"""pymodbus' TCP server over `edged.modbus`' registers: imported only when ``[modbus]`` is configured.

pymodbus (3.x) decodes the frames, answers malformed ones and unknown function codes, and calls a
server context for every read and write. `Context` is that context, over `edged.modbus.Registers`
(the unit id checked, every address outside the blocks an exception); `_Server` and `_Handler`
bound the connections (beyond ``max_connections`` closed as they come, unless the one silent
longest has been silent for ``reclaim_idle_s``: it is closed instead) and the answers a client
leaves unread (`edged.modbus.MAX_UNREAD_BYTES`), and count the requests answered.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

from pymodbus.constants import ExcCodes
from pymodbus.datastore import ModbusServerContext
from pymodbus.exceptions import NoSuchIdException
from pymodbus.pdu import ExceptionResponse, ModbusPDU
from pymodbus.server import ModbusTcpServer
from pymodbus.server.requesthandler import ServerRequestHandler

from edged.listen import every_address

if TYPE_CHECKING:
    from edged.modbus import ModbusOutput

READ_REGISTERS, READ_COILS = 3, 1
WRITE_COILS = (5, 15)
WRITE_REGISTERS = (6, 16, 22, 23)
MAX_UNREAD_BYTES = 64 * 1024  # answers a client has not read, held by edged; beyond, it is dropped
SEND_BUFFER_BYTES = 16 * 1024  # the kernel's send buffer of a client (it doubles it): answers are at most 260 bytes


class Context(ModbusServerContext):
    """The datastore pymodbus calls on its loop: the output's registers, for its unit id alone."""

    def __init__(self, owner: ModbusOutput) -> None:
        # Not ModbusServerContext.__init__: it builds a simulated device this context replaces.
        self.owner = owner
        self.old_simulator = True  # pymodbus calls this context as it is, rather than a simulator of it
        self.simdevices = []

    def device_ids(self) -> list[int]:
        return [self.owner.cfg.unit_id]

    def _check(self, device_id: int) -> None:
        if device_id != self.owner.cfg.unit_id:
            raise NoSuchIdException(f"unit {device_id} is not edged's")  # answered with exception 0x0B

    async def async_getValues(
        self, device_id: int, func_code: int, address: int, count: int = 1
    ) -> list[int] | list[bool] | ExcCodes:
        self._check(device_id)
        registers = self.owner.registers
        if func_code == READ_COILS or func_code in WRITE_COILS:
            coils = registers.read_coils(address, count)
            return coils if coils is not None else ExcCodes.ILLEGAL_ADDRESS
        if func_code == READ_REGISTERS or func_code in WRITE_REGISTERS:
            words = registers.read(address, count)
            return words if words is not None else ExcCodes.ILLEGAL_ADDRESS
        return ExcCodes.ILLEGAL_FUNCTION

    async def async_setValues(
        self, device_id: int, func_code: int, address: int, values: Sequence[int] | Sequence[bool]
    ) -> ExcCodes | None:
        self._check(device_id)
        owner = self.owner
        if func_code in WRITE_COILS:
            indexes = [owner.registers.coil_index(address + k) for k in range(len(values))]
            if any(index is None or not owner.takes_requests(index) for index in indexes):
                return ExcCodes.ILLEGAL_ADDRESS
            for index, value in zip(indexes, values, strict=True):
                if value and index is not None:
                    owner.request(index)
            return None
        if func_code in WRITE_REGISTERS:
            return None if owner.registers.write_part_id(address, [int(v) for v in values]) else ExcCodes.ILLEGAL_ADDRESS
        return ExcCodes.ILLEGAL_FUNCTION


class _Handler(ServerRequestHandler):
    """One client's connection: closed at once beyond ``max_connections`` (unless a silent one makes
    room, `_Server.reclaim`), or once its unread answers pile up."""

    server: _Server
    heard: float  # monotonic time of the connection or of its last bytes

    def callback_connected(self) -> None:
        super().callback_connected()
        owner = self.server.owner
        if len(self.server.active_connections) > owner.cfg.max_connections and not self.server.reclaim(self):
            owner.refused += 1
            self.close()
            return
        owner.clients = len(self.server.active_connections)
        sock = self.transport.get_extra_info("socket")
        if sock is not None:  # the kernel's share of a client's unread answers: small, as they are
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)

    def callback_disconnected(self, exc: Exception | None) -> None:
        super().callback_disconnected(exc)
        self.server.owner.clients = max(len(self.server.active_connections) - 1, 0)

    def callback_data(self, data: bytes, addr: tuple[str, int] | None = None) -> int:
        self.heard = self.server.owner.clock()
        transport: Any = self.transport
        if transport is not None and transport.get_write_buffer_size() > MAX_UNREAD_BYTES:
            self.server.owner.unread += 1
            transport.abort()  # not close(), which would wait for the unread answers to go out
            self.close()
            self.server.owner.clients = len(self.server.active_connections)
            return len(data)
        return int(super().callback_data(data, addr))


class _Server(ModbusTcpServer):
    def __init__(self, owner: ModbusOutput) -> None:
        self.owner = owner
        host, port = owner.cfg.host_port()
        if every_address(host):  # asyncio binds "::" for IPv6 alone; "" is every address of both
            host = ""
        super().__init__(Context(owner), address=(host, port), trace_pdu=self._answered)

    def reclaim(self, new: _Handler) -> bool:
        """Close the connection silent longest to make room for ``new``, if it has been silent for
        ``reclaim_idle_s``; False, and nothing closed, when none has."""
        others = [cast(_Handler, h) for h in self.active_connections.values() if h is not new]
        if not others:
            return False
        silent = min(others, key=lambda h: h.heard)
        if self.owner.clock() - silent.heard < self.owner.cfg.reclaim_idle_s:
            return False
        self.owner.reclaimed += 1
        transport: Any = silent.transport
        if transport is not None:
            transport.abort()  # its unsent answers, if any, are not waited for
        silent.close()
        return True

    def callback_new_connection(self) -> _Handler:
        handler = _Handler(self, self.trace_packet, self.trace_pdu, self.trace_connect)  # type: ignore[no-untyped-call]
        handler.heard = self.owner.clock()  # listed from here on, before its callback_connected
        return handler

    def _answered(self, sending: bool, pdu: ModbusPDU) -> ModbusPDU:
        """Every PDU in or out: each answer sent counts a request served, an exception one more."""
        if sending:
            self.owner.requests += 1
            if isinstance(pdu, ExceptionResponse):
                self.owner.exceptions += 1
        return pdu


async def start_server(owner: ModbusOutput) -> _Server:
    """The server listening on ``owner``'s address; RuntimeError when it cannot."""
    server = _Server(owner)
    await server.serve_forever(background=True)
    return server
