"""The guide's asyncio claims that can be executed: the async quickstart runs,
and sync users do not need SQLAlchemy's asyncio (greenlet) to import sa_fence."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import redis
import sqlalchemy as sa

from tests.project.test_docs import ASYNCIO, ROOT, run_guide_block


def test_the_async_quickstart_runs_and_refuses_the_stale_task(
    database_url: sa.URL, redis_client: redis.Redis, key_prefix: str, tmp_path: Path
) -> None:
    lines = run_guide_block("Async quickstart", database_url, key_prefix, tmp_path, ASYNCIO)
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
        "assert 'sa_fence.lease.aio' not in sys.modules\n"
        "assert 'AsyncFencer' in dir(sa_fence)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stderr


def test_a_star_import_leaves_the_asyncio_machinery_unloaded() -> None:
    """``from sa_fence import *`` stays light; the async names still load by name.

    Were AsyncFencer in ``__all__``, the star import would resolve it through
    the module's ``__getattr__`` and import ``sa_fence.lease.aio``."""
    code = (
        "import sys\n"
        "from sa_fence import *\n"
        "assert 'Fencer' in dir() and 'install' in dir()\n"
        "loaded = sorted({'sqlalchemy.ext.asyncio', 'sa_fence.lease.aio'} & set(sys.modules))\n"
        "assert loaded == [], loaded\n"
        "assert 'AsyncFencer' not in dir()\n"
        "from sa_fence import AsyncFencer, AsyncLease\n"
        "import sa_fence, sa_fence.lease.aio\n"
        "assert sa_fence.AsyncFencer is AsyncFencer is sa_fence.lease.aio.AsyncFencer\n"
        "assert AsyncLease is sa_fence.lease.aio.AsyncLease\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stderr
