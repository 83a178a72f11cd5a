"""The benchmarks run: every section of ``make bench`` and ``sa-fence bench``,
with tiny counts.  Nothing here looks at a time: machine noise never fails it."""

from __future__ import annotations

import io
import re
import subprocess
import sys
from pathlib import Path

import pytest
import redis
import sqlalchemy as sa

from sa_fence.cli import bench as _bench
from sa_fence.db.register import Register
from sa_fence.db.tokens import TokenSource
from tests.conftest import PG_SERVER, REDIS_URL

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def test_every_benchmark_section_runs_and_prints_its_table(tmp_path: Path) -> None:
    plot = tmp_path / "flush.svg"
    proc = subprocess.run(
        [sys.executable, "-m", "tests.benchmarks", "--quick", "--quiet", "--plot", str(plot)],
        cwd=ROOT,
        env={"SA_FENCE_TEST_PG": PG_SERVER, "SA_FENCE_TEST_REDIS": REDIS_URL, "PATH": ""},
        capture_output=True,
        text=True,
        timeout=600,  # a hang guard only: about 50 s on a loaded 2-core machine
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for heading in (
        "lease cycle (acquire + release)",
        "hand-written floor",
        "the token statement alone",
        "redis-py Lock",
        "PG advisory lock",
        "lease scope: on",
        "flush (load + change/delete + commit)",
        "update 1 row",
        "delete 1 row",
        "statements sent by one flush",
        "where the fenced 1-row update's time goes",
        "the register check in SQL",
        "flush CPU time of this process",
        "the same, server backend CPU per transaction (schedstat)",
        "fenced over skipped: lease scope",
        "guard trigger (BEFORE INSERT OR UPDATE OR DELETE, policy reject) vs no trigger",
        "insert 20 rows",
        "contention:",
        "stale writes accepted",
        "where the workers' time goes",
        "contention jobs/s, sa-fence below redis-py",
        "memory: RSS",
        "Python function calls per op (cProfile",
        "where the calls go: fenced vs plain, update 1 row",
        "targets",
        "sa-fence's own calls, update 1 row",
        "sa-fence's own calls, delete 1 row",
        "calls per lease cycle",
    ):
        assert heading in out, f"{heading!r} missing from:\n{out}"
    # the call counts (their values are not checked: only that they were counted)
    counted = re.findall(r"^(update|delete) (1|20) rows? +(\d+) +(\d+) +[+-]\d+ ", out, re.M)
    assert len(counted) == 4, out
    assert all(int(plain) > 0 and int(fenced) > 0 for _, _, plain, fenced in counted)
    (cycle,) = re.findall(r"^lease cycle \(acquire \+ release\) +(\d+)$", out, re.M)
    assert int(cycle) > 0
    # the contention section's counts come from the database, not from timing
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if "stale writes accepted  refused" in line)
    rows = {line.split()[0]: line.split() for line in lines[header + 1 : header + 3]}
    assert rows["sa-fence"][3] == "0", rows  # no stale write accepted


@pytest.mark.parametrize(
    ("strict", "limit", "status"),
    [(True, 0, 1), (False, 0, 0), (True, 10**9, 0)],
    ids=["strict-missed", "missed-without-strict", "strict-all-met"],
)
def test_strict_exits_1_only_when_a_target_is_missed(
    monkeypatch: pytest.MonkeyPatch, strict: bool, limit: int, status: int
) -> None:
    """``--strict`` turns a MISS into exit status 1; without it a miss still exits 0.
    The call-count limits are set so that every target of the section is missed (0)
    or met (10**9), whatever this machine counts."""
    from tests.benchmarks import __main__ as bench_main
    from tests.benchmarks import calls

    monkeypatch.setattr(calls, "TRANSACTION_LIMIT", limit)
    monkeypatch.setattr(calls, "CYCLE_LIMIT", limit)
    argv = ["--pg", PG_SERVER, "--redis", REDIS_URL, "--quick", "--quiet", "--no-plot"]
    argv += ["--sections", "calls", *(["--strict"] if strict else [])]
    assert bench_main.main(argv) == status


