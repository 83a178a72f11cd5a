"""The :class:`Fenced` mixin and the fence column marker; how sa-fence finds a table's or a
mapper's fence column (cached), the ORM index the flush hook reads, and the PostgreSQL error of
a fence column the models declare but the table lacks."""

from __future__ import annotations

import contextlib
import re
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from sqlalchemy import (
    BigInteger,
    Column,
    FetchedValue,
    FromClause,
    Table,
    bindparam,
    event,
    text,
    update,
)
from sqlalchemy import inspect as sa_inspect
from sqlalchemy.exc import NoInspectionAvailable, NoReferencedTableError, NoReferenceError
from sqlalchemy.orm import (
    ColumnProperty,
    Mapped,
    Mapper,
    class_mapper,
    declared_attr,
    mapped_column,
    mapperlib,
)
from sqlalchemy.orm.exc import UnmappedClassError
from sqlalchemy.sql.util import find_tables

from ..errors import FencingConfigError

if TYPE_CHECKING:
    from sqlalchemy.orm import ClassManager, InstanceState, Session, registry

#: Key in ``Column.info`` that marks a column as a table's fence column.
FENCE_INFO_KEY = "sa_fence.fence"


def _fence_options() -> dict[str, Any]:
    # sa-fence sets the fence in the UPDATE statement itself, so the ORM must
    # expire and reload it after an UPDATE rather than keep the old value.
    return {
        "nullable": False,
        "server_default": text("0"),
        "server_onupdate": FetchedValue(),
        "info": {FENCE_INFO_KEY: True},
    }


def fence_column(name: str = "fence") -> Column[int]:
    """A ``BIGINT NOT NULL DEFAULT 0`` column marked as the table's fence.

    For Core ``Table`` definitions and imperative mappings; declarative
    classes use the :class:`Fenced` mixin instead.
    """
    return Column(name, BigInteger, **_fence_options())


class Fenced:
    """Declarative mixin: adds the ``fence`` column and marks the class fenced.

    ``fence`` holds the token of the last lease holder that wrote the row.  sa-fence writes it at
    flush time from the bound lease's token; assigning ``obj.fence`` makes the next flush raise
    :class:`~sa_fence.FencingConfigError` before any SQL is sent.  ``Session.merge`` does not copy
    a detached object's loaded fence.  Rows inserted without a lease (:func:`sa_fence.unfenced`)
    get ``fence = 0``.

    Works with SQLModel too (``class Job(sa_fence.Fenced, SQLModel, table=True)``): ``fence`` is
    a mapped column, not a pydantic field, so it is neither a constructor argument nor part of
    ``model_dump()``.
    """

    @declared_attr
    def fence(cls) -> Mapped[int]:
        return mapped_column(BigInteger, sort_order=1000, **_fence_options())


_table_fences: weakref.WeakKeyDictionary[Any, Column[Any] | None] = weakref.WeakKeyDictionary()
_mapper_fences: weakref.WeakKeyDictionary[Mapper[Any], str | None] = weakref.WeakKeyDictionary()


def fence_column_of(table: FromClause) -> Column[Any] | None:
    try:
        return _table_fences[table]
    except KeyError:
        return _table_fences.setdefault(table, _scan(table))
    except TypeError:  # not weak-referenceable: compute without caching
        return _scan(table)


def carries_fence(col: object) -> bool:
    """Whether ``col`` is a table ``Column`` marked as its table's fence (a mapper's ``columns``
    also hold SQL expressions and derived columns: nothing to fence, and a ``Label`` has no
    ``info``)."""
    return isinstance(col, Column) and bool(col.info.get(FENCE_INFO_KEY))


def _scan(table: FromClause) -> Column[Any] | None:
    return next((col for col in table.columns if carries_fence(col)), None)  # type: ignore[return-value]


