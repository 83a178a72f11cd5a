"""The side-effect tests' queue, worker processes and receivers (all real, on loopback).

- :func:`make_app`: a procrastinate ``App`` on the run's database with the
  tasks the tests enqueue: ``send_webhook`` (an HTTP POST carrying the
  job's ``Idempotency-Key``) and ``send_mail`` (an SMTP message whose
  ``Message-ID`` is derived from the key), and ``send_webhook_unkeyed``, the
  same POST with a fresh key per attempt (what code without a stable key
  does).
- Child side (``python -m tests._side_effects DSN``, run from the repository
  root): a procrastinate worker in its own process.  With ``--recover`` it
  first retries the jobs of stalled workers (procrastinate's documented
  recovery), then works until the queue is empty and exits.
- :class:`HttpSink` and :class:`SmtpSink`: receivers that count every
  delivery attempt and the effects left after deduplicating on the key.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import smtplib
import subprocess
import sys
import threading
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from email.message import EmailMessage
from pathlib import Path
from typing import Any

import procrastinate

from sa_fence.cli.demo_side_effects import (
    LoopbackApi,
    PostHandler,
    retry_stalled,
    work_until_empty,
)
from tests._redis_server import free_port

ROOT = Path(__file__).resolve().parent.parent
#: A worker imports procrastinate, psycopg and asyncio before it works.
WORKER_TIMEOUT = 60.0
#: A sink holding a delivery waits at most this long for the test.
HOLD_TIMEOUT = 30.0


def message_id(key: str, domain: str = "sa-fence.invalid") -> str:
    """A Message-ID made from an idempotency key: the same key, the same Message-ID."""
    return f"<{hashlib.sha256(key.encode()).hexdigest()[:40]}@{domain}>"


def make_app(conninfo: str, *, sync: bool = False) -> procrastinate.App:
    """The queue: procrastinate on ``conninfo`` with the tasks below."""
    connector: Any = (
        procrastinate.SyncPsycopgConnector(conninfo=conninfo)
        if sync
        else procrastinate.PsycopgConnector(conninfo=conninfo)
    )
    app = procrastinate.App(connector=connector)
    retry = procrastinate.RetryStrategy(max_attempts=3, wait=0)

    @app.task(name="send_webhook", retry=retry)
    def send_webhook(url: str, body: dict[str, Any], idempotency_key: str) -> None:
        request = urllib.request.Request(
            url,
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", "Idempotency-Key": idempotency_key},
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=HOLD_TIMEOUT * 2) as response:
            response.read()

    @app.task(name="send_webhook_unkeyed", retry=retry)
    def send_webhook_unkeyed(url: str, body: dict[str, Any], idempotency_key: str) -> None:
        # What code without a stable key does: a new key per attempt.
        send_webhook(url, body, idempotency_key=str(uuid.uuid4()))

    @app.task(name="send_mail", retry=retry)
    def send_mail(host: str, port: int, to: str, subject: str, idempotency_key: str) -> None:
        msg = EmailMessage()
        msg["From"] = "jobs@example.invalid"
        msg["To"] = to
        msg["Subject"] = subject
        msg["Message-ID"] = message_id(idempotency_key)
        msg["Idempotency-Key"] = idempotency_key
        msg.set_content(f"{subject}\n")
        with smtplib.SMTP(host, port, timeout=HOLD_TIMEOUT) as smtp:
            smtp.send_message(msg)

    return app


def apply_schema(conninfo: str) -> None:
    """Create procrastinate's tables the way it documents (its schema manager)."""
    app = make_app(conninfo, sync=True)
    with app.open():
        app.schema_manager.apply_schema()


def clear_queue(conninfo: str) -> None:
    import psycopg

    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute(
            "TRUNCATE procrastinate_jobs, procrastinate_events, procrastinate_workers,"
            " procrastinate_periodic_defers CASCADE"
        )


def jobs(conninfo: str) -> list[dict[str, Any]]:
    """Every job row: id, task, status, attempts, args."""
    import psycopg
    from psycopg.rows import dict_row

    with psycopg.connect(conninfo, row_factory=dict_row) as conn:
        return conn.execute(
            "SELECT id, task_name, status::text AS status, attempts, args"
            " FROM procrastinate_jobs ORDER BY id"
        ).fetchall()


