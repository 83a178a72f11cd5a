"""``python -m tests.sqlalchemy_suite``: see the package docstring.

Options: ``--pg URL`` (server, no database; default ``SA_FENCE_TEST_PG``),
``--cache DIR`` (where the sdist is kept; default ``.venv/sqlalchemy-suite``
or ``SA_FENCE_SQLA_CACHE``), ``--files F ...`` (instead of the default
list; an ``ext/asyncio`` file runs with the async driver), ``--keep-logs``.
Exit status 0 when no outcome differs beyond the allowlist, 1 otherwise, 2
when a run could not be made at all.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import os
import re
import shutil
import ssl
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.parse
import urllib.request
import uuid
from collections.abc import Sequence
from html import unescape
from pathlib import Path

import psycopg
import sqlalchemy as sa

from .compare import (
    Difference,
    Outcome,
    Recorded,
    differences,
    matches,
    node_id,
    read_allowlist,
    read_junit,
    read_recorded,
    to_run_again,
    write_recorded,
)

ROOT = Path(__file__).resolve().parents[2]
ALLOWLIST = Path(__file__).with_name("allowlist.txt")
#: The plain runs recorded, one file per SQLAlchemy version (see compare.py).
RECORDINGS = Path(__file__).with_name("recorded")
DEFAULT_PG = os.environ.get("SA_FENCE_TEST_PG", "postgresql+psycopg://postgres@127.0.0.1:5432")
DEFAULT_CACHE = Path(os.environ.get("SA_FENCE_SQLA_CACHE", ROOT / ".venv" / "sqlalchemy-suite"))

#: The files issue 18 names, then cheap ones on relationships, inheritance,
#: events, scoping, merge, binds and expression properties.
SYNC_FILES = (
    "test/orm/test_unitofwork.py",
    "test/orm/test_unitofworkv2.py",
    "test/orm/test_versioning.py",
    "test/orm/test_cascade.py",
    "test/orm/test_transaction.py",
    "test/orm/test_naturalpks.py",
    "test/orm/dml/test_bulk.py",
    "test/orm/dml/test_bulk_statements.py",
    "test/orm/test_relationships.py",
    "test/orm/inheritance/test_basic.py",
    "test/orm/test_events.py",
    "test/orm/test_scoping.py",
    "test/orm/test_merge.py",
    "test/orm/test_session.py",
    "test/orm/test_bind.py",
    "test/orm/test_deferred.py",
    "test/orm/test_composites.py",
    "test/ext/test_hybrid.py",
    "test/ext/test_associationproxy.py",
)
ASYNC_FILES = (
    "test/ext/asyncio/test_session.py",
    "test/ext/asyncio/test_scoping.py",
)
MODES = ("plain", "fenced")
PLUGIN = "tests.sqlalchemy_suite.plugin"
PER_TEST_TIMEOUT = 300  # seconds; a hang fails that test instead of the whole run


def sdist_tests(cache: Path, version: str) -> Path:
    """The unpacked sdist of SQLAlchemy ``version`` (downloaded once into ``cache``)."""
    root = cache / f"sqlalchemy-{version}"
    if (root / "test" / "conftest.py").is_file():
        return root
    cache.mkdir(parents=True, exist_ok=True)
    archive = cache / f"sqlalchemy-{version}.tar.gz"
    if not archive.is_file():
        print(
            f"sqlalchemy suite: downloading the sdist of SQLAlchemy {version} (once, into {cache})"
        )
        download_sdist(version, archive)
    print(f"sqlalchemy suite: unpacking {archive.name}", flush=True)
    with tempfile.TemporaryDirectory(dir=cache) as unpacking, tarfile.open(archive) as tar:
        tar.extractall(unpacking, filter="data")
        Path(unpacking, f"sqlalchemy-{version}").rename(root)
    return root


def download_sdist(version: str, archive: Path) -> None:
    """The sdist from pip's own package indexes, read as pip reads them, nothing built.

    ``pip download --no-binary`` would prepare the sdist's metadata first, which
    means installing its build requirements (with ``:all:``, building Cython
    from source: minutes); the simple index page gives the file's address and
    hash without that.  When the page cannot be read, ``pip download`` with
    the build requirements as wheels (about half a minute).
    """
    try:
        url, digest = sdist_url(version, archive.name)
        print(f"sqlalchemy suite: fetching {url.split('#', 1)[0]}", flush=True)
        with urllib.request.urlopen(url, context=ssl_context(), timeout=180) as response:
            data = response.read()
        if digest and hashlib.sha256(data).hexdigest() != digest:
            raise ValueError(f"sha256 of {url} differs from the index's")
        partial = archive.with_suffix(".part")
        partial.write_bytes(data)
        partial.rename(archive)
        return
    except (OSError, ValueError, LookupError) as exc:
        print(f"sqlalchemy suite: reading the package index failed ({exc}); pip download instead")
    pip = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary"]
    command = [*pip, "sqlalchemy", f"sqlalchemy=={version}", "--dest", str(archive.parent)]
    subprocess.run(command, check=True)


def pip_config() -> dict[str, str]:
    """pip's settings (``pip config list``): its environment variables win."""
    found: dict[str, str] = {}
    listed = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True
    ).stdout
    for line in sorted(listed.splitlines(), key=lambda line: line.startswith(":env:")):
        section, _, rest = line.partition(".")
        key, _, value = rest.partition("=")
        if section in ("global", "download", ":env:") and value:
            found[key] = value.strip("'\"")
    for key in ("index-url", "extra-index-url", "cert"):
        variable = "PIP_" + key.upper().replace("-", "_")
        if os.environ.get(variable):
            found[key] = os.environ[variable]
    return found


