"""Which SQL would take a bound transaction out of lease scope, read by PostgreSQL's own parser.

PostgreSQL runs the statements of one message in turn: in ``COMMIT; BEGIN`` the COMMIT is checked,
but the BEGIN starts a transaction no arm reached, and in ``COMMIT; INSERT ...`` the INSERT commits
on its own; ``COMMIT AND CHAIN`` begins an unarmed transaction too, and a ROLLBACK TO undoes an arm
sent inside its savepoint.  :func:`scope_effect` finds them.

Where the statements of a message begin and end, and which of them end the transaction, is read by
PostgreSQL's own lexer and grammar (libpg_query, through pglast), never by a reading of our own: a
hand-written splitter disagreed with the server on shapes no review had listed (a ``--`` comment
ends at ``\\r`` too; any character past ASCII may stand in an identifier or a dollar-quote tag).
What is left between the client's reading and the server's, and why each is closed:

- The server lexes the text after converting it from ``client_encoding`` to its own encoding, which
  is always ASCII-safe, so the structure pglast reads in the Python string is the server's.
- ``standard_conforming_strings = off`` changes how a backslash in a string is lexed; libpg_query
  lexes with it on, so lease scope refuses to read SQL where the server reports it off
  (``sa_fence.scope.arming``; psycopg knows it from the server's ParameterStatus).
- A grammar newer or older than the server's: SQL pglast cannot parse is split at the ``;``
  tokens of PostgreSQL's lexer instead, which finds every statement boundary the grammar would,
  and more (a ``;`` inside ``BEGIN ATOMIC`` or a rule's action), so a doubt refuses, never passes.

tests/scope/test_transaction_sql.py holds this reading to the server's own, over generated messages.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

from pglast import ast, parser
from pglast.enums.parsenodes import TransactionStmtKind


class Statement(NamedTuple):
    """One statement of a message, as PostgreSQL reads it: ``kind`` is ``"end"`` (COMMIT, END,
    ROLLBACK, ABORT, PREPARE TRANSACTION), ``"savepoint"`` (ROLLBACK TO, which undoes what was
    sent inside the savepoint) or ``None`` (anything else); ``chain``: ``AND CHAIN``."""

    kind: str | None
    chain: bool


def might_leave_scope(sql: str) -> bool:
    """The first look at each statement a bound connection sends: False if it has no ``;``,
    CHAIN or ROLLBACK in any case (substrings, not a parse: 0.5 us a statement).

    Sound: PostgreSQL needs a ``;`` token between two statements, and its keywords are ASCII
    letters in any case, which ``str.lower()`` reads as ASCII too (it may find more, never less)."""
    lowered = sql.lower()
    return ";" in sql or "chain" in lowered or "rollback" in lowered


#: The words a statement that ends the transaction or rolls back to a savepoint must hold.
_END_WORDS = ("commit", "end", "rollback", "abort", "prepare")
_ENDS = {
    TransactionStmtKind.TRANS_STMT_COMMIT: "end",  # COMMIT, END
    TransactionStmtKind.TRANS_STMT_ROLLBACK: "end",  # ROLLBACK, ABORT
    TransactionStmtKind.TRANS_STMT_PREPARE: "end",  # PREPARE TRANSACTION
    TransactionStmtKind.TRANS_STMT_ROLLBACK_TO: "savepoint",
}


@functools.lru_cache(maxsize=1024)  # the same SQL text is sent again and again
def statements(sql: str) -> tuple[Statement, ...]:
    """``sql``'s statements as PostgreSQL's parser splits them (empty ones dropped); SQL the
    parser refuses is split at the lexer's ``;`` tokens, each piece read as the worst it can be
    when it holds a word that may end the transaction."""
    pieces: Sequence[str]
    try:
        pieces = parser.split(sql, with_parser=True)
    except parser.ParseError:
        pieces = _lexed_pieces(sql)
    return tuple(_statement(piece) for piece in pieces)


def _lexed_pieces(sql: str) -> list[str]:
    """``sql`` split at the ``;`` tokens of PostgreSQL's lexer, for SQL its grammar refused
    (pieces holding no token, comments only, dropped).  A ``;`` the grammar would keep inside
    a statement (``BEGIN ATOMIC``, a rule's action) splits it here: more pieces, never fewer."""
    try:
        tokens = parser.scan(sql)
    except parser.ParseError:  # not even lexed (an unterminated quote): one piece, the worst
        return [sql]
    pieces: list[str] = []
    first = None
    for token in [*tokens, None]:
        if token is not None and token.name != "ASCII_59":  # (";")
            first = token.start if first is None else first
            last = token.end
            continue
        if first is not None:
            pieces.append(sql[first : last + 1])
        first = None
    return pieces


def _statement(piece: str) -> Statement:
    if not might_end(piece):
        return Statement(None, False)  # (no parse: these words are in every such statement)
    lowered = piece.lower()
    try:
        (raw,) = parser.parse_sql(piece)
    except (parser.ParseError, ValueError):  # unread: taken for the worst it may be
        return Statement("end", "chain" in lowered)
    stmt = raw.stmt
    if not isinstance(stmt, ast.TransactionStmt):
        return Statement(None, False)
    kind = _ENDS.get(stmt.kind) if stmt.kind is not None else None
    return Statement(kind, bool(kind == "end" and stmt.chain))


def scope_effect(sql: str) -> tuple[bool, bool]:
    """Whether ``sql`` ends its transaction, or rolls back to a savepoint, and goes on (a
    statement after a COMMIT, END, ROLLBACK [TO], ABORT or PREPARE TRANSACTION; ``AND
    CHAIN``), and whether it rolls back to a savepoint at all."""
    found = statements(sql)
    last = len(found) - 1
    leaves = any(s.kind is not None and (index < last or s.chain) for index, s in enumerate(found))
    return leaves, any(s.kind == "savepoint" for s in found)


def might_end(sql: str) -> bool:
    """The first look for :func:`ends_transaction`: False if ``sql`` holds none of the words
    every such statement holds (sound for the reason :func:`might_leave_scope` gives)."""
    lowered = sql.lower()
    return any(word in lowered for word in _END_WORDS)


def ends_transaction(sql: str) -> bool:
    """Whether a statement of ``sql`` ends its transaction (COMMIT, END, ROLLBACK, ABORT or
    PREPARE TRANSACTION; not ROLLBACK TO, not COMMIT PREPARED), last or not (for psycopg's
    pipeline mode, scope.arming)."""
    return might_end(sql) and any(s.kind == "end" for s in statements(sql))
