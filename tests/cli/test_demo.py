"""``sa-fence demo`` as a user runs it: the console script, in a subprocess.

Each run uses real PostgreSQL and Redis, creates its own database and key
prefix, and must leave neither behind.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO, TYPE_CHECKING

import pytest
import sqlalchemy as sa

from tests.conftest import PG_SERVER, REDIS_URL

if TYPE_CHECKING:
    import redis

pytestmark = pytest.mark.slow

SA_FENCE = Path(sys.executable).parent / "sa-fence"
TTL = "0.3"
RUN_TIMEOUT = 120


def _env(**overrides: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SA_FENCE_DEMO_")}
    env.update(overrides)
    return env


def _demo(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(SA_FENCE), "demo", *args],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
        env=_env() if env is None else env,
        check=False,
    )


def _flat(output: str) -> str:
    """The output with all whitespace runs made one space (the timeline wraps long lines)."""
    return " ".join(output.split())


def _names(output: str) -> tuple[str, str]:
    """The temporary database and Redis key prefix the demo announced."""
    database = re.search(r"database (sa_fence_demo_[0-9a-f]{8}) ", _flat(output))
    prefix = re.search(r"keys under '(sa_fence_demo:[0-9a-f]{8}:)'", _flat(output))
    assert database, output
    assert prefix, output
    return database.group(1), prefix.group(1)


def _assert_setup_reads_as_setup(output: str) -> None:
    """The admin's expected warning is said in words, not shown as a fault (issue 12)."""
    setup = " ".join(" ".join(line.split()) for line in output.splitlines() if " setup " in line)
    assert "logged (warning)" not in setup, setup
    assert "flushing fenced objects without a lease" not in _flat(output)
    assert "inside sa_fence.unfenced(session), the opt-out for admin scripts" in _flat(output)


def _assert_cleaned_up(
    output: str, engine: sa.Engine, redis_client: redis.Redis
) -> tuple[str, str]:
    database, prefix = _names(output)
    with engine.connect() as conn:
        left = conn.scalar(
            sa.text("SELECT count(*) FROM pg_database WHERE datname = :name"), {"name": database}
        )
    assert left == 0, f"the demo left database {database} behind"
    assert list(redis_client.scan_iter(match=prefix + "*")) == []
    assert f"dropped database {database}" in _flat(output)
    return database, prefix


def test_the_fenced_demo_shows_the_paused_workers_late_write_refused(
    engine: sa.Engine, redis_client: redis.Redis
) -> None:
    run = _demo("--ttl", TTL, "--pg", PG_SERVER, "--redis", REDIS_URL)
    assert run.returncode == 0, run.stdout + run.stderr
    out = _flat(run.stdout)
    assert "mode FENCED" in out
    # the story, in order: A holds token 1, is stopped, B writes with token 2, A is refused
    story = [
        "A (token 1) A acquired lease 'job:1' with token 1, TTL 0.3 s",
        "A (token 1) demo SIGSTOP A",
        "nobody redis A's lease has expired",
        "B (token 2) B acquired lease 'job:1' with token 2",
        "B (token 2) B wrote result='B' and committed; row now job 1: result='B', fence=2",
        "nobody demo SIGCONT A after",
        "nobody A writes result='A' and commits (UPDATE jobs ... WHERE id = 1 AND fence <= 1)",
        "nobody A REFUSED by the fence: StaleTokenError: UPDATE on table 'jobs' refused: "
        "token 1 of lease 'job:1' is stale for row(s) 1 (fence 2).",
    ]
    positions = [out.find(line) for line in story]
    assert -1 not in positions, run.stdout
    assert positions == sorted(positions), run.stdout
    assert "final row job 1: result='B', fence=2" in out
    assert "verdict OK: A's stale write (token 1) was refused" in out
    assert "DOUBLE WRITE" not in out
    assert run.stderr == ""
    _assert_setup_reads_as_setup(run.stdout)
    assert "their guard triggers" in out
    _assert_cleaned_up(run.stdout, engine, redis_client)