def ssl_context() -> ssl.SSLContext:
    return ssl.create_default_context(cafile=pip_config().get("cert"))


def _pips_default_index() -> str:
    """The index pip uses when none is configured, as pip itself names it (no address is
    written here); a pip without that name: the fallback, pip download, is used instead."""
    try:
        from pip._internal.models.index import PyPI
    except ImportError:
        return ""
    return str(PyPI.simple_url)


def sdist_url(version: str, filename: str) -> tuple[str, str]:
    """The address (and sha256) of ``filename`` on the first of pip's indexes that has it."""
    config = pip_config()
    indexes = [config.get("index-url") or _pips_default_index()]
    indexes += config.get("extra-index-url", "").split()
    for index in filter(None, indexes):
        page = index.rstrip("/") + "/sqlalchemy/"
        request = urllib.request.Request(page, headers={"Accept": "text/html"})
        try:
            with urllib.request.urlopen(request, context=ssl_context(), timeout=60) as response:
                html = response.read().decode("utf-8", "replace")
        except OSError:
            continue
        for href in re.findall(r'href="([^"]+)"', html):
            address = urllib.parse.urljoin(page, unescape(href))
            name = urllib.parse.unquote(urllib.parse.urlsplit(address).path.rsplit("/", 1)[-1])
            if name.lower() == filename.lower():
                fragment = urllib.parse.urlsplit(address).fragment
                digest = fragment.removeprefix("sha256=") if fragment.startswith("sha256=") else ""
                return address, digest
    raise LookupError(f"{filename} on none of {', '.join(indexes)}")


def admin_dsn(server: sa.URL) -> str:
    url = server.set(database="postgres", drivername="postgresql")
    return url.render_as_string(hide_password=False)


def pytest_command(
    sdist: Path, files: Sequence[str], uri: str, junit: Path, mode: str
) -> list[str]:
    command = [sys.executable, "-s", "-m", "pytest", *files, "--dburi", uri]
    # SQLAlchemy's addopts (-v, --maxfail) replaced; its filterwarnings stay.
    command += ["-o", "addopts=", "-q", "-p", "no:cacheprovider", "--junitxml", str(junit)]
    command += ["-o", "junit_family=xunit2", "-o", f"timeout={PER_TEST_TIMEOUT}"]
    if mode == "fenced":
        command += ["-p", PLUGIN]
    return command


