"""``sa-fence prune``: the command over :meth:`sa_fence.Fencer.prune` (``sa_fence.db.prune``)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, TextIO

import redis as redis_lib

from .._failures import cause_text
from ..db.prune import UNITS, PruneResult, check_ages, format_duration, prune_on, redis_held
from .check import EXIT_FINDINGS, EXIT_OK, EXIT_UNREACHABLE, EXIT_USAGE, with_connection
from .redact import redact_url

if TYPE_CHECKING:
    import sqlalchemy as sa

__all__ = ["describe", "parse_duration", "run", "would_go"]


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")


def parse_duration(text: str) -> float:
    """``"90"`` / ``"90s"``, ``"15m"``, ``"12h"``, ``"30d"``, ``"2w"`` -> seconds."""
    match = _DURATION.match(text.lower())
    if match is None:
        raise ValueError(
            f"not a duration: {text!r}; use a number with a unit: 90s, 15m, 12h, 30d, 2w "
            "(no unit: seconds)"
        )
    number, unit = match.groups()
    return float(number) * UNITS[unit or "s"]


def describe(result: PruneResult) -> str:
    """One line for people: what was (or would be) removed and what was kept."""
    verb = "would remove" if result.dry_run else "removed"
    kept = [f"{result.held} held in Redis now"]
    if result.regranted:
        kept.append(f"{result.regranted} granted again while pruning")
    return (
        f"{verb} {result.rows} register row(s), {result.bytes} bytes of row data; kept "
        + " and ".join(kept)
        + " (old enough, but not removed)"
    )


def would_go(result: PruneResult) -> list[str]:
    """A dry run's names, one a line, and how many more it did not list."""
    lines = [f"  {name}" for name in result.names]
    if result.rows > len(result.names):
        lines.append(f"  ... and {result.rows - len(result.names)} more")
    return lines


def run(
    url: str,
    redis_url: str,
    *,
    sequence: str,
    key_prefix: str,
    older_than: float,
    longest_lease: float,
    dry_run: bool,
    out: TextIO,
    err: TextIO,
) -> int:
    """The ``sa-fence prune`` command; returns the exit status (0 done, 1 no
    register, 2 bad argument, 3 PostgreSQL or Redis unreachable)."""
    try:
        age = check_ages(older_than, longest_lease)
    except ValueError as exc:
        print(
            f"sa-fence prune: {exc}".replace("older_than", "--older-than").replace(
                "longest_lease", "--longest-lease"
            ),
            file=err,
        )
        return EXIT_USAGE
    try:
        client = redis_lib.Redis.from_url(redis_url, socket_timeout=5, socket_connect_timeout=5)
    except ValueError as exc:
        print(f"sa-fence prune: --redis {redact_url(redis_url)}: {exc}", file=err)
        return EXIT_USAGE

    def body(conn: sa.Connection, _: Any) -> int:
        try:
            result = prune_on(conn, redis_held(client, key_prefix), sequence, age, dry_run=dry_run)
        except LookupError as exc:
            print(f"sa-fence prune: {exc}", file=err)
            return EXIT_FINDINGS
        except redis_lib.RedisError as exc:
            print(
                f"sa-fence prune: cannot read Redis at {redact_url(redis_url)}: "
                f"{cause_text(exc)}; what was removed before stays removed",
                file=err,
            )
            return EXIT_UNREACHABLE
        print(
            f"sa-fence prune: rows granted more than {format_duration(age)} ago, not held: "
            + describe(result),
            file=out,
        )
        for line in would_go(result):
            print(line, file=out)
        return EXIT_OK

    try:
        return with_connection(url, None, err, body, command="sa-fence prune")
    finally:
        client.close()
