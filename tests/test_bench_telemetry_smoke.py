"""The telemetry benchmark and the dashboard run (tiny counts; their numbers mean nothing)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import PG_SERVER, REDIS_URL

ARGS = ["--pg", PG_SERVER, "--redis", REDIS_URL]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args],
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


@pytest.mark.slow
def test_the_dashboard_is_drawn_from_a_short_run(tmp_path: Path) -> None:
    out = tmp_path / "dashboard.png"
    done = _run("tests.benchmarks.dashboard", "--seconds", "3", "--out", str(out), *ARGS)
    assert done.returncode == 0, done.stderr
    assert out.read_bytes().startswith(b"\x89PNG")
