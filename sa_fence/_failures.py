"""What a failed Redis or PostgreSQL call means, and whether to resend it.

Pure, like :mod:`sa_fence._protocol`, which drives it: the kinds of failure,
the cause and fix each error names, and the resend policy (backoff, failure
budget) shared by both front ends and both backends.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: How many times one Redis call is sent at most when it failed in a way a
#: resend may fix (an outage or failover), within the failure budget
#: (:class:`FailureBudget`), before the front end gives up with
#: LeaseBackendError.  Every script is idempotent for one owner, so resending
#: is safe.  (redis-py may also retry inside each call: see its ``retry``.)
BACKEND_ATTEMPTS = 3


@dataclass(frozen=True, slots=True)
class Backoff:
    """Exponential backoff with full jitter: wait ``uniform(0, min(cap, base * 2**n))``.

    Full jitter spreads competing waiters out (no synchronised retry waves),
    and the cap bounds every single wait.
    """

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


# ---------------------------------------------------------------- failures
#
# What a failed call means, decided here for both front ends and both
# backends, so that every error names its cause and its fix the same way:
#
# * SETUP: a set-up mistake (wrong password, no such database index, TLS on
#   one side only, a missing ACL command, no register, no rights).  Resending
#   cannot help: FencingConfigError at once, with the fix.
# * OUTAGE: the server did not answer or refused the connection.  Resent
#   within the failure budget, then LeaseBackendError.
# * FAILOVER: an outage that a failover explains (no master known to the
#   Sentinels, a read-only replica, a cluster slot without a master): as
#   OUTAGE, and the error says a failover may be under way.
# * REFUSED: the server answered the call with an error no resend changes
#   (out of memory, a busy script): LeaseBackendError at once.
#
# ``may_have_set`` says whether the call may have reached the server and
# changed something: an error reply, a refused connection or a failed login
# prove that nothing was set, so acquire skips its clean-up then (the
# clean-up would only fail the same way and log noise).

SETUP = "setup"
OUTAGE = "outage"
FAILOVER = "failover"
REFUSED = "refused"
#: Failures worth resending (within the budget).
RESENDABLE = frozenset({OUTAGE, FAILOVER})

#: Default failure budget (seconds) of one operation: see FailureBudget.
DEFAULT_BACKEND_TIMEOUT = 5.0

ACL_DOC = "docs/topologies.md#redis-acl"
ROLE_DOC = "docs/topologies.md#postgresql-role"
POOLER_DOC = "docs/topologies.md#pgbouncer"
TIMEOUTS_DOC = "docs/topologies.md#timeouts"


@dataclass(frozen=True, slots=True)
class Failure:
    """What one failed call means: its kind, whether it may have set anything, and the
    text for the error (the cause, and for SETUP the fix)."""

    kind: str
    may_have_set: bool
    text: str


def cause_text(exc: BaseException) -> str:
    """``Type: message`` of a client's exception, on one line, without SQLAlchemy's
    statement and background link (the driver's own exception when it wraps one)."""
    orig = getattr(exc, "orig", None)
    if isinstance(orig, BaseException):
        exc = orig
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def check_backend_timeout(timeout: object) -> float:
    if isinstance(timeout, bool) or not isinstance(timeout, int | float):
        raise TypeError(
            f"timeout must be a number of seconds, got {type(timeout).__name__}: {timeout!r}"
        )
    if not math.isfinite(timeout) or timeout <= 0:
        raise ValueError(
            f"timeout must be a finite number of seconds > 0, got {timeout!r}: it is how "
            "long an operation may spend on a failing Redis or PostgreSQL before it gives up"
        )
    return float(timeout)


@dataclass
class FailureBudget:
    """The resend policy of one operation's calls, bounded by a budget in seconds.

    The budget counts from the send time of the first failed attempt (so the
    wait for a busy lease and the calls that succeeded before are not part of
    it).  A failure is resent only when it is resendable, fewer than
    :data:`BACKEND_ATTEMPTS` sends were made, and the next attempt, judged by
    how long the last one took, ends within the budget: the operation gives up
    within the budget, or within one call of the client when a single call
    (its ``socket_timeout`` times its own retries) takes longer than that.
    sa-fence never multiplies the client's own retries beyond that.
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
        if failure.kind not in RESENDABLE or self.failures >= BACKEND_ATTEMPTS:
            return None
        wait = BACKEND_BACKOFF.delay(self.failures - 1, rand)
        took = self.last_took = max(0.0, now - sent_at)
        if now + wait + took > self.first_sent + self.budget:
            return None
        return wait

    def fits_another(self, now: float) -> bool:
        """Whether one more call, as long as the last failed one, ends within the
        budget (the clean-up after a failed acquire is sent only then: against a
        Redis that stopped answering it would only wait again)."""
        return now + self.last_took <= self.budget + (
            now if self.first_sent is None else self.first_sent
        )

    def remaining(self, now: float) -> float:
        """Seconds of the budget left at ``now`` (all of it before a failure)."""
        if self.first_sent is None:
            return self.budget
        return max(0.0, self.first_sent + self.budget - now)

    def reset(self) -> None:
        self.failures = 0
        self.first_sent = None


def _redis_setup(cause: str, fix: str) -> Failure:
    return Failure(SETUP, False, f"the Redis connection is set up wrongly ({cause}). {fix}")


def classify_redis(exc: BaseException, *, speaks: str | None = None, tls: bool = False) -> Failure:
    """What a failed Redis call means.

    ``speaks`` is what a probe of the server found when the connection itself
    failed: ``"tls"``, ``"plain"`` or None (not probed / no answer); ``tls``
    is whether the client uses TLS.  A client and server that disagree about
    TLS fail as timeouts or closed connections, so only the probe tells that
    set-up mistake from an outage.
    """
    import redis.exceptions as rx

    cause = cause_text(exc)
    message = str(exc)
    lowered = message.lower()
    if isinstance(exc, rx.AuthenticationError | rx.AuthorizationError) or (
        "wrongpass" in lowered or "noauth" in lowered
    ):
        return _redis_setup(
            cause,
            "Check the user name and password the client connects with (redis://user:"
            "password@host/..., or username=/password=) against the server's ACL or "
            "requirepass.",
        )
    if "db index is out of range" in lowered or "invalid db index" in lowered:
        return _redis_setup(
            cause,
            "The database index in the URL (redis://host:port/<index>) or db= is higher "
            "than the server's 'databases' setting (16 by default); use an index below it.",
        )
    if (
        isinstance(exc, rx.NoPermissionError)
        or "noperm" in lowered
        or ("user executing the script" in lowered)
    ):
        return _redis_setup(
            cause,
            "The Redis user lacks a command or key sa-fence needs. Give it the minimal "
            "ACL: -@all +evalsha +script|load +get +set +pexpire +pttl +del "
            f"~<key_prefix>* (see {ACL_DOC}).",
        )
    if "certificate" in lowered or ("ssl" in lowered and "verify" in lowered):
        return _redis_setup(
            cause,
            "The server's TLS certificate was not accepted: give the client the CA that "
            "signed it (ssl_ca_certs=..., or ?ssl_ca_certs= in the rediss:// URL) and "
            "connect by a name or address the certificate lists.",
        )
    if speaks == "plain" and tls:
        return _redis_setup(
            cause,
            "The client uses TLS (rediss://, ssl=True) but the server answers in plain "
            "Redis on that port: use redis://, or connect to the server's tls-port.",
        )
    if speaks == "tls" and not tls:
        return _redis_setup(
            cause,
            "The server expects TLS on that port but the client speaks plain Redis: use "
            "rediss:// (ssl=True) with ssl_ca_certs=<the CA file>.",
        )
    if "unknown command" in lowered:
        return _redis_setup(
            cause,
            "The server does not run Lua scripts under their usual names (EVALSHA, "
            "SCRIPT LOAD renamed or disabled); sa-fence needs them.",
        )
    connect_phase = "connecting to" in lowered or "error connecting" in lowered
    if type(exc).__name__ == "MasterNotFoundError" or (
        isinstance(exc, rx.ClusterError | rx.TryAgainError | rx.RedisClusterException)
    ):
        # Nothing was sent: no master to send it to (a cluster reply refused it).
        return Failure(FAILOVER, False, cause)
    if (
        isinstance(exc, rx.ReadOnlyError)
        or "previous master is now a slave" in lowered
        or ("readonly" in lowered)
    ):
        return Failure(FAILOVER, False, cause)
    if isinstance(exc, rx.BusyLoadingError):
        return Failure(OUTAGE, False, cause)
    if isinstance(exc, rx.ConnectionError | rx.TimeoutError):
        return Failure(OUTAGE, not connect_phase, cause)
    if isinstance(exc, rx.ResponseError):
        return Failure(REFUSED, False, cause)
    return Failure(REFUSED, True, cause)


def wants_probe(failure: Failure) -> bool:
    """Whether to probe the server before reporting ``failure`` as an outage: TLS
    on one side only looks like one (a handshake that times out, a connection
    reset while reading the reply), and only a probe tells them apart."""
    return failure.kind == OUTAGE


def probe_timeout(remaining: float) -> float:
    """How long the TLS probe may wait: what is left of the budget, 0.05 to 0.5 s."""
    return min(0.5, max(0.05, remaining))


def outage_detail(backend: str, failure: Failure, attempts: int) -> str:
    """LeaseBackendError's text for an outage: what happened, what is known, what to do."""
    sends = "once" if attempts <= 1 else f"{attempts} times"
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


# PostgreSQL: SQLSTATE classes and the connection-failure texts libpq gives
# without a SQLSTATE (a login refused by the server arrives as a message).
_PG_SETUP_STATES = {
    "28P01": "auth",
    "28000": "auth",
    "3D000": "database",
    "42P01": "schema",
    "42883": "schema",
    "3F000": "schema",
    "42501": "rights",
    "42P05": "prepared",
    "26000": "prepared",
}
_PG_FAILOVER_STATES = {"25006"}  # read_only_sql_transaction: connected to a standby
_PG_AUTH_TEXTS = (
    "password authentication failed",
    "pg_hba.conf",
    "authentication failed",
    "no such user",
)


def classify_postgres(sqlstate: str | None, message: str) -> tuple[str, str | None]:
    """(SETUP | OUTAGE | FAILOVER | REFUSED, the set-up problem's name or None).

    A login refused by the server reaches the client as a message without a
    SQLSTATE (libpq's connection failure), so those are told by their text.
    """
    if sqlstate in _PG_SETUP_STATES:
        return SETUP, _PG_SETUP_STATES[sqlstate]
    if sqlstate in _PG_FAILOVER_STATES:
        return FAILOVER, None
    if sqlstate is None:
        lowered = message.lower()
        if "does not exist" in lowered and 'role "' in lowered:
            return SETUP, "auth"
        if ("does not exist" in lowered and 'database "' in lowered) or (
            "no such database" in lowered
        ):
            return SETUP, "database"
        if any(text in lowered for text in _PG_AUTH_TEXTS):
            return SETUP, "auth"
        return OUTAGE, None
    if sqlstate.startswith(("08", "57", "53")):
        return OUTAGE, None
    return REFUSED, None


def postgres_setup_fix(problem: str, *, sequence: str, register: str, function: str) -> str:
    """The fix for a PostgreSQL set-up problem found by :func:`classify_postgres`."""
    if problem == "auth":
        return (
            "PostgreSQL refused the login: check the user and password in the engine's "
            "URL, and that pg_hba.conf (or PgBouncer's auth_file) admits them."
        )
    if problem == "database":
        return "The database named in the engine's URL does not exist: check its name."
    if problem == "schema":
        return (
            f"The token sequence {sequence}, the lease register {register} or its commit "
            f"check {function} is missing: run `sa-fence check --url ...` to see which, and "
            "create them with sa_fence.fence_sequence(metadata) and metadata.create_all(), "
            "or in a migration with op.create_fence_register()."
        )
    if problem == "rights":
        return (
            "The database role lacks a right sa-fence needs: GRANT USAGE, SELECT ON "
            f"SEQUENCE {sequence}; GRANT SELECT, INSERT, UPDATE ON {register}; GRANT "
            f"EXECUTE ON FUNCTION {function}(text, bigint); and SELECT, INSERT, UPDATE, "
            f"DELETE on the fenced tables (see {ROLE_DOC})."
        )
    if problem == "prepared":
        return (
            "The connection goes through a pooler that pools by transaction (PgBouncer "
            "pool_mode = transaction, before 1.21 or with max_prepared_statements = 0), "
            "which mixes up psycopg's prepared statements between clients. Create the "
            f"engine with connect_args={{'prepare_threshold': None}} (see {POOLER_DOC})."
        )
    return ""
