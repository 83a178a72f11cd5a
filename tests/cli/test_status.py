"""``sa-fence status``, run as a subprocess against the real servers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest
import redis
import sqlalchemy as sa

import sa_fence
from sa_fence.cli import main as cli
from sa_fence.cli import status as _status
from sa_fence.cli.status import owner_hash
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
    with fencer.acquire("job:1", ttl=30) as lease:
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
    with fencer.acquire("job:2", ttl=30) as lease:
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


def status_in_process(
    *args: str, engine: sa.Engine, capsys: pytest.CaptureFixture[str]
) -> tuple[int, str, str]:
    url = engine.url.render_as_string(hide_password=False)
    code = cli.main(["status", "--sequence", SEQUENCE, "--url", url, "--redis", REDIS_URL, *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_the_key_prefix_comes_from_sa_fence_key_prefix_and_the_flag_wins(
    fencer: sa_fence.Fencer,
    engine: sa.Engine,
    key_prefix: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SA_FENCE_KEY_PREFIX", key_prefix)
    with fencer.acquire("env:1", ttl=30) as lease:
        from_env = status_in_process("--json", "env:1", engine=engine, capsys=capsys)
        flag_wins = status_in_process(
            "--json", "--key-prefix", "another:", "env:1", engine=engine, capsys=capsys
        )
    assert from_env[0] == 0, from_env[2]
    (row,) = json.loads(from_env[1])
    assert (row["state"], row["holder_token"]) == ("held", lease.token)
    assert "note" not in from_env[2]
    (row,) = json.loads(flag_wins[1])
    assert row["state"] == "free"


def test_a_held_lease_read_under_the_wrong_prefix_is_free_with_a_hint_naming_the_prefix(
    fencer: sa_fence.Fencer,
    engine: sa.Engine,
    key_prefix: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    with fencer.acquire("hint:1", ttl=30):
        code, out, err = status_in_process(
            "--key-prefix", "sa_fence_wrong:", "hint:1", engine=engine, capsys=capsys
        )
    assert code == 0, err
    assert "free" in out
    err = " ".join(err.split())
    assert (
        "note: Redis holds no key under the prefix 'sa_fence_wrong:' for any of the 1 "
        "name(s) the register holds" in err
    )
    assert "--key-prefix, or set $SA_FENCE_KEY_PREFIX" in err
    assert f"'hint:1' has a key under: --key-prefix {key_prefix!r}" in err


def test_no_hint_when_a_registered_name_is_held_under_the_prefix(
    fencer: sa_fence.Fencer, engine: sa.Engine, key_prefix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    fencer.acquire("quiet:1", ttl=30).release()
    with fencer.acquire("quiet:2", ttl=30):
        code, out, err = status_in_process(
            "--key-prefix", key_prefix, "quiet:1", "quiet:2", engine=engine, capsys=capsys
        )
    assert code == 0, err
    assert "held" in out
    assert "note" not in err


def test_leases_not_held_read_as_free_without_a_note(
    fencer: sa_fence.Fencer, engine: sa.Engine, key_prefix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """No lease held is the normal state: the table says free, stderr says nothing."""
    for name in ("idle:1", "idle:2"):
        fencer.acquire(name, ttl=30).release()
    for args in (("idle:1", "idle:2"), ("--json", "idle:1")):
        code, out, err = status_in_process(
            "--key-prefix", key_prefix, *args, engine=engine, capsys=capsys
        )
        assert code == 0, err
        assert "free" in out
        assert err == ""


def test_no_note_when_the_prefix_is_in_use_though_another_prefix_holds_the_name(
    fencer: sa_fence.Fencer,
    engine: sa.Engine,
    redis_client: redis.Redis,
    key_prefix: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Another application's lease of the same name is its own business: the prefix asked
    for has keys, so it is the right one and the name is just not held under it."""
    other_prefix = f"{key_prefix.rstrip(':')}-other-app:"
    other = sa_fence.Fencer(redis_client, engine, sequence=SEQUENCE, key_prefix=other_prefix)
    with fencer.acquire("inuse:busy", ttl=30), other.acquire("inuse:1", ttl=30):
        code, out, err = status_in_process(
            "--key-prefix", key_prefix, "inuse:1", engine=engine, capsys=capsys
        )
    assert code == 0, err
    assert "free" in out
    assert err == ""


def test_no_note_for_a_key_under_another_prefix_that_is_no_sa_fence_lease(
    fencer: sa_fence.Fencer,
    engine: sa.Engine,
    redis_client: redis.Redis,
    key_prefix: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    fencer.acquire("plain:1", ttl=30).release()
    redis_client.set(f"{key_prefix}plain:1", "a cache entry, not a lease", ex=60)
    empty_prefix = f"{key_prefix.rstrip(':')}-nothing-here:"
    code, out, err = status_in_process(
        "--key-prefix", empty_prefix, "plain:1", engine=engine, capsys=capsys
    )
    assert code == 0, err
    assert "free" in out
    assert err == ""


def test_without_the_hint_a_wrong_prefix_shows_a_held_lease_as_free_silently(
    fencer: sa_fence.Fencer,
    engine: sa.Engine,
    redis_client: redis.Redis,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The pair of the hint test: with the check removed, nothing tells the reader."""
    url = engine.url.render_as_string(hide_password=False)
    args = ("--sequence", SEQUENCE, "--url", url, "--redis", REDIS_URL, "pair:1")
    with fencer.acquire("pair:1", ttl=30):
        assert cli.main(["status", "--key-prefix", "sa_fence_wrong:", *args]) == 0
        assert "note: Redis holds no key" in capsys.readouterr().err
        monkeypatch.setattr(_status, "no_keys_hint", lambda *_: "")  # the hint switched off
        assert cli.main(["status", "--key-prefix", "sa_fence_wrong:", *args]) == 0
    out, err = capsys.readouterr()
    assert "free" in out  # the held lease, shown as free
    assert err.strip() == ""  # and nothing says why
