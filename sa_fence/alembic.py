"""Alembic operations and autogenerate support for sa-fence.

Importing this module (in ``env.py``) registers the operations on Alembic's ``op``::

    import sa_fence.alembic  # noqa: F401  (registers op.create_fence_sequence & co.)

    # a revision's upgrade(); its downgrade() drops in the reverse order
    op.create_fence_sequence()              # bigint, CACHE 1, NO CYCLE
    op.create_fence_register()              # sa_fence_leases + its commit check
    op.add_fence_column("jobs")             # BIGINT NOT NULL DEFAULT 0, no rewrite
    op.create_fence_guard("jobs")           # trigger refusing stale writers

Every operation has a ``reverse()``; ``alembic revision --autogenerate`` adds what fenced models
and a declared register lack: docs/migrations.md.
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import sqlalchemy as sa
from alembic.autogenerate import comparators, renderers
from alembic.operations import MigrateOperation, Operations
from alembic.operations import ops as alembic_ops
from alembic.util import DispatchPriority, PriorityDispatchResult
from sqlalchemy.schema import CreateSequence, DropSequence

from .db.fitness import CHECK_FUNCTION_SQL, SEQUENCE_SQL, register_op_args
from .db.guard import (
    GUARD_STATE_SQL,
    TRIGGER_NAME,
    check_name,
    check_policy,
    create_guard_sql,
    drop_guard_sql,
    guard_made_with,
    outdated,
    qualified,
)
from .db.register import (
    REGISTER_TABLE,
    SCOPE_TABLE,
    Register,
    create_register_sql,
    drop_register_sql,
    register_objects_outdated,
    scope_trigger_problem,
    split_name,
)
from .db.tokens import DEFAULT_SEQUENCE, fence_schema
from .orm.create_guard import check_column, check_sequence, ddl, shown_table
from .orm.model import fence_column_of

if TYPE_CHECKING:
    from alembic.autogenerate.api import AutogenContext

__all__ = [
    "AddFenceColumnOp",
    "AlterFenceSequenceOp",
    "CreateFenceGuardOp",
    "CreateFenceRegisterOp",
    "CreateFenceSequenceOp",
    "DropFenceColumnOp",
    "DropFenceGuardOp",
    "DropFenceRegisterOp",
    "DropFenceSequenceOp",
    "ReplaceFenceGuardOp",
]


#: A rendered op leaves an argument out at this value; one not named here is always written
#: (``on_missing_token``: which writers the guard refuses is the revision reader's decision).
_DEFAULTS = dict(name=DEFAULT_SEQUENCE, sequence=DEFAULT_SEQUENCE, column="fence", schema=None)
#: The arguments a rendered op writes without their keyword.
_POSITIONAL = ("name", "table_name", "column")

#: The op classes, in definition order (their docstrings become ``help(op.<name>)``).
_OP_CLASSES: list[type[_FenceOp]] = []
#: Each op's reverse: the opposite op, made with the same arguments.
_OPPOSITE: dict[type[_FenceOp], Callable[..., _FenceOp]] = {}


class _FenceOp(MigrateOperation):
    """What every sa-fence op has: a name, the SQL it runs, and its arguments as source."""

    op_name: ClassVar[str] = ""
    _fields: ClassVar[tuple[str, ...]]  # the arguments; its reverse is made with the same
    _shown: ClassVar[tuple[str, ...]] = ()  # what a revision shows, in order, if not _fields
    _diff: ClassVar[tuple[str, ...]]  # what ``alembic check`` reports, after the op's name

    def __init_subclass__(cls, opposite: type[_FenceOp] | None = None) -> None:
        """Name and dispatch a public op class; ``opposite``: the op its reverse is."""
        super().__init_subclass__()
        if not cls.__name__.startswith("_"):
            # CreateFenceGuardOp: op.create_fence_guard, registered with that name
            cls.op_name = re.sub(r"(?<!^)([A-Z])", r"_\1", cls.__name__[:-2]).lower()
            _OP_CLASSES.append(cls)
            Operations.implementation_for(cls)(lambda operations, op: op._run(operations))
            renderers.dispatch_for(cls)(lambda autogen_context, op: op._render(autogen_context))
        if opposite is not None:
            _OPPOSITE.update({cls: opposite, opposite: cls})

    def _arguments(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self._fields}

    def reverse(self) -> _FenceOp:
        return _OPPOSITE[type(self)](**self._arguments())

    def to_diff_tuple(self) -> tuple[Any, ...]:
        return (self.op_name, *(getattr(self, name) for name in self._diff))

    def _statements(self, operations: Operations) -> Iterable[Any]:
        """What to execute, after any online check (nothing is sent when one fails)."""
        raise NotImplementedError

    def _run(self, operations: Operations) -> None:
        for statement in self._statements(operations):
            operations.execute(ddl(statement) if isinstance(statement, str) else statement)

    def _render_args(self) -> str:
        """The op's arguments as autogenerate writes them into a revision."""
        shown = {f: getattr(self, f) for f in self._shown or self._fields}
        shown = {f: v for f, v in shown.items() if f not in _DEFAULTS or v != _DEFAULTS[f]}
        positional = [repr(shown.pop(f)) for f in _POSITIONAL if f in shown]
        return ", ".join([*positional, *(f"{k}={v!r}" for k, v in shown.items())])

    def _notes(self) -> list[str]:  # the comment lines above the op in a revision
        return []

    def _render(self, autogen_context: AutogenContext) -> list[str]:
        """``op.<name>(<args>)`` for a revision, which then imports sa_fence.alembic."""
        autogen_context.imports.add("import sa_fence.alembic  # noqa: F401")
        return [*self._notes(), f"op.{self.op_name}({self._render_args()})"]


