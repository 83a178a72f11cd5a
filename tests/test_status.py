"""``sa-fence status``, run as a subprocess against the real servers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest
import sqlalchemy as sa

import sa_fence
from sa_fence._status import owner_hash
from tests.conftest import REDIS_URL
from tests.models import SEQUENCE


def status(
    *args: str, url: sa.URL | None, key_prefix: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "sa_fence", "status", "--sequence", SEQUENCE]
    command += ["--key-prefix", key_prefix, *args]  # a later --sequence wins
    environ = {**os.environ, "PYTHONPATH": os.getcwd(), "SA_FENCE_REDIS_URL": REDIS_URL}
    environ.pop("SA_FENCE_DATABASE_URL", None)
    if url is not None:
        environ["SA_FENCE_DATABASE_URL"] = url.render_as_string(hide_password=False)
    environ.update(env or {})
    return subprocess.run(command, capture_output=True, text=True, timeout=60, env=environ)


def test_a_held_lease_shows_its_token_ttl_and_a_hash_of_its_owner_never_the_owner(
    fencer: sa_fence.Fencer, engine: sa.Engine, key_prefix: str
) -> None:
    with fencer.lease("job:1", ttl=30) as lease:
        done = status("job:1", "--json", url=engine.url, key_prefix=key_prefix)
        table = status("job:1", url=engine.url, key_prefix=key_prefix)
    assert done.returncode == 0, done.stderr
    (row,) = json.loads(done.stdout)
    assert row["name"] == "job:1"
    assert row["token"] == lease.token
    assert row["holder_token"] == lease.token
    assert row["state"] == "held"
    assert 0 < row["ttl"] <= 30
    assert row["holder"] == owner_hash(lease.owner)
    assert row["granted_at"].endswith("+00:00")
    assert table.returncode == 0, table.stderr
    assert "job:1" in table.stdout
    assert "held" in table.stdout
    assert f"owner#{owner_hash(lease.owner)}" in table.stdout
    for out in (done.stdout, done.stderr, table.stdout, table.stderr):
        assert lease.owner not in out


def test_a_released_lease_is_free_and_keeps_its_last_token(
    fencer: sa_fence.Fencer, engine: sa.Engine, key_prefix: str
) -> None:
    with fencer.lease("job:2", ttl=30) as lease:
        pass
    done = status("job:2", "--json", url=engine.url, key_prefix=key_prefix)
    assert done.returncode == 0, done.stderr
    (row,) = json.loads(done.stdout)
    assert row["state"] == "free"
    assert row["token"] == lease.token
    assert row["ttl"] is None
    assert row["holder"] is None


def test_without_names_the_newest_grants_are_listed(
    fencer: sa_fence.Fencer, engine: sa.Engine, key_prefix: str
) -> None:
    for name in ("list:a", "list:b"):
        fencer.acquire(name, ttl=30).release()
    done = status("--json", "--limit", "2", url=engine.url, key_prefix=key_prefix)
    assert done.returncode == 0, done.stderr
    rows: list[dict[str, Any]] = json.loads(done.stdout)
    assert [r["name"] for r in rows] == ["list:b", "list:a"]


def test_a_name_never_granted_exits_1(engine: sa.Engine, key_prefix: str) -> None:
    done = status("never:granted", url=engine.url, key_prefix=key_prefix)
    assert done.returncode == 1
    assert "never granted" in done.stderr


def test_no_register_exits_1_and_says_how_to_check(engine: sa.Engine, key_prefix: str) -> None:
    done = status("--sequence", "no_such_schema.seq", url=engine.url, key_prefix=key_prefix)
    assert done.returncode == 1
    assert "no lease register" in done.stderr


def test_an_unreachable_database_exits_3_without_showing_the_password(key_prefix: str) -> None:
    url = sa.make_url("postgresql+psycopg://user:s3cret@127.0.0.1:1/db")
    done = status(url=url, key_prefix=key_prefix)
    assert done.returncode == 3
    assert "s3cret" not in done.stdout + done.stderr
    assert "***" in done.stderr


def test_an_unreachable_redis_exits_3_without_showing_the_password(
    engine: sa.Engine, key_prefix: str
) -> None:
    done = status(
        "job:1",
        url=engine.url,
        key_prefix=key_prefix,
        env={"SA_FENCE_REDIS_URL": "redis://u:s3cret@127.0.0.1:1/0"},
    )
    assert done.returncode == 3
    assert "s3cret" not in done.stdout + done.stderr


@pytest.mark.parametrize("bad", ["--limit=0", "--redis=http://x"])
def test_bad_arguments_exit_2(bad: str, engine: sa.Engine, key_prefix: str) -> None:
    done = status(bad, url=engine.url, key_prefix=key_prefix)
    assert done.returncode == 2
