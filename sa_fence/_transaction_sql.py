"""Which SQL would take a bound transaction out of lease scope.

PostgreSQL runs the statements of one message in turn: in ``COMMIT; BEGIN`` the COMMIT is checked,
but the BEGIN starts a transaction no arm reached, and in ``COMMIT; INSERT ...`` the INSERT commits
on its own; ``COMMIT AND CHAIN`` begins an unarmed transaction too, and a ROLLBACK TO undoes an arm
sent inside its savepoint. :func:`scope_effect` finds them, splitting statements as the server
does: quotes, dollar quotes, nested comments, parentheses and (psql's rule) ``BEGIN ATOMIC`` bodies
hold no boundary. Not sqlparse: it does not nest comments, so ``/* /* */ */ COMMIT; BEGIN`` would
hide its COMMIT from it. tests/test_transaction_sql.py holds this split to the server's own."""

from __future__ import annotations

import re
from itertools import pairwise


def might_leave_scope(sql: str) -> bool:
    """The first look at each statement a bound connection sends: False if it has no ``;``,
    CHAIN or ROLLBACK in any case (substrings, not a regex: 0.5 us against 8 a statement)."""
    lowered = sql.lower()
    return ";" in sql or "chain" in lowered or "rollback" in lowered


_TOKEN = re.compile(
    r"""(?P<space>\s+)
    | (?P<comment>--[^\n]*)
    | (?P<block>/\*)
    | (?P<escaped>[eE]')
    | (?P<quote>')
    | (?P<ident>")
    | (?P<dollar>\$(?:[^\W\d]\w*)?\$)
    | (?P<word>[^\W\d]\w*(?:\$\w*)*)
    | (?P<other>.)""",
    re.VERBOSE | re.DOTALL,
)
_STRING_END = {True: re.compile(r"(?:[^'\\]|''|\\.)*'", re.S), False: re.compile(r"(?:[^']|'')*'")}
_IDENT_END = re.compile(r'(?:[^"]|"")*"')
_BLOCK_PART = re.compile(r"/\*|\*/")

_ENDS = frozenset({"COMMIT", "END", "ROLLBACK", "ABORT"})
_END_WORDS = ("commit", "end", "rollback", "abort", "prepare")


def statements(sql: str, backslash_quotes: bool = False) -> list[list[str]]:
    """``sql``'s statements as token lists (words upper-cased, quoted text as ``'``;
    ``[]`` if empty); ``backslash_quotes``: ``standard_conforming_strings`` is off."""
    found: list[list[str]] = [[]]
    depth = atomic = 0  # parentheses; BEGIN ATOMIC ... END of a function body
    pos, size = 0, len(sql)
    while pos < size:
        match = _TOKEN.match(sql, pos)
        assert match is not None  # (`other` matches any character)
        kind, pos, text, current = match.lastgroup, match.end(), match.group(), found[-1]
        if kind in ("space", "comment"):
            continue
        if kind == "block":
            nested = 1
            while nested and (part := _BLOCK_PART.search(sql, pos)) is not None:
                nested += 1 if part.group() == "/*" else -1
                pos = part.end()
            pos = pos if nested == 0 else size
            continue
        if kind in ("escaped", "quote", "ident", "dollar"):
            if kind == "dollar":
                end = sql.find(text, pos)
                pos = size if end < 0 else end + len(text)
            else:
                escapes = kind == "escaped" or backslash_quotes
                closed = (_IDENT_END if kind == "ident" else _STRING_END[escapes]).match(sql, pos)
                pos = size if closed is None else closed.end()
            current.append("'")
            continue
        if kind == "word":
            word = text.upper()
            if depth == 0 and _in_routine(current):  # a BEGIN ATOMIC body, as psql reads it
                atomic += (word == "ATOMIC" and current[-1:] == ["BEGIN"]) or (
                    word == "CASE" and atomic > 0
                )
                atomic -= word == "END" and atomic > 0
            current.append(word)
        elif text == ";" and depth == 0 and atomic == 0:
            found.append([])
        else:
            depth += (text == "(") - (text == ")" and depth > 0)
            current.append(text)
    return found


def _in_routine(tokens: list[str]) -> bool:
    """``CREATE [OR REPLACE] FUNCTION|PROCEDURE`` so far."""
    head = tokens[:4]
    return head[:1] == ["CREATE"] and bool({"FUNCTION", "PROCEDURE"} & set(head[1:]))


def _kind(tokens: list[str]) -> str | None:
    """``"end"``: COMMIT, END, ROLLBACK, ABORT (not ``COMMIT PREPARED``) or PREPARE
    TRANSACTION; ``"savepoint"``: ROLLBACK TO, which undoes an arm sent in the savepoint."""
    if tokens[:2] == ["PREPARE", "TRANSACTION"]:
        return "end"
    if not tokens or tokens[0] not in _ENDS:
        return None
    rest = tokens[2:] if tokens[1:2] in (["WORK"], ["TRANSACTION"]) else tokens[1:]
    return None if rest[:1] == ["PREPARED"] else "savepoint" if rest[:1] == ["TO"] else "end"


def _leaves(found: list[list[str]]) -> bool:
    return any(
        (kind := _kind(tokens)) is not None
        and (index < len(found) - 1 or (kind == "end" and ("AND", "CHAIN") in pairwise(tokens)))
        for index, tokens in enumerate(found)
    )


def scope_effect(sql: str, backslash_quotes: bool | None = None) -> tuple[bool, bool]:
    """Whether ``sql`` ends its transaction, or rolls back to a savepoint, and goes on (a
    statement after a COMMIT, END, ROLLBACK [TO], ABORT or PREPARE TRANSACTION; ``AND
    CHAIN``), and whether it rolls back to a savepoint at all.  With
    ``backslash_quotes=None`` (the server's setting unknown), either reading of a
    backslash before a quote finding one is enough."""
    splits = _splits(sql, backslash_quotes)
    return any(map(_leaves, splits)), any(_kind(t) == "savepoint" for f in splits for t in f)


def ends_transaction(sql: str) -> bool:
    """Whether a statement of ``sql`` ends its transaction (COMMIT, END, ROLLBACK, ABORT or
    PREPARE TRANSACTION; not ROLLBACK TO, not COMMIT PREPARED), last or not, under either
    reading of a backslash before a quote (for psycopg's pipeline mode, _scope)."""
    lowered = sql.lower()  # (a first look, as might_leave_scope's: most SQL has none)
    if not any(word in lowered for word in _END_WORDS):
        return False
    return any(_kind(tokens) == "end" for found in _splits(sql, None) for tokens in found)


def _splits(sql: str, backslash_quotes: bool | None) -> list[list[list[str]]]:
    """``sql``'s non-empty statements under each reading of a backslash to consider."""
    readings = (
        [False, True] if backslash_quotes is None and "\\" in sql else [bool(backslash_quotes)]
    )
    return [[tokens for tokens in statements(sql, reading) if tokens] for reading in readings]