class _FenceProperty(ColumnProperty[int]):
    """The fence attribute's property: ``Session.merge`` leaves a loaded fence behind.

    ``merge()`` copies a detached object's loaded attributes as if assigned, and a loaded fence,
    usually older than its row's now, would be refused at flush; an *assigned* one is copied (and
    refused).  :func:`fence_key_of` gives a fence's ``ColumnProperty`` this class."""

    __slots__ = ()

    def merge(
        self,
        session: Session,
        source_state: InstanceState[Any],
        source_dict: dict[str, Any],
        dest_state: InstanceState[Any],
        dest_dict: dict[str, Any],
        load: bool,
        *maps: dict[Any, object],  # _recursive, _resolve_conflict_map: passed on as they are
    ) -> None:
        if load and self.key in source_dict and self.key not in source_state.committed_state:
            return  # loaded, never assigned: not a value to write
        super().merge(session, source_state, source_dict, dest_state, dest_dict, load, *maps)


def fence_key_of(mapper: Mapper[Any]) -> str | None:
    """The attribute name of ``mapper``'s fence column, or None if not fenced."""
    try:
        return _mapper_fences[mapper]
    except KeyError:
        pass
    found = (mapper.get_property_by_column(col) for col in mapper.columns if carries_fence(col))
    prop = next(found, None)
    if type(prop) is ColumnProperty:
        prop.__class__ = _FenceProperty
    key = _mapper_fences[mapper] = None if prop is None else prop.key
    return key


@event.listens_for(Fenced, "mapper_configured", propagate=True)
def _fenced_mapper_configured(mapper: Mapper[Any], cls: type) -> None:
    """A :class:`Fenced` class gets its fence property before any merge; one whose table has no
    fence (a concrete subclass: the mixin's column is its parent's) is refused."""
    if fence_key_of(mapper) is None and isinstance(mapper.local_table, Table):
        raise FencingConfigError(
            f"{cls.__name__} is a Fenced class, but its table {mapper.local_table.name!r} has no "
            "fence column (concrete inheritance does not copy the mixin's), so its rows would be "
            "written unfenced. Give it one in the class body: `fence = sa_fence.fence_column()`."
        )


_fenced_classes: weakref.WeakKeyDictionary[type, bool] = weakref.WeakKeyDictionary()


def is_fenced_class(cls: type) -> bool:
    fenced = _fenced_classes.get(cls)
    if fenced is not None:
        return fenced
    try:
        fenced = fence_key_of(class_mapper(cls)) is not None
    except (UnmappedClassError, NoInspectionAvailable):
        fenced = False
    _fenced_classes[cls] = fenced
    return fenced


class Covered(NamedTuple):
    """A table of a fenced joined-inheritance class without the fence column: the fence column,
    (this table's column, the fence table's column) for each key column of the fence's table,
    in the order of an object's identity, the UPDATE of the fence's rows by key that the
    statement hook fences, and the hierarchy's base mapper (the unit of work sends its
    statements with that mapper's compiled cache)."""

    fence_col: Column[Any]
    pk_pairs: tuple[tuple[Column[Any], Column[Any]], ...]
    bump: Any  # UPDATE <fence's table> WHERE key = :sa_fence_key_<i> (the rewrite adds the SET)
    base_mapper: Mapper[Any]


class Readback(NamedTuple):
    """A hierarchy's fence table as its flush writes it: the key columns in the order of an
    object's identity, the fence's attribute and the base mapper (whose class is the identity's),
    so that each object a flush's UPDATE wrote is shown its row's token."""

    key_cols: list[Column[Any]]  # (a list: compared with a statement's key columns)
    attr: str  # "" (not used): the classes name it differently
    base_mapper: Mapper[Any]


