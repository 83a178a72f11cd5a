"""Sans-I/O part of the lease protocol: scripts, argument checks, value formats.

Everything here is pure: no Redis, no PostgreSQL.  The sync front end
(:mod:`sa_fence._lease`) drives it today; an asyncio front end can drive the
same functions and scripts without copying them.

The protocol (docs/how-it-works.md, "The protocol")::

    1. ACQUIRE: if the key is free,           Redis: grant the lease (a resend
       SET <key> <owner> PX <ttl>              after a lost reply finds <owner>
                                               and answers "already ours")
    2. nextval(<sequence>) in its own         PostgreSQL: take the token
       committed transaction
    3. CONFIRM: if GET <key> == <owner>       Redis: record the token in the
       then SET <key> <owner>:<token> KEEPTTL  lease and prove it is still ours
       else fail and throw the token away

A token is therefore only ever handed to a holder whose lease was still live
*after* the token was drawn, so token order follows grant order.

Every script is idempotent for one owner value, so a call whose reply was
lost on the wire can be resent and answers as the first one would have:
the holder never reports "acquired" or "not acquired" when the answer is
unknown.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, field

# Every script touches exactly one key (KEYS[1]) so it runs unchanged on
# Redis Cluster.  Each compares the stored value with the exact value this
# lease wrote, so it never acts on another owner's lease.

# CONFIRM: record the token in the lease and confirm the lease is still ours.
# KEYS[1] lease key; ARGV[1] the value ACQUIRE stored (the owner);
# ARGV[2] the new value ("<owner>:<token>").
# Returns the lease's remaining PTTL in ms (>= 0), or -1 if it is not ours.
# Idempotent: a resend after a lost reply finds ARGV[2] and answers the same.
CONFIRM_SCRIPT = """
local v = redis.call('GET', KEYS[1])
if v == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[2], 'KEEPTTL')
  return redis.call('PTTL', KEYS[1])
end
if v == ARGV[2] then
  return redis.call('PTTL', KEYS[1])