def environment() -> dict[str, str]:
    env = dict(os.environ)
    # this repository, for the plugin (and sa_fence when it is not installed)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def run_modes(
    sdist: Path,
    groups: Sequence[tuple[str, Sequence[str]]],
    uris: dict[str, sa.URL],
    logs: Path,
    tag: str,
    modes: Sequence[str] = MODES,
) -> dict[str, dict[str, Outcome]]:
    """Run every group (driver, files) in ``modes``, the modes side by side."""
    outcomes: dict[str, dict[str, Outcome]] = {mode: {} for mode in modes}
    for mode in modes:
        (logs / mode).mkdir(parents=True, exist_ok=True)
    how = " and ".join(modes) + (" side by side" if len(modes) > 1 else " only")
    for n, (driver, files) in enumerate(groups):
        print(
            f"sqlalchemy suite: running {len(files)} file(s) with {driver} "
            f"({tag} {n + 1} of {len(groups)}), {how}",
            flush=True,
        )
        started = time.monotonic()
        running = {}
        for mode in modes:
            junit = logs / mode / f"{tag}{n}.xml"
            uri = uris[mode].set(drivername=driver).render_as_string(hide_password=False)
            log = (logs / mode / f"{tag}{n}.log").open("w")
            command = pytest_command(sdist, files, uri, junit, mode)
            process = subprocess.Popen(
                command, cwd=sdist, env=environment(), stdout=log, stderr=subprocess.STDOUT
            )
            running[mode] = (process, junit, log)
        wait_reporting(
            [(mode, process, Path(log.name)) for mode, (process, _, log) in running.items()],
            started,
        )
        for mode, (process, junit, log) in running.items():
            status = process.wait()
            log.close()
            if status not in (0, 1) or not junit.is_file():  # 1: some tests failed
                tail = Path(log.name).read_text().splitlines()[-30:]
                raise RuntimeError(
                    f"the {mode} run of {' '.join(files)} ended with status {status} "
                    f"(not a test outcome): {' '.join(command_of(process))}\n" + "\n".join(tail)
                )
            outcomes[mode].update(read_junit(junit))
    return outcomes


PROGRESS = re.compile(rb"\[\s*(\d+)%\]")


def wait_reporting(
    processes: Sequence[tuple[str, subprocess.Popen[bytes], Path]], started: float
) -> None:
    """Wait for the runs, saying every 30 s how far each is (pytest's [NN%] in its log)."""
    every = 30.0
    last = {mode: 0 for mode, _, _ in processes}
    while any(process.poll() is None for _, process, _ in processes):
        time.sleep(1)
        if time.monotonic() - started < every:
            continue
        every += 30
        states = []
        for mode, process, log in processes:
            found = PROGRESS.findall(log.read_bytes()[-4000:]) if log.is_file() else []
            last[mode] = int(found[-1]) if found else last[mode]  # none: the summary's lines
            done = "done" if process.poll() is not None else f"{last[mode]}%"
            states.append(f"{mode} {done}")
        elapsed = time.monotonic() - started
        print(f"  still running ({elapsed:.0f} s): {', '.join(states)}", flush=True)
    print(f"  done in {time.monotonic() - started:.0f} s", flush=True)


def command_of(process: subprocess.Popen[bytes]) -> list[str]:
    args = process.args
    return [str(a) for a in args] if isinstance(args, list) else [str(args)]


def groups_for(files: Sequence[str]) -> list[tuple[str, list[str]]]:
    sync = [f for f in files if "ext/asyncio/" not in f]
    asyncio = [f for f in files if "ext/asyncio/" in f]
    groups: list[tuple[str, list[str]]] = []
    if sync:
        groups.append(("postgresql+psycopg", sync))
    if asyncio:
        groups.append(("postgresql+psycopg_async", asyncio))
    return groups


def confirm(
    test_ids: Sequence[str], sdist: Path, uris: dict[str, sa.URL], logs: Path
) -> list[Difference]:
    """Run each of ``test_ids`` again on its own, in both modes; keep what differs."""
    if not test_ids:
        return []
    by_file: dict[str, list[str]] = {}
    for test_id in test_ids:
        node = node_id(test_id, sdist)
        by_file.setdefault(node.split("::", 1)[0], []).append(node)
    groups = [
        (driver, [node for f in files for node in by_file[f]])
        for driver, files in groups_for(list(by_file))
    ]
    again = run_modes(sdist, groups, uris, logs, "again")
    ids = set(test_ids)
    plain = {k: v for k, v in again["plain"].items() if k in ids}
    fenced = {k: v for k, v in again["fenced"].items() if k in ids}
    return differences(plain, fenced)