@dataclass(slots=True)
class OrmIndex:
    """What the flush hook needs to know about all mapped classes, computed once.

    ``association_tables``: ``secondary`` tables of relationships with a fenced class on either
    side (writing their rows needs a bound lease).  ``bump_keys``: fenced classes of a joined
    hierarchy with a table that has no fence column (a subclass's own below the fence's table,
    or an unfenced base above it), with the fence key: a change to that table alone still
    bumps the fence.  ``covered``: those tables by ``(mapper, table)`` for the ORM's statements,
    and a subclass's own table by itself (all its rows are fenced), for the statements that
    write them, not the flush's own.  ``shared``: an unfenced table above the fence's (whose
    rows other classes share), with one of its ``covered`` entries.  Recomputed after a class
    is mapped (``_generation``), not per flush; a disposed registry's classes stay until then.
    ``readback``: for a fence table, a :class:`Readback` of each hierarchy that writes it.
    ``cascading``: unfenced tables whose UPDATEs or DELETEs PostgreSQL carries into fenced rows
    (a foreign key ``ON DELETE`` / ``ON UPDATE`` ``CASCADE``, ``SET NULL`` or ``SET DEFAULT``, as
    the model declares it, through any chain of tables).
    """

    generation: int
    association_tables: frozenset[Any] = frozenset()
    bump_keys: dict[type, str] = field(default_factory=dict)
    covered: dict[Any, Covered] = field(default_factory=dict)
    shared: dict[Any, Covered] = field(default_factory=dict)
    readback: dict[Any, list[Readback]] = field(default_factory=dict)
    cascading: frozenset[Any] = frozenset()


_index = OrmIndex(-1)
#: Bumped whenever a class is mapped: the index is out of date.
_generation = 0


@event.listens_for(Mapper, "instrument_class")
def _class_mapped(mapper: Mapper[Any], cls: type) -> None:
    global _generation
    _generation += 1


def orm_index() -> OrmIndex:
    global _index
    if _index.generation == _generation:
        return _index
    bump_keys: dict[type, str] = {}
    covered: dict[Any, Covered] = {}  # by table, and by (mapper, table)
    shared: dict[Any, Covered] = {}
    association: set[Any] = set()
    readback: dict[Any, list[Readback]] = {}
    fenced: set[Any] = set()
    for cls in unmapped_classes():
        _refuse_unmapped_fenced(cls)
    failed = _unconfigurable_registries()
    unread: list[Mapper[Any]] = []  # unfenced mappers whose relationships cannot be read
    for mapper in mappers():
        key = fence_key_of(mapper)
        if mapper.registry in failed:
            if key is not None or _fenced_lineage(mapper):
                _refuse_unconfigured_fenced(mapper, failed[mapper.registry])
            unread.append(mapper)
            continue
        if key is not None:
            _add_readback(readback, mapper, key)
            fenced.update(mapper.tables)
        if key is not None and mapper.inherits is not None:
            fence_col = mapper.columns[key]
            for table in mapper.tables:
                if table is fence_col.table:
                    continue
                bump_keys[mapper.class_] = key
                covered[mapper, table] = _covered(mapper, fence_col, table)
                if table is mapper.local_table:  # below the fence's table: only fenced rows
                    covered[table] = covered[mapper, table]
                shared.setdefault(table, covered[mapper, table])
        for prop in mapper.relationships:
            if prop.secondary is not None and (
                key is not None or fence_key_of(prop.mapper) is not None
            ):
                association.add(prop.secondary)
    association |= _maybe_secondaries(unread, fenced)
    shared = {table: c for table, c in shared.items() if table not in covered}  # above the fence
    cascading = _cascading_into(fenced) - fenced
    _index = OrmIndex(
        _generation, frozenset(association), bump_keys, covered, shared, readback, cascading
    )
    return _index


_CASCADING_ACTIONS = {"CASCADE", "SET NULL", "SET DEFAULT"}


def _cascading_into(fenced: set[Any]) -> frozenset[Any]:
    """The tables whose writes PostgreSQL's foreign key actions carry into ``fenced``."""
    found: set[Any] = set()
    todo = list(fenced)
    while todo:
        for fk in getattr(todo.pop(), "foreign_key_constraints", ()):
            actions = {(fk.ondelete or "").upper(), (fk.onupdate or "").upper()}
            try:
                parent = fk.referred_table
            except NoReferencedTableError:  # (a table the metadata does not hold)
                continue
            if actions & _CASCADING_ACTIONS and parent not in found:
                found.add(parent)
                todo.append(parent)
    return frozenset(found)


