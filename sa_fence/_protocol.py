"""Sans-I/O part of the lease protocol: scripts, argument checks, value formats.

Everything here is pure: no Redis, no PostgreSQL.  The sync front end
(:mod:`sa_fence._lease`) drives it today; an asyncio front end can drive the
same functions and scripts without copying them.

The protocol (DESIGN.md, invariant I3)::

    1. SET <key> <owner> NX PX <ttl>          Redis: grant the lease
    2. nextval(<sequence>) in its own         PostgreSQL: take the token
       committed transaction
    3. CONFIRM: if GET <key> == <owner>       Redis: record the token in the
       then SET <key> <owner>:<token> KEEPTTL  lease and prove it is still ours
       else fail and throw the token away

A token is therefore only ever handed to a holder whose lease was still live
*after* the token was drawn, so token order follows grant order.
"""

from __future__ import annotations

import math
import secrets

# Every script touches exactly one key (KEYS[1]) so it runs unchanged on
# Redis Cluster.  Each compares the stored value with the exact value this
# lease wrote, so it never acts on another owner's lease.

# CONFIRM: record the token in the lease and confirm the lease is still ours.
# KEYS[1] lease key; ARGV[1] the value SET NX stored (the owner);
# ARGV[2] the new value ("<owner>:<token>").
# Returns the lease's remaining PTTL in ms (>= 0), or -1 if it is not ours.
CONFIRM_SCRIPT = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[2], 'KEEPTTL')
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
