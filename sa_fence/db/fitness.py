"""The fitness rules of the token sequence and the lease register, stated once.

A sequence issues fencing tokens only when every rule of :data:`SEQUENCE_RULES` holds; a
register serves a sequence only when no rule of :data:`REGISTER_RULES` is broken.  The grant
statement (:mod:`sa_fence.db.register`: :data:`SEQUENCE_FIT_SQL` and :func:`token_sequences_sql`),
``Fencer.check()`` (the first :class:`Problem` as one sentence), ``sa-fence check`` (every
:class:`Problem`) and ``sa-fence status`` all read them, and PostgreSQL evaluates the same
predicates in each, so what the grant refuses is what the checks report.  Everything names
``pg_catalog`` objects qualified: a grant runs on the application's search_path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import text

from .guard import DEFAULT_SEQUENCE


@dataclass(frozen=True)
class SequenceRule:
    """One thing the token sequence must be: ``key``, its column of :data:`SEQUENCE_SQL`;
    ``sql``, the rule as a predicate over ``pg_catalog.pg_sequence s``; ``clause``, the
    ``CREATE``/``ALTER SEQUENCE`` clause that makes it hold; ``shown``, what a fit sequence is
    (as ``sa-fence check`` says it); ``problem``, why it does not hold (formatted with the row)."""

    key: str
    sql: str
    clause: str
    shown: str
    problem: str


SEQUENCE_RULES: tuple[SequenceRule, ...] = (
    SequenceRule(
        "is_bigint",
        "s.seqtypid = 'pg_catalog.int8'::pg_catalog.regtype",
        "AS bigint",
        "bigint",
        "its type is {data_type} (need bigint: AS bigint)",
    ),
    SequenceRule(
        "is_cache_1",
        "s.seqcache = 1",
        "CACHE 1",
        "CACHE 1",
        "it has CACHE {seqcache} (need CACHE 1: cached values are not ordered in time "
        "across connections)",
    ),
    SequenceRule(
        "is_no_cycle",
        "NOT s.seqcycle",
        "NO CYCLE",
        "NO CYCLE",
        "it is CYCLE (need NO CYCLE: a wrapped token looks ancient)",
    ),
    SequenceRule(
        "is_increasing",
        "s.seqincrement > 0",
        "INCREMENT BY 1",
        "increment > 0",
        "it has INCREMENT {seqincrement} (need a positive increment)",
    ),
    SequenceRule(
        "is_logged",
        "s.seqrelid IN (SELECT c.oid FROM pg_catalog.pg_class c WHERE c.relpersistence = 'p')",
        "",  # not a clause of CREATE/ALTER SEQUENCE's option list: the problem says the fix
        "logged",
        "it is UNLOGGED or temporary (need a logged sequence: a crash resets an UNLOGGED "
        "sequence, which would hand out tokens again; ALTER SEQUENCE ... SET LOGGED)",
    ),
)

#: Every sequence rule at once (the grant's condition on ``pg_sequence s``).
SEQUENCE_FIT_SQL = " AND ".join(rule.sql for rule in SEQUENCE_RULES)
#: The clauses that make a sequence fit: ``AS bigint CACHE 1 NO CYCLE INCREMENT BY 1``.
SEQUENCE_CLAUSES = " ".join(rule.clause for rule in SEQUENCE_RULES if rule.clause)
#: What a fit sequence is: ``bigint, CACHE 1, NO CYCLE, increment > 0, logged``.
SEQUENCE_SHOWN = ", ".join(rule.shown for rule in SEQUENCE_RULES)

#: The sequence's settings and, per rule, whether it holds (``:name``: the sequence).
SEQUENCE_SQL = text(
    "SELECT pg_catalog.format_type(s.seqtypid, NULL) AS data_type, "
    "s.seqcache, s.seqcycle, s.seqincrement, s.seqstart, "
    + ", ".join(f"({rule.sql}) AS {rule.key}" for rule in SEQUENCE_RULES)
    + " FROM pg_catalog.pg_sequence s WHERE s.seqrelid = pg_catalog.to_regclass(:name)"
)


def token_sequences_sql(register: str) -> str:
    """A subquery: the OIDs of the relations the token default of ``register`` (an SQL
    expression of type regclass) depends on; the sequences among them are the ones it draws from."""
    return f"""(
           SELECT p.refobjid
             FROM pg_catalog.pg_attrdef d
             JOIN pg_catalog.pg_attribute a ON a.attrelid = d.adrelid AND a.attnum = d.adnum
             JOIN pg_catalog.pg_depend p
               ON p.classid = 'pg_catalog.pg_attrdef'::pg_catalog.regclass AND p.objid = d.oid
              AND p.refclassid = 'pg_catalog.pg_class'::pg_catalog.regclass
            WHERE d.adrelid = {register} AND a.attname = 'token')"""


#: The register's columns as the catalog has them (``:register``).
REGISTER_COLUMNS_SQL = text(
    """
    SELECT a.attname AS name, format_type(a.atttypid, a.atttypmod) AS data_type,
           a.attnotnull AS not_null
      FROM pg_catalog.pg_attribute a
     WHERE a.attrelid = to_regclass(:register) AND a.attnum > 0 AND NOT a.attisdropped
    """
)

#: The sequence the register's token default draws from (NULL: none).
REGISTER_SEQUENCE_SQL = text(
    "SELECT t.oid::regclass::text AS sequence FROM pg_catalog.pg_class t "
    "WHERE t.relkind = 'S' AND t.oid IN "
    + token_sequences_sql("to_regclass(:register)")
    + " ORDER BY 1 LIMIT 1"
)

#: Does the check function exist (with the right arguments)?
CHECK_FUNCTION_SQL = text(
    "SELECT to_regprocedure(:function || '(text, bigint)') IS NOT NULL AS present"
)

#: What the register must look like: column -> (type, not null).
REGISTER_SHAPE: dict[str, tuple[str, bool]] = {
    "name": ("text", True),
    "token": ("bigint", True),
    "granted_at": ("timestamp with time zone", True),
    "previous": ("bigint", False),
}


@dataclass(frozen=True)
class Problem:
    """A broken rule: what is wrong with what, and how to fix it."""

    subject: str
    problem: str
    fix: str
    #: the key of the broken rule in :data:`REGISTER_RULES`
    rule: str = ""

    def sentence(self) -> str:
        """The problem as one sentence (``Fencer.check()``'s FencingConfigError)."""
        return f"the {self.subject} {self.problem}. Fix: {self.fix}"


@dataclass(frozen=True)
class Rule:
    """One way the set-up can be unfit: templates over :func:`_names` and the facts found."""

    key: str
    subject: str
    problem: str
    fix: str

    def broken(self, names: dict[str, str], **facts: str) -> Problem:
        parts = (self.subject, self.problem, self.fix)
        subject, problem, fix = (part.format(**names, **facts) for part in parts)
        return Problem(subject, problem, fix, self.key)


_SUBJECT = "lease register {register}"
#: The ways the set-up can be unfit, in the order they are tested: the sequence's
#: presence and fitness (:data:`SEQUENCE_RULES`), then the register's.
REGISTER_RULES: tuple[Rule, ...] = (
    Rule(
        "sequence missing",
        "token sequence {sequence}",
        "does not exist, so no lease can get a token",
        "in a migration: op.create_fence_sequence({sequence_arg}); or "
        "sa_fence.fence_schema(metadata{metadata_arg}) and metadata.create_all(); or in "
        "SQL: CREATE SEQUENCE {sequence_sql} " + SEQUENCE_CLAUSES + ";",
    ),
    Rule(
        "sequence unfit",
        "token sequence {sequence}",
        "cannot issue fencing tokens: {problems}",
        "ALTER SEQUENCE {sequence_sql} "
        + SEQUENCE_CLAUSES
        + "; (in a migration: op.alter_fence_sequence(...))",
    ),
    Rule(
        "missing",
        _SUBJECT,
        "does not exist: no Fencer grants a lease without it, and without it a stale "
        "holder's INSERTs and writes to other tables would not be refused",
        "in a migration, after the sequence: op.create_fence_register({args}); or "
        "metadata.create_all() with sa_fence.fence_schema(metadata)",
    ),
    Rule(
        "shape",
        _SUBJECT,
        "has the wrong shape: {shape}",
        "stop the workers, then drop and recreate it (it holds only the newest token per "
        "lease name): op.drop_fence_register({args}) and op.create_fence_register({args})",
    ),
    Rule(
        "no sequence",
        _SUBJECT,
        "draws its tokens from no sequence (its token column has no nextval default): "
        "every grant is refused",
        "ALTER TABLE {register_sql} ALTER COLUMN token SET DEFAULT nextval('{sequence_sql}');",
    ),
    Rule(
        "other sequence",
        _SUBJECT,
        "draws its tokens from sequence {owner}, not from {sequence}: a Fencer naming "
        "{sequence} is refused (tokens of one register must come from one sequence, or a "
        "stale holder's token could overtake a newer one)",
        "if your Fencers use {owner}, pass sequence='{owner}' to them (and check with "
        "--sequence {owner}); to move the register to {sequence}, stop the workers, run "
        "sa-fence repair-sequence --sequence {sequence} first, then ALTER TABLE "
        "{register_sql} ALTER COLUMN token SET DEFAULT nextval('{sequence_sql}');",
    ),
    Rule(
        "no check function",
        "commit check function {function_sql}(text, bigint)",
        "is missing: no session bound to a lease can commit",
        "op.create_fence_register({args}) (keeps the register's rows), or "
        "sa_fence.fence_schema(metadata) and metadata.create_all()",
    ),
)
_RULES = {rule.key: rule for rule in REGISTER_RULES}


def register_op_args(sequence: str) -> str:
    """The arguments of ``op.create_fence_register(...)`` (and ``drop_...``) for
    ``sequence``, as autogenerate and the hints write them: none for the default."""
    return "" if sequence == DEFAULT_SEQUENCE else f"sequence={sequence!r}"


def _names(shown: Any) -> dict[str, str]:
    """The names a rule's text may show, from a ``Register`` as the user named it."""
    sequence = shown.sequence
    default = sequence == DEFAULT_SEQUENCE
    return {
        "sequence": sequence,
        "sequence_sql": shown.sequence_sql,
        "register": shown.table_display,
        "register_sql": shown.table_sql,
        "function_sql": shown.function_sql,
        "args": register_op_args(sequence),
        "sequence_arg": "" if default else repr(sequence),
        "metadata_arg": "" if default else f", {sequence!r}",
    }


def sequence_problem(conn: Any, shown: Any, pinned: Any) -> tuple[Any, Problem | None]:
    """(the :data:`SEQUENCE_SQL` row or None, the sequence's problem or None); ``shown``,
    ``pinned``: the ``Register`` as named and schema-qualified (``pinned_register``)."""
    row = conn.execute(SEQUENCE_SQL, {"name": pinned.sequence_sql}).one_or_none()
    if row is None:
        return None, _RULES["sequence missing"].broken(_names(shown))
    values = row._mapping
    problems = [rule.problem.format(**values) for rule in SEQUENCE_RULES if not values[rule.key]]
    if not problems:
        return row, None
    return row, _RULES["sequence unfit"].broken(_names(shown), problems="; ".join(problems))


def register_problems(conn: Any, shown: Any, pinned: Any) -> list[Problem]:
    """Every broken rule of :data:`REGISTER_RULES` for the register (only
    ``missing`` when it does not exist); reads the pinned names."""
    names = _names(shown)
    columns = conn.execute(REGISTER_COLUMNS_SQL, {"register": pinned.table_sql}).all()
    if not columns:
        return [_RULES["missing"].broken(names)]
    found = []
    kinds = {row.name: (row.data_type, bool(row.not_null)) for row in columns}
    shape = []
    for column, (data_type, not_null) in REGISTER_SHAPE.items():
        has_type, has_not_null = kinds.get(column, (None, True))
        if has_type is None:
            shape.append(f"has no column {column!r} ({data_type})")
        elif has_type != data_type:
            shape.append(f"column {column!r} is {has_type} (need {data_type})")
        if not_null and not has_not_null:
            shape.append(f"column {column!r} allows NULL (need NOT NULL)")
    if shape:
        found.append(_RULES["shape"].broken(names, shape="; ".join(shape)))
    owner = conn.execute(REGISTER_SEQUENCE_SQL, {"register": pinned.table_sql}).scalar()
    mine = conn.execute(
        text("SELECT to_regclass(:seq)::text"), {"seq": pinned.sequence_sql}
    ).scalar()
    if owner is None:
        found.append(_RULES["no sequence"].broken(names))
    elif owner != mine:
        found.append(_RULES["other sequence"].broken(names, owner=owner))
    if not conn.execute(CHECK_FUNCTION_SQL, {"function": pinned.function_sql}).scalar():
        found.append(_RULES["no check function"].broken(names))
    return found
