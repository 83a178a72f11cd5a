"""Private servers for the topology tests, started from the machine's binaries.

Everything here runs on loopback (127.0.0.1) on free ports, in a temporary
directory of its own; every context manager stops what it started (SIGCONT
first, then SIGKILL) and deletes its files, also when the test fails.  The
shared PostgreSQL and Redis of the suite are never stopped, flushed or
reconfigured.

* :func:`redis_cluster`: three cluster-enabled masters joined with
  ``redis-cli --cluster create``.
* :func:`sentinel_topology`: a master, a replica that replicates through a
  :class:`tests._tcp_proxy.TcpProxy` (which the test can hold, so that the replica never
  receives a write), and three Sentinels (``redis-server --sentinel``).
* :func:`tls_redis`: a redis-server on a TLS port, with a CA and a server
  certificate made by the ``openssl`` CLI at test time.
* :func:`pgbouncer`: Debian's PgBouncer in transaction pooling mode in front
  of the suite's PostgreSQL.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import redis

from tests._redis_server import free_port as any_free_port
from tests._tcp_proxy import TcpProxy
from tests._tools import missing

HOST = "127.0.0.1"
#: The minimal ACL rule for sa-fence's Redis user (docs/topologies.md, "Redis
#: ACL"), for the key prefix "sa_fence:"; the tests substitute their own prefix.
MINIMAL_ACL = "-@all +evalsha +script|load +get +set +pexpire +pttl +del ~sa_fence:*"
MASTER_NAME = "sa-fence-master"
#: Sentinel settings the failover tests use (also in docs/topologies.md).
DOWN_AFTER_MS = 1000
FAILOVER_TIMEOUT_MS = 10000


def binary(name: str) -> str:
    found = shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/local/sbin")
    if found is None:
        missing(f"{name} is not installed", "make test installs it (.ci/topology-tools)")
    return found


def free_port(*, bus: bool = False) -> int:
    """A free loopback port; with ``bus``, port + 10000 is free too (the cluster bus)."""
    for _ in range(100):
        port = any_free_port(HOST)  # (this pytest-xdist worker's own)
        if not bus:
            return port
        if port + 10000 < 65536:
            with socket.socket() as s:
                try:
                    s.bind((HOST, port + 10000))
                except OSError:
                    continue
            return port
    raise RuntimeError("no free port pair for a cluster node")


def wait_until(check: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll ``check`` until it is true; fail the test naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if check():
                return
        except (redis.exceptions.RedisError, OSError):
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


@dataclass
class Proc:
    name: str
    proc: subprocess.Popen[bytes]
    port: int

    def kill(self) -> None:
        """SIGCONT then SIGKILL to the process group this test started (runuser's
        child too), and reap it."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGCONT)
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # a child left in the group


@dataclass
class Servers:
    """Processes started in one temporary directory; :meth:`stop` ends them all."""

    dir: Path
    procs: list[Proc] = field(default_factory=list)
    closers: list[Callable[[], None]] = field(default_factory=list)

    def start(self, name: str, port: int, argv: list[str], *, user: str | None = None) -> Proc:
        log = open(self.dir / f"{name}.log", "wb")  # noqa: SIM115  closed with the process
        self.closers.append(log.close)
        if user is not None and os.geteuid() == 0:
            argv = ["runuser", "-u", user, "--", *argv]
        popen = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        proc = Proc(name, popen, port)
        self.procs.append(proc)
        return proc

    def redis(self, name: str, port: int, *extra: str) -> Proc:
        return self.start(
            name,
            port,
            [
                binary("redis-server"),
                "--port",
                str(port),
                "--bind",
                HOST,
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.dir),
                *extra,
            ],
        )

    def log(self, name: str) -> str:
        path = self.dir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.kill()
        for close in reversed(self.closers):
            with contextlib.suppress(Exception):
                close()


@contextmanager
def servers(label: str) -> Iterator[Servers]:
    path = Path(tempfile.mkdtemp(prefix=f"sa_fence_{label}_"))
    path.chmod(0o777)  # PgBouncer runs as the postgres user
    group = Servers(path)
    try:
        yield group
    finally:
        group.stop()
        shutil.rmtree(path, ignore_errors=True)


def ping(port: int, **kwargs: object) -> bool:
    client = redis.Redis(host=HOST, port=port, socket_timeout=0.5, **kwargs)  # type: ignore[arg-type]
    try:
        return bool(client.ping())
    finally:
        client.close()


# ------------------------------------------------------------------ Cluster


@dataclass
class Cluster:
    ports: list[int]
    group: Servers


