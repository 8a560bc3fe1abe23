"""A TCP proxy on a free loopback port that can be switched off and on: a server that is "down" for its clients
(every open connection reset, every new one reset at once) while the real server keeps its state (moto keeps
its buckets only in memory, so stopping it would lose them)."""

from __future__ import annotations

import contextlib
import selectors
import socket
import struct
import threading
from collections.abc import Iterator

from loom.devstack.servers import free_port


def _reset(conn: socket.socket) -> None:
    # SO_LINGER 0: close sends RST, as a crashed server's kernel would for an established connection.
    with contextlib.suppress(OSError):
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        conn.close()


class FaultProxy:
    def __init__(self, target_port: int, target_host: str = "127.0.0.1") -> None:
        self.target = (target_host, target_port)
        self.port = free_port()
        self.down = threading.Event()
        self.refused = 0  # connections reset while down
        self._listener = socket.create_server(("127.0.0.1", self.port), reuse_port=False)
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = threading.Event()
        threading.Thread(target=self._accept, daemon=True, name="fault-proxy").start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def set_down(self, down: bool) -> None:
        if down:
            self.down.set()
            with self._lock:
                for conn in list(self._open):
                    _reset(conn)
                self._open.clear()
        else:
            self.down.clear()

    def close(self) -> None:
        self._closed.set()
        self.set_down(True)
        with contextlib.suppress(OSError):
            self._listener.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            if self.down.is_set():
                self.refused += 1
                _reset(conn)
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                _reset(conn)
                continue
            with self._lock:
                self._open.update((conn, upstream))
            threading.Thread(target=self._pipe, args=(conn, upstream), daemon=True).start()

    def _pipe(self, a: socket.socket, b: socket.socket) -> None:
        selector = selectors.DefaultSelector()
        try:
            selector.register(a, selectors.EVENT_READ, b)
            selector.register(b, selectors.EVENT_READ, a)
            while not self.down.is_set():
                for key, _ in selector.select(timeout=0.5):
                    data = key.fileobj.recv(65536)  # type: ignore[union-attr]
                    if not data:
                        return
                    key.data.sendall(data)
        except (OSError, ValueError):
            return
        finally:
            selector.close()
            with self._lock:
                self._open.discard(a)
                self._open.discard(b)
            for conn in (a, b):
                with contextlib.suppress(OSError):
                    conn.close()


@contextlib.contextmanager
def fault_proxy(target_port: int) -> Iterator[FaultProxy]:
    proxy = FaultProxy(target_port)
    try:
        yield proxy
    finally:
        proxy.close()