class _SequenceOp(_FenceOp):
    _fields = ("name", "schema")
    _diff: ClassVar[tuple[str, ...]] = ("schema", "name")
    _ddl: ClassVar[type[CreateSequence] | type[DropSequence]]

    def __init__(self, name: str = DEFAULT_SEQUENCE, *, schema: str | None = None) -> None:
        self.name = check_name("sequence name", name)
        self.schema = schema if schema is None else check_name("schema", schema)

    @classmethod
    def _sequence_op(
        cls, operations: Operations, name: str = DEFAULT_SEQUENCE, *, schema: str | None = None
    ) -> None:
        operations.invoke(cls(name, schema=schema))

    def _statements(self, operations: Operations) -> Iterable[Any]:
        return [self._ddl(fence_schema(None, self.name, schema=self.schema))]


@Operations.register_operation("create_fence_sequence", "_sequence_op")
class CreateFenceSequenceOp(_SequenceOp):
    """``op.create_fence_sequence(name="sa_fence_token_seq", *, schema=None)``.

    Creates the token sequence: ``AS bigint INCREMENT BY 1 START WITH 1 CACHE 1 NO CYCLE``.
    The reverse drops it, which resets the tokens.
    """

    _ddl = CreateSequence


#: Above a rendered drop_fence_sequence() (it appears in downgrade()).
DROP_SEQUENCE_WARNING = [
    "# WARNING: this drops the token sequence.  Created again, it starts from 1 again,",
    "# below the fences already on your rows and the tokens in the lease register:",
    "# every later writer of those rows would be refused until it catches up.  Never",
    "# run this on a live database; delete this line to keep the sequence.",
]

#: Column defaults that draw from a sequence (``nextval``), e.g. the register's token.
_SEQUENCE_USERS_SQL = sa.text(
    """SELECT d.adrelid::regclass::text AS table_name, a.attname AS column_name,
           c.relname = :register AS is_register
      FROM pg_catalog.pg_depend p
      JOIN pg_catalog.pg_attrdef d
        ON p.classid = 'pg_catalog.pg_attrdef'::regclass AND p.objid = d.oid
      JOIN pg_catalog.pg_attribute a ON a.attrelid = d.adrelid AND a.attnum = d.adnum
      JOIN pg_catalog.pg_class c ON c.oid = d.adrelid
     WHERE p.refclassid = 'pg_catalog.pg_class'::regclass AND p.refobjid = to_regclass(:sequence)
     ORDER BY 1, 2"""
)