end
return -1
"""

# EXTEND: set a new TTL on our lease (a new TTL, not an increment).
# KEYS[1] lease key; ARGV[1] our value; ARGV[2] new TTL in ms.
# Returns 1 when extended, 0 when the lease is not ours (expired or taken).
EXTEND_SCRIPT = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""

# RELEASE: delete our lease, never another owner's.
# KEYS[1] lease key; ARGV[1] our value.
# Returns 1 when deleted, 0 when the lease was already gone or not ours.
RELEASE_SCRIPT = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""

#: Longest TTL accepted (Redis PX takes a signed 64-bit value; a lease this
#: long is a bug, so the bound is a sanity check, not a Redis limit).
MAX_TTL_SECONDS = 7 * 24 * 3600.0
MAX_NAME_LENGTH = 1024
#: Longest lease name in UTF-8 bytes.  The name is the lease register's primary
#: key, and a btree index entry must fit in a third of a page: on PostgreSQL's
#: default 8 kB pages an incompressible name of more than 2,692 bytes is refused
#: ("index row size exceeds btree version 4 maximum", measured on PostgreSQL 15
#: with random ASCII; a repetitive name compresses and may pass).  2,048 bytes
#: leaves room below that for any content; with MAX_NAME_LENGTH it allows 1,024
#: characters of ASCII or of two-byte scripts (Cyrillic, Greek), 682 CJK ones.
MAX_NAME_BYTES = 2048


def new_owner() -> str:
    """A fresh owner value: 128 random bits from :mod:`secrets`, hex-encoded."""
    return secrets.token_hex(16)


def confirmed_value(owner: str, token: int) -> str:
    """The lease value once its token is recorded."""
    return f"{owner}:{token}"


def token_from_value(value: bytes | str | None) -> int | None:
    """The token recorded in a stored lease value, if any."""
    if value is None:
        return None
    if isinstance(value, bytes):
        value = value.decode("ascii", "replace")
    _, sep, token = value.rpartition(":")
    return int(token) if sep and token.isdigit() else None


def check_name(name: object) -> str:
    """Validate a lease name (before anything is written)."""
    if not isinstance(name, str):
        raise TypeError(f"lease name must be a str, got {type(name).__name__}: {name!r}")
    if not name or len(name) > MAX_NAME_LENGTH:
        raise ValueError(
            f"lease name must be 1 to {MAX_NAME_LENGTH} characters, got {len(name)}: "
            "name the resource the lease protects, e.g. 'job:42'"
        )
    if "\x00" in name:
        raise ValueError(
            "lease name must not contain NUL characters (PostgreSQL text cannot hold them, "
            "and the name is kept in the lease register)"
        )
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"lease name is not encodable as UTF-8: {exc.object[exc.start : exc.end]!r} at "
            f"position {exc.start} is a lone surrogate (half of a UTF-16 pair, e.g. from "
            "bytes decoded with errors='surrogateescape'). Decode the name's bytes with its "
            "real encoding, or escape them first (e.g. name.encode('utf-8', "
            "'backslashreplace').decode())"
        ) from None
    if size > MAX_NAME_BYTES:
        raise ValueError(
            f"lease name must be at most {MAX_NAME_BYTES} bytes in UTF-8, got {size} bytes "
            f"({len(name)} characters): the name is the lease register's primary key, and "
            "PostgreSQL's btree index cannot hold longer ones. Name the resource by a "
            "shorter key, e.g. its id, or a hash of a long natural key"
        )
    return name


def check_prefix(prefix: object) -> str:
    if not isinstance(prefix, str):
        raise TypeError(f"key_prefix must be a str, got {type(prefix).__name__}")
    return prefix


def ttl_to_ms(ttl: object, what: str = "ttl") -> int:
    """Validate a TTL in seconds and return it in whole milliseconds (>= 1)."""
    if isinstance(ttl, bool) or not isinstance(ttl, int | float):
        raise TypeError(f"{what} must be a number of seconds, got {type(ttl).__name__}: {ttl!r}")
    if not math.isfinite(ttl) or ttl <= 0 or ttl > MAX_TTL_SECONDS:
        raise ValueError(
            f"{what} must be a finite number of seconds in (0, {MAX_TTL_SECONDS:g}], got {ttl!r}"
        )
    ms = math.ceil(ttl * 1000)
    return max(ms, 1)


# ------------------------------------------------------------ lease lifecycle
#
# Everything below is pure as well: the front end passes in the clock reading
# (``now``, monotonic seconds) and a uniform random number, and gets back a
# decision.  Retries are hand-rolled rather than delegated to tenacity: the
# decisions here are not "retry on exception" but a small state machine over
# three kinds of answer (granted / held by another owner / unknown because the
# reply was lost), where the wait must also stop at the caller's deadline and
# at the lease's local validity, and where an unknown answer must never be
# reported as "acquired" or "not acquired".  Keeping it as plain functions of
# (now, random) lets the sync and asyncio front ends share it and lets tests
# drive it without sleeping; tenacity's Retrying/AsyncRetrying read the clock
# and sleep themselves, so the policy would be split between its objects and
# this state machine.

# ACQUIRE: grant the lease, idempotently for one owner value.
# KEYS[1] lease key; ARGV[1] owner; ARGV[2] TTL in ms.
# Returns 1 when it set the lease now, 2 when the lease already holds this
# owner (a retry after a reply lost on the wire), else the stored value of the
# other owner (a string).  Equivalent to SET NX PX for a first attempt.
ACQUIRE_SCRIPT = """
local v = redis.call('GET', KEYS[1])
if not v then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
if v == ARGV[1] then
  return 2
