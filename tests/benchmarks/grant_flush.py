"""The grant with and without its WAL flush (docs/benchmarks.md, "The grant's WAL flush").

``python -m tests.benchmarks.grant_flush [--rounds N] [--cycles N]``

On a private PostgreSQL cluster (tests/_pg_cluster.py: its WAL is the
benchmark's alone, since a grant skips the flush only when the WAL is
flushed up to its draw) and the development Redis (``SA_FENCE_TEST_REDIS``
or redis://127.0.0.1:6379/0, keys under a unique prefix): the grant
statement alone and a lease cycle (acquire + release), each with
``TokenSource.skip_flush`` on and off, interleaved round by round.  Two
patterns: a holder's commit between cycles (untimed: it flushes the WAL, as
a holder's work does) and cycles back to back.  Prints the median of the
rounds' medians and the share of grants that skipped the flush.  Not a test.
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import statistics
import time
from collections.abc import Callable

import psycopg
import redis
import sqlalchemy as sa

import sa_fence
from tests._pg_cluster import private_cluster
from tests.models import SEQUENCE, Base


def measure(
    fencer: sa_fence.Fencer, op: Callable[[], object], between: Callable[[], object] | None, n: int
) -> tuple[float, float]:
    """Median time of ``op`` (us) over ``n`` calls and the share that skipped the flush."""
    times, skipped = [], 0
    for _ in range(n):
        started = time.perf_counter()
        op()
        times.append(time.perf_counter() - started)
        skipped += fencer._tokens.last_flushed is False
        if between is not None:
            between()
    return statistics.median(times) * 1e6, skipped / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--cycles", type=int, default=200, help="ops per round and setting")
    args = parser.parse_args()
    logging.disable(logging.WARNING)  # the unbound-release notice
    client = redis.Redis.from_url(os.environ.get("SA_FENCE_TEST_REDIS", "redis://127.0.0.1:6379/0"))
    prefix = f"sa-fence-grant-flush-{secrets.token_hex(4)}:"
    with private_cluster("grant_flush") as pg:
        pg.create_database("bench")
        engine = sa.create_engine(pg.url("bench"))
        Base.metadata.create_all(engine)
        fencer = sa_fence.Fencer(client, engine, sequence=SEQUENCE, key_prefix=prefix)
        writer = psycopg.connect(pg.dsn("bench"), autocommit=True)

        def holder_commit() -> None:
            writer.execute("UPDATE sa_fence_leases SET granted_at = granted_at WHERE name = 'b'")

        ops: dict[str, Callable[[], object]] = {
            "grant statement": lambda: fencer._tokens.next_token("b"),
            "lease cycle": lambda: fencer.acquire("b", 30).release(),
        }
        results: dict[tuple[str, str, bool], list[tuple[float, float]]] = {}
        try:
            fencer.check()
            for _ in range(args.rounds):
                for op_name, op in ops.items():
                    for pattern, between in (
                        ("holder commit between", holder_commit),
                        ("back to back", None),
                    ):
                        for skip in (True, False):
                            fencer._tokens.skip_flush = skip
                            results.setdefault((op_name, pattern, skip), []).append(
                                measure(fencer, op, between, args.cycles)
                            )
        finally:
            writer.close()
            fencer.close()
            engine.dispose()
            for key in client.scan_iter(match=prefix + "*"):
                client.delete(key)
    print(f"{'op':<17}{'pattern':<23}{'skip_flush':<12}{'median us':>10}{'skipped':>9}")
    for (op_name, pattern, skip), rows in results.items():
        median = statistics.median(t for t, _ in rows)
        share = statistics.mean(s for _, s in rows)
        print(f"{op_name:<17}{pattern:<23}{skip!s:<12}{median:>10.0f}{share:>9.2f}")


if __name__ == "__main__":
    main()
