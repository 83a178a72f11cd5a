"""``sa-fence demo --side-effects``: a paused worker's e-mail never leaves.

The story of ``sa-fence demo``, with an e-mail:

1. Worker A (a process of its own) takes lease ``job:1``, sets the job's
   result and, in the same transaction, enqueues its "job 1 is done" e-mail
   with :func:`sa_fence.side_effect`: a procrastinate job row, not sent yet.
2. The demo freezes A with ``SIGSTOP`` past its TTL.  Worker B takes the
   lease over, does the same and commits: its row and its e-mail job commit
   together.
3. A resumes and commits.  Lease scope refuses the commit
   (:class:`~sa_fence.StaleTokenError`), so A's e-mail job never existed
   for any worker.
4. A procrastinate worker process delivers the queue to a mail API on
   loopback (an HTTP receiver in the demo process that deduplicates on the
   ``Idempotency-Key`` header).  The demo SIGKILLs that worker while the
   receiver holds its request open, mid-delivery; a second worker retries
   the stalled job with the same key and the receiver drops the duplicate.
   B's e-mail leaves exactly once.

With ``--unfenced`` the workers use plain sessions and enqueue the same jobs
in their transactions with procrastinate alone: A's commit goes through and
its e-mail goes out too.

Needs procrastinate (``pip install 'sa-fence[side-effects]'``).  The demo
creates procrastinate's tables with its schema manager in the temporary
database, as procrastinate documents (``procrastinate schema --apply``).
"""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import json
import os
import sys
import threading
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, TextIO

import sqlalchemy as sa

from ..errors import StaleTokenError
from ..integrations.side_effects import side_effect
from . import demo
from .demo import (
    EXIT_OK,
    EXIT_STORY,
    EXIT_USAGE,
    JOB_ID,
    LEASE_NAME,
    STARTUP_TIMEOUT,
    STEP_TIMEOUT,
    Demo,
    Emitter,
    StoryError,
    Timeline,
    Worker,
    wait_for,
)
from .demo_models import DemoJob

if TYPE_CHECKING:
    import procrastinate
    from sqlalchemy.orm import Session

MODULE = "sa_fence.cli.demo_side_effects"
#: How long the mail API keeps the first delivery open, at most (the demo kills the sender).
HOLD_TIMEOUT = 30.0
#: The delivery workers' heartbeat, and how old one must be for its jobs to count as stalled.
HEARTBEAT = 0.2
STALLED_AFTER = 1.0

INSTALL_HINT = (
    "`sa-fence demo --side-effects` needs procrastinate, the job queue side effects are "
    "enqueued on: pip install 'sa-fence[side-effects]'"
)


def make_app(conninfo: str) -> procrastinate.App:
    """The demo's queue: procrastinate on the temporary database, with one task."""
    import procrastinate

    app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=conninfo))

    @app.task(name="send_mail", retry=procrastinate.RetryStrategy(max_attempts=3, wait=1))
    def send_mail(api: str, to: str, subject: str, idempotency_key: str) -> None:
        """POST the e-mail to a mail API, with the key as its ``Idempotency-Key``."""
        request = urllib.request.Request(
            api,
            data=json.dumps({"to": to, "subject": subject}).encode(),
            headers={"Content-Type": "application/json", "Idempotency-Key": idempotency_key},
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=2 * HOLD_TIMEOUT) as response:
            response.read()

    return app


# ===================================================================== workers


def holder_main(stdin: TextIO, stdout: TextIO) -> int:
    """A or B: acquire, write the result and enqueue the e-mail; commit on ``write``."""
    return demo.serve(stdin, stdout, _write_and_enqueue)


def _write_and_enqueue(config: dict[str, Any], emit: Emitter, stdin: TextIO) -> demo.Work:
    fenced = bool(config["fenced"])
    who = str(config["result"])
    app = make_app(config["conninfo"])
    send_mail = app.tasks["send_mail"]

    def work(session: Session) -> None:
        mail = {"api": config["api"], "to": f"{who.lower()}@example.invalid"}
        mail["subject"] = f"job {JOB_ID} is done (by worker {who})"
        session.get_one(DemoJob, JOB_ID).result = who
        if fenced:
            effect = side_effect(session, send_mail, **mail)
            job_id, key = effect.job_id, effect.idempotency_key
        else:  # procrastinate alone, in the same transaction: the best without sa-fence
            key = f"unfenced-{uuid.uuid4()}"
            driver = session.connection().connection.driver_connection
            job_id = send_mail.configure(connection=driver).defer(**mail, idempotency_key=key)
        emit("enqueued", job_id=job_id, key=key, to=mail["to"])

        wait_for(stdin, "write")
        try:
            session.commit()
        except StaleTokenError as exc:
            session.rollback()
            emit("refused", error=type(exc).__name__, message=str(exc))
        else:
            emit("committed")

    return work


