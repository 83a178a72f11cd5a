"""Leases in Redis with tokens from PostgreSQL: :class:`Fencer` and :class:`Lease`."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import TracebackType
from typing import TYPE_CHECKING, Any

import redis as redis_lib
from sqlalchemy import Engine

from . import _protocol as proto
from ._tokens import DEFAULT_SEQUENCE, TokenSource
from .errors import FencingConfigError, LeaseLostError, LeaseNotAcquiredError

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

log = logging.getLogger("sa_fence")

DEFAULT_KEY_PREFIX = "sa_fence:"


def check_engine(engine: object) -> Engine:
    """Refuse engines that cannot fence: not PostgreSQL, or no executemany rowcounts."""
    if hasattr(engine, "sync_engine"):  # AsyncEngine (not imported: needs greenlet)
        raise FencingConfigError(
            "Fencer takes a sync sqlalchemy Engine; pass async_engine.sync_engine"
        )
    if not isinstance(engine, Engine):
        raise TypeError(f"engine must be a sqlalchemy Engine, got {type(engine).__name__}")
    check_dialect(engine.dialect)
    return engine


def check_dialect(dialect: Any) -> None:
    if dialect.name != "postgresql":
        raise FencingConfigError(
            f"sa-fence needs PostgreSQL (tokens come from a sequence in the protected "
            f"database); this engine's dialect is {dialect.name!r}"
        )
    if not (dialect.supports_sane_rowcount and dialect.supports_sane_multi_rowcount):
        raise FencingConfigError(
            f"driver {dialect.driver!r} does not report row counts for executemany, so a "
            "stale batched write could not be detected. Use psycopg 3: "
            "'postgresql+psycopg://...' (or 'postgresql+psycopg_async://' for asyncio)"
        )


class Fencer:
    """Grants leases (Redis) that carry fencing tokens (PostgreSQL sequence).

    ``redis`` is a ``redis.Redis`` client; ``engine`` is the SQLAlchemy engine
    of the database that holds the fenced rows *and* the token sequence.
    Leases are stored under ``key_prefix + name``.
    """

    def __init__(
        self,
        redis: redis_lib.Redis | redis_lib.RedisCluster,
        engine: Engine,
        *,
        sequence: str = DEFAULT_SEQUENCE,
        key_prefix: str = DEFAULT_KEY_PREFIX,
    ) -> None:
        if not isinstance(redis, redis_lib.Redis | redis_lib.RedisCluster):
            raise TypeError(
                "redis must be a sync redis.Redis or redis.RedisCluster client, got "
                f"{type(redis).__module__}.{type(redis).__name__}"
            )
        if not isinstance(sequence, str) or not sequence:
            raise ValueError("sequence must be the (optionally schema-qualified) sequence name")
        self.redis = redis
        self.engine = check_engine(engine)
        self.key_prefix = proto.check_prefix(key_prefix)
        self._tokens = TokenSource(engine, sequence)
        self._check_lock = threading.Lock()
        self._confirm = redis.register_script(proto.CONFIRM_SCRIPT)
        self._extend = redis.register_script(proto.EXTEND_SCRIPT)
        self._release = redis.register_script(proto.RELEASE_SCRIPT)

    @property
    def sequence(self) -> str:
        return self._tokens.sequence

    def key(self, name: str) -> str:
        """The Redis key that holds lease ``name``."""
        return self.key_prefix + proto.check_name(name)

    def check(self) -> None:
        """Check the token sequence and ``synchronous_commit`` now.

        Runs automatically before the first token; raises
        :class:`~sa_fence.FencingConfigError` saying how to fix what is wrong.
        """
        with self._check_lock:
            self._tokens.check()

    def acquire(self, name: str, ttl: float) -> Lease:
        """Take lease ``name`` for ``ttl`` seconds and draw its token (non-blocking).

        Raises :class:`~sa_fence.LeaseNotAcquiredError` when another owner
        holds it, :class:`~sa_fence.LeaseLostError` when the lease expired
        before its token could be recorded (the token is thrown away), and
        :class:`~sa_fence.FencingConfigError` when the sequence or database
        is unfit (checked before anything is written to Redis).
        """
        key = self.key(name)
        ttl_ms = proto.ttl_to_ms(ttl)
        if not self._tokens._checked:
            self.check()
        owner = proto.new_owner()
        started = time.monotonic()
        if not self.redis.set(key, owner, nx=True, px=ttl_ms):
            raise LeaseNotAcquiredError(name, proto.token_from_value(self.redis.get(key)))
        try:
            token = self._tokens.next_token()
        except BaseException:
            self._release_quietly(key, owner)
            raise
        value = proto.confirmed_value(owner, token)
        remaining = int(self._confirm(keys=[key], args=[owner, value]))
        if remaining < 0:
            raise LeaseLostError(
                f"lease {name!r} expired or was taken over before its token {token} could "
                "be recorded; the token was thrown away. Use a longer ttl if this repeats."
            )
        return Lease(self, name, key, owner, token, ttl, value, started)

    @contextmanager
    def lease(self, name: str, ttl: float) -> Iterator[Lease]:
        """``with fencer.lease(name, ttl) as lease:`` acquires, then releases on exit."""
        lease = self.acquire(name, ttl)
        try:
            yield lease
        finally:
            lease.release()

    def _release_quietly(self, key: str, value: str) -> None:
        try:
            self._release(keys=[key], args=[value])
        except Exception:  # the original error matters more; the lease will expire
            log.warning("could not release lease %s after a failed acquire", key, exc_info=True)


class Lease:
    """A granted lease: ``name``, ``owner``, ``token``, ``ttl``.

    Bind it to sessions with :meth:`bind`; keep it alive with :meth:`extend`;
    give it back with :meth:`release` (or use it as a context manager).
    """

    def __init__(
        self,
        fencer: Fencer,
        name: str,
        key: str,
        owner: str,
        token: int,
        ttl: float,
        value: str,
        acquired_at: float,
    ) -> None:
        self.fencer = fencer
        self.name = name
        self.key = key
        self.owner = owner
        self.token = token
        self.ttl = ttl
        self._value = value
        self.acquired_at = acquired_at
        self._released = False

    def __repr__(self) -> str:
        state = "released" if self._released else "held"
        return f"<Lease {self.name!r} token={self.token} ttl={self.ttl} {state}>"

    @property
    def released(self) -> bool:
        """True once :meth:`release` ran."""
        return self._released

    def extend(self, ttl: float | None = None) -> None:
        """Set the lease's remaining time to ``ttl`` seconds (default: the original ttl).

        Owner-checked: raises :class:`~sa_fence.LeaseLostError` when the lease
        expired or another owner holds it (it is then never extended).
        """
        ttl_ms = proto.ttl_to_ms(self.ttl if ttl is None else ttl)
        if self._released:
            raise LeaseLostError(f"lease {self.name!r} was released; acquire a new one")
        if not int(self.fencer._extend(keys=[self.key], args=[self._value, ttl_ms])):
            raise LeaseLostError(
                f"lease {self.name!r} (token {self.token}) is no longer ours: it expired "
                "or another owner took it. Stop the work; its writes will be refused."
            )

    def release(self) -> bool:
        """Give the lease back; never deletes another owner's lease.

        Idempotent.  Returns True when this call deleted our live lease,
        False when it had already expired, been taken over, or been released.
        """
        if self._released:
            return False
        self._released = True
        deleted = bool(int(self.fencer._release(keys=[self.key], args=[self._value])))
        if not deleted:
            log.warning(
                "lease %r (token %d) had already expired or been taken over at release",
                self.name,
                self.token,
            )
        return deleted

    def bind(self, session: Session) -> Session:
        """Fence ``session``'s flushes with this lease's token from now on.

        The session (or its class / sessionmaker) must have the flush hook:
        see :func:`sa_fence.install`.  Returns the session.
        """
        from ._flush import bind_lease

        bind_lease(session, self)
        return session

    def __enter__(self) -> Lease:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()
