"""The database-side guard: a PL/pgSQL trigger that fences every writer.

The ORM hook fences writes that go through a fenced session.  The guard
fences the table itself, so raw SQL, Core, another service or a ``psql``
session cannot overwrite or delete a row a newer lease holder has written.

How a writer presents its token (checked by the trigger, in this order):

1. The transaction-local setting ``sa_fence.token``.  The fenced flush sets
   it *inside its own statement*: its comparison is
   ``fence <= CAST(set_config('sa_fence.token', :token, true) AS BIGINT)``,
   so no extra round trip is spent, with or without a guard (the predicate
   cannot be true without the token having been presented).  Raw SQL
   presents it with ``SELECT set_config('sa_fence.token', '<token>', true)``
   in the same transaction; :func:`sa_fence.fence_connection` does that for a
   Core connection, and a bound session does it once per transaction before
   its first ``text()`` statement.
2. Otherwise, an UPDATE that *raises* the fence presents the new fence as its
   token.

Rules (one row at a time, ``BEFORE INSERT OR UPDATE OR DELETE ... FOR EACH ROW``):

* an UPDATE that would lower the fence is refused (lowering: a fence set
  to NULL, or to a smaller value; a NULL fence is "never fenced", so an
  UPDATE leaving it NULL lowers nothing);
* a write whose token is smaller than the row's fence is refused (stale);
* an UPDATE or DELETE that presents no token: ``on_missing_token="reject"``
  (default) refuses it; ``"unchanged"`` lets an UPDATE through when it
  leaves the fence as it is (a DELETE always needs a token);
* a write whose token, or whose new fence, is greater than the last value
  the token sequence has handed out is refused (stale: no lease ever held
  that token).  Without this rule a writer could set the fence to, say,
  2^63-1 and lock every later holder out of the row for good.  The sequence
  is read (``pg_sequence_last_value``, no round trip) only when the write
  would raise the row's fence; the writer's role needs ``SELECT`` or
  ``USAGE`` on it;
* an INSERT is held to the rule above only: a new row has no newer holder
  to lose to (a stale holder's INSERTs through sa-fence are refused at
  COMMIT by lease scope).  Without a token, its fence (if not NULL) is its
  token; with neither, the row is "never fenced" and goes in as it is;
* an accepted write records the token: ``fence = greatest(fence, token)``
  (on an INSERT, the presented token replaces whatever fence it carried).

Refusals raise SQLSTATE :data:`STALE_SQLSTATE` (stale or lowering) or
:data:`NO_TOKEN_SQLSTATE` (no token presented), with a message naming table,
key and token, and a JSON ``DETAIL`` that sa-fence turns into
:class:`~sa_fence.StaleTokenError` / :class:`~sa_fence.UnfencedWriteError`.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any, Literal

from .errors import FenceError, FencingConfigError, StaleTokenError, UnfencedWriteError

#: SQLSTATE of a refused stale or fence-lowering write (class "SF" is unused by PostgreSQL).
STALE_SQLSTATE = "SF001"
#: SQLSTATE of a write that presented no token to a guard in "reject" mode.
NO_TOKEN_SQLSTATE = "SF002"
#: The transaction-local setting a writer presents its token in.
TOKEN_SETTING = "sa_fence.token"
#: The trigger's name on every guarded table.
TRIGGER_NAME = "sa_fence_guard"
#: SQLSTATE of a refused commit: a newer lease of the same name was granted
#: (the commit check in ``_register`` raises it, :func:`lease_error_from_check` reads it).
LEASE_STALE_SQLSTATE = "SF003"
#: The token sequence a guard reads when none is named; the package's one
#: default (``_register``, ``_tokens`` and the tools import it from here).
DEFAULT_SEQUENCE = "sa_fence_token_seq"

MissingToken = Literal["reject", "unchanged"]
MISSING_TOKEN_POLICIES: tuple[MissingToken, ...] = ("reject", "unchanged")

#: The comparison that refuses a stale writer (a test removes it to prove it matters).
STALE_CHECK = "current_fence > token"
#: The comparison that refuses a token or fence no lease was ever granted
#: (``raised``: the larger of token and new fence; ``issued``: the sequence's
#: last value).  A test removes it to prove it matters.
ISSUED_CHECK = "raised > issued"

#: The events the guard trigger fires on, before each row (a test removes
#: INSERT to prove it matters).
EVENTS = "INSERT OR UPDATE OR DELETE"
#: ``pg_trigger.tgtype`` bits of a complete guard: ROW, BEFORE, INSERT, DELETE, UPDATE.
TGTYPE_COMPLETE = 1 | 2 | 4 | 8 | 16

_IDENT_MAX = 63


def quote_ident(name: str) -> str:
    """PostgreSQL identifier quoting (always quoted, so any name is safe)."""
    return '"' + name.replace('"', '""') + '"'


def qualified(name: str, schema: str | None) -> str:
    return f"{quote_ident(schema)}.{quote_ident(name)}" if schema else quote_ident(name)


def function_name(table: str) -> str:
    """The guard function's name for ``table`` (a short hash when the name is too long)."""
    name = f"sa_fence_guard_{table}"
    if len(name.encode()) <= _IDENT_MAX:
        return name
    digest = hashlib.sha1(table.encode()).hexdigest()[:10]
    return f"sa_fence_guard_{table.encode()[:30].decode(errors='ignore')}_{digest}"