def _covered(mapper: Mapper[Any], fence_col: Column[Any], table: Any) -> Covered:
    """``table`` of ``mapper``'s rows, paired with the key of the table that holds their fence
    through the inheritance conditions (a deeper hierarchy's too), in the order of an object's
    identity; no pairs when the conditions do not equate every key column once."""
    pairs, base, fence_keys = [], mapper.base_mapper, fence_col.table.primary_key.columns
    for ident in base.primary_key:
        found = [k for k in fence_keys if _equated(mapper, ident, k)]
        same = [c for c in table.primary_key.columns for k in found if _equated(mapper, c, k)]
        if len(found) != 1 or len(same) != 1 or len(base.primary_key) != len(fence_keys):
            return Covered(fence_col, (), None, base)
        pairs.append((same[0], found[0]))
    keys = [col == bindparam(f"sa_fence_key_{i}") for i, (_, col) in enumerate(pairs)]
    return Covered(fence_col, tuple(pairs), update(fence_col.table).where(*keys), base)


def _add_readback(found: dict[Any, Any], mapper: Mapper[Any], key: str) -> None:
    fence_col = mapper.columns[key]
    own = _covered(mapper, fence_col, fence_col.table)  # the fence table's key, paired with itself
    if not own.pk_pairs:  # no object's identity to find: its flush sends the fence the ORM expires
        return
    base, hierarchies = own.base_mapper, found.setdefault(fence_col.table, [])
    known = next((i for i, r in enumerate(hierarchies) if r.base_mapper is base), None)
    if known is not None:  # another class of the hierarchy: if it names the fence otherwise,
        if hierarchies[known].attr != key:  # the flush sends the fence the ORM expires
            hierarchies[known] = Readback(hierarchies[known].key_cols, "", base)
        return
    hierarchies.append(Readback([col for _, col in own.pk_pairs], key, base))


def _equated(mapper: Mapper[Any], col: Any, other: Any) -> bool:
    """Whether ``col`` is ``other`` or ``mapper``'s inheritance conditions equate them, directly
    or through the tables between them."""
    if col is other:
        return True
    seen, todo = {col}, [col]
    equivalents: dict[Any, set[Any]] = mapper._equivalent_columns
    while todo:
        for found in equivalents.get(todo.pop(), ()):
            if found is other:
                return True
            if found not in seen:
                seen.add(found)
                todo.append(found)
    return False


def _class_managers() -> list[ClassManager[Any]]:
    return [m for reg in list(mapperlib._mapper_registries) for m in list(reg._managers)]


def mappers() -> list[Mapper[Any]]:
    """The mapper of every mapped class.  A class whose declarative mapping failed stays in its
    registry, with no mapper, while anything references it (a kept traceback is enough):
    ``registry.mappers`` then raises, and plain SQLAlchemy passes the class by, as this does."""
    return [manager.mapper for manager in _class_managers() if manager.is_mapped]


def unmapped_classes() -> list[type]:
    """The classes a registry holds whose declarative mapping failed (see :func:`mappers`)."""
    return [manager.class_ for manager in _class_managers() if not manager.is_mapped]


def _unconfigurable_registries() -> dict[registry, Exception]:
    """The registries SQLAlchemy cannot configure (a relationship to a missing class, ...), with
    the error: plain SQLAlchemy cannot use their classes, and flushes every other registry's."""
    failed = {}
    for reg in list(mapperlib._mapper_registries):
        try:
            reg.configure(cascade=True)  # what reading a mapper's relationships would do
        except Exception as exc:
            failed[reg] = exc
    return failed


def _fenced_lineage(mapper: Mapper[Any]) -> bool:
    """Whether ``mapper``'s class is :class:`Fenced` or inherits a fenced class's mapping."""
    return issubclass(mapper.class_, Fenced) or any(
        fence_key_of(m) is not None for m in mapper.iterate_to_root()
    )


def _refuse_unconfigured_fenced(mapper: Mapper[Any], exc: Exception) -> None:
    """A fenced mapper its registry cannot configure: which tables its relationships write is not
    known, so no write is let through unfenced for want of it."""
    if isinstance(exc, FencingConfigError):  # sa-fence's own refusal while it was configured
        raise exc
    raise FencingConfigError(
        f"{mapper.class_.__name__} is a fenced class, but SQLAlchemy cannot configure its "
        f"mapper ({exc}), so sa-fence cannot tell which tables its writes reach; nothing is "
        "written until the mapping is fixed (or its registry disposed of)."
    ) from exc


