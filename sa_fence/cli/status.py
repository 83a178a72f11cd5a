"""``sa-fence status [NAME...]``: who holds which lease, since when, with which token.

Two sources, read side by side:

* the lease register in PostgreSQL (``sa_fence_leases``): per name, the
  newest token granted and when; it is what every commit is checked against,
  and it outlives the lease (a Redis-only lock forgets a holder the moment
  its key expires);
* Redis: whether the lease is held right now, its TTL left, and the token the
  holder recorded in it.  The owner value (the holder's secret: whoever knows
  it can release or extend the lease) is never shown; a short hash of it tells
  holders apart.

Beside them, which transactions hold a register row now (a grant of that name waits for
them, then fails): the backend's pid, state and transaction start, or the prepared
transaction's gid (sa_fence.db.blockers).

Read-only.  Exit status: 0 shown; 1 a NAME given is neither in the register
nor held in Redis, or the register does not exist; 2 bad argument;
3 PostgreSQL or Redis unreachable.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any, TextIO

import redis as redis_lib
import sqlalchemy as sa

from .._failures import cause_text
from ..db import blockers as _blockers
from ..db.fitness import register_problems
from ..db.register import Register, pinned_register
from ..lease import protocol as proto
from .check import EXIT_FINDINGS, EXIT_OK, EXIT_UNREACHABLE, with_connection
from .redact import redact_url

#: Where the applications' key_prefix is read from (the ``--key-prefix`` default).
KEY_PREFIX_ENV = "SA_FENCE_KEY_PREFIX"

#: Rows listed when no NAME is given (newest grants first).
DEFAULT_LIMIT = 50
#: Broken register rules (sa_fence.db.fitness) that leave no register to read.
UNREADABLE = {"missing", "shape"}

HELD = "held"  # in Redis, with the register's token
GRANTING = "granting"  # in Redis, its token not recorded yet (an acquire under way)
HELD_OTHER = "held-other-token"  # in Redis, with a token the register no longer has
FREE = "free"  # not in Redis
UNKNOWN = "unknown"  # neither in the register nor in Redis


@dataclass
class LeaseStatus:
    name: str
    #: the register's newest token for the name, when it was granted, the one before
    token: int | None
    granted_at: str | None  # ISO 8601, UTC
    previous: int | None
    state: str
    #: seconds of TTL left in Redis (None: not held)
    ttl: float | None
    #: the token the Redis lease carries (None: not held, or not recorded yet)
    holder_token: int | None
    #: the first 8 hex digits of SHA-256 of the owner value (never the value)
    holder: str | None
    #: the transactions holding the name's register row now (a grant waits for them)
    blocked_by: list[_blockers.Blocker] = field(default_factory=list)


def owner_hash(owner: str) -> str:
    """A short, one-way tag of an owner value: tells holders apart, reveals nothing."""
    return hashlib.sha256(owner.encode()).hexdigest()[:8]


def _register_rows(
    conn: sa.Connection, register: Register, names: Sequence[str], limit: int
) -> dict[str, tuple[int, datetime, int | None]] | None:
    """name -> (token, granted_at, previous); None when there is no register."""
    exists = conn.execute(
        sa.text("SELECT to_regclass(:register) IS NOT NULL"), {"register": register.table_sql}
    ).scalar_one()
    if not exists:
        return None
    columns = f"SELECT name, token, granted_at, previous FROM {register.table_sql}"
    if names:
        rows = conn.execute(sa.text(f"{columns} WHERE name = ANY(:names)"), {"names": list(names)})
    else:
        rows = conn.execute(
            sa.text(f"{columns} ORDER BY granted_at DESC, name LIMIT :limit"), {"limit": limit}
        )
    return {row.name: (int(row.token), row.granted_at, row.previous) for row in rows}


def _redis_state(
    client: redis_lib.Redis, key_prefix: str, names: Sequence[str]
) -> list[tuple[bytes | None, int]]:
    """(stored value, PTTL in ms) of each lease key, in one round trip."""
    pipe = client.pipeline(transaction=False)
    for name in names:
        pipe.get(key_prefix + name)
        pipe.pttl(key_prefix + name)
    replies = pipe.execute()
    return [(replies[i], int(replies[i + 1])) for i in range(0, len(replies), 2)]


def statuses(
    conn: sa.Connection,
    client: redis_lib.Redis,
    *,
    names: Sequence[str],
    sequence: str,
    key_prefix: str,
    limit: int = DEFAULT_LIMIT,
) -> list[LeaseStatus] | None:
    """The status of ``names`` (or of the ``limit`` newest grants); None: no register."""
    # schema-qualified: a temporary table or another schema cannot stand in
    rows = _register_rows(conn, pinned_register(conn, sequence), names, limit)
    if rows is None:
        return None
    listed = list(names) if names else list(rows)
    found = []
    for name, (value, pttl) in zip(listed, _redis_state(client, key_prefix, listed), strict=True):
        token, granted, previous = rows.get(name, (None, None, None))
        holder = holder_token = ttl = None
        if value is None:
            state = FREE if token is not None else UNKNOWN
        else:
            text = value.decode("utf-8", "replace")
            holder_token = proto.token_from_value(text)
            owner = text.rpartition(":")[0] if holder_token is not None else text
            holder = owner_hash(owner)
            ttl = pttl / 1000 if pttl >= 0 else None
            if holder_token is None:
                state = GRANTING
            elif holder_token == token:
                state = HELD
            else:
                state = HELD_OTHER
        found.append(
            LeaseStatus(
                name=name,
                token=token,
                granted_at=None if granted is None else granted.astimezone(UTC).isoformat(),
                previous=previous,
                state=state,
                ttl=ttl,
                holder_token=holder_token,
                holder=holder,
            )
        )
    return found


def _age(iso: str | None, now: datetime) -> str:
    if iso is None:
        return "-"
    seconds = max(0.0, (now - datetime.fromisoformat(iso)).total_seconds())
    if seconds < 120:
        return f"{seconds:.0f} s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min ago"
    if seconds < 172800:
        return f"{seconds / 3600:.0f} h ago"
    return f"{seconds / 86400:.0f} d ago"


def render(found: Sequence[LeaseStatus], out: TextIO) -> None:
    now = datetime.now(UTC)
    header = ("NAME", "TOKEN", "GRANTED (UTC)", "", "STATE", "TTL LEFT", "HOLDER")
    rows = [header]
    for s in found:
        holder = "-"
        if s.holder is not None:
            holder = f"owner#{s.holder}" + (
                f" token {s.holder_token}" if s.holder_token is not None else ""
            )
        rows.append(
            (
                s.name,
                "-" if s.token is None else str(s.token),
                "-" if s.granted_at is None else s.granted_at[:19].replace("T", " "),
                _age(s.granted_at, now),
                s.state,
                "-" if s.ttl is None else f"{s.ttl:.1f} s",
                holder,
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip(), file=out)


#: SCAN calls (COUNT :data:`SCAN_COUNT` each) spent looking for keys under a
#: prefix, or for the registered names under another: bounded, so a large
#: Redis costs little.
SCAN_CALLS = 20
SCAN_COUNT = 1000
_GLOB_SPECIAL = re.compile(r"([*?\[\]\\])")
#: A value sa-fence stores in a lease key: the owner (``proto.new_owner()``, 32 hex
#: digits), then ``:token`` once the token is recorded (``proto.confirmed_value``).
_LEASE_VALUE = re.compile(rb"[0-9a-f]{32}(?::[0-9]+)?")


def _scan(client: redis_lib.Redis, pattern: str) -> Iterator[list[bytes]]:
    """The keys matching glob ``pattern``, a SCAN call's batch at a time, for at most
    :data:`SCAN_CALLS` calls (finding nothing proves nothing)."""
    cursor = 0
    for _ in range(SCAN_CALLS):
        cursor, keys = client.scan(cursor=cursor, match=pattern, count=SCAN_COUNT)
        yield [key if isinstance(key, bytes) else key.encode() for key in keys]  # (decoded)
        if cursor == 0:
            return


def _glob(text: str) -> str:
    return _GLOB_SPECIAL.sub(r"\\\1", text)


def prefix_in_use(client: redis_lib.Redis, key_prefix: str) -> bool:
    """Whether Redis holds any key under ``key_prefix`` (a bounded SCAN)."""
    return any(keys for keys in _scan(client, _glob(key_prefix) + "*"))


def other_prefixes(client: redis_lib.Redis, key_prefix: str, name: str) -> list[str]:
    """Prefixes other than ``key_prefix`` under which Redis holds an sa-fence lease
    value for ``name`` (a bounded SCAN: an empty list proves nothing)."""
    raw = name.encode()
    keys = [
        key
        for batch in _scan(client, "*" + _glob(name))
        for key in batch
        if key.endswith(raw) and len(key) > len(raw) and key[: -len(raw)] != key_prefix.encode()
    ][:100]
    values = client.mget(keys) if keys else []  # (None for a key of another type)
    return sorted(
        {
            key[: -len(raw)].decode("utf-8", "replace")
            for key, value in zip(keys, values, strict=True)
            if value is not None
            and _LEASE_VALUE.fullmatch(value if isinstance(value, bytes) else value.encode())
        }
    )


def no_keys_hint(
    client: redis_lib.Redis, key_prefix: str, registered: Sequence[LeaseStatus]
) -> str | None:
    """What to say when no name the register holds has a key under ``key_prefix``:
    nothing, the normal state of leases not held now, unless the prefix looks
    mistyped (no key under it at all) and Redis holds an sa-fence lease of the
    newest name under another prefix; then that prefix."""
    try:
        if prefix_in_use(client, key_prefix):
            return None
        prefixes = other_prefixes(client, key_prefix, registered[0].name)
    except redis_lib.RedisError:
        return None
    if not prefixes:
        return None
    return (
        f"sa-fence status: note: Redis holds no key under the prefix {key_prefix!r} for "
        f"any of the {len(registered)} name(s) the register holds, nor any other key under "
        f"it, so each shows as free; {registered[0].name!r} has a key under: "
        + ", ".join(f"--key-prefix {p!r}" for p in prefixes[:5])
        + ". If that lease is your application's, its Fencer uses that key_prefix: pass "
        f"--key-prefix, or set ${KEY_PREFIX_ENV} as the recipes read it."
    )


def run(
    url: str,
    redis_url: str,
    names: Sequence[str],
    *,
    sequence: str,
    key_prefix: str,
    limit: int,
    as_json: bool,
    out: TextIO,
    err: TextIO,
) -> int:
    """The ``sa-fence status`` command; returns the exit status (see the module)."""
    for name in names:
        try:
            proto.check_name(name)
        except ValueError as exc:
            print(f"sa-fence status: {exc}", file=err)
            return 2
    try:
        client = redis_lib.Redis.from_url(redis_url, socket_timeout=5, socket_connect_timeout=5)
    except ValueError as exc:
        print(f"sa-fence status: --redis {redact_url(redis_url)}: {exc}", file=err)
        return 2
    result: dict[str, Any] = {}
    try:
        status = with_connection(
            url,
            None,
            err,
            lambda conn, _: _read(
                conn,
                client,
                names,
                result,
                sequence=sequence,
                key_prefix=key_prefix,
                limit=limit,
                redis_url=redis_url,
                err=err,
            ),
            command="sa-fence status",
        )
    finally:
        client.close()
    if status != EXIT_OK:
        return status
    status = _show(result["found"], result.get("hint"), as_json=as_json, out=out, err=err)
    if not as_json:
        render_blockers(result["blockers"], out)
    return status


def _read(
    conn: sa.Connection,
    client: redis_lib.Redis,
    names: Sequence[str],
    result: dict[str, Any],
    *,
    sequence: str,
    key_prefix: str,
    limit: int,
    redis_url: str,
    err: TextIO,
) -> int:
    """Read the statuses into ``result`` (``found``, and ``hint`` when all look free).

    Returns the exit status; problems go to ``err``."""
    # the register's rules, as Fencer.check() and sa-fence check read them
    problems = register_problems(conn, Register(sequence), pinned_register(conn, sequence))
    for problem in problems:
        print(f"sa-fence status: {problem.sentence()}", file=err)
    if any(p.rule in UNREADABLE for p in problems):
        print(
            "sa-fence status: no lease register to read; run `sa-fence check` to see "
            "the set-up, or pass --sequence",
            file=err,
        )
        return EXIT_FINDINGS
    try:
        found = statuses(
            conn, client, names=names, sequence=sequence, key_prefix=key_prefix, limit=limit
        )
    except redis_lib.RedisError as exc:
        print(
            f"sa-fence status: cannot read Redis at {redact_url(redis_url)}: {cause_text(exc)}",
            file=err,
        )
        return EXIT_UNREACHABLE
    if found is None:
        register = Register(sequence)
        print(
            f"sa-fence status: there is no lease register {register.table_display} for "
            f"sequence {sequence!r} in this database; run `sa-fence check` to see the "
            "set-up, or pass --sequence",
            file=err,
        )
        return EXIT_FINDINGS
    result["found"] = found
    result["blockers"] = held_rows(conn, sequence, names, found, err)
    registered = [s for s in found if s.token is not None]
    if registered and all(s.state == FREE for s in registered):
        result["hint"] = no_keys_hint(client, key_prefix, registered)
    return EXIT_OK


def held_rows(
    conn: sa.Connection,
    sequence: str,
    names: Sequence[str],
    found: Sequence[LeaseStatus],
    err: TextIO,
) -> list[_blockers.Blocker]:
    """The transactions holding register rows (of ``names``; of every name when none is
    given), each also noted on its name's status in ``found``; best effort."""
    try:
        with conn.begin_nested():
            table = pinned_register(conn, sequence).table_sql
            blockers = _blockers.find(conn, table, names or None)
    except sa.exc.SQLAlchemyError as exc:
        print(
            "sa-fence status: note: could not tell which transactions hold register rows: "
            + cause_text(exc),
            file=err,
        )
        return []
    listed = {s.name: s for s in found}
    for blocker in blockers:
        if blocker.name in listed:
            listed[blocker.name].blocked_by.append(blocker)
    return blockers


def render_blockers(blockers: Sequence[_blockers.Blocker], out: TextIO) -> None:
    """The section of register rows held now, one line per holding transaction."""
    if blockers:
        print(
            "\nregister rows held by a transaction (a grant of the name waits for it, then "
            "fails; see docs/lease-scope.md):",
            file=out,
        )
    for blocker in blockers:
        print(f"  {blocker.name}: {blocker}", file=out)


def _show(
    found: list[LeaseStatus], hint: str | None, *, as_json: bool, out: TextIO, err: TextIO
) -> int:
    """Print ``found`` (a table or JSON) and ``hint``; exit 1 for names never granted."""
    if as_json:
        json.dump([asdict(s) for s in found], out, indent=2)
        print(file=out)
    elif found:
        render(found, out)
    else:
        print("no lease has been granted yet", file=out)
    if hint:
        print(hint, file=err)
    unknown = [s.name for s in found if s.state == UNKNOWN]
    if unknown:
        print(
            f"sa-fence status: never granted and not held: {', '.join(map(repr, unknown))}",
            file=err,
        )
        return EXIT_FINDINGS
    return EXIT_OK