def check_policy(on_missing_token: str) -> MissingToken:
    for policy in MISSING_TOKEN_POLICIES:
        if on_missing_token == policy:
            return policy
    raise ValueError(
        f"on_missing_token must be 'reject' or 'unchanged', got {on_missing_token!r}: "
        "'reject' refuses every UPDATE/DELETE that presents no token; 'unchanged' lets "
        "an UPDATE that leaves the fence as it is through"
    )


def check_name(what: str, value: object) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{what} must be a non-empty string, got {value!r}")
    return value


_FUNCTION_SQL = """\
CREATE OR REPLACE FUNCTION {function}() RETURNS trigger
LANGUAGE plpgsql AS $sa_fence$
-- sa-fence guard for {table_text}.{column_text} (on_missing_token = {policy},
-- token sequence {sequence_text}).
-- Refuses an UPDATE or DELETE that would lower the fence, that carries a token
-- older than the row's fence, and any write (INSERT included) whose token or
-- fence is newer than any token issued.
-- Generated by sa_fence; recreate it with op.create_fence_guard(), do not edit
-- it by hand.
DECLARE
    presented text := nullif(current_setting('{setting}', true), '');
    token bigint;
    current_fence bigint := OLD.{column};
    new_fence bigint;
    raised bigint;
    issued bigint;
    reason text;
    kind text := 'stale';  -- the refusal's kind, in DETAIL: stale, lowering, not_issued, no_token
    sqlstate_ text := '{stale}';
    key_names text;
    key_values text;
    key_json jsonb;
    keyed jsonb;
BEGIN
    IF presented IS NOT NULL THEN
        IF presented !~ '^[0-9]{{1,19}}$' THEN
            RAISE EXCEPTION 'sa-fence guard: setting {setting} = % is not a token', presented
                USING ERRCODE = '{no_token}',
                      HINT = 'Present the lease''s token: SELECT set_config(''{setting}'', '
                             '''<token>'', true);';
        END IF;
        token := presented::bigint;
    END IF;
    IF TG_OP = 'UPDATE' THEN
        new_fence := NEW.{column};
        -- A NULL fence is "never fenced": leaving it NULL lowers nothing.
        IF (new_fence IS NULL AND current_fence IS NOT NULL) OR new_fence < current_fence THEN
            reason := format('would lower the fence from %s to %s (token %s)', current_fence,
                             coalesce(new_fence::text, 'NULL'), coalesce(token::text, 'none'));
            kind := 'lowering';
        ELSIF token IS NULL AND new_fence IS NOT NULL
              AND (current_fence IS NULL OR new_fence > current_fence) THEN
            token := new_fence;  -- the writer presents its token as the new fence
        END IF;
    ELSIF TG_OP = 'INSERT' THEN
        -- A new row has no holder to lose to: only a forged fence is refused.
        new_fence := NEW.{column};
        IF token IS NULL THEN
            IF new_fence IS NULL THEN
                RETURN NEW;  -- never fenced: the first fenced write sets its fence
            END IF;
            token := new_fence;  -- the writer presents its token as the fence
        END IF;
    END IF;
    IF reason IS NULL AND token IS NULL THEN
        IF TG_OP = 'UPDATE' AND {allow_unchanged} THEN
            RETURN NEW;  -- on_missing_token = 'unchanged': the fence stays as it is
        END IF;
        reason := 'presents no token';
        kind := 'no_token';
        sqlstate_ := '{no_token}';
    END IF;
    IF reason IS NULL AND {stale_check} THEN
        reason := format('token %s is stale: the row''s fence is %s', token, current_fence);
    END IF;
    -- No lease was ever granted a token past the sequence's last value: such a
    -- token or fence would lock every later holder out.  Read the sequence only
    -- when the write would raise the row's fence (no round trip either way).
    raised := greatest(token, new_fence);
    IF reason IS NULL AND (current_fence IS NULL OR raised > current_fence) THEN
        issued := pg_catalog.pg_sequence_last_value({sequence_literal}::regclass);
        IF issued IS NULL
           AND NOT pg_catalog.has_sequence_privilege({sequence_literal}, 'SELECT, USAGE') THEN
            RAISE EXCEPTION 'sa-fence guard: role % cannot read the token sequence %',
                current_user, {sequence_literal}
                USING ERRCODE = '42501',
                      HINT = format('GRANT SELECT ON SEQUENCE %s TO %I;', {sequence_literal},
                                    current_user);
        END IF;
        issued := coalesce(issued, 0);  -- NULL: no token handed out yet
        IF {issued_check} THEN
            reason := format('%s %s is past the last token issued (%s by sequence %s)',
                             CASE WHEN presented IS NOT NULL AND raised = token
                                  THEN 'token' ELSE 'the new fence' END,
                             raised, issued, {sequence_literal});
            kind := 'not_issued';
        END IF;
    END IF;
    IF reason IS NULL THEN
        IF TG_OP = 'DELETE' THEN
            RETURN OLD;
        END IF;
        -- The row records the writer's token: never a value the writer chose
        -- (a fence above its own token would shut out later holders of other names).
        NEW.{column} := token;
        RETURN NEW;
    END IF;
    -- Refused (the failure path only): name the row by its primary key.
    IF TG_OP = 'INSERT' THEN
        keyed := to_jsonb(NEW);
    ELSE
        keyed := to_jsonb(OLD);
    END IF;
    SELECT string_agg(quote_ident(a.attname), ', ' ORDER BY k.ord),
           string_agg(coalesce(keyed ->> a.attname::text, 'NULL'), ', ' ORDER BY k.ord),
           jsonb_agg(keyed -> a.attname::text ORDER BY k.ord)
      INTO key_names, key_values, key_json
      FROM pg_catalog.pg_index i
     CROSS JOIN LATERAL unnest(i.indkey::int2[]) WITH ORDINALITY AS k(attnum, ord)
      JOIN pg_catalog.pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
     WHERE i.indrelid = TG_RELID AND i.indisprimary;
    RAISE EXCEPTION 'sa-fence guard: % on table %.% refused for row (%)=(%): %',
        TG_OP, quote_ident(TG_TABLE_SCHEMA), quote_ident(TG_TABLE_NAME),
        coalesce(key_names, '?'), coalesce(key_values, '?'), reason
        USING ERRCODE = sqlstate_,
              SCHEMA = TG_TABLE_SCHEMA,
              TABLE = TG_TABLE_NAME,
              COLUMN = '{column_text}',
              DETAIL = jsonb_build_object(
                  'op', TG_OP, 'reason', kind, 'schema', TG_TABLE_SCHEMA, 'table', TG_TABLE_NAME,
                  'key', coalesce(key_json, '[]'::jsonb), 'token', token,
                  'fence', current_fence, 'issued', issued)::text,
              HINT = CASE WHEN sqlstate_ = '{no_token}'
                  THEN 'Present the lease''s token in this transaction: SELECT '
                       'set_config(''{setting}'', ''<token>'', true); (Python: '
                       'sa_fence.fence_connection(conn, lease)).'
                  WHEN issued IS NOT NULL AND raised > issued
                  THEN 'Present the token your lease was granted; never set the fence by hand.'
                  ELSE 'A newer lease holder has written this row; roll back and re-read it.'
              END;
END
$sa_fence$
"""