def _refuse_unmapped_fenced(cls: type) -> None:
    """A fenced class whose mapping failed after declarative made its table: a table without a
    fence column (a joined subclass's own) would be written with no fencing at all."""
    table = cls.__dict__.get("__table__")
    if not isinstance(table, Table) or fence_column_of(table) is not None:
        return  # no table of its own, or one its fence column fences
    bases: list[Any] = [sa_inspect(base, raiseerr=False) for base in cls.__mro__[1:]]
    if issubclass(cls, Fenced) or any(isinstance(m, Mapper) and _fenced_lineage(m) for m in bases):
        raise FencingConfigError(
            f"{cls.__name__} is a fenced class, but its mapping failed, so its table "
            f"{table.name!r} would be written with no fencing at all. Fix the mapping; until "
            "then, or until nothing references the class any more, nothing is written."
        )


def _maybe_secondaries(unread: list[Mapper[Any]], fenced: set[Any]) -> set[Any]:
    """For unfenced mappers whose relationships cannot be read: their metadata's tables that no
    class maps and whose foreign keys reach both one of theirs and a fenced class's, taken for
    the ``secondary`` of a relationship with a fenced class (its rows then need a lease)."""
    found: set[Any] = set()
    if not unread:
        return found
    mapped = {m.local_table for m in mappers()}
    for mapper in unread:
        own = set(mapper.tables)
        for metadata in {t.metadata for t in own if isinstance(t, Table)}:
            for table in metadata.tables.values():
                reached = set()
                for fk in table.foreign_keys:
                    with contextlib.suppress(NoReferenceError):  # not in the metadata
                        reached.add(fk.column.table)
                if table not in mapped and reached & own and reached & fenced:
                    found.add(table)
    return found


#: PostgreSQL's messages for an undefined column (SQLSTATE 42703): an INSERT or UPDATE target
#: (``column "fence" of relation "jobs" does not exist``), a qualified reference (``column
#: jobs.fence does not exist``) or a bare one.
_UNDEFINED_COLUMN = re.compile(
    r'column (?:"(?P<target>[^"]+)" of relation "(?P<relation>[^"]+)"'
    r'|(?P<qualifier>[^\s"]+|"[^"]+")\.(?P<qualified>[^\s"]+|"[^"]+")'
    r'|"(?P<bare>[^"]+)") does not exist'
)


def _unquoted(name: str | None) -> str | None:
    if name and len(name) > 1 and name[0] == name[-1] == '"':
        return name[1:-1].replace('""', '"')
    return name


def missing_fence_column(
    orig: BaseException, statement: Any = None
) -> tuple[str | None, str, str] | None:
    """(schema, table, fence column) when ``orig`` says a fenced table's fence column does not
    exist (``create_all`` adds no columns to a table made before its model was fenced), else
    None; from the fenced tables ``statement`` names and every mapped fenced table."""
    if getattr(orig, "sqlstate", None) != "42703":  # undefined_column
        return None
    diag = getattr(orig, "diag", None)
    message = str(getattr(diag, "message_primary", None) or orig)
    match = _UNDEFINED_COLUMN.search(message)
    if match is None:
        return None
    column = _unquoted(match["target"] or match["qualified"] or match["bare"]) or ""
    relation = _unquoted(match["relation"] or match["qualifier"])
    tables: list[Any] = []
    if statement is not None:
        with contextlib.suppress(Exception):  # a statement find_tables cannot walk
            tables = find_tables(statement, include_crud=True, include_joins=True)

    def fenced_by(table: Any) -> bool:
        return getattr(fence_column_of(table), "name", None) == column

    in_statement = [t for t in tables if fenced_by(t)]
    mapped = [t for mapper in mappers() for t in mapper.tables if fenced_by(t)]
    # the relation PostgreSQL names; else (an alias such as jobs_1) the statement's own
    named = [t for t in [*in_statement, *mapped] if relation in (None, getattr(t, "name", None))]
    for table in named or in_statement:
        return getattr(table, "schema", None), str(getattr(table, "name", None)), column
    return None
