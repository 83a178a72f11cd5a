"""The ``sa-fence`` command: a small dispatcher over subcommands.

``sa-fence`` and ``python -m sa_fence`` run the same thing.

``sa-fence demo`` plays the lost-lease double write with two worker
processes (see :mod:`sa_fence.cli.demo`); ``sa-fence check`` and
``sa-fence repair-sequence`` inspect and repair a live database's fencing
set-up (see :mod:`sa_fence.cli.check`); ``sa-fence create-guard`` adds the
guard trigger to a database made without migrations (see
:mod:`sa_fence.cli.create_guard`); ``sa-fence bench`` measures what fencing
costs on the user's servers (see :mod:`sa_fence.cli.bench`).  Each subcommand's module is imported
only when it runs, so ``sa-fence --help`` stays fast.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from .. import __version__
from .redact import redact_text, redact_url

DEMO_PG_ENV = "SA_FENCE_DEMO_PG"
DEMO_REDIS_ENV = "SA_FENCE_DEMO_REDIS"
DEFAULT_DEMO_PG = "postgresql+psycopg://postgres@127.0.0.1:5432"
DEFAULT_DEMO_REDIS = "redis://127.0.0.1:6379/0"
DATABASE_URL_ENV = "SA_FENCE_DATABASE_URL"
#: ``bench`` (and ``demo``, after $SA_FENCE_DEMO_REDIS): the Redis to use
REDIS_URL_ENV = "SA_FENCE_REDIS_URL"
DEFAULT_REDIS = DEFAULT_DEMO_REDIS
#: ``repair-sequence``: tokens to skip past the largest fence
DEFAULT_MARGIN = 1000

Handler = Callable[[argparse.Namespace], int]


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0.1 <= value <= 60:
        raise argparse.ArgumentTypeError(f"must be between 0.1 and 60 seconds, got {text}")
    return value


def _margin(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if not 0 <= value <= 2**62:  # (added to the largest fence, it must stay a bigint)
        raise argparse.ArgumentTypeError(f"must be between 0 and 2**62, got {value}")
    return value


def _name(text: str) -> str:
    """A database name (a table, column, schema or sequence): not empty, no control character."""
    if not text or any(c < " " or c == "\x7f" for c in text):
        raise argparse.ArgumentTypeError(f"must be a non-empty name, got {text!r}")
    return text


def _bounded_int(low: int, high: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be between {low} and {high}, got {value}")
        return value

    return parse


def _bench_pg_url(text: str) -> str:
    """A SQLAlchemy URL of a PostgreSQL database, driven by psycopg 3."""
    from sqlalchemy import make_url

    try:
        url = make_url(text)
    except Exception:  # (ArgumentError; a ValueError for a port that is not a number)
        raise argparse.ArgumentTypeError(
            f"not a database URL: {redact_url(text)!r} "
            "(e.g. postgresql+psycopg://user@host:5432/app)"
        ) from None
    if url.get_backend_name() != "postgresql":
        raise argparse.ArgumentTypeError(
            f"sa-fence needs PostgreSQL, got a {url.get_backend_name()!r} URL"
        )
    if url.drivername == "postgresql":
        url = url.set(drivername="postgresql+psycopg")
    elif url.drivername != "postgresql+psycopg":
        raise argparse.ArgumentTypeError(
            f"driver {url.get_driver_name()!r} is not supported: use postgresql+psycopg://..."
        )
    if not url.database:
        raise argparse.ArgumentTypeError(
            f"the URL names no database: {redact_url(text)!r}; add /DBNAME (the bench "
            "creates and drops its own tables there)"
        )
    return url.render_as_string(hide_password=False)


def _redis_url(text: str) -> str:
    """A Redis URL redis-py can read (checked here: a bad port is a usage error, not a
    traceback out of ``Redis.from_url``)."""
    example = "(e.g. redis://127.0.0.1:6379/0)"
    if not text.startswith(("redis://", "rediss://", "unix://")):
        raise argparse.ArgumentTypeError(f"not a Redis URL: {redact_url(text)!r} {example}")
    from redis.connection import parse_url

    try:
        parse_url(text)  # type: ignore[no-untyped-call]  # (redis-py leaves it untyped)
    except ValueError as exc:  # a port or a query value redis-py cannot read
        raise argparse.ArgumentTypeError(
            f"not a Redis URL: {redact_url(text)!r} ({redact_text(str(exc))}) {example}"
        ) from None
    return text


def _database_url(text: str) -> str:
    """``text`` if SQLAlchemy can read it as a URL, else ValueError (the reason).

    A ``?password=`` query parameter is moved into the URL's own password
    (psycopg is given the same password either way), where every message of
    the tools hides it.
    """
    from sqlalchemy import make_url

    try:
        url = make_url(text)
    except ValueError:  # (SQLAlchemy's int() of the port)
        raise ValueError("has a port that is not a number") from None
    except Exception:  # ArgumentError, or whatever else it raises: a usage error all the same
        raise ValueError("is not a SQLAlchemy URL") from None
    password = url.query.get("password")
    if password is None:
        return text
    if isinstance(password, tuple):  # (given twice: psycopg would be given the last)
        password = password[-1]
    folded = url.difference_update_query(["password"]).set(password=password)
    return folded.render_as_string(hide_password=False)


def _demo(args: argparse.Namespace) -> int:
    from . import demo

    run = demo.run
    if args.side_effects:
        from . import demo_side_effects

        run = demo_side_effects.run
    return run(pg=args.pg, redis_url=args.redis, ttl=args.ttl, fenced=not args.unfenced)


def _check(args: argparse.Namespace) -> int:
    from . import check

    return check.run_check(
        args.url,
        args.sequence,
        args.metadata,
        args.column,
        sys.stdout,
        sys.stderr,
        app_dir=args.app_dir,
        strict=args.strict,
    )


def _repair_sequence(args: argparse.Namespace) -> int:
    from . import check

    return check.run_repair(
        args.url,
        args.sequence,
        args.metadata,
        args.column,
        args.margin,
        args.yes,
        input,
        sys.stdout,
        sys.stderr,
        app_dir=args.app_dir,
        after_failover=args.after_failover,
    )


def _bench(args: argparse.Namespace) -> int:
    from . import bench

    return bench.main(
        args.url, args.redis, rounds=args.rounds, rows=args.rows, progress=not args.quiet
    )


def _status(args: argparse.Namespace) -> int:
    from . import status

    return status.run(
        args.url,
        args.redis,
        args.names,
        sequence=args.sequence,
        key_prefix=args.key_prefix,
        limit=args.limit,
        as_json=args.json,
        out=sys.stdout,
        err=sys.stderr,
    )


def _prune(args: argparse.Namespace) -> int:
    from . import prune

    return prune.run(
        args.url,
        args.redis,
        sequence=args.sequence,
        key_prefix=args.key_prefix,
        older_than=args.older_than,
        longest_lease=args.longest_lease,
        dry_run=args.dry_run,
        out=sys.stdout,
        err=sys.stderr,
    )


def _create_guard(args: argparse.Namespace) -> int:
    from . import create_guard

    return create_guard.run(
        args.url,
        args.tables,
        column=args.column,
        schema=args.schema,
        sequence=args.sequence,
        on_missing_token=args.on_missing_token,
        out=sys.stdout,
        err=sys.stderr,
    )


def _duration(text: str) -> float:
    from .prune import parse_duration

    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


#: The options that take a URL: an error in one is a line of its own, without usage
#: (a URL's problem has nothing to do with how the command line is laid out).
URL_OPTIONS = ("--url", "--pg", "--redis")


class _Parser(argparse.ArgumentParser):
    """argparse's parser, whose errors never show a password: argparse quotes the
    arguments it refuses (``unrecognized arguments: postgresql://u:pw@h/db``)."""

    def error(self, message: str) -> NoReturn:
        message = redact_text(message)
        if not message.startswith(tuple(f"argument {option}:" for option in URL_OPTIONS)):
            self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n")


def _block() -> argparse.ArgumentParser:
    """An empty argparse parent parser: options several subcommands share."""
    return _Parser(add_help=False)


def _url_block(help: str, type: Callable[[str], str] = str) -> argparse.ArgumentParser:
    """``--url``, defaulting to $SA_FENCE_DATABASE_URL.

    Not ``required=`` in argparse: the environment variable satisfies it,
    and ``--help`` must not say it is required.  :func:`main` asks for it
    when neither is given (``needs_url``).
    """
    block = _block()
    block.add_argument(
        "--url",
        metavar="URL",
        type=type,
        default=os.environ.get(DATABASE_URL_ENV),
        help=help.replace(
            f"(default: ${DATABASE_URL_ENV})",
            f"(default: ${DATABASE_URL_ENV}; required when it is not set)",
        ),
    )
    block.set_defaults(needs_url=True)
    return block


@dataclass(frozen=True)
class _Blocks:
    """The option blocks subcommands share, as parent parsers.

    A subcommand lists the ones it takes in ``parents``, in the order its
    ``--help`` shows them, and adds its own options after them.
    """

    url: argparse.ArgumentParser  # --url of the protected database
    sequence: argparse.ArgumentParser  # --sequence
    models: argparse.ArgumentParser  # --metadata, --app-dir, --column (check, repair-sequence)
    redis: argparse.ArgumentParser  # --redis
    key_prefix: argparse.ArgumentParser  # --key-prefix


def _blocks() -> _Blocks:
    from ..db.tokens import DEFAULT_SEQUENCE
    from ..lease.lifecycle import DEFAULT_KEY_PREFIX
    from .status import KEY_PREFIX_ENV

    sequence = _block()
    sequence.add_argument(
        "--sequence",
        metavar="NAME",
        type=_name,
        default=DEFAULT_SEQUENCE,
        help=f"the token sequence, optionally schema-qualified (default: {DEFAULT_SEQUENCE})",
    )
    models = _block()
    models.add_argument(
        "--metadata",
        metavar="MODULE:ATTR",
        help="your models, e.g. myapp.models:Base; fenced tables are taken from them "
        "(default: every table with a COLUMN column or a guard trigger). Imported with "
        "--app-dir first on the import path, as Alembic's prepend_sys_path does",
    )
    models.add_argument(
        "--app-dir",
        metavar="DIR",
        default=".",
        help="the folder --metadata is imported from, put first on the import path "
        "(default: the current folder)",
    )
    models.add_argument(
        "--column",
        metavar="COLUMN",
        type=_name,
        default="fence",
        help="the fence column's name, used without --metadata (default: fence)",
    )
    redis = _block()
    redis.add_argument(
        "--redis",
        metavar="URL",
        type=_redis_url,
        default=os.environ.get(REDIS_URL_ENV, DEFAULT_REDIS),
        help=f"Redis URL (default: ${REDIS_URL_ENV}, else {DEFAULT_REDIS})",
    )
    key_prefix = _block()
    key_prefix.add_argument(
        "--key-prefix",
        metavar="PREFIX",
        default=os.environ.get(KEY_PREFIX_ENV, DEFAULT_KEY_PREFIX),
        help=f"the Fencer's key_prefix (default: ${KEY_PREFIX_ENV}, as the recipes read "
        f"it, else {DEFAULT_KEY_PREFIX})",
    )
    url = _url_block(f"SQLAlchemy URL of the protected database (default: ${DATABASE_URL_ENV})")
    return _Blocks(url, sequence, models, redis, key_prefix)


def build_parser() -> argparse.ArgumentParser:
    """The ``sa-fence`` parser: one ``_<command>_parser`` per subcommand, in --help's order."""
    parser = _Parser(
        prog="sa-fence",
        description="Fencing tokens for SQLAlchemy: a worker whose Redis lease expired "
        "cannot overwrite the newer holder's rows.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    blocks = _blocks()
    _demo_parser(commands, blocks)
    _check_parser(commands, blocks)
    _repair_parser(commands, blocks)
    _bench_parser(commands, blocks)
    _status_parser(commands, blocks)
    _create_guard_parser(commands, blocks)
    _prune_parser(commands, blocks)
    return parser


def _demo_parser(commands: Any, blocks: _Blocks) -> None:
    demo = commands.add_parser(
        "demo",
        help="show a paused worker's late write refused (or, --unfenced, overwriting)",
        description="Two worker processes, one job. Worker A takes the lease with a short "
        "TTL and is frozen with SIGSTOP past it; worker B takes the lease over and writes; "
        "then A resumes and writes too. Fenced, A's write is refused with StaleTokenError; "
        "--unfenced, it silently overwrites B's result. Uses a temporary database and its "
        "own Redis keys, both removed at the end. Exit status: 0 story as expected, "
        "1 story went differently, 2 bad argument, 3 PostgreSQL or Redis unreachable.",
    )
    demo.add_argument(
        "--unfenced",
        action="store_true",
        help="use plain sessions (no sa_fence.install): the lease alone, as most code does",
    )
    demo.add_argument(
        "--side-effects",
        action="store_true",
        help="the same story with an e-mail per worker, enqueued with sa_fence.side_effect() "
        "on procrastinate: A's never leaves, B's leaves once although its first delivery "
        "is killed (needs: pip install 'sa-fence[side-effects]')",
    )
    demo.add_argument(
        "--pg",
        metavar="URL",
        default=os.environ.get(DEMO_PG_ENV, DEFAULT_DEMO_PG),
        help=f"SQLAlchemy URL of the PostgreSQL server; the demo creates and drops its own "
        f"database there (default: ${DEMO_PG_ENV}, else {DEFAULT_DEMO_PG})",
    )
    demo.add_argument(
        "--redis",
        metavar="URL",
        default=os.environ.get(DEMO_REDIS_ENV) or os.environ.get(REDIS_URL_ENV, DEFAULT_REDIS),
        help=f"Redis URL (default: ${DEMO_REDIS_ENV}, else ${REDIS_URL_ENV}, else {DEFAULT_REDIS})",
    )
    demo.add_argument(
        "--ttl",
        metavar="SECONDS",
        type=_seconds,
        default=1.0,
        help="lease TTL; worker A stays stopped past it, until B has taken over (default: 1.0)",
    )
    demo.set_defaults(handler=_demo, parser=demo)


def _check_parser(commands: Any, blocks: _Blocks) -> None:
    check = commands.add_parser(
        "check",
        help="check a live database: token sequence, fenced tables' columns and guards",
        description="Checks that the token sequence exists with CACHE 1 and NO CYCLE, that "
        "every fenced table has its fence column and guard trigger, and that the sequence "
        "is at or past max(fence) of every fenced table. Prints each problem with its fix. "
        "A table with no guard trigger is advice (raw SQL writers go unfenced), a problem "
        "with --strict. Read-only. Exit status: 0 no problems, 1 problems found, "
        "2 bad argument, 3 database unreachable.",
        parents=[blocks.url, blocks.sequence, blocks.models],
    )
    check.add_argument(
        "--strict",
        action="store_true",
        help="count advice (a fenced table with no guard trigger) as problems: exit 1",
    )
    check.set_defaults(handler=_check, parser=check)


def _repair_parser(commands: Any, blocks: _Blocks) -> None:
    repair = commands.add_parser(
        "repair-sequence",
        help="move the token sequence past max(fence) plus a margin (after a restore)",
        description="After a restore from backup or the promotion of a logical replica the "
        "token sequence can be behind the fences on the rows. This moves it to the largest "
        "fence of every fenced table plus --margin (never backwards), after asking. Stop "
        "the workers first. Exit status: 0 moved or nothing to do, 1 aborted, refused or no "
        "sequence, 2 bad argument, 3 database unreachable.",
        parents=[blocks.url, blocks.sequence, blocks.models],
    )
    repair.add_argument(
        "--margin",
        metavar="N",
        type=_margin,
        default=DEFAULT_MARGIN,
        help="tokens to skip past the largest fence, covering tokens handed out but not "
        f"yet written (default: {DEFAULT_MARGIN})",
    )
    repair.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    repair.add_argument(
        "--after-failover",
        action="store_true",
        help="the newest grants may be lost (a promoted asynchronous replica, a point-in-"
        "time or backup restore): also move past the sequence's own last value, and give "
        "every lease name of the register a new token so that no lease granted before can "
        "commit (docs/reliability.md)",
    )
    repair.set_defaults(handler=_repair_sequence, parser=repair)


def _bench_parser(commands: Any, blocks: _Blocks) -> None:
    url = _url_block(
        "SQLAlchemy URL of a PostgreSQL database where the bench may create and drop "
        f"a schema (default: ${DATABASE_URL_ENV})",
        type=_bench_pg_url,
    )
    bench = commands.add_parser(
        "bench",
        help="measure a lease cycle and the fenced-flush overhead on your servers",
        description="Times a lease cycle (acquire with token + release) next to the same "
        "protocol written by hand with raw redis-py and psycopg calls, and a fenced ORM "
        "update + commit of 1 row and of --rows rows next to a plain one, interleaved, "
        "and prints medians and ratios; the fenced sessions run with lease scope on. "
        "Creates a schema sa_fence_bench_<random> (three tables, a token sequence and its "
        "lease register) in the database and keys with that prefix in Redis, and removes "
        "them at the end. Progress goes to stderr. Exit status: 0 done, "
        "2 bad argument, 3 PostgreSQL or Redis unreachable.",
        parents=[url, blocks.redis],
    )
    bench.add_argument(
        "--rounds",
        metavar="N",
        type=_bounded_int(1, 1000),
        default=10,
        help="interleaved rounds per measurement (default: 10)",
    )
    bench.add_argument(
        "--rows",
        metavar="N",
        type=_bounded_int(2, 100_000),
        default=1000,
        help="rows changed by the large flush (default: 1000)",
    )
    bench.add_argument("--quiet", action="store_true", help="no progress on stderr")
    bench.set_defaults(handler=_bench, parser=bench)


def _create_guard_parser(commands: Any, blocks: _Blocks) -> None:
    from ..db.guard import DEFAULT_SEQUENCE, MISSING_TOKEN_POLICIES

    guard = commands.add_parser(
        "create-guard",
        help="create the guard trigger on fenced tables (a database made with create_all)",
        description="Creates (or replaces) the guard trigger sa_fence_guard on each TABLE: "
        "the trigger op.create_fence_guard() makes in a migration, for a database made "
        "with Base.metadata.create_all(). It refuses UPDATEs and DELETEs with a stale "
        "token and any write of a fence no lease was granted, from every writer (raw SQL, "
        "psql, other services). All tables in one transaction: if a table, its bigint "
        "fence column or the token sequence is missing, nothing is created. Exit status: "
        "0 created, 1 nothing created (the message says why), 2 bad argument, "
        "3 database unreachable.",
        parents=[
            blocks.url,
        ],
    )
    guard.add_argument("tables", metavar="TABLE", nargs="+", type=_name, help="fenced tables")
    guard.add_argument(
        "--schema",
        metavar="SCHEMA",
        type=_name,
        help="the tables' schema (default: the search_path)",
    )
    guard.add_argument(
        "--column",
        metavar="COLUMN",
        type=_name,
        default="fence",
        help="the fence column (default: fence)",
    )
    guard.add_argument(
        "--sequence",
        metavar="NAME",
        type=_name,
        default=DEFAULT_SEQUENCE,
        help="the Fencers' token sequence, optionally schema-qualified "
        f"(default: {DEFAULT_SEQUENCE})",
    )
    guard.add_argument(
        "--on-missing-token",
        choices=MISSING_TOKEN_POLICIES,
        default="reject",
        help="reject (default): refuse UPDATEs and DELETEs that present no token; "
        "unchanged: let an UPDATE that leaves the fence as it is through",
    )
    guard.set_defaults(handler=_create_guard, parser=guard)


def _prune_parser(commands: Any, blocks: _Blocks) -> None:
    prune = commands.add_parser(
        "prune",
        help="delete lease register rows of names no one holds, last granted long ago",
        description="Delete the lease register's rows whose name is not held in Redis "
        "and whose newest grant is older than --older-than. Each row is deleted only while "
        "it still holds the token read, so a grant made meanwhile survives. A stale holder "
        "of a pruned name is still refused at commit. --older-than may not be shorter "
        "than --longest-lease. Prints the rows and bytes removed. Exit status: 0 done, "
        "1 no register, 2 bad argument, 3 PostgreSQL or Redis unreachable.",
        parents=[blocks.url, blocks.redis, blocks.key_prefix, blocks.sequence],
    )
    prune.add_argument(
        "--older-than",
        metavar="DURATION",
        type=_duration,
        required=True,
        help="prune names last granted longer ago than this: 90s, 15m, 12h, 30d, 2w",
    )
    prune.add_argument(
        "--longest-lease",
        metavar="DURATION",
        type=_duration,
        required=True,
        help="the longest a lease of yours lasts from its grant to its last commit, "
        "renewals included (a bound only you know); --older-than must be at least this",
    )
    prune.add_argument(
        "--dry-run", action="store_true", help="delete nothing; print what would be removed"
    )
    prune.set_defaults(handler=_prune, parser=prune)


def _status_parser(commands: Any, blocks: _Blocks) -> None:
    from .status import DEFAULT_LIMIT

    status = commands.add_parser(
        "status",
        help="per lease name: the register's token and grant time, and who holds it now",
        description="For each NAME (default: the --limit most recently granted names), "
        "the lease register's newest token and its grant time (PostgreSQL), and whether "
        "the lease is held in Redis now, its TTL left and the token its holder carries. "
        "Owners are shown only as a short hash. Read-only. Exit status: 0 shown, "
        "1 a NAME was never granted and is not held (or there is no register), "
        "2 bad argument, 3 PostgreSQL or Redis unreachable.",
        parents=[blocks.url, blocks.redis, blocks.key_prefix, blocks.sequence],
    )
    status.add_argument("names", metavar="NAME", nargs="*", help="lease names (default: all)")
    status.add_argument(
        "--limit",
        metavar="N",
        type=_bounded_int(1, 100_000),
        default=DEFAULT_LIMIT,
        help=f"names listed without NAME, newest grants first (default: {DEFAULT_LIMIT})",
    )
    status.add_argument("--json", action="store_true", help="print JSON instead of a table")
    status.set_defaults(handler=_status, parser=status)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``sa-fence`` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    if getattr(args, "needs_url", False) and args.url is None:
        args.parser.error(
            f"--url is required when ${DATABASE_URL_ENV} is not set, e.g. "
            "--url postgresql+psycopg://user@host:5432/dbname"
        )
    for option in ("--url", "--pg"):  # the database URLs: bench's is checked by its type
        dest = option[2:]
        if getattr(args, dest, None) is None:
            continue
        try:
            setattr(args, dest, _database_url(getattr(args, dest)))
        except ValueError as exc:
            print(
                f"{args.parser.prog}: error: {option} {redact_url(getattr(args, dest))!r} "
                f"{exc}; expected e.g. postgresql+psycopg://user@host:5432"
                + ("/dbname" if option == "--url" else ""),
                file=sys.stderr,
            )
            return 2
    handler: Handler = args.handler
    try:
        return handler(args)
    except KeyboardInterrupt:
        print("sa-fence: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
