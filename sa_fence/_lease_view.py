"""What the flush hook and telemetry need of a lease, as typing Protocols.

:class:`~sa_fence._lease.BaseLease` (and so ``Lease`` and ``AsyncLease``)
satisfies :class:`LeaseView`; ``Fencer`` and ``AsyncFencer`` satisfy
:class:`FencerView`.  ``_flush`` and ``_telemetry`` type their arguments with
these instead of importing ``_lease``, which imports both of them: the
dependency then runs one way, from the lease down to the hooks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from ._tokens import TokenSource


class FencerView(Protocol):
    """The fencer of a lease, as the flush hook reads it."""

    @property
    def engine(self) -> Any:
        """The Engine (or AsyncEngine) of the token sequence and lease register."""

    @property
    def token_source(self) -> TokenSource:
        """Where its tokens come from: the register and the database's identity."""


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

    #: Set by the flush hook once the lease is bound to a session or connection.
    _bound: bool
    #: The lease's ``_telemetry.LeaseTelemetry`` (typed there, where it is set).
    _tel: Any

    def _check_for_write(self) -> None:
        """Raise LeaseLostError unless a write may still use the lease."""