# ---------------------------------------------------------------- child side


async def _work(conninfo: str, recover: bool) -> None:
    app = make_app(conninfo)
    async with app.open_async():
        # a worker that died mid-job leaves its jobs "doing" until they are retried
        if recover and not await retry_stalled(app, HOLD_TIMEOUT):
            raise SystemExit("no stalled job to recover")
        await work_until_empty(app)


def child_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="tests._side_effects")
    parser.add_argument("conninfo")
    parser.add_argument("--recover", action="store_true")
    args = parser.parse_args(argv)
    asyncio.run(_work(args.conninfo, args.recover))
    return 0


# --------------------------------------------------------------- parent side


def start_worker(conninfo: str, *, recover: bool = False) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "tests._side_effects", conninfo]
    if recover:
        cmd.append("--recover")
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def run_worker(conninfo: str, *, recover: bool = False) -> str:
    """Run a worker process until the queue is empty; its output (it must exit 0)."""
    proc = start_worker(conninfo, recover=recover)
    try:
        out, _ = proc.communicate(timeout=WORKER_TIMEOUT)
    finally:
        stop(proc)
    text = out.decode(errors="replace")
    assert proc.returncode == 0, f"worker exited {proc.returncode}:\n{text}"
    return text


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=WORKER_TIMEOUT)
    if proc.stdout is not None:
        proc.stdout.close()


# ------------------------------------------------------------------ receivers


@dataclass
class Deliveries:
    """What a receiver saw: every attempt, and the effects left after deduplication."""

    attempts: list[tuple[str, Any]] = field(default_factory=list)
    effects: dict[str, Any] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, key: str, payload: Any) -> bool:
        """Count an attempt; apply its effect unless the key was seen (True if applied)."""
        with self.lock:
            self.attempts.append((key, payload))
            if key in self.effects:
                return False
            self.effects[key] = payload
            return True


class HttpSink(LoopbackApi):
    """An HTTP receiver on loopback that deduplicates POSTs on ``Idempotency-Key``.

    ``hold_first()`` makes it keep the first request open after applying its
    effect, until ``release()``: a worker killed then is killed mid-delivery.
    """

    def __init__(self) -> None:
        self.seen = Deliveries()
        self.refused: list[str] = []
        self._failures = 0
        sink = self

        class Handler(PostHandler):
            def do_POST(self) -> None:
                key, body = self.posted()
                with sink.seen.lock:
                    fail = sink._failures > 0
                    sink._failures -= fail
                if fail:  # down for maintenance: nothing applied
                    sink.refused.append(key)
                    self.send_error(503)
                    return
                applied = sink.seen.record(key, body)
                sink.hold()
                self.answer(201 if applied else 200)

        super().__init__(Handler, "/hooks", holding=False, join_timeout=HOLD_TIMEOUT)

    def fail_next(self, n: int) -> None:
        """Answer the next ``n`` requests 503 without applying them."""
        self._failures = n

    def hold_first(self) -> None:
        self.keep_open()


class SmtpSink:
    """An SMTP receiver on loopback (aiosmtpd) that deduplicates on ``Message-ID``."""

    def __init__(self) -> None:
        from aiosmtpd.controller import Controller

        self.seen = Deliveries()
        seen = self.seen

        class Handler:
            async def handle_DATA(self, server: Any, session: Any, envelope: Any) -> str:
                from email import message_from_bytes

                msg = message_from_bytes(envelope.content)
                seen.record(
                    str(msg["Message-ID"]),
                    {"to": list(envelope.rcpt_tos), "subject": str(msg["Subject"])},
                )
                return "250 OK"

        self.port = free_port()
        self._controller = Controller(Handler(), hostname="127.0.0.1", port=self.port)
        self._controller.start()

    def close(self) -> None:
        self._controller.stop()


@contextlib.contextmanager
def sinks() -> Iterator[tuple[HttpSink, SmtpSink]]:
    http_sink = HttpSink()
    try:
        smtp_sink = SmtpSink()
        try:
            yield http_sink, smtp_sink
        finally:
            smtp_sink.close()
    finally:
        http_sink.close()


if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1:]))