end
return v
"""

GRANTED = "granted"
ALREADY_OURS = "already-ours"
HELD = "held"


def parse_acquire_reply(reply: object) -> tuple[str, int | None]:
    """(GRANTED | ALREADY_OURS | HELD, holder's token when HELD and recorded)."""
    if isinstance(reply, int) and not isinstance(reply, bool):
        if reply == 1:
            return GRANTED, None
        if reply == 2:
            return ALREADY_OURS, None
    if isinstance(reply, bytes | str):
        return HELD, token_from_value(reply)
    raise ValueError(f"unexpected reply from the acquire script: {reply!r}")


#: How many times one Redis call is sent at most when it failed in a way a
#: resend may fix (an outage or failover), within the failure budget
#: (:class:`FailureBudget`), before the front end gives up with
#: LeaseBackendError.  Every script is idempotent for one owner, so resending
#: is safe.  (redis-py may also retry inside each call: see its ``retry``.)
BACKEND_ATTEMPTS = 3

#: Default share of the TTL after which a renewed lease is extended.
DEFAULT_RENEW_FRACTION = 1 / 3
MAX_RENEW_FRACTION = 0.75


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


#: Waits between attempts while another owner holds the lease.
CONTENTION_BACKOFF = Backoff(base=0.02, cap=1.0)
#: Waits before resending a call whose answer was lost.
BACKEND_BACKOFF = Backoff(base=0.02, cap=0.5)


def wait_until(deadline: float, now: float, backoff: Backoff, attempt: int, rand: float) -> float:
    """How long to wait before the next attempt; never past ``deadline``; 0 if passed."""
    return max(0.0, min(backoff.delay(attempt, rand), deadline - now))


def check_timeout(blocking: object, timeout: object, ttl: float) -> float:
    """Validate ``blocking``/``timeout``; return the longest wait for contention (s)."""
    if not isinstance(blocking, bool):
        raise TypeError(f"blocking must be True or False, got {blocking!r}")
    if timeout is None:
        # Never wait forever: one lease lifetime is long enough for a crashed
        # holder's lease (of the same TTL) to run out.
        return ttl if blocking else 0.0
    if isinstance(timeout, bool) or not isinstance(timeout, int | float):
        raise TypeError(
            f"timeout must be a number of seconds, got {type(timeout).__name__}: {timeout!r}"
        )
    if not math.isfinite(timeout) or timeout < 0:
        raise ValueError(
            f"timeout must be a finite number of seconds >= 0, got {timeout!r}; "
            "use blocking=True, timeout=<seconds> to wait for a busy lease"
        )
    if not blocking:
        raise ValueError(
            f"timeout={timeout!r} has no effect without blocking=True: pass "
            "blocking=True to wait up to timeout seconds, or drop timeout"
        )
    return float(timeout)


def check_renew_fraction(fraction: object) -> float:
    if isinstance(fraction, bool) or not isinstance(fraction, int | float):
        raise TypeError(f"renew_fraction must be a number, got {fraction!r}")
    if not (0 < fraction <= MAX_RENEW_FRACTION):
        raise ValueError(
            f"renew_fraction must be in (0, {MAX_RENEW_FRACTION}], got {fraction!r}: it is "
            "the share of the TTL after which a renewed lease is extended (1/3 renews "
            "three times per TTL; above 3/4 leaves no time to retry a failed renewal)"
        )
    return float(fraction)


def drift(ttl_ms: int) -> float:
    """Seconds subtracted from the TTL for clock drift and transit (Redlock's 1% + 2 ms)."""
    return (ttl_ms / 100 + 2) / 1000


def valid_until(sent_at: float, ttl_ms: int) -> float:
    """Monotonic deadline of a lease set (or extended) by a call sent at ``sent_at``.

    Redis counts the TTL from when it executes the call, which is after it was
    sent; the drift allowance covers a Redis clock running somewhat fast.
    """
    return sent_at + ttl_ms / 1000 - drift(ttl_ms)


@dataclass
class AcquireAttempts:
    """The retry state of one acquire call (one owner value for all its attempts)."""

    deadline: float  # give up waiting for contention at this monotonic time
    attempt: int = 0  # contention retries so far
    #: resends of failed attempts, within the failure budget
    failed: FailureBudget = field(default_factory=lambda: FailureBudget(DEFAULT_BACKEND_TIMEOUT))
    unknown_since: float | None = None  # send time of the first attempt that may have set it

    def sent(self, now: float) -> float:
        """Record an attempt sent at ``now``; return the time validity counts from.

        After lost answers, the lease may have been set by the *first* of them,
        so validity counts from that one.
        """
        if self.unknown_since is None:
            return now
        return self.unknown_since

    def on_failure(
        self, failure: Failure, *, sent_at: float, now: float, rand: float
    ) -> float | None:
        """The attempt failed: seconds to wait before resending, or None to give up."""
        if failure.may_have_set and self.unknown_since is None:
            self.unknown_since = sent_at
        return self.failed.on_failure(failure, sent_at=sent_at, now=now, rand=rand)

    def on_held(self, now: float, rand: float) -> float | None:
        """Another owner holds it: seconds to wait before the next try, or None to give up."""
        # A lost attempt of ours would have been found as ours: it set nothing.
        self.failed.reset()
        self.unknown_since = None
        if now >= self.deadline:
            return None
        wait = wait_until(self.deadline, now, CONTENTION_BACKOFF, self.attempt, rand)
        self.attempt += 1
        return wait


# Why a lease is no longer usable (LeaseLostError messages).
def released_message(name: str, token: int) -> str:
    return (
        f"the lease {name!r} (token {token}) bound to this session was released; "
        "acquire a new lease and bind it before writing"
    )


def not_ours_message(name: str, token: int) -> str:
    return (
        f"lease {name!r} (token {token}) is no longer ours: it expired or another owner "
        "took it. Stop the work; its writes will be refused."
    )


def expired_locally_message(name: str, token: int) -> str:
    return (
        f"lease {name!r} (token {token}) has outlived its local validity (its TTL minus "
        "a drift allowance, on this process's monotonic clock), so it may already be "
        "another owner's. Stop the work; nothing was sent."
    )


def renewal_timed_out_message(name: str, token: int) -> str:
    # Worded by what is known: no renewal succeeded within the validity.  Why
    # is not known here: this process may have been paused (GC, swap, SIGSTOP),
    # so that its renewer never ran, or Redis may not have answered.
    return (
        f"lease {name!r} (token {token}) could not be renewed in time: its local "
        "validity ran out before a renewal succeeded (this process may have been "
        "paused, or Redis may not have answered). Stop the work; nothing was sent."
    )


@dataclass
class LeaseState:
    """What a holder knows about its lease, and the transitions between states.

    ``valid_until`` is the monotonic time after which the lease may already
    have expired in Redis.  ``lost`` is set once the holder *knows* the lease
    is gone (an owner-checked script found another value, or renewal could not
    reach Redis within the validity); it never goes back.
    """

    name: str
    token: int
    valid_until: float
    fail_fast: bool
    renewing: bool = False
    released: bool = False
    lost: str | None = None  # the LeaseLostError message, once lost
    extended_from: float = -math.inf  # send time of the call that set valid_until

    def mark_lost(self, message: str) -> bool:
        """Record the loss; True only the first time (so ``on_lost`` runs once)."""
        if self.lost is not None or self.released:
            return False
        self.lost = message
        self.renewing = False
        return True

    def on_extended(self, sent_at: float, ttl_ms: int) -> None:
        if sent_at >= self.extended_from:
            self.extended_from = sent_at
            self.valid_until = valid_until(sent_at, ttl_ms)

    def overdue(self, now: float) -> bool:
        """A renewed lease whose validity ran out without a successful renewal."""
        return self.renewing and self.lost is None and now >= self.valid_until

    def problem(self, now: float, *, for_write: bool) -> str | None:
        """Why the lease may not be used now, or None.

        For a write, local validity counts only when ``fail_fast`` is on:
        without it the fence alone decides (a late write is refused only if a
        newer token has written the row).
        """
        if self.released:
            return released_message(self.name, self.token)
        if self.lost is not None:
            return self.lost
        if (self.fail_fast or not for_write) and now >= self.valid_until:
            return expired_locally_message(self.name, self.token)
        return None


@dataclass(frozen=True, slots=True)
class RenewStep:
    """What the renewer does next for one lease: renew at ``at``, or mark it lost."""

    at: float
    lost: str | None = None


def after_renewal(
    state: LeaseState,
    *,
    outcome: str,
    now: float,
    sent_at: float,
    ttl_ms: int,
    fraction: float,
    failures: int,
    rand: float,
) -> RenewStep:
    """The renewer's next step after one EXTEND of a renewed lease.

    ``outcome``: "extended", "not-ours" (the script found another owner or no
    key: the lease is lost at once), or "unknown" (timeout, connection lost:
    try again with backoff until the local validity runs out, then lost).
    """
    if outcome == "extended":
        state.on_extended(sent_at, ttl_ms)
        return RenewStep(at=sent_at + fraction * ttl_ms / 1000)
    if outcome == "not-ours":
        return RenewStep(at=now, lost=not_ours_message(state.name, state.token))
    if now >= state.valid_until:
        return RenewStep(at=now, lost=renewal_timed_out_message(state.name, state.token))
    return RenewStep(at=now + wait_until(state.valid_until, now, BACKEND_BACKOFF, failures, rand))


# ------------------------------------------------- shared by both front ends
#
# The sync (:mod:`sa_fence._lease`) and asyncio (:mod:`sa_fence._async`)
# front ends validate, decide and word their errors through these, so the
# two cannot drift apart; they differ only in how they wait and send.


def check_lease_options(renew: object, on_lost: object, fail_fast: object) -> None:
    """Validate acquire's ``renew``, ``on_lost`` and ``fail_fast`` (before any I/O)."""
    if not isinstance(renew, bool):
        raise TypeError(f"renew must be True or False, got {renew!r}")
    if on_lost is not None and not callable(on_lost):
        raise TypeError(f"on_lost must be a callable taking the lease, got {on_lost!r}")
    if fail_fast is not None and not isinstance(fail_fast, bool):
        raise TypeError(f"fail_fast must be True, False or None, got {fail_fast!r}")


def overtaken_grant_message(name: str, drawn: int) -> str:
    return (
        f"lease {name!r} was not granted: a newer grant of that name committed while "
        f"this one (token {drawn}) was in flight, so this acquire's lease "
        "expired or was taken over before its token could be recorded; the token was "
        "thrown away. Use a longer ttl if this repeats."
    )


def confirm_lost_message(name: str, token: int) -> str:
    return (
        f"lease {name!r} expired or was taken over before its token {token} could "
        "be recorded; the token was thrown away. Use a longer ttl if this repeats."
    )


def release_deleted(
    state: LeaseState, *, deleted: bool, resent: bool, first_sent: float, now: float
) -> bool:
    """Whether a release deleted our live lease.

    ``deleted`` is the last RELEASE reply.  When an earlier attempt's reply
    was lost (``resent``) and the key is gone now, while the lease was still
    within its validity both when the first attempt was sent and now, only
    that earlier attempt can have deleted it.
    """
    if deleted or not resent or state.lost is not None:
        return deleted
    return now < state.valid_until and first_sent < state.valid_until


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