@contextmanager
def redis_cluster(masters: int = 3) -> Iterator[Cluster]:
    """``masters`` cluster-enabled redis-servers, every slot assigned, cluster_state:ok."""
    with servers("cluster") as group:
        ports = [free_port(bus=True) for _ in range(masters)]
        for port in ports:
            group.redis(
                f"node-{port}",
                port,
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                f"nodes-{port}.conf",
                "--cluster-node-timeout",
                "2000",
            )
        for port in ports:
            wait_until(lambda p=port: ping(p), 10, f"cluster node {port}")  # type: ignore[misc]
        subprocess.run(
            [
                binary("redis-cli"),
                "--cluster",
                "create",
                *(f"{HOST}:{port}" for port in ports),
                "--cluster-replicas",
                "0",
                "--cluster-yes",
            ],
            check=True,
            capture_output=True,
            timeout=60,
        )

        def ready(port: int) -> bool:
            client = redis.Redis(host=HOST, port=port, socket_timeout=0.5, decode_responses=True)
            try:
                info = client.execute_command("CLUSTER INFO")
            finally:
                client.close()
            return bool(info["cluster_state"] == "ok" and info["cluster_slots_ok"] == "16384")

        for port in ports:
            wait_until(lambda p=port: ready(p), 30, f"cluster node {port} to see every slot")  # type: ignore[misc]
        yield Cluster(ports, group)


# ----------------------------------------------------------------- Sentinel


@dataclass
class SentinelTopology:
    master: Proc
    replica: Proc
    sentinel_ports: list[int]
    link: TcpProxy
    group: Servers

    @property
    def sentinels(self) -> list[tuple[str, int]]:
        return [(HOST, port) for port in self.sentinel_ports]

    def master_address(self) -> tuple[str, int]:
        for port in self.sentinel_ports:
            client = redis.Redis(host=HOST, port=port, socket_timeout=0.5, decode_responses=True)
            try:
                host, master_port = client.execute_command(
                    "SENTINEL", "GET-MASTER-ADDR-BY-NAME", MASTER_NAME
                )
                return str(host), int(master_port)
            except redis.exceptions.RedisError:
                continue
            finally:
                client.close()
        raise AssertionError("no Sentinel answered")

    def wait_for_failover(self, timeout: float = 30) -> None:
        """Until every Sentinel names the replica as a healthy master and it is one."""

        def seen_by(port: int) -> bool:
            client = redis.Redis(host=HOST, port=port, socket_timeout=0.5, decode_responses=True)
            try:
                state = client.sentinel_master(MASTER_NAME)
            finally:
                client.close()
            return bool(state["port"] == self.replica.port and state["flags"] == "master")

        def promoted() -> bool:
            if not all(seen_by(port) for port in self.sentinel_ports):
                return False
            client = redis.Redis(host=HOST, port=self.replica.port, socket_timeout=0.5)
            try:
                return client.info("replication")["role"] == "master"
            finally:
                client.close()

        wait_until(promoted, timeout, "the Sentinels to promote the replica")


def _sentinel_conf(path: Path, port: int, master_port: int) -> None:
    path.write_text(
        f"port {port}\n"
        f"bind {HOST}\n"
        f"dir {path.parent}\n"
        f"sentinel monitor {MASTER_NAME} {HOST} {master_port} 2\n"
        f"sentinel down-after-milliseconds {MASTER_NAME} {DOWN_AFTER_MS}\n"
        f"sentinel failover-timeout {MASTER_NAME} {FAILOVER_TIMEOUT_MS}\n"
        f"sentinel parallel-syncs {MASTER_NAME} 1\n"
    )


@contextmanager
def sentinel_topology() -> Iterator[SentinelTopology]:
    """A master, a replica (through a TcpProxy it replicates through) and three Sentinels,
    all in sync."""
    with servers("sentinel") as group:
        master_port, replica_port = free_port(), free_port()
        # no 5 s wait before the replica's first (diskless) sync
        master = group.redis("master", master_port, "--repl-diskless-sync-delay", "0")
        wait_until(lambda: ping(master_port), 10, "the master")
        link = TcpProxy((HOST, master_port), name="replication")
        group.closers.append(link.close)
        replica = group.redis("replica", replica_port, "--replicaof", HOST, str(link.port))

        def in_sync() -> bool:
            client = redis.Redis(host=HOST, port=replica_port, socket_timeout=0.5)
            try:
                return client.info("replication").get("master_link_status") == "up"
            finally:
                client.close()

        wait_until(in_sync, 20, "the replica to sync with the master")
        ports = [free_port() for _ in range(3)]
        for port in ports:
            conf = group.dir / f"sentinel-{port}.conf"
            _sentinel_conf(conf, port, master_port)
            group.start(f"sentinel-{port}", port, [binary("redis-server"), str(conf), "--sentinel"])

        def acquainted(port: int) -> bool:
            client = redis.Redis(host=HOST, port=port, socket_timeout=0.5)
            try:
                others = client.execute_command("SENTINEL", "SENTINELS", MASTER_NAME)
                replicas = client.execute_command("SENTINEL", "REPLICAS", MASTER_NAME)
            finally:
                client.close()
            return len(others) == 2 and len(replicas) == 1

        for port in ports:
            wait_until(
                lambda p=port: acquainted(p),  # type: ignore[misc]
                30,
                f"Sentinel {port} to know the other Sentinels and the replica",
            )
        yield SentinelTopology(master, replica, ports, link, group)


