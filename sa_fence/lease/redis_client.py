"""What a Redis client will do, read from its settings, and what its failures mean.

How long one call of a (sync or asyncio) redis-py client can last, the failure
budget a Fencer may promise with it, where a plain client connects and what the
server there speaks (the TLS probe), and the error a failed call becomes.
"""

from __future__ import annotations

import math
import socket
import ssl
from typing import Any

import redis as redis_lib

from .. import _failures
from ..errors import FenceError, FencingConfigError, LeaseBackendError

#: Everything a Redis client raises for a failed call (cluster routing errors
#: such as SlotNotCoveredError are not RedisErrors).
REDIS_ERRORS = (redis_lib.exceptions.RedisError, redis_lib.exceptions.RedisClusterException)


def connection_kwargs(client: object) -> dict[str, Any] | None:
    """A (sync or asyncio) Redis or RedisCluster client's connection settings, or None."""
    nodes = getattr(client, "nodes_manager", None)
    pool = nodes if nodes is not None else getattr(client, "connection_pool", None)
    kwargs = getattr(pool, "connection_kwargs", None)
    return kwargs if isinstance(kwargs, dict) else None


def has_no_socket_timeout(client: object) -> bool:
    """Whether the client waits for a reply without bound (its ``socket_timeout`` is None)."""
    kwargs = connection_kwargs(client)
    return kwargs is not None and kwargs.get("socket_timeout") is None


#: How long redis-py's cluster clients pause after CLUSTERDOWN before they refresh their slot map.
_CLUSTER_DOWN_PAUSE = 0.25


def _client_retry(client: object, kwargs: dict[str, Any]) -> Any:
    """The client's own ``Retry`` (a cluster client's, or its connections'), or None."""
    if getattr(client, "nodes_manager", None) is not None:
        return getattr(client, "retry", None)
    return kwargs.get("retry")


def client_retries(client: object) -> int:
    """How many times the (sync or asyncio) client retries one call itself (0: unknown)."""
    kwargs = connection_kwargs(client)
    retry = None if kwargs is None else _client_retry(client, kwargs)
    retries = retry.get_retries() if retry is not None else 0
    return retries if isinstance(retries, int) and retries > 0 else 0


def client_call_bound(
    client: object, *, retries: int | None = None
) -> tuple[float | None, str] | None:
    """The longest one call of a plain, Sentinel or cluster client can last (None: unbounded),
    and how; None when it cannot be read (a custom class).  ``retries``: as if the client
    retried that many times itself (``Retry(NoBackoff(), 0)``: 0), not as it does.

    A plain client connects with up to ``retries`` retries, each after a backoff wait, then waits
    for the reply, and on a failure does it all again up to ``retries`` times.  A cluster client
    makes up to ``retries`` more attempts after a backoff wait each (redis-py 8.2+); one that
    meets CLUSTERDOWN pauses and refreshes its slot map (a second round trip).
    """
    kwargs = connection_kwargs(client)
    if kwargs is None:
        return None
    nodes = getattr(client, "nodes_manager", None)
    read = kwargs.get("socket_timeout")
    connect = kwargs.get("socket_connect_timeout") or read
    retry = _client_retry(client, kwargs)
    backoff = getattr(retry, "_backoff", None)
    cap = 0.0 if backoff is None else getattr(backoff, "_cap", getattr(backoff, "_backoff", None))
    if retries is None:
        retries = retry.get_retries() if retry is not None else 0
    else:
        cap = 0.0  # NoBackoff()
    per_down = f", a {_CLUSTER_DOWN_PAUSE} s pause and a slot-map refresh per CLUSTERDOWN"
    how = f"socket_timeout={read}, socket_connect_timeout={connect}, {retries} retries of its own"
    how += f" with waits of up to {cap} s" + ("" if nodes is None else per_down)
    if read is None or connect is None or retries < 0:
        return None, how
    if not isinstance(cap, int | float):
        return None
    if nodes is not None:
        attempt = 2 * (float(connect) + float(read)) + _CLUSTER_DOWN_PAUSE
        return (retries + 1) * attempt + retries * float(cap), how
    connecting = (retries + 1) * float(connect) + retries * float(cap)
    return connecting + float(read) + retries * (connecting + float(read) + float(cap)), how


