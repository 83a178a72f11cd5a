"""A small TCP proxy between a Redis client and Redis that can lose a reply.

``drop_reply_to(marker)``: the next request containing ``marker`` (e.g. the
lease key) reaches Redis and is executed, but its reply is thrown away and the
client's connection closed, exactly what a connection lost after the command
was sent looks like.  Everything else is forwarded unchanged.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from types import TracebackType


class LossyProxy:
    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.05)  # so close() does not wait on accept()
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._drop_marker: bytes | None = None
        self.dropped = 0
        self._closed = False
        self._sockets: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._start(self._accept)

    def drop_reply_to(self, marker: bytes) -> None:
        with self._lock:
            self._drop_marker = marker

    def _start(self, target: object, *args: object) -> None:
        t = threading.Thread(target=target, args=args, daemon=True)  # type: ignore[arg-type]
        self._threads.append(t)
        t.start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            client.settimeout(None)
            upstream = socket.create_connection(self.upstream)
            self._sockets += [client, upstream]
            drop = threading.Event()
            self._start(self._requests, client, upstream, drop)
            self._start(self._replies, upstream, client, drop)

    def _requests(
        self, client: socket.socket, upstream: socket.socket, drop: threading.Event
    ) -> None:
        try:
            while data := client.recv(65536):
                with self._lock:
                    if self._drop_marker is not None and self._drop_marker in data:
                        self._drop_marker = None
                        drop.set()
                upstream.sendall(data)
        except OSError:
            pass
        finally:
            _shut(upstream)

    def _replies(
        self, upstream: socket.socket, client: socket.socket, drop: threading.Event
    ) -> None:
        try:
            while data := upstream.recv(65536):
                if drop.is_set():
                    with self._lock:
                        self.dropped += 1
                    break  # the reply is lost and the connection with it
                client.sendall(data)
        except OSError:
            pass
        finally:
            _shut(client)
            _shut(upstream)

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        for s in self._sockets:
            _shut(s)
        for t in self._threads:
            t.join(timeout=5)

    def __enter__(self) -> LossyProxy:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _shut(s: socket.socket) -> None:
    with contextlib.suppress(OSError):
        s.shutdown(socket.SHUT_RDWR)
    s.close()
