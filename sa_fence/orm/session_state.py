"""What sa-fence keeps on one session (``SessionState``, in ``session.info``) and what
the lease core inherits from the flush hook (``Marks``)."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sqlalchemy import (
    Connection,
    func,
    literal,
    select,
    true,
)

from .. import telemetry as _telemetry
from ..db.guard import TOKEN_SETTING
from ..errors import (
    FenceError,
    UnfencedWriteError,
)
from ..scope import arming

if TYPE_CHECKING:
    from typing import TypeAlias

    from sqlalchemy import Column, Table
    from sqlalchemy.orm import Session, UOWTransaction

    from .._lease_view import LeaseView
    from .model import Covered, Readback

    Lease: TypeAlias = LeaseView  # a Lease or an AsyncLease


_STATE_KEY = "sa_fence.state"


@dataclass(slots=True)
class Pending:
    """A primary-key targeted statement whose row count after_execute checks."""

    statement: Any
    table: Table
    token: int
    pk_cols: list[Column[Any]]
    pk_names: list[str]
    param_sets: Sequence[Mapping[str, Any]]
    lease_name: str
    only_keys: bool = True  # nothing but the key in its WHERE clause: only the fence skips rows
    expected: int | None = None  # the row count due; None: one row per parameter set
    counted: int = 0  # rows an upsert's cursor executions reported
    readback: Readback | None = None  # a flush's UPDATE: its objects are shown the token


@dataclass(slots=True, weakref_slot=True, eq=False)
class SessionState:
    """What sa-fence keeps on one session (in ``session.info``)."""

    lease: Lease | None = None
    unfenced: int = 0
    poisoned: FenceError | None = None
    pending: Pending | None = None
    connections: list[Connection] = field(default_factory=list)
    bumped: list[Any] = field(default_factory=list)  # joined-inheritance objects this flush bumps
    presented_in: tuple[Any, int] | None = None  # (transaction, token) presented for raw SQL
    flush_span: Any = None  # the span of the fenced flush under way
    session: Callable[[], Session | None] = lambda: None  # a weak reference (none: a connection)
    flush: Callable[[], UOWTransaction | None] = lambda: None  # a weak reference: the last flush

    def in_flush(self, elem: Any, options: Mapping[str, Any], of: Covered | Readback) -> bool:
        """Whether ``elem`` is one of the running flush's statements: sent with the compiled
        cache of ``of``'s hierarchy (a listener's Core statement has none), not an ORM bulk
        statement (those are annotated), in the transaction the flush holds (a bulk method
        begins its own)."""
        session, flush, cache = self.session(), self.flush(), options.get("compiled_cache")
        if session is None or cache is not of.base_mapper._compiled_cache:
            return False
        bulk = "_emit_update_table" in elem._annotations
        return not bulk and getattr(flush, "transaction", 0) is session._transaction

    def require_lease(self) -> Lease | None:
        """The lease to fence with; None when the caller opted out explicitly."""
        lease = self.lease
        if lease is not None:
            # released, lost or (fail_fast) past its validity: LeaseLostError, no SQL sent
            lease.check(for_write=True)
            return lease
        if self.unfenced:
            return None
        _telemetry.unfenced_refused()
        raise UnfencedWriteError(
            "this session has no lease bound, so it may not write fenced rows. Acquire a "
            "lease and call lease.bind(session); admin scripts that must write without one "
            "can wrap the writes in `with sa_fence.unfenced(session):`. Nothing was sent."
        )

    def fail(self, error: FenceError) -> FenceError:
        """Remember a fencing error: the session may not commit until rolled back."""
        if self.poisoned is None:
            self.poisoned = error
        return error

    def check_not_poisoned(self, what: str) -> None:
        if self.poisoned is not None:
            raise FenceError(
                f"{what} refused: this session hit a fencing error ({self.poisoned}) and "
                "may not commit any part of this transaction. Call session.rollback()."
            ) from self.poisoned

    def present_for_raw_sql(self, conn: Connection) -> None:
        """Before raw SQL (``text()``), which cannot carry the token: present it to guards
        once per transaction."""
        lease = self.lease
        if lease is None or lease.released:
            return
        transaction = conn.get_transaction()
        if transaction is not None and self.presented_in == (transaction, lease.token):
            return
        token = literal(str(lease.token))  # presented to guards for the rest of the transaction
        conn.execute(select(func.set_config(literal(TOKEN_SETTING), token, true())))
        self.presented_in = (conn.get_transaction(), lease.token)


def state_of(session: Session) -> SessionState | None:
    return session.info.get(_STATE_KEY)


class Marks(arming.ScopeMark):
    """The lease core inherits this: only the flush hook touches these."""

    #: Set once the lease is bound to a session or connection.
    _bound: bool = False
    #: Set at the first write statement under the lease (its timing, _telemetry.wrote).
    _wrote: bool = False


def bound_lease(session: Session) -> Lease | None:
    state = state_of(session)
    return None if state is None else state.lease


def state_for(session: Session) -> SessionState:
    info = session.info  # (`in` and [], not get(): no call)
    if _STATE_KEY not in info:
        info[_STATE_KEY] = SessionState(session=weakref.ref(session))
    return info[_STATE_KEY]  # type: ignore[no-any-return]