# ---------------------------------------------------------------------- TLS


@dataclass
class TlsFiles:
    ca: Path
    cert: Path
    key: Path


def make_certificates(directory: Path) -> TlsFiles:
    """A CA and a server certificate for 127.0.0.1 / localhost, made by openssl."""
    openssl = binary("openssl")

    def run(*argv: str) -> None:
        subprocess.run([openssl, *argv], check=True, capture_output=True, cwd=directory)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt",
        "-days", "2", "-subj", "/CN=sa-fence test CA")  # fmt: skip
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr",
        "-subj", "/CN=localhost")  # fmt: skip
    (directory / "san.ext").write_text("subjectAltName = IP:127.0.0.1, DNS:localhost\n")
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
        "-CAcreateserial", "-out", "server.crt", "-days", "2", "-extfile", "san.ext")  # fmt: skip
    return TlsFiles(directory / "ca.crt", directory / "server.crt", directory / "server.key")


@dataclass
class TlsRedis:
    port: int
    files: TlsFiles
    group: Servers

    def url(self, db: int = 0) -> str:
        return f"rediss://{HOST}:{self.port}/{db}?ssl_ca_certs={self.files.ca}"


@contextmanager
def tls_redis(*extra: str) -> Iterator[TlsRedis]:
    """A redis-server that speaks only TLS (``--port 0 --tls-port <port>``)."""
    with servers("tls") as group:
        files = make_certificates(group.dir)
        port = free_port()
        group.start(
            "tls-redis",
            port,
            [
                binary("redis-server"),
                "--port",
                "0",
                "--tls-port",
                str(port),
                "--bind",
                HOST,
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(group.dir),
                "--tls-cert-file",
                str(files.cert),
                "--tls-key-file",
                str(files.key),
                "--tls-ca-cert-file",
                str(files.ca),
                "--tls-auth-clients",
                "no",
                *extra,
            ],
        )
        wait_until(
            lambda: ping(port, ssl=True, ssl_ca_certs=str(files.ca)), 10, "the TLS redis-server"
        )
        yield TlsRedis(port, files, group)


# ---------------------------------------------------------------- PgBouncer

#: The pgbouncer.ini the PgBouncer tests use (docs/topologies.md shows it).
PGBOUNCER_INI = """\
[databases]
* = host={pg_host} port={pg_port}

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {port}
unix_socket_dir =
auth_type = trust
auth_file = {dir}/userlist.txt
pool_mode = transaction
default_pool_size = 2
max_client_conn = 100
logfile = {dir}/pgbouncer.log
pidfile = {dir}/pgbouncer.pid
"""


@dataclass
class PgBouncer:
    port: int
    group: Servers


@contextmanager
def pgbouncer(pg_host: str, pg_port: int, users: list[str]) -> Iterator[PgBouncer]:
    """PgBouncer in transaction pooling mode on a free loopback port."""
    executable = binary("pgbouncer")
    with servers("pgbouncer") as group:
        port = free_port()
        ini = group.dir / "pgbouncer.ini"
        ini.write_text(PGBOUNCER_INI.format(pg_host=pg_host, pg_port=pg_port, port=port,
                                            dir=group.dir))  # fmt: skip
        (group.dir / "userlist.txt").write_text("".join(f'"{u}" ""\n' for u in users))
        for path in group.dir.iterdir():
            path.chmod(0o666)
        group.start("pgbouncer-run", port, [executable, str(ini)], user="postgres")

        def listening() -> bool:
            with socket.create_connection((HOST, port), timeout=0.5):
                return True

        try:
            wait_until(listening, 10, "PgBouncer")
        except AssertionError:
            raise AssertionError(group.log("pgbouncer") + group.log("pgbouncer-run")) from None
        yield PgBouncer(port, group)