def test_the_unfenced_demo_shows_the_double_write_and_reads_its_servers_from_the_env(
    engine: sa.Engine, redis_client: redis.Redis
) -> None:
    env = _env(SA_FENCE_DEMO_PG=PG_SERVER, SA_FENCE_DEMO_REDIS=REDIS_URL)
    run = _demo("--unfenced", "--ttl", TTL, env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    out = _flat(run.stdout)
    assert "mode UNFENCED" in out
    assert "B wrote result='B' and committed; row now job 1: result='B', fence=0" in out
    assert "A committed; row now job 1: result='A', fence=0" in out
    assert "final row job 1: result='A', fence=0" in out
    assert "\n  DOUBLE WRITE: B's result was overwritten by A's stale write\n" in run.stdout
    assert "REFUSED" not in out
    assert "StaleTokenError" not in out
    _assert_setup_reads_as_setup(run.stdout)
    assert "guard triggers," not in out  # --unfenced does not claim them (issue 12)
    assert "no guard triggers (--unfenced: nothing in the database checks the writers)" in out
    _assert_cleaned_up(run.stdout, engine, redis_client)


def test_the_demo_names_an_unreachable_redis_and_how_to_start_it() -> None:
    run = _demo("--pg", PG_SERVER, "--redis", "redis://127.0.0.1:1/0")
    assert run.returncode == 3
    assert run.stdout == ""
    assert "cannot reach Redis at redis://127.0.0.1:1/0: " in run.stderr
    assert "redis-server" in run.stderr
    assert "--redis" in run.stderr


def test_the_demo_shows_an_unreachable_redis_without_its_password() -> None:
    run = _demo("--pg", PG_SERVER, "--redis", "redis://user:s3cret@127.0.0.1:1/0")
    assert run.returncode == 3
    assert "cannot reach Redis at redis://user:***@127.0.0.1:1/0: " in run.stderr
    assert "s3cret" not in run.stdout + run.stderr


def test_the_demo_names_an_unreachable_postgresql_and_how_to_start_it() -> None:
    run = _demo("--pg", "postgresql+psycopg://postgres@127.0.0.1:1", "--redis", REDIS_URL)
    assert run.returncode == 3
    assert run.stdout == ""
    assert "cannot reach PostgreSQL at postgresql+psycopg://postgres@127.0.0.1:1" in run.stderr
    assert "pg_ctlcluster" in run.stderr
    assert "--pg" in run.stderr


def _pump(pipe: IO[str], lines: queue.Queue[str | None]) -> None:
    for line in pipe:
        lines.put(line)
    lines.put(None)


def test_a_demo_terminated_while_worker_a_is_stopped_kills_its_workers_and_drops_its_database(
    engine: sa.Engine, redis_client: redis.Redis
) -> None:
    proc = subprocess.Popen(
        [str(SA_FENCE), "demo", "--ttl", "2", "--pg", PG_SERVER, "--redis", REDIS_URL],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=_env(),
    )
    try:
        assert proc.stdout is not None
        lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=_pump, args=(proc.stdout, lines), daemon=True).start()
        seen: list[str] = []
        while not any("SIGSTOP A" in line for line in seen):  # A is stopped for 4 s now
            line = lines.get(timeout=60)
            assert line is not None, "".join(seen)
            seen.append(line)
        proc.terminate()
        proc.wait(timeout=60)
        while (line := lines.get(timeout=60)) is not None:  # the rest, up to EOF
            seen.append(line)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out = "".join(seen)
    assert proc.returncode == 128 + signal.SIGTERM, out
    assert "REFUSED" not in out
    for pid in re.findall(r"worker process started \(pid (\d+)\)", out):
        with pytest.raises(ProcessLookupError):
            os.kill(int(pid), 0)
    _assert_cleaned_up(out, engine, redis_client)
