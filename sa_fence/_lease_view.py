"""What the flush hook and telemetry need of a lease, as typing Protocols: ``orm``,
``scope`` and ``telemetry`` import these, not the leases, which import them
(docs/architecture.md, "The lease interface")."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from .db.tokens import TokenSource


class FencerView(Protocol):
    """The fencer of a lease, as the flush hook reads it."""

    @property
    def engine(self) -> Any: ...  # the Engine (or AsyncEngine) of the tokens and the register

    @property
    def token_source(self) -> TokenSource: ...  # the register and the database's identity


class LeaseView(Protocol):
    """A granted lease, as the flush hook and telemetry read it."""

    @property
    def name(self) -> str: ...

    @property
    def token(self) -> int: ...

    @property
    def acquired_at(self) -> float: ...

    @property
    def fencer(self) -> FencerView: ...

    @property
    def released(self) -> bool: ...

    # Declared here for typing; each is touched only by the room that owns it.
    _bound: bool  # orm.session_state.Marks
    _wrote: bool  # orm.session_state.Marks
    _scoped: Any  # scope.arming.ScopeMark
    _tel: Any  # telemetry.Reported

    def check(self, *, for_write: bool = False) -> None:
        """Raise LeaseLostError unless the lease is still usable (for a write)."""
