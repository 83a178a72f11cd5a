"""The fitness rules of the sequence and the register are stated once (sa_fence.db.fitness).

The grant statement, ``Fencer.check()``, ``sa-fence check`` and ``sa-fence
status`` read the same rule: a rule's text changed in the table shows in
every path, and a broken set-up gets the same problem and fix from each.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import pytest
import redis
import sqlalchemy as sa

import sa_fence
from sa_fence.cli import main as cli
from sa_fence.cli.schema import upgrade_demo_schema
from sa_fence.db import fitness as _fitness
from sa_fence.db import register as _register
from tests._fresh_db import fresh_database, url_of
from tests.conftest import REDIS_URL

MARK = "MARKED-BY-THE-RULE-TABLE"


@pytest.fixture
def migrated() -> Iterator[sa.Engine]:
    with fresh_database("fitness") as engine:
        upgrade_demo_schema(engine)
        yield engine


def execute(engine: sa.Engine, *statements: str) -> None:
    with engine.begin() as conn:
        for statement in statements:
            conn.execute(sa.text(statement))


def flat(text: str) -> str:
    return " ".join(text.split())


def fencer_refusal(
    engine: sa.Engine, redis_client: redis.Redis, key_prefix: str, sequence: str
) -> str:
    fencer = sa_fence.Fencer(redis_client, engine, sequence=sequence, key_prefix=key_prefix)
    try:
        with pytest.raises(sa_fence.FencingConfigError) as refused:
            fencer.check()
    finally:
        fencer.close()
    return flat(str(refused.value))


def command(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    status = cli.main(list(argv))
    out, err = capsys.readouterr()
    return status, flat(out + " " + err)


def mark(monkeypatch: pytest.MonkeyPatch, key: str) -> None:
    """Append MARK to the problem and the fix of rule ``key`` in the rule table."""
    rules = tuple(
        replace(rule, problem=rule.problem + " " + MARK, fix=rule.fix + " " + MARK + "-FIX")
        if rule.key == key
        else rule
        for rule in _fitness.REGISTER_RULES
    )
    assert rules != _fitness.REGISTER_RULES, f"no rule {key!r}"
    monkeypatch.setattr(_fitness, "_RULES", {rule.key: rule for rule in rules})


def test_a_missing_register_is_told_from_the_one_rule_by_every_path(
    migrated: sa.Engine,
    redis_client: redis.Redis,
    key_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    execute(migrated, "DROP TABLE sa_fence_leases")
    mark(monkeypatch, "missing")
    refusal = fencer_refusal(migrated, redis_client, key_prefix, "sa_fence_token_seq")
    _, checked = command(capsys, "check", "--url", url_of(migrated))
    status, shown = command(
        capsys, "status", "--url", url_of(migrated), "--redis", REDIS_URL, "--key-prefix", "x:"
    )
    assert status == 1
    for path in (refusal, checked, shown):
        assert "lease register sa_fence_leases does not exist" in path
        assert MARK in path
        assert MARK + "-FIX" in path


@pytest.mark.parametrize(
    ("statements", "key", "hint"),
    [
        pytest.param(
            ["ALTER SEQUENCE sa_fence_token_seq CACHE 20"],
            "sequence unfit",
            'ALTER SEQUENCE "sa_fence_token_seq" AS bigint CACHE 1 NO CYCLE INCREMENT BY 1;',
            id="sequence-cached",
        ),
        pytest.param(
            ["ALTER SEQUENCE sa_fence_token_seq SET UNLOGGED"],
            "sequence unfit",
            "it is UNLOGGED or temporary (need a logged sequence: a crash resets an UNLOGGED "
            "sequence, which would hand out tokens again; ALTER SEQUENCE ... SET LOGGED)",
            id="sequence-unlogged",
        ),
        pytest.param(
            [
                "CREATE SEQUENCE other_seq AS bigint CACHE 1",
                "ALTER TABLE sa_fence_leases ALTER COLUMN token SET DEFAULT nextval('other_seq')",
            ],
            "other sequence",
            "if your Fencers use other_seq, pass sequence='other_seq' to them",
            id="register-of-another-sequence",
        ),
        pytest.param(
            ["DROP FUNCTION sa_fence_check_lease(text, bigint)"],
            "no check function",
            "op.create_fence_register() (keeps the register's rows)",
            id="no-check-function",
        ),
    ],
)
def test_fencer_check_and_sa_fence_check_give_the_same_rules_hint(
    migrated: sa.Engine,
    redis_client: redis.Redis,
    key_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    statements: list[str],
    key: str,
    hint: str,
) -> None:
    execute(migrated, *statements)
    refusal = fencer_refusal(migrated, redis_client, key_prefix, "sa_fence_token_seq")
    status, checked = command(capsys, "check", "--url", url_of(migrated))
    assert status == 1
    assert hint in refusal
    assert hint in checked
    mark(monkeypatch, key)  # the same rule, changed in the table: both paths follow
    assert MARK + "-FIX" in fencer_refusal(migrated, redis_client, key_prefix, "sa_fence_token_seq")
    assert MARK + "-FIX" in command(capsys, "check", "--url", url_of(migrated))[1]


def test_the_grant_statement_holds_every_sequence_rule() -> None:
    grant = _register.grant_function_sql()
    assert _fitness.SEQUENCE_FIT_SQL in grant
    for rule in _fitness.SEQUENCE_RULES:
        assert rule.sql in grant
        assert rule.clause in _fitness.SEQUENCE_CLAUSES
        assert f"({rule.sql}) AS {rule.key}" in str(_fitness.SEQUENCE_SQL)


def test_sequence_rules_are_read_by_fencer_check_and_sa_fence_check(
    migrated: sa.Engine,
    redis_client: redis.Redis,
    key_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A rule's problem text, changed in SEQUENCE_RULES, shows in both paths."""
    execute(migrated, "ALTER SEQUENCE sa_fence_token_seq CYCLE")
    rules = tuple(
        replace(rule, problem=MARK) if rule.key == "is_no_cycle" else rule
        for rule in _fitness.SEQUENCE_RULES
    )
    monkeypatch.setattr(_fitness, "SEQUENCE_RULES", rules)
    assert MARK in fencer_refusal(migrated, redis_client, key_prefix, "sa_fence_token_seq")
    assert MARK in command(capsys, "check", "--url", url_of(migrated))[1]


def test_status_names_a_register_of_the_wrong_shape_and_exits_1(
    migrated: sa.Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    """It used to fail reading the missing column; now it says the rule's problem and fix."""
    execute(migrated, "ALTER TABLE sa_fence_leases DROP COLUMN previous")
    status, shown = command(
        capsys, "status", "--url", url_of(migrated), "--redis", REDIS_URL, "--key-prefix", "x:"
    )
    assert status == 1
    assert (
        "the lease register sa_fence_leases has the wrong shape: has no column 'previous' "
        "(bigint). Fix: stop the workers, then drop and recreate it" in shown
    )
