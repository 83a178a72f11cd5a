"""A TCP proxy the tests steer: pass traffic, delay it, hold it, or cut it.

Put between a client and a server (PostgreSQL, Redis, a replica's
walreceiver and its primary), it forwards bytes both ways on one asyncio
loop in a background thread, so it costs one thread however many
connections pass through it.  Faults, set from any thread:

* :meth:`delay`: every chunk waits ``seconds`` before it is forwarded (order
  kept), as a slow or congested network would;
* :meth:`hold`: nothing is forwarded any more and connections stay open, so
  neither side notices (a partition that TCP does not report: a replica that
  simply stops receiving WAL); what was sent waits and flows on :meth:`heal`;
* :meth:`cut`: every connection is closed now and new ones are refused
  (closed at once) until :meth:`heal`;
* :meth:`heal`: back to passing traffic;
* :meth:`drop_reply_to`: the next request containing a marker (e.g. a lease
  key), or every one (``times=None``), reaches the server and is executed, but
  its reply is thrown away and the client's connection closed: exactly what a
  connection lost after the command was sent looks like.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from types import TracebackType

PASS = "pass"
DELAY = "delay"
HOLD = "hold"
CUT = "cut"


class TcpProxy:
    def __init__(self, upstream: tuple[str, int], *, name: str = "proxy") -> None:
        self.upstream = upstream
        self.name = name
        self.mode = PASS
        self.delay_seconds = 0.0
        self.port = 0
        self.connections = 0  # accepted so far
        self.dropped = 0  # replies thrown away (drop_reply_to)
        self._drop_marker: bytes | None = None
        self._drops_left: int | None = None  # None: every request with the marker
        self._writers: set[asyncio.StreamWriter] = set()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._server: asyncio.AbstractServer | None = None
        self._thread = threading.Thread(target=self._run, name=f"tcp-proxy-{name}", daemon=True)
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("the proxy did not start")

    # ---------------------------------------------------------------- control

    def delay(self, seconds: float) -> None:
        self.delay_seconds = seconds
        self.mode = DELAY

    def hold(self) -> None:
        self.mode = HOLD

    def cut(self) -> None:
        self.mode = CUT
        self._call(self._close_all)

    def drop_reply_to(self, marker: bytes, times: int | None = 1) -> None:
        self._drops_left = times
        self._drop_marker = marker

    def heal(self) -> None:
        self.mode = PASS
        self.delay_seconds = 0.0

    def close(self) -> None:
        if self._loop.is_closed():
            return

        async def shutdown() -> None:
            if self._server is not None:
                self._server.close()
            self._close_all()

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self._loop.close()

    def __enter__(self) -> TcpProxy:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # ---------------------------------------------------------------- the loop

    def _call(self, fn: object) -> None:
        async def run() -> None:
            fn()  # type: ignore[operator]

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(run(), self._loop).result(10)

    def _close_all(self) -> None:
        for writer in list(self._writers):
            with contextlib.suppress(Exception):
                writer.transport.abort()
        self._writers.clear()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)

        async def start() -> None:
            self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
            self.port = self._server.sockets[0].getsockname()[1]

        self._loop.run_until_complete(start())
        self._ready.set()
        self._loop.run_forever()
        # stopped: end what is left
        pending = [t for t in asyncio.all_tasks(self._loop) if not t.done()]
        for task in pending:
            task.cancel()
        if pending:
            self._loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        if self.mode == CUT:
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            writer.transport.abort()
            return
        self._writers.update((writer, up_writer))
        lose_reply = asyncio.Event()  # set by a request carrying the drop marker
        await asyncio.gather(
            self._pump(reader, up_writer, writer, marks=lose_reply),
            self._pump(up_reader, writer, up_writer, loses=lose_reply),
            return_exceptions=True,
        )

    async def _while_held(self) -> None:
        """While held, read nothing: bytes wait in the kernel's buffers, then
        TCP's window stops the sender; nothing is lost or reordered."""
        while self.mode == HOLD:
            await asyncio.sleep(0.01)

    async def _pump(
        self,
        src: asyncio.StreamReader,
        dst: asyncio.StreamWriter,
        other: asyncio.StreamWriter,
        *,
        marks: asyncio.Event | None = None,
        loses: asyncio.Event | None = None,
    ) -> None:
        """Forward ``src`` to ``dst``.  Requests (``marks``) carrying the drop
        marker mark their connection; replies (``loses``) on a marked one are
        thrown away with the connection."""
        try:
            while True:
                await self._while_held()
                data = await src.read(65536)
                if not data:
                    break
                await self._while_held()  # read as the hold began: kept back too
                if self.mode == CUT:
                    break
                marker = self._drop_marker
                if marks is not None and marker is not None and marker in data:
                    if self._drops_left is not None:
                        self._drops_left -= 1
                        if self._drops_left <= 0:
                            self._drop_marker = None
                    marks.set()
                if loses is not None and loses.is_set():
                    self.dropped += 1
                    break  # the reply is lost and the connection with it
                if self.mode == DELAY and self.delay_seconds > 0:
                    await asyncio.sleep(self.delay_seconds)
                dst.write(data)
                await dst.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            for w in (dst, other):
                with contextlib.suppress(Exception):
                    w.transport.abort()
                self._writers.discard(w)
