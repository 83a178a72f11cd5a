"""The guide's asyncio claims that can be executed: the async quickstart runs,
and sync users do not need SQLAlchemy's asyncio (greenlet) to import sa_fence."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import redis
import sqlalchemy as sa

from tests.conftest import REDIS_URL

ROOT = Path(__file__).resolve().parent.parent
GUIDE = ROOT / "docs" / "index.md"


def async_quickstart_code() -> str:
    """The first ```python block under the "Async quickstart" heading of the guide."""
    text = GUIDE.read_text(encoding="utf-8")
    heading = re.search(r"^#+\s+Async quickstart\s*$", text, flags=re.MULTILINE)
    assert heading, "docs/index.md has no 'Async quickstart' heading"
    block = re.compile(r"^```python\n(.*?)^```\s*$", flags=re.MULTILINE | re.DOTALL)
    match = block.search(text, heading.end())
    assert match, "no ```python block under the Async quickstart heading"
    next_heading = re.compile(r"^#+\s", flags=re.MULTILINE).search(text, heading.end())
    assert next_heading is None or match.start() < next_heading.start()
    return match.group(1)


def test_the_async_quickstart_runs_and_refuses_the_stale_task(
    database_url: sa.URL, redis_client: redis.Redis, key_prefix: str, tmp_path: Path
) -> None:
    script = tmp_path / "async_quickstart.py"
    script.write_text(async_quickstart_code(), encoding="utf-8")
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
    assert proc.returncode == 0, f"async quickstart failed:\n{proc.stdout}\n{proc.stderr}"
    lines = proc.stdout.strip().splitlines()
    assert re.fullmatch(r"token \d+ wrote job 1", lines[0]), lines
    refused = next(line for line in lines if line.startswith("A "))
    stale, fence = map(int, re.findall(r"\d+", refused))
    assert stale < fence
    assert lines[-1] == "job 1 result: written by B", lines
    assert list(redis_client.scan_iter(match=f"{key_prefix}*")) == []


def test_sync_users_import_and_use_sa_fence_without_greenlet() -> None:
    code = (
        "import sys\n"
        "sys.modules['greenlet'] = None  # not installed\n"
        "import sa_fence\n"
        "from sqlalchemy.orm import sessionmaker\n"
        "sa_fence.install(sessionmaker())\n"
        "assert 'sqlalchemy.ext.asyncio' not in sys.modules\n"
        "assert 'sa_fence._async' not in sys.modules\n"
        "assert 'AsyncFencer' in sa_fence.__all__\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stderr
