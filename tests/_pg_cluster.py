"""Private PostgreSQL clusters for crash, failover and chaos tests.

The system cluster is never touched: each :class:`PgCluster` is its own
``initdb`` in a temporary folder owned by the ``postgres`` user (initdb and
postgres refuse to run as root), listening on a free loopback port with its
unix socket in that folder.  Tests crash it (``crash()``: the SIGQUIT that
``pg_ctl stop -m immediate`` sends, sent straight to the postmaster so that
it lands within a millisecond of the caller's last statement), restart it,
and make streaming replicas of it (``pg_basebackup -R``).  Every cluster is
stopped and its folder removed when its ``with`` block ends, even on failure.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
import sqlalchemy as sa

from tests._redis_server import free_port
from tests._tools import missing

PG_USER = "postgres"
START_TIMEOUT = 60


def pg_bin() -> Path | None:
    """The folder of initdb / pg_ctl / postgres (the newest installed), or None."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"))
    if found:
        return Path(found[-1]).parent
    on_path = shutil.which("pg_ctl")
    return Path(on_path).parent if on_path else None


def require_pg_bin() -> Path:
    """The binaries' folder, or skip: these tests need to start their own servers."""
    folder = pg_bin()
    if folder is None or not (folder / "initdb").exists():
        missing(
            "PostgreSQL server binaries (initdb, pg_ctl) are not installed",
            "apt-get install postgresql",
        )
    if os.geteuid() == 0:
        try:
            pwd.getpwnam(PG_USER)
        except KeyError:
            missing(
                "running as root without a 'postgres' user to run the servers as",
                "apt-get install postgresql creates it (or: useradd --system postgres)",
            )
    return folder


def _as_postgres(argv: list[str]) -> list[str]:
    """Run ``argv`` as the postgres user when we are root (initdb refuses root)."""
    if os.geteuid() == 0:
        return ["runuser", "-u", PG_USER, "--", *argv]
    return argv


def _chown_to_postgres(path: Path) -> None:
    if os.geteuid() == 0:
        entry = pwd.getpwnam(PG_USER)
        os.chown(path, entry.pw_uid, entry.pw_gid)