#: Ends the guard function's dollar-quoted body: no name may contain it.
_BODY_QUOTE = "$sa_fence$"


def quote_literal(value: str) -> str:
    """A PostgreSQL string literal for ``value``, safe whatever
    ``standard_conforming_strings`` is: the ``E''`` form escapes both quotes
    and backslashes.  (Used where a statement cannot take parameters: the
    guard function's body, and the commit check, which must travel in one
    simple-protocol message with ``COMMIT``.)"""
    if "\x00" in value:
        raise ValueError(
            f"{value!r} contains a NUL character, which PostgreSQL text cannot hold: remove it"
        )
    return "E'" + value.replace("\\", "\\\\").replace("'", "''") + "'"


def create_guard_sql(
    table: str,
    column: str = "fence",
    *,
    schema: str | None = None,
    on_missing_token: str = "reject",
    sequence: str = DEFAULT_SEQUENCE,
) -> list[str]:
    """The statements that create (or replace) the guard function and trigger.

    ``sequence`` (``"name"`` or ``"schema.name"``) is the token sequence of
    the Fencers writing this table: a token or fence past its last value is
    refused.  An unqualified name is looked up on the writer's
    ``search_path``, like the lease register's.
    """
    policy = check_policy(on_missing_token)
    check_name("table", table)
    check_name("column", column)
    check_name("sequence", sequence)
    for what, value in (("table", table), ("column", column), ("schema", schema or ""),
                        ("sequence", sequence)):  # fmt: skip
        if _BODY_QUOTE in value:
            raise ValueError(f"{what} {value!r} cannot contain {_BODY_QUOTE!r}")
    seq_schema, _, seq_name = sequence.rpartition(".")
    sequence_sql = qualified(seq_name, seq_schema or None)
    function = qualified(function_name(table), schema)
    target = qualified(table, schema)
    body = _FUNCTION_SQL.format(
        function=function,
        table_text=target.replace("$", ""),
        sequence_text=sequence_sql.replace("$", ""),
        sequence_literal=quote_literal(sequence_sql),
        column=quote_ident(column),
        column_text=column.replace("'", "''"),
        policy=policy,
        setting=TOKEN_SETTING,
        stale=STALE_SQLSTATE,
        no_token=NO_TOKEN_SQLSTATE,
        allow_unchanged="true" if policy == "unchanged" else "false",
        stale_check=STALE_CHECK,
        issued_check=ISSUED_CHECK,
    )
    return [
        body,
        f"DROP TRIGGER IF EXISTS {TRIGGER_NAME} ON {target}",
        f"CREATE TRIGGER {TRIGGER_NAME} BEFORE {EVENTS} ON {target} "
        f"FOR EACH ROW EXECUTE FUNCTION {function}()",
    ]