async def retry_stalled(app: procrastinate.App, within: float) -> list[Any]:
    """procrastinate's recovery for a worker that died mid-job (its docs run this
    as a periodic task): the jobs of stalled workers, retried; waits up to
    ``within`` seconds for there to be any (none then)."""
    deadline = time.monotonic() + within
    while True:
        stalled = list(
            await app.job_manager.get_stalled_jobs(seconds_since_heartbeat=STALLED_AFTER)
        )
        if stalled or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.1)
    for job in stalled:
        await app.job_manager.retry_job(job)
    return stalled


async def work_until_empty(app: procrastinate.App) -> None:
    """A procrastinate worker, one job at a time, beating its heart every HEARTBEAT
    seconds (what :func:`retry_stalled` reads), until the queue is empty."""
    await app.run_worker_async(
        wait=False,
        concurrency=1,
        update_heartbeat_interval=HEARTBEAT,
        install_signal_handlers=False,
        listen_notify=False,
    )


async def _deliver(app: procrastinate.App, recover: bool, emit: Emitter) -> None:
    async with app.open_async():
        if recover:
            stalled = await retry_stalled(app, STEP_TIMEOUT)
            emit("recovered", jobs=[job.id for job in stalled])
        emit("working")
        await work_until_empty(app)
    emit("drained")


def deliverer_main(stdin: TextIO, stdout: TextIO) -> int:
    """A procrastinate worker: on ``deliver``, work until the queue is empty, then exit."""
    emit = Emitter(stdout)
    try:
        config = json.loads(stdin.readline() or "{}")
        app = make_app(config["conninfo"])
        emit("ready", pid=os.getpid())
        wait_for(stdin, "deliver")
        asyncio.run(_deliver(app, bool(config["recover"]), emit))
        return EXIT_OK
    except Exception as exc:
        emit("error", error=type(exc).__name__, message=str(exc))
        return EXIT_STORY


def _entry(argv: list[str]) -> int:
    roles = {"worker": holder_main, "deliverer": deliverer_main}
    if len(argv) != 2 or argv[0] not in roles or not argv[1].isdigit():
        print(f"{MODULE} is started by `sa-fence demo --side-effects`.", file=sys.stderr)
        return EXIT_USAGE
    demo.die_with_parent(int(argv[1]))
    return roles[argv[0]](sys.stdin, sys.stdout)


# =================================================================== receiver


class LoopbackApi:
    """An HTTP API on loopback (the demo's mail API, the tests' webhook receiver).

    Its requests run on daemon threads of a ``ThreadingHTTPServer``; a
    subclass passes its handler (a :class:`PostHandler`) and URL path.  A
    handler may :meth:`hold` a request open, after it was accepted, until
    :meth:`release` (``holding``: from the start, else from
    :meth:`keep_open` on): the sender is still waiting for the answer when
    it is killed.
    """

    def __init__(
        self, handler: type[PostHandler], path: str, *, holding: bool, join_timeout: float
    ) -> None:
        self.arrived = threading.Event()
        self._release = threading.Event()
        if not holding:
            self._release.set()
        self._path = path
        self._join_timeout = join_timeout
        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}{self._path}"

    def hold(self) -> None:
        """Say a request arrived, and keep it open until :meth:`release` (at most HOLD_TIMEOUT)."""
        self.arrived.set()
        self._release.wait(HOLD_TIMEOUT)

    def keep_open(self) -> None:
        """From now on :meth:`hold` keeps requests open, until :meth:`release`."""
        self._release.clear()

    def release(self) -> None:
        self._release.set()

    def close(self) -> None:
        self._release.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=self._join_timeout)


class PostHandler(http.server.BaseHTTPRequestHandler):
    """A :class:`LoopbackApi`'s request handler: JSON POSTs keyed by ``Idempotency-Key``."""

    def posted(self) -> tuple[str, Any]:
        """The request's ``Idempotency-Key`` (empty if none) and its JSON body."""
        key = self.headers.get("Idempotency-Key", "")
        return key, json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))

    def answer(self, status: int) -> None:
        """An empty answer; none if the sender is gone (it may be dead by now)."""
        with contextlib.suppress(OSError):
            self.send_response(status)
            self.send_header("Content-Length", "0")
            self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