class PgCluster:
    """One private cluster: its folder, port, settings and process."""

    def __init__(self, root: Path, name: str, bindir: Path, port: int) -> None:
        self.root = root
        self.name = name
        self.bindir = bindir
        self.port = port
        self.data = root / name
        self.socket_dir = root / f"{name}.sock"
        self.log = root / f"{name}.log"

    # ------------------------------------------------------------ settings

    def url(self, database: str = "postgres", driver: str = "postgresql+psycopg") -> sa.URL:
        return sa.URL.create(
            driver, username=PG_USER, host="127.0.0.1", port=self.port, database=database
        )

    def dsn(self, database: str = "postgres") -> str:
        return f"host=127.0.0.1 port={self.port} user={PG_USER} dbname={database}"

    def connect(self, database: str = "postgres", **kwargs: Any) -> psycopg.Connection[Any]:
        """A plain autocommit psycopg connection (for set-up and inspection)."""
        kwargs.setdefault("autocommit", True)
        kwargs.setdefault("connect_timeout", 10)
        return psycopg.connect(self.dsn(database), **kwargs)

    def sql(self, statement: str, database: str = "postgres") -> list[tuple[Any, ...]]:
        with self.connect(database) as conn:
            cur = conn.execute(statement)
            return cur.fetchall() if cur.description else []

    def configure(self, **settings: object) -> None:
        """Append settings to postgresql.auto.conf (read at the next start; it
        overrides postgresql.conf, and pg_basebackup -R writes there too)."""
        lines = []
        for key, value in settings.items():
            shown = f"'{value}'" if isinstance(value, str) else str(value).lower()
            lines.append(f"{key} = {shown}\n")
        with open(self.data / "postgresql.auto.conf", "a") as conf:
            conf.writelines(lines)

    # ----------------------------------------------------------- lifecycle

    def initdb(self, **settings: object) -> None:
        self.socket_dir.mkdir()
        _chown_to_postgres(self.socket_dir)
        subprocess.run(
            _as_postgres(
                [
                    str(self.bindir / "initdb"),
                    "-D",
                    str(self.data),
                    "-U",
                    PG_USER,
                    "-A",
                    "trust",
                    "--no-sync",
                    "--no-instructions",
                ]
            ),
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            timeout=120,
        )
        base: dict[str, object] = {
            "listen_addresses": "127.0.0.1",
            "unix_socket_directories": str(self.socket_dir),
            "shared_buffers": "16MB",
            "max_connections": 60,
            "wal_level": "replica",
            "max_wal_senders": 4,
            "hot_standby": True,
            "fsync": True,
            "synchronous_commit": "on",
            "log_min_messages": "warning",
            "log_line_prefix": "%m [%p] ",
        }
        base.update(settings)
        self.configure(port=self.port, **base)
        with open(self.data / "pg_hba.conf", "a") as hba:
            hba.write("host replication all 127.0.0.1/32 trust\n")

    def start(self) -> None:
        subprocess.run(
            _as_postgres(
                [
                    str(self.bindir / "pg_ctl"),
                    "-D",
                    str(self.data),
                    "-l",
                    str(self.log),
                    "-w",
                    "-t",
                    str(START_TIMEOUT),
                    "start",
                ]
            ),
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            timeout=START_TIMEOUT + 30,
        )

    def postmaster_pid(self) -> int | None:
        try:
            first = (self.data / "postmaster.pid").read_text().split("\n", 1)[0]
        except (FileNotFoundError, IndexError):
            return None
        return int(first) if first.strip().isdigit() else None

    def running(self) -> bool:
        pid = self.postmaster_pid()
        return pid is not None and _alive(pid)

    def crash(self) -> None:
        """``pg_ctl stop -m immediate``: SIGQUIT to the postmaster, no checkpoint, no
        WAL flush; the next start runs crash recovery.  Returns once it is gone."""
        pid = self.begin_crash()
        if pid is not None:
            self._wait_gone(pid)

    def begin_crash(self) -> int | None:
        """Send the immediate-shutdown signal and return the postmaster's pid at once
        (for a test that must act between the signal and the end, see
        :func:`wait_for_signal`); :meth:`wait_gone` then waits."""
        pid = self.postmaster_pid()
        if pid is None or not _alive(pid):
            return None
        os.kill(pid, signal.SIGQUIT)
        return pid

    def wait_gone(self, pid: int | None) -> None:
        if pid is not None:
            self._wait_gone(pid)

    def stop(self, mode: str = "fast") -> None:
        if not self.running():
            return
        subprocess.run(
            _as_postgres(
                [str(self.bindir / "pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "stop"]
            ),
            check=False,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=120,
        )
        pid = self.postmaster_pid()
        if pid is not None and _alive(pid):
            self.crash()

    def restart_after_crash(self) -> None:
        self.crash()
        self.start()

    def _wait_gone(self, pid: int, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while _alive(pid):
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                time.sleep(0.2)
                return
            time.sleep(0.005)
        # its children end right after it (immediate shutdown: SIGQUIT to each)
        while any(_alive(p) for p in self.children_pids()):
            if time.monotonic() > deadline:
                break
            time.sleep(0.005)

    def children_pids(self) -> list[int]:
        """Server processes still running on this data folder (their working folder)."""
        found = []
        for entry in os.listdir("/proc"):
            if entry.isdigit() and _cwd_is(int(entry), self.data) and _alive(int(entry)):
                found.append(int(entry))
        return found

    # ------------------------------------------------------------- helpers

    def backend_pids(self, database: str) -> list[int]:
        rows = self.sql(
            "SELECT pid FROM pg_stat_activity WHERE datname = "
            f"'{database}' AND pid <> pg_backend_pid() AND backend_type = 'client backend'"
        )
        return [int(r[0]) for r in rows]

    def create_database(self, name: str) -> sa.URL:
        self.sql(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def promote(self) -> None:
        self.sql("SELECT pg_promote(wait => true, wait_seconds => 60)")


def _signal_mask(pid: int, *fields: str) -> int | None:
    """The union of ``fields`` (``SigPnd:``, ``SigCgt:``, ...) of ``/proc/<pid>/status``,
    or None once the process is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    mask = 0
    for line in status.splitlines():
        if line.startswith(fields):
            mask |= int(line.split()[1], 16)
    return mask


def wait_for_signal(pid: int, signum: int, timeout: float = 30) -> None:
    """Wait until ``signum`` is pending for (stopped) process ``pid``, or it is gone."""
    bit = 1 << (signum - 1)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pending = _signal_mask(pid, "SigPnd:", "ShdPnd:")
        if pending is None or pending & bit:
            return
        time.sleep(0.005)
    raise TimeoutError(f"signal {signum} never became pending for process {pid}")


def wait_until_caught(pid: int, signum: int, timeout: float = 30) -> None:
    """Wait until process ``pid`` has a handler of its own for ``signum`` (its SigCgt mask):
    a signal sent before then meets the default action (SIGTERM: killed, status -15)."""
    bit = 1 << (signum - 1)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        caught = _signal_mask(pid, "SigCgt:")
        if caught is None:
            raise ProcessLookupError(f"process {pid} ended before it handled signal {signum}")
        if caught & bit:
            return
        time.sleep(0.01)
    raise TimeoutError(f"process {pid} never installed a handler for signal {signum}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie is gone for our purposes
    with contextlib.suppress(OSError):
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        if state == "Z":
            return False
    return True


def _cwd_is(pid: int, folder: Path) -> bool:
    try:
        return Path(os.readlink(f"/proc/{pid}/cwd")) == folder
    except OSError:
        return False


@contextmanager
def cluster_root() -> Iterator[Path]:
    """A temporary folder the postgres user owns, removed afterwards."""
    root = Path(tempfile.mkdtemp(prefix="sa_fence_pg_"))
    try:
        _chown_to_postgres(root)
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


@contextmanager
def private_cluster(name: str = "primary", **settings: object) -> Iterator[PgCluster]:
    """A started private cluster; stopped (immediately) and removed on exit."""
    bindir = require_pg_bin()
    with cluster_root() as root:
        cluster = PgCluster(root, name, bindir, free_port())
        try:
            cluster.initdb(**settings)
            cluster.start()
            yield cluster
        finally:
            cluster.stop("immediate")


def make_replica(
    primary: PgCluster, name: str, *, via_port: int | None = None, **settings: object
) -> PgCluster:
    """A streaming replica of ``primary`` in the same root (``pg_basebackup -R``).

    ``via_port``: the replica reaches the primary through this port (a proxy
    the test controls) instead of the primary's own.  Not started.
    """
    replica = PgCluster(primary.root, name, primary.bindir, free_port())
    replica.socket_dir.mkdir()
    _chown_to_postgres(replica.socket_dir)
    subprocess.run(
        _as_postgres(
            [
                str(primary.bindir / "pg_basebackup"),
                "-h",
                "127.0.0.1",
                "-p",
                str(primary.port),
                "-U",
                PG_USER,
                "-D",
                str(replica.data),
                "-R",
                "-X",
                "stream",
                "--checkpoint=fast",  # the default spreads the checkpoint over minutes
                "--no-sync",
            ]
        ),
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        timeout=300,
    )
    conninfo = (
        f"host=127.0.0.1 port={via_port or primary.port} user={PG_USER} application_name={name}"
    )
    replica.configure(
        port=replica.port,
        unix_socket_directories=str(replica.socket_dir),
        primary_conninfo=conninfo,
        wal_receiver_timeout="5s",
        wal_retrieve_retry_interval="200ms",
        **settings,
    )
    return replica