def test_sa_fence_bench_core_prints_ratios_and_leaves_nothing_behind(
    database_url: sa.URL, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    made: list[_bench.Schema] = []

    def make_schema(prefix: str | None = None) -> _bench.Schema:
        made.append(real_make_schema(prefix))
        return made[-1]

    # Its Redis keys are looked for under its own prefix: a bench run elsewhere
    # on the same Redis (another checkout's suite) has keys of its own meanwhile.
    real_make_schema = _bench.make_schema
    monkeypatch.setattr(_bench, "make_schema", make_schema)
    out, progress = io.StringIO(), io.StringIO()
    status = _bench.run(
        database_url,
        REDIS_URL,
        rounds=1,
        rows=5,
        out=out,
        progress=_bench.Progress(progress),
    )
    assert status == 0
    text = out.getvalue()
    assert "sa-fence / floor" in text, text
    assert "fenced/plain" in text, text
    assert "lease scope: on" in text, text  # checked by a refused commit, not assumed
    assert "lease cycle" in progress.getvalue()  # the progress indication went to its stream
    engine = sa.create_engine(database_url)
    try:
        with engine.connect() as conn:
            left = conn.execute(
                sa.text(
                    "SELECT relname FROM pg_class WHERE relname LIKE 'sa_fence_bench_%' "
                    "UNION ALL "
                    "SELECT nspname FROM pg_namespace WHERE nspname LIKE 'sa_fence_bench_%'"
                )
            ).all()
    finally:
        engine.dispose()
    assert left == []  # its schema (tables, sequence, lease register) is gone
    (schema,) = made
    assert list(redis_client.scan_iter(match=f"*{schema.prefix}*")) == []


def test_the_floor_grants_with_sa_fences_own_statement_and_parameters(
    database_url: sa.URL,
) -> None:
    """The hand-written floor draws and registers its token exactly as sa-fence's token
    source does: same statement, same parameters (lock wait bound included)."""
    engine = sa.create_engine(database_url)
    try:
        source = TokenSource(engine, "some_schema.some_seq", lock_timeout_ms=2500)
        floor_params = _bench.grant_params(source.sequence, "floor", source.lock_timeout_ms)
        assert floor_params == source.params("floor")
        assert Register("some_schema.some_seq").grant_sql == source.register.grant_sql
    finally:
        engine.dispose()


def test_a_fenced_commit_after_the_register_moved_is_refused_in_the_bench(
    database_url: sa.URL, redis_client: redis.Redis
) -> None:
    """The flush benchmark measures lease scope on: its probe sees a refused COMMIT,
    and puts the register back so the timed commits pass."""
    engine = sa.create_engine(database_url)
    schema = _bench.make_schema()
    try:
        with (
            _bench.bench_objects(engine, redis_client, schema) as fencer,
            fencer.acquire("flush", ttl=60) as lease,
        ):
            bench = _bench.FlushBench(engine, schema, lease, 3)
            bench.seed()
            assert bench.verify_lease_scope().startswith("lease scope: on")
            bench.update("fenced", 1)  # the register holds the lease's token again
    finally:
        engine.dispose()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--url", "::not a url::"], "not a database URL: '::not a url::'"),
        (["--url", "sqlite://"], "needs PostgreSQL"),
        (["--url", "postgresql://u@h"], "names no database"),
        (["--url", "postgresql+asyncpg://u@h/db"], "use postgresql+psycopg"),
        (["--url", "postgresql://u@h/db", "--rounds", "0"], "--rounds: must be between"),
        (["--url", "postgresql://u@h/db", "--rows", "x"], "--rows: not a whole number"),
        (["--url", "postgresql://u@h/db", "--redis", "http://x"], "not a Redis URL"),
    ],
)
def test_sa_fence_bench_rejects_bad_arguments_with_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from sa_fence.cli import main as cli

    with pytest.raises(SystemExit) as exited:
        cli.main(["bench", *argv])
    assert exited.value.code == 2
    assert message in capsys.readouterr().err
