"""What a failed Redis or PostgreSQL call means, and whether to resend it.

Pure, like :mod:`sa_fence.lease.protocol`, which drives it: the kinds of failure,
the cause and fix each error names, and the resend policy (backoff, budget).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from redis import exceptions as rx

#: How many times one call is sent at most when a resend may fix its failure (an outage or
#: failover), within the failure budget; every script is idempotent for one owner.  (redis-py
#: may also retry inside each call.)
BACKEND_ATTEMPTS = 3


# Not redis-py's Retry and backoff classes: Retry's loop sleeps by itself (time.sleep, or
# asyncio.sleep in its asyncio twin), while this policy is pure and one lifecycle runs it for
# both front ends, each sleeping its own way; and a resend here is bounded by a time budget,
# which Retry has no notion of.  Backoff is FullJitterBackoff's formula with the random draw
# passed in, so that the lifecycle's tests can fix it.
@dataclass(frozen=True, slots=True)
class Backoff:
    """Exponential backoff with full jitter: wait ``uniform(0, min(cap, base * 2**n))``."""

    base: float = 0.02
    cap: float = 0.5

    def ceiling(self, attempt: int) -> float:
        """The largest wait before retry number ``attempt`` (0-based)."""
        return min(self.cap, self.base * 2.0 ** min(attempt, 60))

    def delay(self, attempt: int, rand: float) -> float:
        """The wait for ``attempt`` given ``rand`` uniform in [0, 1)."""
        return rand * self.ceiling(attempt)


#: Waits before resending a call whose answer was lost.
BACKEND_BACKOFF = Backoff(base=0.02, cap=0.5)


# The kinds of failure, for both front ends and backends.  SETUP: a set-up mistake (a wrong
# password or database index, TLS on one side only, a missing ACL command, register or right):
# FencingConfigError at once, with the fix.  OUTAGE: no answer or a refused connection.
# FAILOVER: an outage a failover explains (no master known to the Sentinels, a read-only
# replica, a cluster slot without a master).  REFUSED: an error reply no resend changes (out of
# memory, a busy script).  Only outages and failovers are resent (within the budget).
SETUP = "setup"
OUTAGE = "outage"
FAILOVER = "failover"
REFUSED = "refused"

#: Default failure budget (seconds) of one operation: see FailureBudget.
DEFAULT_BACKEND_TIMEOUT = 5.0

POOLER_DOC = "docs/topologies.md#pgbouncer"


@dataclass(frozen=True, slots=True)
class Failure:
    """A failed call's kind, whether it may have set anything, and the error's text."""

    kind: str
    may_have_set: bool  # if not, acquire skips its clean-up (it would only fail the same way)
    text: str


def cause_text(exc: BaseException) -> str:
    """``Type: message`` of a client's exception on one line (the driver's own, when
    SQLAlchemy wraps one: without its statement and background link)."""
    orig = getattr(exc, "orig", None)
    if isinstance(orig, BaseException):
        exc = orig
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


@dataclass
class FailureBudget:
    """The resend policy of one operation's calls, bounded by a budget in seconds.

    The budget counts from the send of the first failed attempt.  A failure
    is resent only when it is resendable, fewer than :data:`BACKEND_ATTEMPTS`
    sends were made, and the next attempt, as long as the last, ends within
    the budget (or within one call of the client, when one call is longer).
    """

    budget: float
    failures: int = 0
    first_sent: float | None = None
    last_took: float = 0.0  # how long the last failed attempt took

    def on_failure(
        self, failure: Failure, *, sent_at: float, now: float, rand: float
    ) -> float | None:
        """Seconds to wait before resending, or None to give up now."""
        if self.first_sent is None:
            self.first_sent = sent_at
        self.failures += 1
        if failure.kind not in (OUTAGE, FAILOVER) or self.failures >= BACKEND_ATTEMPTS:
            return None
        wait = BACKEND_BACKOFF.delay(self.failures - 1, rand)
        took = self.last_took = max(0.0, now - sent_at)
        return None if now + wait + took > self.first_sent + self.budget else wait

    def fits_another(self, now: float) -> bool:
        """Whether one more call, as long as the last failed one, ends within the budget."""
        return now + self.last_took <= self.budget + (
            now if self.first_sent is None else self.first_sent
        )

    def remaining(self, now: float) -> float:
        """Seconds of the budget left at ``now`` (all of it before a failure)."""
        if self.first_sent is None:
            return self.budget
        return max(0.0, self.first_sent + self.budget - now)


#: The fix of each set-up mistake a failed Redis call shows.
_REDIS_FIXES = {
    "auth": "Check the user name and password the client connects with (redis://user:"
    "password@host/..., or username=/password=) against the server's ACL or requirepass.",
    "db": "The database index in the URL (redis://host:port/<index>) or db= is higher "
    "than the server's 'databases' setting (16 by default); use an index below it.",
    "acl": "The Redis user lacks a command or key sa-fence needs. Give it the minimal "
    "ACL: -@all +evalsha +script|load +get +set +pexpire +pttl +del "
    "~<key_prefix>* (see docs/topologies.md#redis-acl).",
    "certificate": "The server's TLS certificate was not accepted: give the client the CA "
    "that signed it (ssl_ca_certs=..., or ?ssl_ca_certs= in the rediss:// URL) and "
    "connect by a name or address the certificate lists.",
    "plain": "The client uses TLS (rediss://, ssl=True) but the server answers in "
    "plain Redis on that port: use redis://, or connect to the server's tls-port.",
    "tls": "The server expects TLS on that port but the client speaks plain "
    "Redis: use rediss:// (ssl=True) with ssl_ca_certs=<the CA file>.",
    "command": "The server does not run Lua scripts under their usual names (EVALSHA, "
    "SCRIPT LOAD renamed or disabled); sa-fence needs them.",
}
#: Set-up mistakes by exception type or text, first match first: (types, text pattern,
#: problem).  Then TLS on one side only, then a renamed command.
_REDIS_SETUP: tuple[tuple[tuple[type[BaseException], ...], str, str], ...] = (
    ((rx.AuthenticationError, rx.AuthorizationError), "wrongpass|noauth", "auth"),
    ((), "db index is out of range|invalid db index", "db"),
    ((rx.NoPermissionError,), "noperm|user executing the script", "acl"),
    ((), "certificate|ssl.*verify|verify.*ssl", "certificate"),
)

#: Any other failure, by type, first match first: (types, kind, may have set).  No master to
#: send to (a cluster reply refused it) sets nothing; a lost connection or a timeout may have,
#: unless it came while connecting.
_NO_MASTER = (rx.ClusterError, rx.TryAgainError, rx.RedisClusterException, rx.ReadOnlyError)
_NO_ANSWER = (rx.ConnectionError, rx.TimeoutError)
_REDIS_KINDS: tuple[tuple[tuple[type[BaseException], ...], str, bool], ...] = (
    (_NO_MASTER, FAILOVER, False),
    ((rx.BusyLoadingError,), OUTAGE, False),
    (_NO_ANSWER, OUTAGE, True),
    ((rx.ResponseError,), REFUSED, False),
)
_FAILOVER_TEXTS = ("previous master is now a slave", "readonly")


def classify_redis(exc: BaseException, *, speaks: str | None = None, tls: bool = False) -> Failure:
    """What a failed Redis call means.

    ``speaks`` is what a probe of the server found when the connection itself failed: ``"tls"``,
    ``"plain"`` or None (not probed / no answer); ``tls`` is whether the client uses TLS.  A client
    and server that disagree about TLS fail as timeouts or closed connections, so only the probe
    tells that set-up mistake from an outage.
    """
    if isinstance(exc, rx.RedisClusterException) and isinstance(exc.__cause__, _NO_ANSWER):
        exc = exc.__cause__  # a cluster none of whose nodes answered: what the connection did
    cause, lowered = cause_text(exc), str(exc).lower()
    for types, pattern, problem in _REDIS_SETUP:  # noqa: B007 (read after the break)
        if isinstance(exc, types) or re.search(pattern, lowered, re.DOTALL):
            break
    else:
        problem = "command" if "unknown command" in lowered else ""
        if speaks is not None and speaks == ("plain" if tls else "tls"):
            problem = speaks  # what the probe found the server speaks
    if problem:
        fix = _REDIS_FIXES[problem]
        return Failure(SETUP, False, f"the Redis connection is set up wrongly ({cause}). {fix}")
    if type(exc).__name__ == "MasterNotFoundError" or any(t in lowered for t in _FAILOVER_TEXTS):
        return Failure(FAILOVER, False, cause)
    connecting = "connecting to" in lowered or "error connecting" in lowered
    for types, kind, may_have_set in _REDIS_KINDS:
        if isinstance(exc, types):
            return Failure(kind, may_have_set and not connecting, cause)
    return Failure(REFUSED, True, cause)


def outage_detail(
    backend: str,
    failure: Failure,
    attempts: int,
    *,
    took: float | None = None,
    client_retries: int = 0,
) -> str:
    """LeaseBackendError's text for an outage: what happened, what is known, what to do.

    ``attempts``: how many times sa-fence sent the call; ``client_retries``: how many times
    the client may retry each send itself (redis-py's own ``retry``), so that a call the
    client retried for seconds does not read as one quick send; ``took``: seconds from the
    first send to giving up."""
    sends = "once" if attempts <= 1 else f"{attempts} times"
    if client_retries > 0:
        each = "" if attempts <= 1 else "each "
        sends += f", {each}retried up to {client_retries} times by the client itself"
    if took is not None:
        sends += f", {took:.2f} s in all"
    known = (
        "the outcome is unknown (the call may have run)"
        if failure.may_have_set
        else "nothing was changed"
    )
    if failure.kind == FAILOVER:
        return (
            f"{backend} is failing over or has no writable primary ({failure.text}; sent "
            f"{sends}): a failover may be under way. {known.capitalize()}; try again in a "
            "moment: the client finds the new primary by itself."
        )
    if failure.kind == REFUSED:
        return f"{backend} refused the call ({failure.text}); {known}."
    what = "did not answer" if failure.may_have_set else "could not be reached"
    return (
        f"{backend} {what} ({failure.text}; sent {sends}); {known}. Check that "
        f"{backend} is up and reachable; the lease's TTL ends anything left behind."
    )


_PG_SETUP_STATES = {
    **dict.fromkeys(("28P01", "28000"), "auth"),
    "3D000": "database",
    **dict.fromkeys(("42P01", "42883", "3F000"), "schema"),
    "42501": "rights",
    **dict.fromkeys(("42P05", "26000"), "prepared"),
}
#: Set-up mistakes told by the text alone, first match first: (words all in it, problem).
_PG_SETUP_TEXTS = (
    (("does not exist", 'role "'), "auth"),
    (("does not exist", 'database "'), "database"),
    (("no such database",), "database"),
    (("password authentication failed",), "auth"),
    (("pg_hba.conf",), "auth"),
    (("authentication failed",), "auth"),
    (("no such user",), "auth"),
)


def classify_postgres(sqlstate: str | None, message: str) -> tuple[str, str | None]:
    """(SETUP | OUTAGE | FAILOVER | REFUSED, the set-up problem's name or None).

    A login refused by the server reaches the client as a message without a SQLSTATE (libpq's
    connection failure), so those are told by their text.
    """
    if sqlstate in _PG_SETUP_STATES:
        return SETUP, _PG_SETUP_STATES[sqlstate]
    if sqlstate == "25006":  # read_only_sql_transaction: connected to a standby
        return FAILOVER, None
    if sqlstate is None:
        lowered = message.lower()
        for words, problem in _PG_SETUP_TEXTS:
            if all(word in lowered for word in words):
                return SETUP, problem
        return OUTAGE, None
    if sqlstate.startswith(("08", "57", "53")):
        return OUTAGE, None
    return REFUSED, None


_PG_FIXES = {
    "auth": "PostgreSQL refused the login: check the user and password in the engine's "
    "URL, and that pg_hba.conf (or PgBouncer's auth_file) admits them.",
    "database": "The database named in the engine's URL does not exist: check its name.",
    "schema": "The token sequence {sequence}, the lease register {register} or its commit "
    "check {function} is missing: run `sa-fence check --url ...` to see which, and "
    "create them with sa_fence.fence_schema(metadata) and metadata.create_all(), "
    "or in a migration with op.create_fence_register().",
    "rights": "The database role lacks a right sa-fence needs: GRANT EXECUTE ON FUNCTION "
    "{grant_function}(text, regclass, text, boolean), {withdraw_function}(text, bigint); "
    "GRANT SELECT ON {register}; GRANT SELECT ON SEQUENCE {sequence}; GRANT INSERT ON "
    "{scope}; and SELECT, INSERT, UPDATE, DELETE on the fenced tables (see "
    "docs/topologies.md#postgresql-role).",
    "prepared": "The connection goes through a pooler that pools by transaction (PgBouncer "
    "pool_mode = transaction, before 1.21 or with max_prepared_statements = 0), "
    "which mixes up psycopg's prepared statements between clients. Create the "
    f"engine with connect_args={{{{'prepare_threshold': None}}}} (see {POOLER_DOC}).",
}


def postgres_setup_fix(problem: str, *, register: Any) -> str:
    """The fix for a PostgreSQL set-up problem found by :func:`classify_postgres`, naming the
    objects of ``register`` (a ``sa_fence.db.register.Register``)."""
    return _PG_FIXES.get(problem, "").format(
        sequence=register.sequence_sql,
        register=register.table_sql,
        function=register.function_sql,
        grant_function=register.grant_function_sql,
        withdraw_function=register.withdraw_function_sql,
        scope=register.scope_sql,
    )