_MAX_BUDGET = (2**31 - 1) // 1000  # s: PostgreSQL's lock_timeout is an int of milliseconds
_TIMEOUTS_DOC = "docs/topologies.md#timeouts."


def check_budget(client: object, timeout: float | None, owner: str) -> float:
    """The failure budget for ``owner`` (a Fencer): ``timeout`` or the default.

    An explicit budget that one call of the client could outlast is refused:
    a call in progress cannot be cut short, so the budget would be a promise
    broken exactly when it matters (a Redis that stopped answering holds each
    call for the client's ``socket_timeout``, once per retry of its own).  The
    default is not checked: it bounds sa-fence's own resends (see the Fencer's
    docstring).  The refusal names both ways out, with numbers: the client's
    socket timeouts that keep this budget, or the budget that keeps this client.
    """
    if timeout is None:
        return _failures.DEFAULT_BACKEND_TIMEOUT
    if isinstance(timeout, bool) or not isinstance(timeout, int | float):
        raise TypeError(
            f"timeout must be a number of seconds, got {type(timeout).__name__}: {timeout!r}"
        )
    if not math.isfinite(timeout) or timeout <= 0 or timeout > _MAX_BUDGET:
        raise ValueError(
            f"timeout must be a finite number of seconds > 0 and <= {_MAX_BUDGET}, got "
            f"{timeout!r}: it is how long an operation may spend on a failing Redis or "
            "PostgreSQL before it gives up (and the grant's lock_timeout, in milliseconds)"
        )
    budget = float(timeout)
    found = client_call_bound(client)  # (None, how) too without a socket timeout
    if found and (found[0] is None or found[0] > budget):
        raise FencingConfigError(_budget_refusal(client, timeout, owner, found))
    return budget


def _budget_refusal(
    client: object, timeout: float, owner: str, found: tuple[float | None, str]
) -> str:
    """Why ``owner(timeout=)`` cannot keep its budget with ``client``, and the two fixes:
    the client's numbers that keep the budget, or the budget that keeps the client's."""
    bound, how = found
    budget = float(timeout)
    longest = "unbounded" if bound is None else f"up to {bound:.3g} s"
    cluster = getattr(client, "nodes_manager", None) is not None  # 2 round trips, a pause
    each = max((budget - _CLUSTER_DOWN_PAUSE) / 5 if cluster else budget / 3, 0.01)
    module = "redis.asyncio" if type(client).__module__.startswith("redis.asyncio") else "redis"
    no_retry = f"retry={module}.retry.Retry(NoBackoff(), 0)"
    kwargs = connection_kwargs(client) or {}
    read = kwargs.get("socket_timeout")
    connect = kwargs.get("socket_connect_timeout") or read
    text = (
        f"{owner}(timeout={timeout!r}) cannot keep its budget: one call of this Redis "
        f"client can last {longest} ({how}), and a call in progress cannot be cut short. "
        f"To keep timeout={timeout!r}, create the client with socket timeouts well below it "
        "and no retries of its own (sa-fence resends what is safe to resend, within the "
        f"budget): {module}.{'RedisCluster' if cluster else 'Redis'}(..., socket_timeout="
        f"{each:.3g}, socket_connect_timeout={each:.3g}, {no_retry})."
    )
    plain = client_call_bound(client, retries=0)  # one connect and one reply wait
    if read is None:
        return text + " A client without a socket_timeout keeps no budget. See " + _TIMEOUTS_DOC
    if plain is None or plain[0] is None or plain[0] > _MAX_BUDGET:
        return text + " See " + _TIMEOUTS_DOC
    fit = f"{math.ceil(plain[0] * 100) / 100:g}"  # its longest call without its retries
    as_is = None  # the budget that keeps the client as it is
    if bound is not None and bound != plain[0] and bound <= _MAX_BUDGET:
        as_is = f"timeout={math.ceil(bound * 100) / 100:g}"
    if plain[0] <= budget:  # its own retries alone outlast the budget
        text += (
            f" Or keep its socket timeouts and give it only {no_retry}: its longest call is "
            f"then {fit} s, within timeout={timeout!r}"
            + ("." if as_is is None else f" (or keep its retries and raise the budget to {as_is}).")
        )
    else:
        text += (
            f" To keep socket_timeout={read} (socket_connect_timeout={connect}), give the "
            f"client {no_retry} and raise the budget to timeout={fit} (its longest call"
            + (")." if as_is is None else f"; {as_is} with its retries as they are).")
        )
    return text + " See " + _TIMEOUTS_DOC


