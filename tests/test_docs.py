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


def quickstart_code() -> str:
    """The first ```python block under the "Quickstart" heading of the guide."""
    text = GUIDE.read_text(encoding="utf-8")
    heading = re.search(r"^#+\s+Quickstart\s*$", text, flags=re.MULTILINE)
    assert heading, "docs/index.md has no Quickstart heading"
    block = re.compile(r"^```python\n(.*?)^```\s*$", flags=re.MULTILINE | re.DOTALL)
    match = block.search(text, heading.end())
    assert match, "no ```python block under the Quickstart heading"
    next_heading = re.compile(r"^#+\s", flags=re.MULTILINE).search(text, heading.end())
    assert next_heading is None or match.start() < next_heading.start(), (
        "the first ```python block after Quickstart belongs to a later section"
    )
    return match.group(1)


def test_the_quickstart_runs_and_refuses_the_stale_writer(
    database_url: sa.URL, redis_client: redis.Redis, key_prefix: str, tmp_path: Path
) -> None:
    script = tmp_path / "quickstart.py"
    script.write_text(quickstart_code(), encoding="utf-8")
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
    assert proc.returncode == 0, f"quickstart failed:\n{proc.stdout}\n{proc.stderr}"
    lines = proc.stdout.strip().splitlines()
    assert len(lines) >= 2, proc.stdout
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