_HEADER = re.compile(
    r"\A\n-- sa-fence guard for .*? \(on_missing_token = (reject|unchanged),\n"
    r"-- token sequence (.+?)\)\.\n",
    re.DOTALL,
)
_QUOTED = re.compile(r'"((?:[^"]|"")*)"(?:\."((?:[^"]|"")*)")?\Z')


def guard_made_with(source: str) -> tuple[MissingToken, str] | None:
    """The ``on_missing_token`` and ``sequence`` a guard function's source
    (``pg_proc.prosrc``) was made with, read from its header; None when the
    source is not one :func:`create_guard_sql` made."""
    header = _HEADER.match(source)
    if header is None:
        return None
    quoted = _QUOTED.match(header.group(2))
    if quoted is None:
        return None
    first, second = (part.replace('""', '"') if part else part for part in quoted.groups())
    sequence = f"{first}.{second}" if second is not None else first
    return check_policy(header.group(1)), sequence


def function_source(statements: list[str]) -> str:
    """What ``pg_proc.prosrc`` holds for the guard function ``statements``
    (:func:`create_guard_sql`'s) create."""
    return statements[0].split(_BODY_QUOTE)[1]


#: The guard trigger of a table (enabled or not; none: no row), as :func:`outdated`
#: needs it, and the DDL that makes it again as it is (what a replace's downgrade
#: restores).
GUARD_STATE_SQL = f"""
SELECT t.tgenabled <> 'D' AS enabled,
       (t.tgtype::int & {TGTYPE_COMPLETE}) = {TGTYPE_COMPLETE} AS complete,
       p.prosrc AS source,
       pg_catalog.pg_get_functiondef(p.oid) AS function_sql,
       pg_catalog.pg_get_triggerdef(t.oid) AS trigger_sql
  FROM pg_catalog.pg_trigger t
  JOIN pg_catalog.pg_proc p ON p.oid = t.tgfoid
 WHERE t.tgrelid = to_regclass(:table) AND t.tgname = '{TRIGGER_NAME}'
   AND NOT t.tgisinternal
"""