def allowed(test_id: str, allowlist: dict[str, str]) -> str | None:
    for pattern, why in allowlist.items():
        if matches(pattern, test_id):
            return why
    return None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.sqlalchemy_suite")
    parser.add_argument("--pg", default=DEFAULT_PG, help="SQLAlchemy URL of the server")
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="sdist cache")
    parser.add_argument("--files", nargs="+", help="test files, relative to the sdist")
    parser.add_argument("--keep-logs", action="store_true", help="keep the logs and XML")
    parser.add_argument(
        "--record",
        action="store_true",
        help=f"run the plain mode alone and record its outcomes in {RECORDINGS.name}/",
    )
    parser.add_argument(
        "--side-by-side",
        action="store_true",
        help="run the plain mode too, even where a recording of it exists",
    )
    args = parser.parse_args(argv)
    if args.record and args.files:
        parser.error("--record records the default files only; leave out --files")
    if isinstance(sys.stdout, io.TextIOWrapper):  # each line as it comes, under make and CI too
        sys.stdout.reconfigure(line_buffering=True)
    allowlist = read_allowlist(ALLOWLIST)
    version = sa.__version__
    started = time.monotonic()
    try:
        sdist = sdist_tests(args.cache, version)
    except subprocess.CalledProcessError as exc:
        print(
            f"could not download the sdist of SQLAlchemy {version} with pip ({exc}); the "
            "package index must be reachable, or put sqlalchemy-<version>.tar.gz into "
            f"{args.cache} (or SA_FENCE_SQLA_CACHE) by hand",
            file=sys.stderr,
        )
        return 2
    files = args.files or [*SYNC_FILES, *ASYNC_FILES]
    missing = [f for f in files if not (sdist / f).is_file()]
    if missing:
        print(f"not in the SQLAlchemy {version} sdist: {', '.join(missing)}", file=sys.stderr)
        return 2
    server = sa.make_url(args.pg)
    run_id = uuid.uuid4().hex[:10]
    uris = {mode: server.set(database=f"sa_fence_sqla_{mode}_{run_id}") for mode in MODES}
    logs = Path(tempfile.mkdtemp(prefix="sa-fence-sqlalchemy-suite-"))
    with psycopg.connect(admin_dsn(server), autocommit=True) as conn:
        for uri in uris.values():
            conn.execute(f'CREATE DATABASE "{uri.database}"')
    try:
        for uri in uris.values():  # the schemas SQLAlchemy's README.unittests.rst asks for
            database = uri.set(drivername="postgresql").render_as_string(hide_password=False)
            with psycopg.connect(database, autocommit=True) as conn:
                conn.execute("CREATE SCHEMA test_schema; CREATE SCHEMA test_schema_2")
        print(
            f"SQLAlchemy {version}'s own tests ({len(files)} files), plain and with sa-fence "
            f"installed on every Session; logs and JUnit XML in {logs}"
        )
        recording = RECORDINGS / f"sqlalchemy-{version}.txt"
        if args.record:
            plain = run_modes(sdist, groups_for(files), uris, logs, "run", ("plain",))["plain"]
            write_recorded(recording, plain, recording_header(version, files, uris["plain"]))
            print(f"recorded the plain outcomes of {len(plain)} tests in {recording}")
            shutil.rmtree(logs)
            return 0
        recorded = None if args.side_by_side or args.files else read_recorded(recording)
        outcomes, found, first = run_and_compare(sdist, files, uris, logs, recorded)
    finally:
        with psycopg.connect(admin_dsn(server), autocommit=True) as conn:
            for uri in uris.values():
                conn.execute(f'DROP DATABASE IF EXISTS "{uri.database}" WITH (FORCE)')
    return report(outcomes, found, first, allowlist, time.monotonic() - started, logs, args)


