"""Sans-I/O part of the lease protocol: scripts, argument checks, value formats.

Pure (no Redis, no PostgreSQL): both front ends drive the same functions and scripts.  ACQUIRE sets
the lease if the key is free, PostgreSQL draws the token, and CONFIRM records it in the lease only
while the lease is still ours (else the token is thrown away), so token order follows grant order
(the whole protocol: docs/how-it-works.md).  Every script is idempotent for one owner value: a call
whose reply was lost can be resent and answers the same.
"""

from __future__ import annotations

import inspect
import math
import secrets
from dataclasses import dataclass, field

from .._failures import BACKEND_BACKOFF, DEFAULT_BACKEND_TIMEOUT, Backoff, Failure, FailureBudget

# Every script touches one key (KEYS[1]), so it runs on Redis Cluster, and compares the stored
# value with this lease's own, never acting on another's.

# ACQUIRE (SET NX PX, idempotent for one owner): ARGV[1] owner, ARGV[2] TTL in ms.  Returns 1
# when it set the lease, 2 when it already holds this owner (a resend after a lost reply), else
# the other owner's stored value.
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

# CONFIRM: ARGV[1] the owner, ARGV[2] "<owner>:<token>".  Returns the PTTL in ms, or -1 if the
# lease is not ours; a resend finds ARGV[2] and answers the same.
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

# EXTEND: ARGV[1] our value, ARGV[2] the new TTL in ms (not an increment).
# Returns 1 when extended, 0 when the lease is not ours (expired or taken).
EXTEND_SCRIPT = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""

# RELEASE: ARGV[1] our value.  Returns 1 when deleted, 0 when gone or not ours.
RELEASE_SCRIPT = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""

#: Longest TTL accepted: a sanity check (a lease this long is a bug), not a Redis limit.
MAX_TTL_SECONDS = 7 * 24 * 3600.0
MAX_NAME_LENGTH = 1024
#: Longest lease name in UTF-8 bytes.  The name is the register's primary key, and a btree entry
#: must fit in a third of a page: on 8 kB pages PostgreSQL 15 refuses an incompressible name over
#: 2,692 bytes ("index row size exceeds btree version 4 maximum").  2,048 leaves room for any
#: content: 1,024 ASCII, Cyrillic or Greek characters, 682 CJK ones.
MAX_NAME_BYTES = 2048


def new_owner() -> str:
    """128 random bits, hex-encoded."""
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
    return max(math.ceil(ttl * 1000), 1)


# The lease lifecycle, pure as well: the front end passes in the clock (monotonic ``now``) and a
# uniform random number.  Not tenacity, which reads the clock and sleeps itself: a state
# machine over granted / held / unknown (never reported as either).

GRANTED = "granted"
HELD = "held"


def parse_acquire_reply(reply: object) -> tuple[str, int | None]:
    """(GRANTED | HELD, the holder's token when HELD and recorded); GRANTED also for a resend."""
    if isinstance(reply, int) and not isinstance(reply, bool) and reply in (1, 2):
        return GRANTED, None
    if isinstance(reply, bytes | str):
        return HELD, token_from_value(reply)
    raise ValueError(f"unexpected reply from the acquire script: {reply!r}")


#: Default share of the TTL after which a renewed lease is extended.
DEFAULT_RENEW_FRACTION = 1 / 3
MAX_RENEW_FRACTION = 0.75

#: Waits between attempts while another owner holds the lease.
CONTENTION_BACKOFF = Backoff(base=0.02, cap=1.0)


def wait_until(deadline: float, now: float, backoff: Backoff, attempt: int, rand: float) -> float:
    """How long to wait before the next attempt; never past ``deadline``; 0 if passed."""
    return max(0.0, min(backoff.delay(attempt, rand), deadline - now))