@Operations.register_operation("drop_fence_sequence", "_sequence_op")
class DropFenceSequenceOp(_SequenceOp, opposite=CreateFenceSequenceOp):
    """``op.drop_fence_sequence(name="sa_fence_token_seq", *, schema=None)``.

    Never run this on a live database: the next sequence starts at 1 again, below the fences
    already on the rows, and every writer is refused.  The lease register's token default
    depends on the sequence: drop the register first (``op.drop_fence_register()``); online,
    this op says so before sending anything.
    """

    _ddl = DropSequence

    def _statements(self, operations: Operations) -> Iterable[Any]:
        if not operations.get_context().as_sql:
            params = {"sequence": qualified(self.name, self.schema), "register": REGISTER_TABLE}
            users = operations.get_bind().execute(_SEQUENCE_USERS_SQL, params).all()
            if users:
                shown = shown_table(self.name, self.schema)
                first = "drop those defaults (or their tables) first"
                if any(u.is_register for u in users):
                    args = register_op_args(shown)
                    first = f"drop the lease register first: op.drop_fence_register({args})"
                raise ValueError(
                    f"drop_fence_sequence: sequence {shown!r} is still the default of "
                    + ", ".join(f"{u.table_name}.{u.column_name}" for u in users)
                    + f"; {first}"
                )
        return super()._statements(operations)

    def _notes(self) -> list[str]:
        return DROP_SEQUENCE_WARNING