def outdated(
    source: str | None,
    complete: bool,
    table: str,
    column: str,
    *,
    schema: str | None,
    default_schema: str | None,
    sequence: str,
) -> list[str]:
    """Why an existing guard is not the one this sa-fence creates (empty: it is).

    ``source``: its function's ``prosrc``; ``complete``: its trigger fires
    before each INSERT, UPDATE and DELETE of a row.  The function is compared
    with the one :func:`create_guard_sql` makes with the policy and sequence
    its header names (or ``sequence``), the table's schema named as given,
    not at all, or as ``default_schema`` (a guard made either way is current).
    """
    why = []
    if not complete:
        why.append(
            "it does not fire before each INSERT, UPDATE and DELETE, so a raw INSERT "
            "with a forged fence would lock every later holder out of its row"
        )
    made_with = guard_made_with(source or "")
    if made_with is None:
        why.append("its function was not made by sa-fence (or was edited by hand)")
        return why
    policy, made_sequence = made_with
    if not any(
        source
        == function_source(
            create_guard_sql(table, column, schema=named, on_missing_token=policy, sequence=seq)
        )
        for named in {schema, None, default_schema}
        for seq in (made_sequence, sequence)
    ):
        why.append("its function differs (made by another sa-fence version, or edited by hand)")
    return why


def drop_guard_sql(table: str, *, schema: str | None = None) -> list[str]:
    """The statements that drop the guard trigger and its function."""
    check_name("table", table)
    return [
        f"DROP TRIGGER IF EXISTS {TRIGGER_NAME} ON {qualified(table, schema)}",
        f"DROP FUNCTION IF EXISTS {qualified(function_name(table), schema)}()",
    ]


# ------------------------------------------------------ SQLSTATE -> sa-fence errors


def error_from_guard(
    orig: BaseException, lease_name: str | None = None, lease_token: int | None = None
) -> FenceError | None:
    """The sa-fence error for a guard refusal raised by the driver, else None.

    ``lease_token`` stands in for the token when the writer presented none
    that the trigger could report (an UPDATE lowering the fence).  A token or
    fence past any the sequence issued is no stale write but a mistake (a fence
    set by hand, or a guard reading another sequence than the Fencer's):
    :class:`~sa_fence.FencingConfigError`.
    """
    sqlstate = getattr(orig, "sqlstate", None)
    if sqlstate not in (STALE_SQLSTATE, NO_TOKEN_SQLSTATE):
        return None
    diag = getattr(orig, "diag", None)
    message = str(getattr(diag, "message_primary", None) or orig).strip()
    try:
        detail: dict[str, Any] = json.loads(getattr(diag, "message_detail", None) or "{}")
    except ValueError:
        detail = {}
    if sqlstate == NO_TOKEN_SQLSTATE:
        return UnfencedWriteError(
            f"{message}. The table's guard refuses writes that present no token: bind a "
            "lease to the session, wrap a Core connection in "
            "sa_fence.fence_connection(conn, lease), or run "
            "SELECT set_config('sa_fence.token', '<token>', true) in the transaction."
        )
    if detail.get("reason") == "not_issued":
        return FencingConfigError(
            f"{message}. No lease was granted that token or fence, so sa-fence did not "
            "send it: either this statement sets the fence column by hand (never do; the "
            "guard records the lease's token), or the Fencer draws its tokens from another "
            "sequence than the one the guard reads (recreate the guard with "
            "op.create_fence_guard(..., sequence=<the Fencer's sequence>)). Nothing was "
            "written.",
            cause=orig,
        )
    schema = detail.get("schema")
    table = str(detail.get("table", "?"))
    if schema and schema != "public":
        table = f"{schema}.{table}"
    key = detail.get("key") or []
    token = detail.get("token")
    if token is None:
        token = lease_token
    fence = detail.get("fence")
    return StaleTokenError(
        table=table,
        statement=str(detail.get("op", "UPDATE")),
        token=int(token) if token is not None else -1,
        primary_keys=[tuple(key)],
        current_fences=[int(fence) if fence is not None else None],
        lease_name=lease_name,
    )


def lease_error_from_check(orig: BaseException, scope: Any) -> StaleTokenError | None:
    """The StaleTokenError for a refused commit check (SQLSTATE SF003), else None."""
    if getattr(orig, "sqlstate", None) != LEASE_STALE_SQLSTATE:
        return None
    diag = getattr(orig, "diag", None)
    try:
        detail: dict[str, Any] = json.loads(getattr(diag, "message_detail", None) or "{}")
    except ValueError:
        detail = {}
    name = detail.get("name")
    token = detail.get("token")
    if name is None or token is None:  # cannot happen with our function; stay specific anyway
        name, token = next(iter(scope))
    newest = detail.get("newest")
    return StaleTokenError(
        statement="COMMIT",
        token=int(token),
        lease_name=str(name),
        newest_token=None if newest is None else int(newest),
    )
