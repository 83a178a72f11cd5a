"""Errors raised by sa-fence.

Every error the library raises on purpose derives from :class:`FenceError`::

    FenceError
    ├── StaleTokenError          (also sqlalchemy.orm.exc.StaleDataError)
    ├── LeaseNotAcquiredError    another owner holds the lease
    ├── LeaseLostError           the lease is no longer ours (expired, taken, released)
    ├── LeaseBackendError        Redis or PostgreSQL failed: the outcome is unknown
    ├── UnfencedWriteError       a fenced entity was written without a lease
    └── FencingConfigError       the database, sequence or session is set up wrongly

Bad arguments (a negative TTL, an empty lease name) raise ``ValueError`` /
``TypeError`` before anything is written.  Every error survives ``pickle`` and
``cls(*args)`` (Celery's JSON results): ``args`` is ``(message, {attributes})``,
which the constructor accepts.  ``str(error)`` is the message.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, overload

from sqlalchemy.orm.exc import StaleDataError

__all__ = [
    "FenceError",
    "FencingConfigError",
    "LeaseBackendError",
    "LeaseLostError",
    "LeaseNotAcquiredError",
    "StaleTokenError",
    "UnfencedWriteError",
]


class FenceError(Exception):
    """Base class of every error sa-fence raises on purpose."""

    # Pickle needs no __reduce__: BaseException's rebuilds cls(*args), then restores __dict__.

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""

    def _init(self, message: str, attributes: dict[str, Any], **shown: Any) -> None:
        """Set the attributes; ``args`` is ``(message, {attributes, then shown})``."""
        self.__dict__.update(attributes)
        super().__init__(message, {**attributes, **shown})


def _from_args(cls: type[Exception], args: tuple[Any, ...]) -> dict[str, Any]:
    """The attributes of the ``cls(message, {attributes})`` form."""
    if len(args) != 2 or not isinstance(args[0], str) or not isinstance(args[1], dict):
        raise TypeError(
            f"{cls.__name__}() takes keyword arguments (or its own args, "
            f"(message, {{attributes}}), to rebuild it), got {args!r}"
        )
    return args[1]


class StaleTokenError(FenceError, StaleDataError):
    """A write carried a token older than the newest one: nothing of it was committed.

    * **At COMMIT** (lease scope, ``statement == "COMMIT"``): a newer lease of the same name
      was granted, so a session bound to the older lease commits nothing, whatever it wrote;
      or a PostgreSQL crash lost this lease's own grant (docs/guarantees.md, "A PostgreSQL
      crash").  ``lease_name``, ``token`` and ``newest_token`` (the register's; ``None`` when
      it has no row for the name: pruned, see ``Fencer.prune``, never granted there, or its
      first grant lost in a crash; below ``token`` when a crash lost this grant) are set;
      ``table`` is ``None``.
    * **At the flush** (the row fence, ``statement`` ``"UPDATE"``, ``"DELETE"`` or
      ``"UPSERT"``): a token-compared statement matched fewer rows than it targeted (an upsert:
      than it proposed), or a guard trigger refused a row.  ``table``, ``primary_keys`` (each a
      tuple) and ``current_fences`` (the fence on each refused row, ``None`` if gone) are set.

    Also a :class:`sqlalchemy.orm.exc.StaleDataError`: ``version_id_col`` handlers catch it.
    """

    _fields = ("token", "table", "statement", "primary_keys", "current_fences", "lease_name",
               "newest_token")  # fmt: skip
    token: int
    table: str | None
    statement: str
    primary_keys: tuple[tuple[Any, ...], ...]
    current_fences: tuple[int | None, ...]
    lease_name: str | None
    newest_token: int | None

    @overload
    def __init__(
        self,
        *,
        token: int,
        table: str | None = None,
        statement: str = "UPDATE",
        primary_keys: Sequence[tuple[Any, ...]] = (),
        current_fences: Sequence[int | None] = (),
        lease_name: str | None = None,
        newest_token: int | None = None,
    ) -> None: ...
    @overload
    def __init__(self, message: str, attributes: dict[str, Any], /) -> None: ...
    def __init__(
        self,
        *rebuild: Any,
        token: int = 0,
        table: str | None = None,
        statement: str = "UPDATE",
        primary_keys: Sequence[Sequence[Any]] = (),
        current_fences: Sequence[int | None] = (),
        lease_name: str | None = None,
        newest_token: int | None = None,
    ) -> None:
        if rebuild:
            StaleTokenError.__init__(self, **_from_args(type(self), rebuild))
            return
        pks, fences = tuple(tuple(pk) for pk in primary_keys), tuple(current_fences)
        if table is None and newest_token is None:
            message = (
                f"commit refused: lease {lease_name!r} (token {token}) is stale: the lease "
                "register no longer holds its token. A newer lease of that name was granted "
                "(its holder's work stands), or the name's row is gone (pruned by sa-fence "
                "prune after the lease ended; never granted in this database; its first grant "
                "lost in a PostgreSQL crash before the WAL was flushed, which makes a grant "
                "durable at the latest at its holder's first commit that writes; or, under "
                "REPEATABLE READ or SERIALIZABLE, granted after this transaction's snapshot: "
                "bind the lease before its first statement). Nothing of this transaction was "
                "committed. Roll back and re-read; take the lease again to write under it."
            )
        elif table is None and newest_token is not None and newest_token < token:
            message = (
                f"commit refused: lease {lease_name!r} (token {token}) is stale: the lease "
                f"register holds an older token of that name ({newest_token}), so this lease's "
                "grant is gone: lost in a PostgreSQL crash before the WAL was flushed (which "
                "makes a grant durable at the latest at its holder's first commit that "
                "writes), or the database was restored from a backup or a replica promoted "
                "without it. Nothing of this transaction was committed. Roll back and re-read; "
                "take the lease again (a new, larger token) to write under it."
            )
        elif table is None:
            message = (
                f"commit refused: lease {lease_name!r} (token {token}) is stale: a newer lease of "
                f"that name was granted (token {newest_token}). Nothing of this transaction was "
                "committed. Roll back and re-read; the newer holder's work stands."
            )
        else:
            rows = ", ".join(
                f"{(pk[0] if len(pk) == 1 else pk)!r} (fence {'<row gone>' if f is None else f})"
                for pk, f in zip(pks, fences, strict=False)
            )
            lease = f" of lease {lease_name!r}" if lease_name else ""
            message = (
                f"{statement} on table {table!r} refused: token {token}{lease} is stale "
                f"for row(s) {rows or '<unknown>'}. A newer lease holder has written "
                "these rows since this lease was granted; this transaction may not commit. "
                "Roll back and re-read the rows."
            )
        values = (token, table, statement, pks, fences, lease_name, newest_token)
        self._init(message, dict(zip(self._fields, values, strict=True)))


class LeaseNotAcquiredError(FenceError):
    """Another owner holds the lease (contention, not a failure).

    ``name`` is the lease name; ``holder_token`` is the token recorded by the current holder
    when known, else ``None``; ``waited`` is how long it waited (``None``: it did not wait).
    """

    name: str
    holder_token: int | None
    waited: float | None

    @overload
    def __init__(
        self, name: str, holder_token: int | None = None, *, waited: float | None = None
    ) -> None: ...
    @overload
    def __init__(self, message: str, attributes: dict[str, Any], /) -> None: ...
    def __init__(
        self,
        name: str,
        holder_token: int | dict[str, Any] | None = None,
        *,
        waited: float | None = None,
    ) -> None:
        if isinstance(holder_token, dict):  # (message, {attributes}): a result backend's rebuild
            LeaseNotAcquiredError.__init__(self, **_from_args(type(self), (name, holder_token)))
            return
        held = f" (holder's token {holder_token})" if holder_token is not None else ""
        after = f" after waiting {waited:.3g} s" if waited is not None else ""
        self._init(
            f"lease {name!r} is held by another owner{held}{after}; try again later",
            {"name": name, "holder_token": holder_token, "waited": waited},
        )


class LeaseLostError(FenceError):
    """The lease is no longer ours: it expired, was taken over, or was released."""


class LeaseBackendError(FenceError):
    """Redis or PostgreSQL did not answer or failed, so the outcome is unknown.

    Not contention: the lease may or may not have been granted, extended or released.  sa-fence
    resent the (idempotent) call a bounded number of times, then gave up; after a failed acquire
    it tries to remove whatever it may have set, and the lease's TTL ends it otherwise.

    Attributes: ``backend`` (``"redis"`` or ``"postgresql"``), ``operation`` (``"check"``,
    ``"acquire"``, ``"token"``, ``"confirm"``, ``"extend"`` or ``"release"``), ``name`` (the
    lease name), ``cause`` (the client's exception; not chained as ``__cause__``: the message
    names it) and ``detail`` (what is known: "nothing was changed", "the outcome is unknown",
    or "a failover may be under way").
    """

    backend: str
    operation: str
    name: str
    cause: BaseException
    detail: str | None

    @overload
    def __init__(
        self,
        *,
        backend: str,
        operation: str,
        name: str,
        cause: BaseException,
        detail: str | None = None,
    ) -> None: ...
    @overload
    def __init__(self, message: str, attributes: dict[str, Any], /) -> None: ...
    def __init__(
        self,
        *rebuild: Any,
        backend: str = "",
        operation: str = "",
        name: str = "",
        cause: BaseException | None = None,
        detail: str | None = None,
    ) -> None:
        if rebuild:  # only the cause's text travels in args; pickle restores the exception
            attributes = dict(_from_args(type(self), rebuild))
            message, shown = rebuild[0], attributes.pop("cause")
            cause = Exception(shown)
        elif cause is None:
            raise TypeError("LeaseBackendError() needs cause=<the client's exception>")
        else:
            attributes = dict(backend=backend, operation=operation, name=name, detail=detail)
            shown = f"{type(cause).__name__}: {cause}"
            message = f"{operation} of lease {name!r} failed: " + (
                detail
                or f"{backend} did not answer or failed ({shown}); the outcome is unknown. "
                f"Check that {backend} is reachable; the lease's TTL ends anything left behind."
            )
        self._init(message, attributes, cause=shown)
        self.cause = cause


class UnfencedWriteError(FenceError):
    """A fenced entity was about to be written by a session with no lease bound.

    Raised before any SQL is sent.  Bind a lease with ``lease.bind(session)``, or, for admin
    scripts only, wrap the writes in ``sa_fence.unfenced(session)``.
    """


class FencingConfigError(FenceError):
    """The environment cannot give the fencing guarantee (the message says how to fix it).

    Examples: the token sequence is missing or has ``CACHE > 1``; ``synchronous_commit`` is
    ``off`` on the token connection; the database driver cannot report executemany row counts;
    a session was bound without the flush hook installed.  Also a server refusing the set-up: a
    wrong password, a Redis database index out of range, TLS on one side only, a missing ACL
    command or database right.  Resending never helps; the message names the cause and the fix.

    ``cause`` is the client's exception when a server refused (else ``None``); not chained as
    ``__cause__``: the message says what it says.
    """

    def __init__(self, *args: Any, cause: BaseException | None = None) -> None:
        super().__init__(*args)
        self.cause = cause