@Operations.register_operation("alter_fence_sequence")
class AlterFenceSequenceOp(_SequenceOp):
    """``op.alter_fence_sequence(name, *, existing_cache=1, existing_cycle=False, schema=None)``.

    Makes an existing sequence fit for tokens: ``AS bigint CACHE 1 NO CYCLE``.
    ``existing_*`` record what it was, for the reverse.
    """

    _shown = ("name", "existing_cache", "existing_cycle", "schema")
    _diff = ("schema", "name", "existing_cache", "cache")

    def __init__(
        self,
        name: str = DEFAULT_SEQUENCE,
        *,
        cache: int = 1,
        cycle: bool = False,
        existing_cache: int = 1,
        existing_cycle: bool = False,
        schema: str | None = None,
    ) -> None:
        super().__init__(name, schema=schema)
        for what, value in (("cache", cache), ("existing_cache", existing_cache)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{what} must be a positive int, got {value!r}")
        self.cache, self.cycle = cache, bool(cycle)
        self.existing_cache, self.existing_cycle = existing_cache, bool(existing_cycle)

    @classmethod
    def alter_fence_sequence(
        cls,
        operations: Operations,
        name: str = DEFAULT_SEQUENCE,
        *,
        existing_cache: int = 1,
        existing_cycle: bool = False,
        schema: str | None = None,
    ) -> None:
        operations.invoke(
            cls(name, existing_cache=existing_cache, existing_cycle=existing_cycle, schema=schema)
        )

    def reverse(self) -> AlterFenceSequenceOp:
        return AlterFenceSequenceOp(
            self.name,
            cache=self.existing_cache,
            cycle=self.existing_cycle,
            existing_cache=self.cache,
            existing_cycle=self.cycle,
            schema=self.schema,
        )

    def _cycle(self) -> str:
        return "CYCLE" if self.cycle else "NO CYCLE"

    def _statements(self, operations: Operations) -> Iterable[Any]:
        target = qualified(self.name, self.schema)
        return [f"ALTER SEQUENCE {target} AS bigint CACHE {self.cache} {self._cycle()}"]

    def _render(self, autogen_context: AutogenContext) -> list[str]:
        if self.cache == 1 and not self.cycle:
            return super()._render(autogen_context)
        # the reverse of a fix: put back what was there (only downgrades render this)
        target = shown_table(self.name, self.schema)
        sql = f"ALTER SEQUENCE {target} CACHE {self.cache} {self._cycle()}"
        return [f"op.execute({sql!r})"]


class _RegisterOp(_FenceOp):
    _fields = ("sequence", "function_only")
    _shown = ("sequence",)

    def __init__(self, sequence: str = DEFAULT_SEQUENCE, *, function_only: bool = False) -> None:
        self.sequence = check_name("sequence", sequence)
        # set by autogenerate for a repair: the reverse drops the function, never the rows
        self.function_only = bool(function_only)

    @classmethod
    def _register_op(cls, operations: Operations, sequence: str = DEFAULT_SEQUENCE) -> None:
        operations.invoke(cls(sequence))

    def to_diff_tuple(self) -> tuple[Any, ...]:
        tail = ("check function only",) if self.function_only else ()
        return (self.op_name, self.sequence, *tail)


@Operations.register_operation("create_fence_register", "_register_op")
class CreateFenceRegisterOp(_RegisterOp):
    """``op.create_fence_register(sequence="sa_fence_token_seq")``.

    Creates the lease register ``sa_fence_leases`` (in the sequence's schema; its ``token``
    default draws from ``sequence``, which must exist), its unique token index, the lease scope
    table with its deferred trigger, and the SECURITY DEFINER functions that alone move the
    register (grant, withdraw, prune) and check a commit.  Idempotent: an existing register is
    kept with its rows, and everything else is brought to this release's form.
    """

    def _statements(self, operations: Operations) -> Iterable[Any]:
        if not operations.get_context().as_sql:  # online: no register for a sequence no
            bind = operations.get_bind()  # Fencer grants from (refused at its first grant)
            check_sequence(bind, self.sequence, "op.create_fence_sequence()", self.op_name)
        return create_register_sql(self.sequence)


@Operations.register_operation("drop_fence_register", "_register_op")
class DropFenceRegisterOp(_RegisterOp, opposite=CreateFenceRegisterOp):
    """``op.drop_fence_register(sequence="sa_fence_token_seq")``.

    Drops the scope table and its trigger, sa-fence's functions and the lease register.  Never on a
    live database: every Fencer refuses to grant without the register, and the newest token of
    every lease name is forgotten.  Comes before ``op.drop_fence_sequence()``, whose sequence
    the register's default uses.
    """

    def _statements(self, operations: Operations) -> Iterable[Any]:
        if self.function_only:
            return []  # the reverse of a repair: the repaired functions and tables stay
        return drop_register_sql(self.sequence)

    def _render(self, autogen_context: AutogenContext) -> list[str]:
        if self.function_only:
            # dropping the functions would leave every bound session unable to commit, and the
            # earlier forms they replaced cannot be made again: the repair stays
            return ["pass  # sa-fence: the register's repaired functions stay"]
        return super()._render(autogen_context)


class _TableOp(_FenceOp):
    _fields: ClassVar[tuple[str, ...]] = ("table_name", "column", "schema")
    _diff = ("schema", "table_name", "column")

    def __init__(self, table_name: str, column: str = "fence", *, schema: str | None = None):
        self.table_name = check_name("table", table_name)
        self.column = check_name("column", column)
        self.schema = schema if schema is None else check_name("schema", schema)

    @classmethod
    def _column_op(
        cls,
        operations: Operations,
        table_name: str,
        column: str = "fence",
        *,
        schema: str | None = None,
    ) -> None:
        operations.invoke(cls(table_name, column, schema=schema))


@Operations.register_operation("add_fence_column", "_column_op")
class AddFenceColumnOp(_TableOp):
    """``op.add_fence_column(table, column="fence", *, schema=None)``.

    Adds ``BIGINT NOT NULL DEFAULT 0``.  On PostgreSQL >= 11 a constant default is stored in
    the catalog: existing rows are not rewritten, so this is instant on a large table (it takes
    a brief ACCESS EXCLUSIVE lock; set ``lock_timeout`` so it cannot queue behind long queries).
    """

    def _run(self, operations: Operations) -> None:
        column = sa.Column(self.column, sa.BigInteger, nullable=False, server_default=sa.text("0"))
        operations.add_column(self.table_name, column, schema=self.schema)


@Operations.register_operation("drop_fence_column", "_column_op")
class DropFenceColumnOp(_TableOp, opposite=AddFenceColumnOp):
    """``op.drop_fence_column(table, column="fence", *, schema=None)``: drops the fence column."""

    def _run(self, operations: Operations) -> None:
        operations.drop_column(self.table_name, self.column, schema=self.schema)


class _GuardOp(_TableOp):
    _fields = (*_TableOp._fields, "on_missing_token", "sequence")

    def __init__(
        self,
        table_name: str,
        column: str = "fence",
        *,
        schema: str | None = None,
        on_missing_token: str = "reject",
        sequence: str = DEFAULT_SEQUENCE,
    ) -> None:
        super().__init__(table_name, column, schema=schema)
        self.on_missing_token = check_policy(on_missing_token)
        self.sequence = check_name("sequence", sequence)

    @classmethod
    def _guard_op(
        cls,
        operations: Operations,
        table_name: str,
        column: str = "fence",
        *,
        schema: str | None = None,
        on_missing_token: str = "reject",
        sequence: str = DEFAULT_SEQUENCE,
    ) -> None:
        policy = {"on_missing_token": on_missing_token, "sequence": sequence}
        operations.invoke(cls(table_name, column, schema=schema, **policy))

    def _statements(self, operations: Operations) -> Iterable[Any]:
        # Online, a missing table or column is refused before anything is written (PL/pgSQL
        # would accept the function and fail at the first write).
        if not operations.get_context().as_sql:
            add_column = AddFenceColumnOp(self.table_name, self.column)._render_args()
            hints = (
                "(the guard goes after op.create_table in the same revision)",
                f"column: op.add_fence_column({add_column}) first",
            )
            check_column(operations.get_bind(), self.table_name, self.column, self.schema, *hints)
            check_sequence(operations.get_bind(), self.sequence, "op.create_fence_sequence()")
        arguments = self._arguments()
        return create_guard_sql(arguments.pop("table_name"), **arguments)


#: Above a rendered create_fence_guard(), by policy.
GUARD_POLICY_NOTES = {
    "unchanged": [
        "# on_missing_token='unchanged': the table already exists, so it may have writers",
        "# that present no token (other services, psql, sessions without sa_fence.install()).",
        "# They may still UPDATE a row if they leave its fence alone; no writer can lower a",
        "# fence or write with a stale token.  Once every writer presents a token, switch to",
        "# 'reject' (the migrations guide: 'Roll the guard out in two steps').",
    ],
    "reject": [
        "# on_missing_token='reject': every UPDATE and DELETE must present a lease token;",
        "# writers without sa-fence (other services, psql) are refused.  Use 'unchanged'",
        "# while such writers remain.",
    ],
}


@Operations.register_operation("create_fence_guard", "_guard_op")
class CreateFenceGuardOp(_GuardOp):
    """``op.create_fence_guard(table, column="fence", *, schema=None, on_missing_token="reject",
    sequence="sa_fence_token_seq")``.

    Creates (or replaces) the PL/pgSQL function ``sa_fence_guard_<table>`` and the ``BEFORE
    INSERT OR UPDATE OR DELETE`` trigger ``sa_fence_guard`` that refuses writes lowering the
    fence, carrying a stale token, or (INSERTs included) carrying a token or fence past the last
    value of ``sequence`` (see :mod:`sa_fence.db.guard` and docs/migrations.md).
    ``on_missing_token``: ``"reject"`` refuses writers that present no token; ``"unchanged"``
    lets their UPDATEs through when the fence is left as it is.
    """

    def _notes(self) -> list[str]:
        return GUARD_POLICY_NOTES[self.on_missing_token]


@Operations.register_operation("drop_fence_guard", "_guard_op")
class DropFenceGuardOp(_GuardOp, opposite=CreateFenceGuardOp):
    """``op.drop_fence_guard(table, column="fence", *, schema=None, on_missing_token="reject",
    sequence="sa_fence_token_seq")``.

    Drops the trigger and its function; ``column``, ``on_missing_token`` and ``sequence`` only
    tell the reverse how to recreate them.
    """

    def _statements(self, operations: Operations) -> Iterable[Any]:
        return drop_guard_sql(self.table_name, schema=self.schema)


@Operations.register_operation("replace_fence_guard")
class ReplaceFenceGuardOp(_GuardOp):
    """``op.replace_fence_guard(table, column="fence", *, schema=None, on_missing_token="reject",
    sequence="sa_fence_token_seq", previous=None)``.

    Remakes an existing guard as this sa-fence creates it (the statements of
    ``create_fence_guard``).  With ``previous`` (the function's and the trigger's DDL as they
    were, which autogenerate writes into the downgrade), puts that guard back instead: its
    trigger is dropped, then ``previous`` runs as written.  Autogenerate emits it for a guard
    that is not the one this sa-fence creates: a trigger that does not fire on INSERT, UPDATE
    and DELETE, or a function another version made or someone edited.
    """

    def __init__(
        self,
        table_name: str,
        column: str = "fence",
        *,
        schema: str | None = None,
        on_missing_token: str = "reject",
        sequence: str = DEFAULT_SEQUENCE,
        previous: Sequence[str] | None = None,
        replaced: Sequence[str] | None = None,
        reasons: Sequence[str] = (),
    ) -> None:
        policy = {"on_missing_token": on_missing_token, "sequence": sequence}
        super().__init__(table_name, column, schema=schema, **policy)
        if previous is not None and (
            isinstance(previous, str)
            or not previous
            or not all(isinstance(s, str) and s.strip() for s in previous)
        ):
            raise ValueError(
                "replace_fence_guard: previous must be a list of SQL statements (the guard "
                f"function's and trigger's DDL, as autogenerate writes them), got {previous!r}"
            )
        # previous: what to put back instead of remaking the guard (a downgrade); replaced:
        # what the database had before this op remade it (reverse() puts it back); reasons:
        # why autogenerate found the guard outdated (a comment in the revision)
        self.previous = tuple(previous) if previous is not None else None
        self.replaced = tuple(replaced) if replaced is not None else None
        self.reasons = tuple(reasons)

    @classmethod
    def replace_fence_guard(
        cls,
        operations: Operations,
        table_name: str,
        column: str = "fence",
        *,
        schema: str | None = None,
        on_missing_token: str = "reject",
        sequence: str = DEFAULT_SEQUENCE,
        previous: Sequence[str] | None = None,
    ) -> None:
        policy = {"on_missing_token": on_missing_token, "sequence": sequence}
        operations.invoke(cls(table_name, column, schema=schema, previous=previous, **policy))

    def reverse(self) -> _FenceOp:
        if self.previous is None and self.replaced is None:
            raise ValueError(
                f"replace_fence_guard({self.table_name!r}) has no reverse: what the guard "
                "was before is unknown (autogenerate records it; a hand-written revision "
                "can pass previous=[...] in its downgrade)"
            )
        swapped: dict[str, Any] = {"previous": self.replaced, "replaced": self.previous}
        return ReplaceFenceGuardOp(**self._arguments(), **swapped, reasons=self.reasons)

    def _statements(self, operations: Operations) -> Iterable[Any]:
        if self.previous is None:
            return super()._statements(operations)
        target = qualified(self.table_name, self.schema)
        return [f"DROP TRIGGER IF EXISTS {TRIGGER_NAME} ON {target}", *self.previous]

    def _render_args(self) -> str:
        if self.previous is None:
            return super()._render_args()
        # the statements as Python source: each one string, line by line, exactly as it was
        items = []
        for statement in self.previous:
            lines = statement.splitlines(keepends=True) or [statement]
            items.append("(\n" + "".join(f"        {line!r}\n" for line in lines) + "    )")
        previous = "[\n" + "".join(f"    {item},\n" for item in items) + "]"
        return f"{super()._render_args()}, previous={previous}"

    def _notes(self) -> list[str]:
        table = self.table_name
        if self.previous is not None:
            return [f"# sa-fence: puts back the guard of {table!r} as it was before the upgrade"]
        wrapper = textwrap.TextWrapper(86, initial_indent="#   ", subsequent_indent="#     ")
        return [
            f"# sa-fence: the guard of {table!r} is not the one this sa-fence creates:",
            *(line for reason in self.reasons for line in wrapper.wrap(reason)),
            "# remade as it was made (same on_missing_token, the token sequence configured); the",
            "# downgrade puts the old one back.",
        ]


# help(op.create_fence_guard) & co.: ops of a kind share one entry point, so each gets its op
# class's docstring, which spells out the call.
for _op_class in _OP_CLASSES:
    getattr(Operations, _op_class.op_name).__doc__ = _op_class.__doc__


def _replacement(
    conn: sa.Connection, table: sa.Table, column: str, guard: Any, sequence: str
) -> Iterator[ReplaceFenceGuardOp]:
    """The op that remakes ``table``'s existing guard, if it is not current."""
    reasons = outdated(
        guard.source,
        guard.complete,
        table.name,
        column,
        schema=table.schema,
        default_schema=conn.dialect.default_schema_name,
        sequence=sequence,
        firing=guard.firing,
        on_columns=guard.on_columns,
        conditional=guard.conditional,
    )
    if not reasons:
        return
    # remade with the policy it was made with (one sa-fence never made gets the lenient policy:
    # its writers are unknown), on the configured sequence (a guard on another one is outdated)
    policy = (guard_made_with(guard.source) or ("unchanged", sequence))[0]
    # the downgrade puts the trigger back in the state it was in (pg_get_triggerdef omits it)
    state = {"D": "DISABLE", "R": "ENABLE REPLICA", "A": "ENABLE ALWAYS"}.get(guard.firing)
    target = qualified(table.name, table.schema)
    restate = [f"ALTER TABLE {target} {state} TRIGGER {TRIGGER_NAME}"] if state else []
    yield ReplaceFenceGuardOp(
        table.name,
        column,
        schema=table.schema,
        on_missing_token=policy,
        sequence=sequence,
        replaced=(guard.function_sql, guard.trigger_sql, *restate),
        reasons=reasons,
    )


def _included(autogen_context: AutogenContext, table: sa.Table) -> bool:
    """Do ``include_name`` and ``include_object`` leave ``table`` in scope?"""
    return autogen_context.run_name_filters(
        table.name, "table", {"schema_name": table.schema}
    ) and autogen_context.run_object_filters(table, table.name, "table", False, None)


def _take_builtin_register_ops(upgrade_ops: alembic_ops.UpgradeOps, register: Register) -> None:
    """Drop Alembic's own ops on the register and scope tables (create, drop, their columns and
    indexes): the register op makes them as a whole, and autogenerate never drops the register
    (docs/migrations.md)."""
    table_ops = alembic_ops.CreateTableOp, alembic_ops.DropTableOp
    other_ops = alembic_ops.ModifyTableOps, alembic_ops.DropIndexOp, alembic_ops.CreateIndexOp
    upgrade_ops.ops = [
        o
        for o in upgrade_ops.ops
        if not (
            isinstance(o, table_ops + other_ops) and o.table_name in (REGISTER_TABLE, SCOPE_TABLE)
        )
        or o.schema != register.schema  # (read only of those kinds of op)
    ]


def _take_builtin_add_column(
    upgrade_ops: alembic_ops.UpgradeOps, table: sa.Table, column: str
) -> None:
    """Remove Alembic's own add_column of the fence column: add_fence_column replaces it."""
    for modify in list(upgrade_ops.ops):
        if isinstance(modify, alembic_ops.ModifyTableOps) and (
            (modify.table_name, modify.schema) == (table.name, table.schema)
        ):
            modify.ops = [
                o
                for o in modify.ops
                if not (isinstance(o, alembic_ops.AddColumnOp) and o.column.name == column)
            ]
            if not modify.ops:
                upgrade_ops.ops.remove(modify)


def _table_ops(
    autogen_context: AutogenContext,
    upgrade_ops: alembic_ops.UpgradeOps,
    tables: list[tuple[sa.Table, str]],
    sequence: str,
) -> Iterator[MigrateOperation]:
    """The column, guard and guard-replacing ops the fenced tables need."""
    conn, inspector = autogen_context.connection, autogen_context.inspector
    assert conn is not None
    for table, column in tables:
        # An existing table may have writers that know nothing of sa-fence: its guard starts
        # lenient ("unchanged"), as the migrations guide advises; a new table has none yet.
        policy = "reject"
        if inspector.has_table(table.name, schema=table.schema):
            policy = "unchanged"
            columns = {c["name"] for c in inspector.get_columns(table.name, schema=table.schema)}
            if column not in columns:
                _take_builtin_add_column(upgrade_ops, table, column)
                yield AddFenceColumnOp(table.name, column, schema=table.schema)
            else:
                target = {"table": qualified(table.name, table.schema)}
                guard = conn.execute(sa.text(GUARD_STATE_SQL), target).one_or_none()
                if guard is not None:
                    yield from _replacement(conn, table, column, guard, sequence)
                    continue
        yield CreateFenceGuardOp(
            table.name, column, schema=table.schema, on_missing_token=policy, sequence=sequence
        )


def _head_ops(conn: sa.Connection, register: Register, included: bool) -> Iterator[_FenceOp]:
    """The sequence's op, then the register's: what goes first in the upgrade."""
    schema, name = split_name(register.sequence)
    row = conn.execute(SEQUENCE_SQL, {"name": register.sequence_sql}).one_or_none()
    if row is None:
        yield CreateFenceSequenceOp(name, schema=schema)
    elif not (row.is_cache_1 and row.is_no_cycle):  # the rules AlterFenceSequenceOp fixes
        cache, cycle = int(row.seqcache), bool(row.seqcycle)
        yield AlterFenceSequenceOp(name, existing_cache=cache, existing_cycle=cycle, schema=schema)
    if not included:
        return
    exists = sa.text("SELECT to_regclass(:register) IS NOT NULL")
    if not conn.execute(exists, {"register": register.table_sql}).scalar_one():
        yield CreateFenceRegisterOp(register.sequence)
    elif (
        not conn.execute(CHECK_FUNCTION_SQL, {"function": register.function_sql}).scalar_one()
        or scope_trigger_problem(conn, register)
        or register_objects_outdated(conn, register)
    ):
        yield CreateFenceRegisterOp(register.sequence, function_only=True)


# LAST: Alembic's own table comparators (MEDIUM) have run by then, so their add_column of the
# fence column can be replaced, and a new table's create_table comes before its guard.
@comparators.dispatch_for("schema", priority=DispatchPriority.LAST)
def _compare_fencing(
    autogen_context: AutogenContext,
    upgrade_ops: alembic_ops.UpgradeOps,
    schemas: Sequence[str | None],
) -> PriorityDispatchResult:
    """Fenced tables without column or guard; a missing or cached token sequence; a missing
    lease register or commit check function."""
    conn = autogen_context.connection
    if conn is None or conn.dialect.name != "postgresql":
        return PriorityDispatchResult.CONTINUE
    sequence = str(autogen_context.opts.get("sa_fence_sequence", DEFAULT_SEQUENCE))
    register = Register(sequence)
    _take_builtin_register_ops(upgrade_ops, register)
    metadata = autogen_context.metadata
    metadatas = [metadata] if isinstance(metadata, sa.MetaData) else list(metadata or ())
    tables = [
        (table, fence.name)
        for m in metadatas
        for table in m.tables.values()
        if (fence := fence_column_of(table)) is not None
        and table.schema in schemas
        and _included(autogen_context, table)
    ]
    # Does the metadata declare the register, and do the filters leave it in scope?
    key = register.table_display
    declared = next((m.tables[key] for m in metadatas if key in m.tables), None)
    if declared is not None:
        included = _included(autogen_context, declared)
    elif tables:
        included = autogen_context.run_name_filters(
            REGISTER_TABLE, "table", {"schema_name": register.schema}
        )
    else:  # nothing fenced, no register: the project's hooks are not asked about a name of ours
        return PriorityDispatchResult.CONTINUE
    if not tables and not included:
        return PriorityDispatchResult.CONTINUE
    new_ops = list(_table_ops(autogen_context, upgrade_ops, tables, sequence))
    # The sequence first, then the register whose default draws from it (so the downgrade
    # drops the register before the sequence), then the rest.
    upgrade_ops.ops[0:0] = _head_ops(conn, register, included)
    upgrade_ops.ops.extend(new_ops)
    return PriorityDispatchResult.CONTINUE
