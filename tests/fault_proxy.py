"""A TCP proxy in front of the test sshd whose live connections a test cuts or freezes at a
chosen request: the faults of a login node's network (a dropped connection, a host that stops
answering mid-exchange), which paramiko meets as EOFError, SSHException or a wait with no end.

The moment is counted in the client's sends (each SSH request paramiko waits on is one send:
a channel's open, then its exec), so a test says "the second request after this" and not a
byte offset that changes with the key type or the server's version."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass, field


@dataclass
class _Pair:
    client: socket.socket
    server: socket.socket
    frozen: bool = False
    closed: bool = False

    def close(self) -> None:
        self.closed = True
        for s in (self.client, self.server):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()


@dataclass
class _Fault:
    action: str  # "drop" | "freeze"
    passed: int  # client sends still forwarded before the fault
    forward: bool  # whether the send that triggers it reaches the server first


@dataclass
class FaultProxy:
    """127.0.0.1:``port`` -> ``target``. ``arm`` applies to the connections open then."""

    target: tuple[str, int]
    port: int = 0
    accepted: int = 0
    _pairs: list[_Pair] = field(default_factory=list)
    _faults: dict[int, _Fault] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self._listener = socket.socket()
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(16)
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def arm(self, action: str, *, after: int = 0, forward: bool = False) -> None:
        """On each open connection: forward ``after`` more client sends, then on the next one
        ``drop`` (both sockets closed) or ``freeze`` (nothing more forwarded either way, the
        sockets held open); ``forward``: that send reaches the server first."""
        with self._lock:
            for i, pair in enumerate(self._pairs):
                if not pair.closed:
                    self._faults[i] = _Fault(action, after, forward)

    def close(self) -> None:
        self._listener.close()
        with self._lock:
            for pair in self._pairs:
                pair.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            self.accepted += 1
            try:
                server = socket.create_connection(self.target, timeout=10)
                server.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                index = len(self._pairs)
                self._pairs.append(_Pair(client, server))
            pair = self._pairs[index]
            threading.Thread(target=self._pump, args=(index, pair, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(index, pair, False), daemon=True).start()

    def _pump(self, index: int, pair: _Pair, from_client: bool) -> None:
        source, sink = (pair.client, pair.server) if from_client else (pair.server, pair.client)
        try:
            while True:
                data = source.recv(65536)
                if not data:
                    break
                fault = self._due(index) if from_client else None
                if fault is not None and fault.forward:
                    sink.sendall(data)
                if fault is not None and fault.action == "drop":
                    break
                if fault is not None:
                    pair.frozen = True
                while pair.frozen and not pair.closed:
                    time.sleep(0.05)
                if pair.closed:
                    return
                if fault is None:
                    sink.sendall(data)
        except OSError:
            pass
        pair.close()

    def _due(self, index: int) -> _Fault | None:
        """The fault this client send sets off, or None (and one send counted)."""
        with self._lock:
            fault = self._faults.get(index)
            if fault is None:
                return None
            if fault.passed > 0:
                fault.passed -= 1
                return None
            del self._faults[index]
            return fault
