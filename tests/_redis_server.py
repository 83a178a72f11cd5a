"""A private redis-server for fault tests: paused, killed, restarted at will.

Fault tests never touch the shared Redis server: each starts its own on a
free loopback port, with persistence off, and stops it afterwards.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from tests._tools import missing


def free_port(host: str = "127.0.0.1") -> int:
    """A free loopback port, and one no other pytest-xdist worker of this run is given: the
    kernel may hand two workers the same free port before either starts its server on it, so
    each worker takes only its share of them (by half the port: Linux hands out odd ones)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    index = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    for _ in range(1000):
        with socket.socket() as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        if (port >> 1) % workers == index % workers:
            return port
    raise RuntimeError(f"no free port for pytest-xdist worker {index} of {workers}")


class RedisServer:
    def __init__(self, proc: subprocess.Popen[bytes], port: int) -> None:
        self.proc = proc
        self.port = port

    def client(self, socket_timeout: float = 0.2) -> redis.Redis:
        """A client with bounded calls and no retries of its own (sa-fence retries)."""
        return redis.Redis(
            host="127.0.0.1",
            port=self.port,
            socket_timeout=socket_timeout,
            socket_connect_timeout=socket_timeout,
            retry=Retry(NoBackoff(), 0),
        )

    def pause(self) -> None:
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(timeout=10)


@contextmanager
def private_redis() -> Iterator[RedisServer]:
    binary = shutil.which("redis-server")
    if binary is None:
        missing("redis-server is not on PATH", "apt-get install redis-server")
    port = free_port()
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    server = RedisServer(proc, port)
    try:
        probe = server.client(socket_timeout=0.5)
        deadline = time.monotonic() + 10
        while True:
            try:
                probe.ping()
                break
            except redis.exceptions.ConnectionError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise
                time.sleep(0.02)
        probe.close()
        yield server
    finally:
        server.kill()