def check_timeout(blocking: object, timeout: object, ttl: float) -> float:
    """Validate ``blocking``/``timeout``; return the longest wait for contention (s)."""
    if not isinstance(blocking, bool):
        raise TypeError(f"blocking must be True or False, got {blocking!r}")
    if timeout is None:
        # Never wait forever: one TTL lets a crashed holder's lease run out.
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

    Redis counts the TTL from when it runs the call, after it was sent; the
    drift allowance covers a Redis clock running somewhat fast.
    """
    return sent_at + ttl_ms / 1000 - drift(ttl_ms)


@dataclass
class AcquireAttempts:
    """The retry state of one acquire call (one owner value for all its attempts)."""

    deadline: float  # give up waiting for contention at this monotonic time
    attempt: int = 0  # contention retries so far
    failed: FailureBudget = field(default_factory=lambda: FailureBudget(DEFAULT_BACKEND_TIMEOUT))
    unknown_since: float | None = None  # send time of the first attempt that may have set it

    def sent(self, now: float) -> float:
        """The time validity counts from: after lost answers, the first of them."""
        return now if self.unknown_since is None else self.unknown_since

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
        self.failed.failures, self.failed.first_sent = 0, None
        self.unknown_since = None
        if now >= self.deadline:
            return None
        wait = wait_until(self.deadline, now, CONTENTION_BACKOFF, self.attempt, rand)
        self.attempt += 1
        return wait


# Why a lease is no longer usable (LeaseLostError messages).
def not_ours_message(name: str, token: int) -> str:
    return (
        f"lease {name!r} (token {token}) is no longer ours: it expired or another owner "
        "took it. Stop the work; its writes will be refused."
    )


def renewal_timed_out_message(name: str, token: int) -> str:
    # Worded by what is known: why no renewal succeeded (a pause, Redis) is not.
    return (
        f"lease {name!r} (token {token}) could not be renewed in time: its local "
        "validity ran out before a renewal succeeded (this process may have been "
        "paused, or Redis may not have answered). Stop the work; nothing was sent."
    )


@dataclass
class LeaseState:
    """What a holder knows about its lease, and the transitions between states.

    ``valid_until``: the monotonic time after which it may have expired in
    Redis.  ``lost``: set, for good, once the holder *knows* it is gone.
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
        """Record the loss; True only the first time (``on_lost`` runs once)."""
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

        For a write, local validity counts only with ``fail_fast``: without it
        the fence alone decides.
        """
        if self.released:
            return (
                f"the lease {self.name!r} (token {self.token}) bound to this session was "
                "released; acquire a new lease and bind it before writing"
            )
        if self.lost is not None:
            return self.lost
        if (self.fail_fast or not for_write) and now >= self.valid_until:
            return (
                f"lease {self.name!r} (token {self.token}) has outlived its local validity "
                "(its TTL minus a drift allowance, on this process's monotonic clock), so it "
                "may already be another owner's. Stop the work; nothing was sent."
            )
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
    """The renewer's next step after one EXTEND: ``outcome`` is "extended",
    "not-ours" (lost at once) or "unknown" (retry until the validity runs out)."""
    if outcome == "extended":
        state.on_extended(sent_at, ttl_ms)
        return RenewStep(at=sent_at + fraction * ttl_ms / 1000)
    if outcome == "not-ours":
        return RenewStep(at=now, lost=not_ours_message(state.name, state.token))
    if now >= state.valid_until:
        return RenewStep(at=now, lost=renewal_timed_out_message(state.name, state.token))
    return RenewStep(at=now + wait_until(state.valid_until, now, BACKEND_BACKOFF, failures, rand))


def calls_async(obj: object) -> bool:
    """Whether calling ``obj`` only makes a coroutine or an async generator: an ``async def``
    (a partial or a bound method of one too), or an object whose ``__call__`` is one."""
    tests, call = (inspect.iscoroutinefunction, inspect.isasyncgenfunction), type(obj).__call__
    return any(test(f) for test in tests for f in (obj, call))


def check_lease_options(renew: object, on_lost: object, fail_fast: object) -> None:
    """Validate acquire's ``renew``, ``on_lost`` and ``fail_fast`` (before any I/O)."""
    if not isinstance(renew, bool):
        raise TypeError(f"renew must be True or False, got {renew!r}")
    if on_lost is not None and not callable(on_lost):
        raise TypeError(f"on_lost must be a callable taking the lease, got {on_lost!r}")
    if on_lost is not None and calls_async(on_lost):
        raise TypeError(
            f"on_lost must be a plain callable, not the async def {on_lost!r}: it is called once, "
            "never awaited, so its coroutine would not run. Pass a plain function; for async work, "
            "have it set an asyncio.Event (loop.call_soon_threadsafe) that a task of yours awaits"
        )
    if fail_fast is not None and not isinstance(fail_fast, bool):
        raise TypeError(f"fail_fast must be True, False or None, got {fail_fast!r}")


def confirm_lost_message(name: str, token: int) -> str:
    return (
        f"lease {name!r} expired or was taken over before its token {token} could "
        "be recorded; the token was thrown away. Use a longer ttl if this repeats."
    )


def release_deleted(
    state: LeaseState, *, deleted: bool, resent: bool, first_sent: float, now: float
) -> bool:
    """Whether a release deleted our live lease (``deleted``: the last reply).

    After a lost reply (``resent``), a key gone while the lease was valid both
    when the first attempt was sent and now can only be that attempt's doing.
    """
    if deleted or not resent or state.lost is not None:
        return deleted
    return now < state.valid_until and first_sent < state.valid_until
