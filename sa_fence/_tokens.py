"""Fencing tokens from a PostgreSQL sequence in the protected database.

Tokens come from a sequence (``CACHE 1``, ``NO CYCLE``, ``bigint``) in the
same database as the fenced rows, so token and rows share one WAL and one
failover fate (DESIGN.md, I4/I4b).
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import BigInteger, Engine, MetaData, Sequence, text

from .errors import FencingConfigError

DEFAULT_SEQUENCE = "sa_fence_token_seq"


def fence_sequence(
    metadata: MetaData | None = None,
    name: str = DEFAULT_SEQUENCE,
    *,
    schema: str | None = None,
) -> Sequence:
    """The token sequence as a SQLAlchemy schema object, declared correctly.

    ``metadata.create_all(engine)`` (or ``fence_sequence().create(conn)``)
    then emits ``CREATE SEQUENCE ... AS BIGINT INCREMENT BY 1 START WITH 1
    CACHE 1 NO CYCLE``.  ``CACHE 1`` is required: with a cache every backend
    pre-allocates a block of values and ``nextval`` stops following real time
    across connections.  Never drop or ``RESTART`` this sequence in a live
    database: tokens would start again below the fences already on the rows.
    """
    return Sequence(
        name,
        start=1,
        increment=1,
        cache=1,
        cycle=False,
        data_type=BigInteger,
        metadata=metadata,
        schema=schema,
    )


_CHECK_SQL = text(
    """
    SELECT format_type(s.seqtypid, NULL) AS data_type,
           s.seqcache, s.seqcycle, s.seqincrement
      FROM pg_catalog.pg_sequence s
     WHERE s.seqrelid = to_regclass(:name)
    """
)

# One round trip, autocommit: txid_current() gives the statement's implicit
# transaction an xid, so its commit is WAL-flushed (with synchronous_commit
# on) and covers the sequence's WAL record: a crash cannot hand this number
# out again (DESIGN.md I4b).  Without an xid, a transaction that only calls
# nextval commits without flushing WAL.
_TOKEN_SQL = text(
    "SELECT nextval(CAST(:name AS regclass)), txid_current(), current_setting('synchronous_commit')"
)


def _fix_hint(name: str) -> str:
    return (
        f"Create it with sa_fence.fence_sequence(metadata, {name!r}) and "
        f"metadata.create_all(), or in SQL: CREATE SEQUENCE {name} AS bigint "
        "CACHE 1 NO CYCLE;"
    )


def _sync_commit_error(value: str) -> FencingConfigError:
    return FencingConfigError(
        f"synchronous_commit is {value!r} on the token connection: a token could be "
        "handed out twice after a crash. Set it to 'on' (ALTER DATABASE <db> SET "
        "synchronous_commit = on, or remove the override from the engine's "
        "connect_args / postgresql.conf)."
    )


@dataclass
class TokenSource:
    """Draws tokens from the sequence through the protected database's engine."""

    engine: Engine
    sequence: str
    _checked: bool = False

    def check(self) -> None:
        """Verify the sequence and the connection settings; raise FencingConfigError."""
        name = self.sequence
        with self.engine.connect() as conn:
            row = conn.execute(_CHECK_SQL, {"name": name}).one_or_none()
            sync = conn.execute(text("SELECT current_setting('synchronous_commit')")).scalar_one()
            conn.rollback()
        if row is None:
            raise FencingConfigError(
                f"token sequence {name!r} does not exist in {self.engine.url.database!r}. "
                + _fix_hint(name)
            )
        problems = []
        if row.data_type != "bigint":
            problems.append(f"its type is {row.data_type} (need bigint: AS bigint)")
        if row.seqcache != 1:
            problems.append(
                f"it has CACHE {row.seqcache} (need CACHE 1: cached values are not "
                "ordered in time across connections)"
            )
        if row.seqcycle:
            problems.append("it is CYCLE (need NO CYCLE: a wrapped token looks ancient)")
        if row.seqincrement <= 0:
            problems.append(f"it has INCREMENT {row.seqincrement} (need a positive increment)")
        if problems:
            raise FencingConfigError(
                f"token sequence {name!r} cannot issue fencing tokens: "
                + "; ".join(problems)
                + f". Fix it with: ALTER SEQUENCE {name} AS bigint CACHE 1 NO CYCLE "
                "INCREMENT BY 1;"
            )
        if sync == "off":
            raise _sync_commit_error(sync)
        self._checked = True

    def ensure_checked(self) -> None:
        if not self._checked:
            self.check()

    def next_token(self) -> int:
        """Take the next token in its own committed transaction."""
        with self.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            token, _xid, sync = conn.execute(_TOKEN_SQL, {"name": self.sequence}).one()
        if sync == "off":
            raise _sync_commit_error(sync)
        return int(token)