class MailApi(LoopbackApi):
    """A mail API on loopback: it sends (counts) each e-mail once per ``Idempotency-Key``.

    The first request is held open after it was accepted, until ``release``:
    the sender is still waiting for the answer when the demo kills it.
    """

    def __init__(self, timeline: Timeline) -> None:
        self.attempts: list[tuple[str, dict[str, Any]]] = []
        self.sent: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()
        api = self

        class Handler(PostHandler):
            def do_POST(self) -> None:
                key, mail = self.posted()
                with api._lock:
                    first = not api.attempts
                    api.attempts.append((key, mail))
                    duplicate = key in api.sent
                    if not duplicate:
                        api.sent[key] = mail
                if duplicate:
                    timeline.say("mail", f"duplicate of {key!r}: answered, NOT sent again")
                else:
                    timeline.say("mail", f"SENT {mail['subject']!r} to {mail['to']} (key {key!r})")
                if first:
                    api.hold()
                self.answer(200 if duplicate else 202)

        super().__init__(Handler, "/v1/mail", holding=True, join_timeout=STEP_TIMEOUT)


# =============================================================== orchestrator


@dataclass
class _SideEffectsDemo(Demo):
    conninfo: str = ""
    api: MailApi | None = field(default=None, repr=False)
    module: ClassVar[str] = MODULE

    def intro(self) -> None:
        mode = (
            "FENCED: each worker binds its lease and enqueues with sa_fence.side_effect()"
            if self.fenced
            else "UNFENCED: plain sessions enqueue the same jobs with procrastinate alone"
        )
        self.echo("sa-fence demo --side-effects: a paused worker's e-mail, and its successor's")
        self.summary("mode", mode)

    def story(self, engine: sa.Engine) -> int:
        from .schema import upgrade_demo_schema

        t = Timeline(self.out, self.client, self.prefix + LEASE_NAME)
        t.header()
        upgrade_demo_schema(engine)
        conninfo = engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
        app = make_app(conninfo)
        with app.open():
            app.schema_manager.apply_schema()
        t.say(
            "setup",
            "created the fenced jobs table and the lease register (alembic upgrade head), "
            "and procrastinate's queue tables with its schema manager (procrastinate "
            "schema --apply)",
        )
        with engine.begin() as conn:
            if not self.fenced:  # nothing in the database checks the writers (as `demo`)
                demo.drop_guards(conn)
            conn.execute(sa.insert(DemoJob).values(id=JOB_ID, result=None, fence=0))
        self.api = api = MailApi(t)
        try:
            return self._play(engine, conninfo, api, t)
        finally:
            api.close()

    def _play(self, engine: sa.Engine, conninfo: str, api: MailApi, t: Timeline) -> int:
        """The acts after the setup; the verdict's exit status."""
        t.say("setup", f"job {JOB_ID} inserted; a mail API listens on {api.url}")
        a, b = self.start_pair(t, "", conninfo=conninfo, api=api.url)
        enq_a = self._a_enqueues_and_freezes(a, t)
        enq_b = self._b_takes_over(b, t)
        written = self._a_wakes_and_commits(a, t)
        a.finish()
        b.finish()
        t.say("queue", f"jobs committed for the workers: {_jobs_text(self.jobs(engine))}")
        self._deliver(engine, conninfo, api, t)
        return self.verdict_mail(engine, written, enq_a, enq_b, api)

    def _a_enqueues_and_freezes(self, a: Worker, t: Timeline) -> dict[str, Any]:
        """A takes the lease, enqueues its e-mail uncommitted, and is stopped past its TTL."""
        ttl = self.ttl
        token_a = self.take_lease(a, t)
        t.say("A", f"acquired lease {LEASE_NAME!r} with token {token_a}, TTL {ttl:g} s")
        enq_a = a.expect("enqueued")
        t.say(
            "A",
            f"set result='A' and enqueued its e-mail to {enq_a['to']} in the same transaction "
            f"(job {enq_a['job_id']}, key {enq_a['key']!r}); not committed yet",
        )
        a.stop()
        t.say(
            "demo",
            "SIGSTOP A, like a long GC pause; it stays stopped until its lease has expired "
            "and B has taken over",
        )
        self.wait_until_expired(time.monotonic())
        t.say("redis", f"A's lease has expired (TTL {ttl:g} s); A is stopped and cannot notice")
        return enq_a

    def _b_takes_over(self, b: Worker, t: Timeline) -> dict[str, Any]:
        """B takes the lease, enqueues its e-mail, commits and releases."""
        token_b = self.take_lease(b, t)
        t.say("B", f"acquired lease {LEASE_NAME!r} with token {token_b}")
        enq_b = b.expect("enqueued")
        t.say("B", f"set result='B' and enqueued its e-mail (key {enq_b['key']!r})")
        b.send("write")
        if b.expect("committed", "refused")["event"] != "committed":
            raise StoryError("B's commit was refused")
        t.say("B", "committed: its row and its e-mail job, together")
        b.send("release")
        b.expect("released")
        return enq_b

    def _a_wakes_and_commits(self, a: Worker, t: Timeline) -> dict[str, Any]:
        """SIGCONT A; returns its commit's event (committed or refused)."""
        a.resume()
        t.say("demo", "SIGCONT A: it carries on as if it still held the lease")
        a.send("write")
        written = a.expect("committed", "refused")
        if written["event"] == "refused":
            t.say("A", f"commit REFUSED: {written['error']}: {written['message']}")
        else:
            t.say("A", "committed: its row and its e-mail job (nothing checked the lease)")
        a.send("release")
        a.expect("released")
        return written

    def _deliver(self, engine: sa.Engine, conninfo: str, api: MailApi, t: Timeline) -> None:
        """W1 is killed mid-delivery; W2 retries its stalled job and drains the queue."""
        first = self.worker("W1", {"conninfo": conninfo, "recover": False}, t, "deliverer")
        first.expect("ready", timeout=STARTUP_TIMEOUT)
        first.send("deliver")
        t.say("W1", f"procrastinate worker started (pid {first.pid}); delivering")
        if not api.arrived.wait(STEP_TIMEOUT):
            raise StoryError("the first delivery never reached the mail API")
        first.kill()
        t.say("demo", "SIGKILL W1 mid-delivery: the API took the e-mail, W1 never heard back")
        api.release()
        t.say("queue", f"after the kill: {_jobs_text(self.jobs(engine))}")

        second = self.worker("W2", {"conninfo": conninfo, "recover": True}, t, "deliverer")
        second.expect("ready", timeout=STARTUP_TIMEOUT)
        second.send("deliver")
        recovered = second.expect("recovered", timeout=STEP_TIMEOUT + STARTUP_TIMEOUT)
        t.say("W2", f"retried the stalled job(s) {recovered['jobs']} of the dead worker")
        second.expect("working")
        second.expect("drained", timeout=STEP_TIMEOUT * 2)
        second.finish()
        t.say("W2", f"queue drained: {_jobs_text(self.jobs(engine))}")

    def jobs(self, engine: sa.Engine) -> list[tuple[int, str]]:
        with engine.connect() as conn:
            rows = conn.execute(
                sa.text("SELECT id, status::text FROM procrastinate_jobs ORDER BY id")
            ).all()
        return [(int(i), str(s)) for i, s in rows]

    def verdict_mail(
        self,
        engine: sa.Engine,
        a_written: dict[str, Any],
        enq_a: dict[str, Any],
        enq_b: dict[str, Any],
        api: MailApi,
    ) -> int:
        result, fence = self.row(engine)
        sent_to = sorted(m["to"] for m in api.sent.values())
        self.echo()
        self.summary("final row", f"job {JOB_ID}: result={result!r}, fence={fence}")
        self.summary(
            "mail API",
            f"{len(api.attempts)} delivery attempt(s), {len(api.sent)} e-mail(s) sent: "
            + (", ".join(sent_to) or "none"),
        )
        if self.fenced:
            if a_written["event"] != "refused":
                raise StoryError("A's stale commit was NOT refused")
            if list(api.sent) != [enq_b["key"]] or result != "B":
                raise StoryError(
                    f"only B's e-mail should have been sent, once; sent: {sent_to}, row {result!r}"
                )
            if [k for k, _ in api.attempts] != [enq_b["key"]] * 2:
                raise StoryError(f"expected two attempts with B's key, got {api.attempts}")
            self.summary(
                "verdict",
                f"OK: A's e-mail (key {enq_a['key']!r}) never left: its job was refused with "
                "its commit. B's e-mail left exactly once: delivered at least once, the "
                "retry after the kill carried the same key, and the API dropped it.",
            )
            return EXIT_OK
        if a_written["event"] != "committed" or enq_a["key"] not in api.sent:
            raise StoryError(f"without fencing A's e-mail should have gone out; sent: {sent_to}")
        self.echo("  DOUBLE E-MAIL: the stale worker A's e-mail went out next to B's")
        self.summary(
            "verdict",
            "the queue alone does not know A's lease expired. Run `sa-fence demo "
            "--side-effects` (without --unfenced) to see A's e-mail never leave.",
        )
        return EXIT_OK


def _jobs_text(jobs: list[tuple[int, str]]) -> str:
    return ", ".join(f"job {i} {s}" for i, s in jobs) or "none"


def run(*, pg: str, redis_url: str, ttl: float, fenced: bool, out: TextIO | None = None) -> int:
    """Play the side-effects story once; the exit status is ``sa-fence demo``'s."""
    try:
        import procrastinate  # noqa: F401
    except ImportError:
        print(f"sa-fence demo: error: {INSTALL_HINT}", file=sys.stderr)
        return EXIT_USAGE
    return demo.play(_SideEffectsDemo, pg=pg, redis_url=redis_url, ttl=ttl, fenced=fenced, out=out)


if __name__ == "__main__":
    sys.exit(_entry(sys.argv[1:]))
