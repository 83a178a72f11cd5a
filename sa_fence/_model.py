"""The :class:`Fenced` mixin and the fence column marker."""

from __future__ import annotations

import weakref
from typing import Any

from sqlalchemy import BigInteger, Column, FetchedValue, FromClause, text
from sqlalchemy.exc import NoInspectionAvailable
from sqlalchemy.orm import Mapped, Mapper, class_mapper, declared_attr, mapped_column
from sqlalchemy.orm.exc import UnmappedClassError

#: Key in ``Column.info`` that marks a column as a table's fence column.
FENCE_INFO_KEY = "sa_fence.fence"


def fence_column(name: str = "fence") -> Column[int]:
    """A ``BIGINT NOT NULL DEFAULT 0`` column marked as the table's fence.

    For Core ``Table`` definitions and imperative mappings; declarative
    classes use the :class:`Fenced` mixin instead.
    """
    return Column(
        name,
        BigInteger,
        nullable=False,
        server_default=text("0"),
        server_onupdate=FetchedValue(),
        info={FENCE_INFO_KEY: True},
    )


class Fenced:
    """Declarative mixin: adds the ``fence`` column and marks the class fenced.

    ``fence`` holds the token of the last lease holder that wrote the row.
    sa-fence writes it at flush time from the bound lease's token; a value
    assigned to it (by hand, or by ``Session.merge`` copying a detached
    object) is never written (DESIGN.md, I8).  Rows inserted without a lease
    (admin scripts using :func:`sa_fence.unfenced`) get ``fence = 0``.

    Works with SQLModel too (``class Job(sa_fence.Fenced, SQLModel,
    table=True)``): the column is declared with ``declared_attr``, which
    SQLAlchemy maps on every subclass and pydantic does not take for a model
    field, so ``fence`` is not a constructor argument nor part of
    ``model_dump()``; the row's token is read as ``job.fence``.
    """

    @declared_attr
    def fence(cls) -> Mapped[int]:
        return mapped_column(
            BigInteger,
            nullable=False,
            server_default=text("0"),
            # sa-fence sets it in the UPDATE statement itself, so the ORM must
            # expire and reload it after an UPDATE rather than keep the old value.
            server_onupdate=FetchedValue(),
            info={FENCE_INFO_KEY: True},
            sort_order=1000,
        )


_table_fences: weakref.WeakKeyDictionary[Any, Column[Any] | None] = weakref.WeakKeyDictionary()
_mapper_fences: weakref.WeakKeyDictionary[Mapper[Any], str | None] = weakref.WeakKeyDictionary()


def fence_column_of(table: FromClause) -> Column[Any] | None:
    """The column marked as ``table``'s fence, or None if the table is not fenced."""
    try:
        return _table_fences[table]
    except KeyError:
        pass
    except TypeError:  # not weak-referenceable: compute without caching
        return _scan(table)
    col = _scan(table)
    _table_fences[table] = col
    return col


def carries_fence(col: object) -> bool:
    """Whether ``col`` is a real table ``Column`` marked as its table's fence.

    Only a ``Column`` can be a fence.  A mapper's ``columns`` also hold the
    SQL expressions of expression properties (``column_property(a + b)`` is
    a ``Label``, ``query_expression()`` another expression) and a mapping
    against a subquery holds its derived columns; those have no ``info`` of
    their own (asking a ``Label`` for it raises ``AttributeError``), and no
    table to fence.
    """
    return isinstance(col, Column) and bool(col.info.get(FENCE_INFO_KEY))


def _scan(table: FromClause) -> Column[Any] | None:
    for col in table.columns:
        if carries_fence(col):
            return col  # type: ignore[return-value]
    return None


def fence_key_of(mapper: Mapper[Any]) -> str | None:
    """The attribute name of ``mapper``'s fence column, or None if not fenced."""
    try:
        return _mapper_fences[mapper]
    except KeyError:
        pass
    key = None
    for col in mapper.columns:
        if carries_fence(col):
            key = mapper.get_property_by_column(col).key
            break
    _mapper_fences[mapper] = key
    return key


_fenced_classes: weakref.WeakKeyDictionary[type, bool] = weakref.WeakKeyDictionary()


def is_fenced_class(cls: type) -> bool:
    """True when instances of mapped class ``cls`` live in a fenced table."""
    try:
        return _fenced_classes[cls]
    except KeyError:
        pass
    try:
        fenced = fence_key_of(class_mapper(cls)) is not None
    except (UnmappedClassError, NoInspectionAvailable):
        fenced = False
    _fenced_classes[cls] = fenced
    return fenced


class OrmIndex:
    """What the flush hook needs to know about all mapped classes, computed once.

    * ``association_tables``: ``secondary`` tables of relationships with a
      fenced class on either side: writing their rows needs a bound lease.
    * ``bump_keys``: joined-inheritance subclasses of a fenced class whose
      own table has no fence column, with the fence attribute's key: a
      change to the subclass table alone still compares and bumps the base
      table's fence.

    Recomputed when the number of mapped classes changes.
    """

    __slots__ = ("association_tables", "bump_keys", "size")

    def __init__(self, size: int) -> None:
        self.size = size
        self.association_tables: frozenset[Any] = frozenset()
        self.bump_keys: dict[type, str] = {}


_index = OrmIndex(-1)


def orm_index() -> OrmIndex:
    global _index
    from sqlalchemy.orm import mapperlib

    registries = list(mapperlib._mapper_registries)
    size = sum(len(r._managers) for r in registries)
    if size == _index.size:
        return _index
    index = OrmIndex(size)
    association: set[Any] = set()
    for registry in registries:
        for mapper in registry.mappers:
            key = fence_key_of(mapper)
            if key is not None and mapper.inherits is not None:
                fence_table = mapper.columns[key].table
                if mapper.local_table is not fence_table and mapper.local_table is not (
                    mapper.inherits.local_table
                ):
                    index.bump_keys[mapper.class_] = key
            for prop in mapper.relationships:
                if prop.secondary is not None and (
                    key is not None or fence_key_of(prop.mapper) is not None
                ):
                    association.add(prop.secondary)
    index.association_tables = frozenset(association)
    _index = index
    return index
