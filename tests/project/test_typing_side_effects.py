"""sa_fence.side_effect's types, as a user's mypy --strict sees them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

CASES = Path(__file__).resolve().parents[1] / "typing_cases" / "side_effects.py"


def test_side_effect_returns_a_side_effect_and_refuses_what_is_not_a_task_or_a_session() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-incremental", str(CASES)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    revealed = [
        line.split("Revealed type is ", 1)[1]
        for line in run.stdout.splitlines()
        if "Revealed type" in line
    ]
    assert run.returncode == 0, run.stdout + run.stderr
    assert revealed == ['"sa_fence.integrations.side_effects.SideEffect"']
