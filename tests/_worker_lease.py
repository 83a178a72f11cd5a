"""A lease-holding worker in its own process, and the test's handle on it.

Child side (``python -m tests._worker_lease``, run from the repository root):
takes lease ``job:1`` with the given TTL, loads job 1 in a session (with
the sa-fence flush hook, or a plain session with ``--unfenced``), prints
``{"event": "holding", ...}`` and blocks on stdin.  On ``write`` it sets
``result``, adds an ``Audit`` row in the same unit of work, commits, prints
``committed`` or ``stale`` (with the StaleTokenError's attributes), releases
the lease, prints ``done`` and exits 0.  One JSON object per stdout line.

Parent side: :class:`LeaseWorker` starts the child, reads its events with
a timeout on every read, stops/resumes it with SIGSTOP/SIGCONT (waiting
until the kernel reports each), and kills it on exit from its ``with`` block.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import queue
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from sa_fence import testing

ROOT = Path(__file__).resolve().parent.parent
LEASE_NAME = "job:1"
JOB_ID = 1
#: The child imports SQLAlchemy, psycopg and redis before it answers.
STARTUP_TIMEOUT = 60.0
STEP_TIMEOUT = 30.0


# ---------------------------------------------------------------- child side


def _emit(event: str, **data: Any) -> None:
    print(json.dumps({"event": event, **data}), flush=True)


def _wait_for(command: str) -> None:
    line = sys.stdin.readline()
    if not line:  # the test went away
        raise SystemExit(1)
    if line.strip() != command:
        raise RuntimeError(f"expected {command!r} on stdin, got {line.strip()!r}")


def child_main(argv: list[str]) -> int:
    import redis
    import sqlalchemy as sa
    from sqlalchemy.orm import Session, sessionmaker

    import sa_fence
    from tests.models import SEQUENCE, Audit, Job

    parser = argparse.ArgumentParser(prog="tests._worker_lease")
    parser.add_argument("--db", required=True)
    parser.add_argument("--redis", required=True)
    parser.add_argument("--prefix", required=True)
    parser.add_argument("--ttl", type=float, required=True)
    parser.add_argument("--result", required=True)
    parser.add_argument("--unfenced", action="store_true")
    args = parser.parse_args(argv)

    engine = sa.create_engine(args.db)
    client = redis.Redis.from_url(args.redis)
    try:
        fencer = sa_fence.Fencer(client, engine, sequence=SEQUENCE, key_prefix=args.prefix)
        make_session: sessionmaker[Session] = sessionmaker(engine)
        if not args.unfenced:
            sa_fence.install(make_session)
        lease = fencer.acquire(LEASE_NAME, args.ttl)
        with make_session() as session:
            if not args.unfenced:
                lease.bind(session)
            job = session.get_one(Job, JOB_ID)
            _emit("holding", token=lease.token, result=job.result, fence=job.fence)

            _wait_for("write")
            job.result = args.result
            session.add(Audit(job_id=JOB_ID, message=f"{args.result} wrote job {JOB_ID}"))
            try:
                session.commit()
            except sa_fence.StaleTokenError as exc:
                session.rollback()
                _emit(
                    "stale",
                    message=str(exc),
                    table=exc.table,
                    statement=exc.statement,
                    token=exc.token,
                    primary_keys=[list(pk) for pk in exc.primary_keys],
                    current_fences=list(exc.current_fences),
                    lease_name=exc.lease_name,
                )
            else:
                _emit("committed", token=lease.token)
        _emit("done", released=lease.release())
        return 0
    finally:
        client.close()
        engine.dispose()


# --------------------------------------------------------------- parent side


class WorkerFailed(AssertionError):
    """The child did not do what the test expected (the message has its stderr)."""


class LeaseWorker:
    """The test's handle on one child worker process."""

    def __init__(self, argv: list[str]) -> None:
        self._events: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._stderr: list[str] = []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests._worker_lease", *argv],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        assert self.proc.stdout is not None
        assert self.proc.stderr is not None
        self._threads = [
            threading.Thread(target=self._pump_events, args=(self.proc.stdout,), daemon=True),
            threading.Thread(target=self._pump_stderr, args=(self.proc.stderr,), daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    @classmethod
    def start(
        cls, *, db: str, redis: str, prefix: str, ttl: float, result: str, fenced: bool
    ) -> LeaseWorker:
        argv = ["--db", db, "--redis", redis, "--prefix", prefix, "--ttl", str(ttl)]
        argv += ["--result", result]
        return cls([*argv, "--unfenced"] if not fenced else argv)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _pump_events(self, pipe: IO[str]) -> None:
        for line in pipe:
            try:
                self._events.put(json.loads(line))
            except ValueError:
                self._stderr.append(f"(stdout) {line.rstrip()}")
        self._events.put(None)

    def _pump_stderr(self, pipe: IO[str]) -> None:
        for line in pipe:
            self._stderr.append(line.rstrip("\n"))

    def stderr(self) -> str:
        return "\n".join(self._stderr)

    def expect(self, *wanted: str, timeout: float = STEP_TIMEOUT) -> dict[str, Any]:
        """The child's next event; it must be one of ``wanted``."""
        try:
            event = self._events.get(timeout=timeout)
        except queue.Empty:
            raise WorkerFailed(
                f"worker said nothing within {timeout} s (wanted {wanted}); stderr:\n"
                + self.stderr()
            ) from None
        if event is None:
            code = self.proc.wait(timeout=STEP_TIMEOUT)
            raise WorkerFailed(
                f"worker exited with {code} before {wanted}; stderr:\n{self.stderr()}"
            )
        if event.get("event") not in wanted:
            raise WorkerFailed(f"worker reported {event}, wanted {wanted}")
        return event

    def send(self, command: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()

    def stop(self) -> None:
        """SIGSTOP; returns once the kernel reports the child stopped."""
        self._signal(testing.pause)

    def resume(self) -> None:
        """SIGCONT; returns once the kernel reports the child running."""
        self._signal(testing.resume)

    def _signal(self, action: Callable[[subprocess.Popen[Any], float], None]) -> None:
        try:
            action(self.proc, STEP_TIMEOUT)
        except (ChildProcessError, TimeoutError) as exc:
            raise WorkerFailed(f"{exc}; stderr:\n{self.stderr()}") from None

    def wait(self) -> int:
        """Close stdin and return the exit status (within the step timeout)."""
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        return self.proc.wait(timeout=STEP_TIMEOUT)

    def kill(self) -> None:
        """Kill the child if it still runs (SIGKILL ends a stopped process too)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=STEP_TIMEOUT)
        for thread in self._threads:  # they reach EOF now that the child is gone
            thread.join(timeout=STEP_TIMEOUT)
        for pipe in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if pipe is not None and not pipe.closed:
                with contextlib.suppress(OSError):  # e.g. a broken pipe on flush
                    pipe.close()

    def __enter__(self) -> LeaseWorker:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.kill()


if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1:]))
