"""The user guide's claims that can be executed: the quickstart runs, and every
public name is documented."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import sa_fence
from tests.conftest import REDIS_URL

if TYPE_CHECKING:
    import redis
    import sqlalchemy as sa

ROOT = Path(__file__).resolve().parent.parent
GUIDE = ROOT / "docs" / "index.md"


def guide_block(heading: str) -> str:
    """The first ```python block under ``heading`` in the guide (not a later section's)."""
    text = GUIDE.read_text(encoding="utf-8")
    found = re.search(rf"^#+\s+{re.escape(heading)}\s*$", text, flags=re.MULTILINE)
    assert found, f"docs/index.md has no {heading!r} heading"
    block = re.compile(r"^```python\n(.*?)^```\s*$", flags=re.MULTILINE | re.DOTALL)
    match = block.search(text, found.end())
    assert match, f"no ```python block under the {heading!r} heading"
    next_heading = re.compile(r"^#+\s", flags=re.MULTILINE).search(text, found.end())
    assert next_heading is None or match.start() < next_heading.start(), (
        f"the first ```python block after {heading!r} belongs to a later section"
    )
    return match.group(1)


def run_guide_block(
    heading: str, database_url: sa.URL, key_prefix: str, tmp_path: Path
) -> list[str]:
    """Run the block as a script against the test run's servers; its stdout lines."""
    script = tmp_path / "guide_block.py"
    script.write_text(guide_block(heading), encoding="utf-8")
    env = {
        **os.environ,
        "DATABASE_URL": database_url.render_as_string(hide_password=False),
        "REDIS_URL": REDIS_URL,
        "SA_FENCE_KEY_PREFIX": key_prefix,
    }
    proc = subprocess.run(
        [sys.executable, str(script)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, f"{heading} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout.strip().splitlines()


def test_the_quickstart_runs_and_refuses_the_stale_writer(
    database_url: sa.URL, redis_client: redis.Redis, key_prefix: str, tmp_path: Path
) -> None:
    lines = run_guide_block("Quickstart", database_url, key_prefix, tmp_path)
    assert len(lines) >= 2, lines
    assert re.fullmatch(r"A \(token \d+\) refused: row \(1,\) has fence \d+", lines[-2]), lines
    assert lines[-1] == "job 1 result: written by B", lines
    # the stale holder's token is smaller than the fence that refused it
    stale, fence = map(int, re.findall(r"\d+", lines[-2].replace("(1,)", "")))
    assert stale < fence
    # its leases are gone from Redis: released, or expired (the stale one)
    assert list(redis_client.scan_iter(match=f"{key_prefix}*")) == []


def test_every_public_name_is_documented_in_the_guide() -> None:
    text = GUIDE.read_text(encoding="utf-8")
    code_spans = " ".join(re.findall(r"`[^`\n]+`", text))
    missing = [
        name for name in sa_fence.__all__ if not re.search(rf"\b{re.escape(name)}\b", code_spans)
    ]
    assert missing == [], f"public names not mentioned as code in docs/index.md: {missing}"
