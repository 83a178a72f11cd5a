"""The public API's types, as a user's mypy --strict sees them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

CASES = Path(__file__).resolve().parents[1] / "typing_cases" / "decorators.py"


def test_skip_adds_skipped_to_the_awaited_result_and_install_keeps_the_type() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-incremental", str(CASES)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    revealed = [
        line.split("Revealed type is ", 1)[1]
        for line in run.stdout.splitlines()
        if "Revealed type" in line
    ]
    assert run.returncode == 0, run.stdout + run.stderr
    assert revealed == [
        '"str | sa_fence.integrations.decorators.Skipped"',
        '"int | sa_fence.integrations.decorators.Skipped"',
        '"str"',
        '"sqlalchemy.orm.session.sessionmaker[sqlalchemy.orm.session.Session]"',
        '"sqlalchemy.ext.asyncio.session.AsyncSession"',
    ]
