"""The token sequence is refused where it is declared, when its declaration says it is unfit.

Issue 49: a ``Sequence("sa_fence_token_seq", cache=20)`` of the user's own, in
the metadata before ``sa_fence.fence_schema(metadata)`` (or passed to it),
passed ``fence_schema()`` and ``create_all()`` and was refused only at the
first acquire.  What a ``Sequence`` declares (type, cache, cycle, increment)
is read against the rules the grant applies (``sa_fence.db.fitness``); what it
cannot declare (an UNLOGGED sequence) is left to the grant.
"""

from __future__ import annotations

from typing import Any

import pytest
import redis
import sqlalchemy as sa

import sa_fence
from tests._fresh_db import fresh_database


def unfit_declarations() -> list[tuple[dict[str, Any], str, str]]:
    """(Sequence() arguments, the rule's words, the fix) for each rule a declaration shows."""
    return [
        ({"cache": 20}, "it has CACHE 20 (need CACHE 1", "cache=1"),
        ({"cycle": True}, "it is CYCLE (need NO CYCLE", "cycle=False"),
        ({"data_type": sa.Integer}, "its type is INTEGER (need bigint", "data_type=BigInteger"),
        ({"increment": -1}, "it has INCREMENT -1 (need a positive increment)", "increment=1"),
    ]


@pytest.mark.parametrize(("declared", "problem", "fix"), unfit_declarations())
def test_an_unfit_sequence_already_in_the_metadata_is_refused_at_declaration(
    declared: dict[str, Any], problem: str, fix: str
) -> None:
    metadata = sa.MetaData()
    sa.Sequence("sa_fence_token_seq", metadata=metadata, **declared)
    with pytest.raises(ValueError, match="already declares the token sequence") as refused:
        sa_fence.fence_schema(metadata)
    assert problem in str(refused.value)
    assert f"or declare it with {fix}; " in str(refused.value)
    assert "sa_fence_leases" not in metadata.tables  # nothing was declared


def test_an_unfit_sequence_on_a_column_and_in_a_schema_is_refused_at_declaration() -> None:
    metadata = sa.MetaData()
    mine = sa.Sequence("tokens", cache=20, schema="app")
    sa.Table("t", metadata, sa.Column("id", sa.BigInteger, mine, primary_key=True))
    with pytest.raises(ValueError, match=r"it has CACHE 20 .*or declare it with cache=1"):
        sa_fence.fence_schema(metadata, "app.tokens")
    with pytest.raises(ValueError, match=r"it has CACHE 20 .*or declare it with cache=1"):
        sa_fence.fence_schema(metadata, "tokens", schema="app")
    sa_fence.fence_schema(metadata, "tokens")  # another sequence (no schema): not refused


def test_a_sequence_passed_for_its_name_is_refused_naming_the_call_to_make() -> None:
    metadata = sa.MetaData()
    with pytest.raises(ValueError, match="declares the token sequence itself") as refused:
        sa_fence.fence_schema(metadata, sa.Sequence("tokens", cache=20, schema="app"))  # type: ignore[arg-type]
    text = str(refused.value)
    assert "it has CACHE 20 (need CACHE 1" in text
    assert "sa_fence.fence_schema(metadata, 'tokens', schema='app')" in text
    assert metadata.tables == {}
    with pytest.raises(ValueError, match=r"Pass the sequence's name instead"):
        sa_fence.fence_schema(metadata, sa.Sequence("tokens"))  # type: ignore[arg-type]


def test_a_fit_declaration_is_kept_and_grants_on_a_real_server(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    """A ``Sequence`` of the user's own left at PostgreSQL's defaults (bigint, CACHE 1,
    NO CYCLE, INCREMENT 1), or ``cache=1``, fits: ``fence_schema()`` accepts it (as it
    accepts being called twice), and a lease is granted from the schema ``create_all()``
    makes.  The refused declaration, created anyway, is what the first acquire refuses."""
    metadata = sa.MetaData()
    sa.Sequence("sa_fence_token_seq", cache=1, metadata=metadata)
    sa_fence.fence_schema(metadata)
    sa_fence.fence_schema(metadata)
    with fresh_database("fit_declared") as engine:
        metadata.create_all(engine)
        fencer = sa_fence.Fencer(redis_client, engine, key_prefix=key_prefix)
        with fencer.acquire("job:1", 5) as lease:
            assert lease.token > 0
        fencer.close()

    unfit = sa.MetaData()
    mine = sa.Sequence("sa_fence_token_seq", cache=20, metadata=unfit)
    with pytest.raises(ValueError, match="it has CACHE 20"):
        sa_fence.fence_schema(unfit)
    with fresh_database("unfit_declared") as engine:
        # what the declaration would have led to: refused only at the first acquire
        schema = sa.MetaData()
        sa_fence.fence_schema(schema)
        schema.create_all(engine)
        with engine.begin() as conn:
            conn.execute(sa.text(f"ALTER SEQUENCE {mine.name} CACHE 20"))
        fencer = sa_fence.Fencer(redis_client, engine, key_prefix=key_prefix)
        with pytest.raises(sa_fence.FencingConfigError, match="it has CACHE 20"):
            fencer.acquire("job:1", 5)
        fencer.close()