def probe_target(client: object) -> tuple[str, int, bool] | None:
    """(host, port, tls) of a plain (non-Sentinel, non-Cluster) client, else None."""
    pool = getattr(client, "connection_pool", None)
    kwargs = getattr(pool, "connection_kwargs", None)
    if not isinstance(kwargs, dict) or "Sentinel" in type(pool).__name__:
        return None
    host, port = kwargs.get("host"), kwargs.get("port", 6379)
    if not isinstance(host, str) or not isinstance(port, int):
        return None  # a Unix socket: no TLS to disagree about
    tls = "SSL" in getattr(getattr(pool, "connection_class", None), "__name__", "")
    return host, port, tls


def probe_speaks(host: str, port: int, timeout: float = 0.5) -> str | None:
    """What the server on ``host:port`` speaks: "plain" (RESP), "tls", or None (no answer): a plain
    Redis answers ``PING`` in RESP, a TLS port closes the connection or answers with a TLS alert."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.sendall(b"PING\r\n")
            data = sock.recv(16)
    except ConnectionResetError:  # a TLS port (Redis resets), or a proxy cut off from Redis
        return "tls" if _answers_tls(host, port, timeout) else None
    except OSError:
        return None
    if data[:1] in (b"\x15", b"\x16"):
        return "tls"
    if not data:
        return "tls" if _answers_tls(host, port, timeout) else None
    if data[:1] in (b"+", b"-"):
        return "plain"
    return None


def _answers_tls(host: str, port: int, timeout: float) -> bool:
    """Whether the server answers a TLS handshake (even with an alert: a client certificate
    wanted): told apart from a connection merely reset or closed, which a proxy or load
    balancer whose Redis is gone does as a TLS port does to plain bytes."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    try:
        with (
            socket.create_connection((host, port), timeout=timeout) as raw,
            context.wrap_socket(raw, server_hostname=host),
        ):
            return True
    except ssl.SSLError as exc:  # a TLS alert: the server speaks TLS (a plain server's text
        return "ALERT" in str(exc.reason or "")  # is WRONG_VERSION_NUMBER; EOF: no record)
    except OSError:
        return False


def redis_error(
    name: str,
    operation: str,
    exc: BaseException,
    attempts: int,
    *,
    target: tuple[str, int, bool] | None = None,
    speaks: str | None = None,
    took: float | None = None,
    client_retries: int = 0,
) -> FenceError:
    """The error to raise for a Redis call that failed for good: ``attempts`` sends by
    sa-fence over ``took`` seconds, each retried up to ``client_retries`` times by the client."""
    failure = _failures.classify_redis(exc, speaks=speaks, tls=bool(target and target[2]))
    if failure.kind == _failures.SETUP:
        where = f" at {target[0]}:{target[1]}" if target else ""
        return FencingConfigError(
            f"{operation} of lease {name!r} failed{where}: {failure.text}", cause=exc
        )
    return LeaseBackendError(
        backend="redis",
        operation=operation,
        name=name,
        cause=exc,
        detail=_failures.outage_detail(
            "Redis", failure, attempts, took=took, client_retries=client_retries
        ),
    )
