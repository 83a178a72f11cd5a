"""The telemetry benchmark and the dashboard run (tiny counts; their numbers mean nothing)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import PG_SERVER, REDIS_URL

ARGS = ["--pg", PG_SERVER, "--redis", REDIS_URL]


def _run(*args: str, how: str = "-m") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, how, *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
        check=False,
    )


def test_the_telemetry_bench_prints_a_ratio_per_variant_and_op() -> None:
    done = _run("tests.benchmarks.telemetry", "--quick", *ARGS)
    assert done.returncode == 0, done.stderr
    # outside any trace: every variant on both ops; inside a trace: off, sdk, hand
    expected = {"off": 4, "api": 2, "metrics": 2, "sdk": 4, "hand": 4}
    for variant, times in expected.items():
        assert done.stdout.count(f"  {variant} ") == times, done.stdout
    assert "lease cycle, traced" in done.stdout
    assert "fenced update + commit, 1 row, traced" in done.stdout


# Runs the telemetry benchmark with every limit set to LIMIT (argv[1]).
LIMITED = (
    "import sys; from tests.benchmarks import telemetry as t; limit = float(sys.argv[1]); "
    "t.LIMITS = {k: tuple((f, limit) for f, _ in v) for k, v in t.LIMITS.items()}; "
    "t.TRACED_LIMITS = {k: tuple((f, limit) for f, _ in v) for k, v in t.TRACED_LIMITS.items()}; "
    "t.TRACED_FLUSH_LIMITS = {k: tuple((f, limit) for f, _ in v) "
    "for k, v in t.TRACED_FLUSH_LIMITS.items()}; "
    "sys.exit(t.main(sys.argv[2:]))"
)


@pytest.mark.parametrize(
    ("strict", "limit", "status"),
    [(True, 0.0, 1), (False, 0.0, 0), (True, 1e9, 0)],
    ids=["strict-missed", "missed-without-strict", "strict-all-met"],
)
def test_the_telemetry_bench_exits_1_under_strict_only_when_a_limit_is_exceeded(
    strict: bool, limit: float, status: int
) -> None:
    """Every ratio is above a limit of 0 and below one of 1e9, whatever this machine measures."""
    args = [LIMITED, str(limit), "--quick", *ARGS, *(["--strict"] if strict else [])]
    done = _run(*args, how="-c")
    assert done.returncode == status, done.stdout + done.stderr
    if status:
        assert "ratio(s) above the limit" in done.stdout


@pytest.mark.slow
def test_the_dashboard_is_drawn_from_a_short_run(tmp_path: Path) -> None:
    out = tmp_path / "dashboard.png"
    done = _run("tests.benchmarks.dashboard", "--seconds", "3", "--out", str(out), *ARGS)
    assert done.returncode == 0, done.stderr
    assert out.read_bytes().startswith(b"\x89PNG")