def run_and_compare(
    sdist: Path,
    files: Sequence[str],
    uris: dict[str, sa.URL],
    logs: Path,
    recorded: Recorded | None,
) -> tuple[dict[str, dict[str, Outcome]], list[Difference], int]:
    """Both modes' outcomes, what still differs once run again side by side, and how many
    differed at first.  With a recording, the plain mode runs only where the fenced run
    differs from it (or the recording no longer names the tests collected)."""
    groups = groups_for(files)
    if recorded is None:
        outcomes = run_modes(sdist, groups, uris, logs, "run")
        found = differences(outcomes["plain"], outcomes["fenced"])
        return outcomes, confirm([d.test_id for d in found], sdist, uris, logs), len(found)
    fenced = run_modes(sdist, groups, uris, logs, "run", ("fenced",))["fenced"]
    again = to_run_again(recorded, fenced)
    if again is None:
        print(
            f"sqlalchemy suite: the recorded plain run names {recorded.count} tests, this run "
            f"collected {len(fenced)} others: running the plain mode as well (re-record with "
            "python -m tests.sqlalchemy_suite --record)",
            flush=True,
        )
        plain = run_modes(sdist, groups, uris, logs, "run", ("plain",))["plain"]
        found = differences(plain, fenced)
        outcomes = {"plain": plain, "fenced": fenced}
        return outcomes, confirm([d.test_id for d in found], sdist, uris, logs), len(found)
    print(
        f"sqlalchemy suite: the fenced run against the recorded plain one: {len(again)} "
        "test(s) to run again in both modes",
        flush=True,
    )
    outcomes = {"plain": recorded.outcomes(set(fenced)), "fenced": fenced}
    first = len(differences(outcomes["plain"], fenced))
    return outcomes, confirm(again, sdist, uris, logs), first


def recording_header(version: str, files: Sequence[str], uri: sa.URL) -> str:
    database = uri.set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(database) as conn:
        server = conn.execute("SHOW server_version").fetchone()
    return (
        f"The plain outcomes of SQLAlchemy {version}'s own tests ({len(files)} files), on\n"
        f"PostgreSQL {server[0] if server else '?'} and Python {sys.version.split()[0]}: "
        "`python -m tests.sqlalchemy_suite --record`.\n"
        "make test runs the fenced mode against it, and both modes side by side where they\n"
        "differ (tests/sqlalchemy_suite/compare.py); every test not listed passed."
    )


def report(
    outcomes: dict[str, dict[str, Outcome]],
    found: list[Difference],
    first: int,
    allowlist: dict[str, str],
    elapsed: float,
    logs: Path,
    args: argparse.Namespace,
) -> int:
    for mode in MODES:
        counts: dict[str, int] = {}
        for outcome in outcomes[mode].values():
            counts[outcome.outcome] = counts.get(outcome.outcome, 0) + 1
        summary = ", ".join(f"{n} {kind}" for kind, n in sorted(counts.items()))
        print(f"  {mode:<7} {len(outcomes[mode])} tests: {summary}")
    unexplained = [d for d in found if allowed(d.test_id, allowlist) is None]
    explained = [d for d in found if d not in unexplained]
    if first > len(found):
        print(f"  {first - len(found)} difference(s) did not repeat when run again on their own")
    for pattern, why in allowlist.items():
        hits = [d for d in explained if matches(pattern, d.test_id)]
        if hits:
            print(f"  allowed, {len(hits)} differing: {pattern} ({why})")
        else:
            print(f"  note: allowlist entry {pattern!r} matched no difference in this run")
    print(f"  {elapsed:.0f} s in all")
    if unexplained:
        print(f"\n{len(unexplained)} test(s) whose outcome differs with sa-fence installed:")
        for difference in unexplained:
            print("  " + difference.describe())
        print(f"\nlogs and JUnit XML kept in {logs}")
        return 1
    if not args.keep_logs:
        for path in sorted(logs.rglob("*"), reverse=True):
            path.rmdir() if path.is_dir() else path.unlink()
        logs.rmdir()
    print("no outcome differs beyond the allowlist")
    return 0


if __name__ == "__main__":
    sys.exit(main())
