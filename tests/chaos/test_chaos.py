"""The chaos harness, short: every fault kind once, fenced; then unfenced, caught.

(``make chaos`` runs the long version: python -m tests.chaos.)
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest

from tests._tools import missing
from tests.chaos.nemesis import DEFAULT_FAULTS
from tests.chaos.run import ChaosConfig, ChaosEnv, chaos_environment, run

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def env() -> Iterator[ChaosEnv]:
    if shutil.which("redis-server") is None:
        missing("redis-server is not on PATH", "apt-get install redis-server")
    with chaos_environment() as environment:
        yield environment


def test_fenced_workers_through_every_fault_kind_show_no_anomaly(env: ChaosEnv) -> None:
    config = ChaosConfig(
        workers=3,
        ops=100_000,  # bounded by the faults, the commits and the time instead
        max_seconds=150,  # a bound for a loaded machine; a fast one ends in about 15 s
        fault_interval=0.4,
        fault_cycles=1,
        min_ok=100,  # enough work to mean something, however slow the machine
        seed=11,
    )
    result = run(env, config)
    print(result.report())
    assert {fault.kind for fault in result.faults} >= set(DEFAULT_FAULTS)
    assert result.nemesis_errors == []
    assert result.anomalies == []
    outcomes = result.outcomes()
    assert outcomes["ok"] >= 100
    assert result.check.committed_uows  # the commit stream was read


def test_the_same_workers_unfenced_are_caught_by_the_checker(env: ChaosEnv) -> None:
    """The pair: plain sessions (the token still written to the row, uncompared),
    workers frozen past their TTL and leases flushed away, the same checker."""
    config = ChaosConfig(
        workers=3,
        ops=100_000,
        max_seconds=25,
        fenced=False,
        faults=("pause", "redis-flush"),
        fault_interval=0.5,
        fault_cycles=4,
        seed=11,
    )
    result = run(env, config)
    print(result.report())
    found = result.check.by_kind()
    assert found["stale-commit"] > 0
    assert found["lost-update"] + found["fence-went-down"] > 0
