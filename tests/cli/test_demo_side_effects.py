"""``sa-fence demo --side-effects`` as a user runs it: the console script, in a subprocess.

Fenced, A's e-mail never leaves and B's leaves once although its first
delivery is SIGKILLed; ``--unfenced`` (the pair) shows A's e-mail going out
next to B's.  Each run must leave no database or Redis key behind.
"""

from __future__ import annotations

import subprocess
import sys
from typing import TYPE_CHECKING

import pytest

from tests.cli.test_demo import RUN_TIMEOUT, TTL, _assert_cleaned_up, _demo, _flat
from tests.conftest import PG_SERVER, REDIS_URL

if TYPE_CHECKING:
    import redis
    import sqlalchemy as sa

pytestmark = pytest.mark.slow


def _in_order(out: str, story: list[str]) -> None:
    positions = [out.find(line) for line in story]
    assert -1 not in positions, (story, out)
    assert positions == sorted(positions), out


def test_the_side_effects_demo_sends_only_the_current_holders_mail_once(
    engine: sa.Engine, redis_client: redis.Redis
) -> None:
    run = _demo("--side-effects", "--ttl", TTL, "--pg", PG_SERVER, "--redis", REDIS_URL)
    assert run.returncode == 0, run.stdout + run.stderr
    out = _flat(run.stdout)
    _in_order(
        out,
        [
            "mode FENCED: each worker binds its lease and enqueues with sa_fence.side_effect()",
            "A set result='A' and enqueued its e-mail to a@example.invalid in the same "
            "transaction (job 1, key 'job:1:1:",
            "demo SIGSTOP A",
            "B committed: its row and its e-mail job, together",
            "A commit REFUSED: StaleTokenError",
            "queue jobs committed for the workers: job 2 todo",
            "mail SENT 'job 1 is done (by worker B)' to b@example.invalid (key 'job:1:2:",
            "demo SIGKILL W1 mid-delivery",
            "queue after the kill: job 2 doing",
            "W2 retried the stalled job(s) [2] of the dead worker",
            "mail duplicate of 'job:1:2:",
            "W2 queue drained: job 2 succeeded",
            "mail API 2 delivery attempt(s), 1 e-mail(s) sent: b@example.invalid",
            "verdict OK: A's e-mail (key 'job:1:1:",
        ],
    )
    assert "by worker A" not in out
    assert "DOUBLE E-MAIL" not in out
    assert run.stderr == ""
    _assert_cleaned_up(run.stdout, engine, redis_client)


def test_the_unfenced_side_effects_demo_sends_the_stale_workers_mail_too(
    engine: sa.Engine, redis_client: redis.Redis
) -> None:
    run = _demo(
        "--side-effects", "--unfenced", "--ttl", TTL, "--pg", PG_SERVER, "--redis", REDIS_URL
    )
    assert run.returncode == 0, run.stdout + run.stderr
    out = _flat(run.stdout)
    _in_order(
        out,
        [
            "mode UNFENCED",
            "A committed: its row and its e-mail job (nothing checked the lease)",
            "queue jobs committed for the workers: job 1 todo, job 2 todo",
            "mail SENT 'job 1 is done (by worker A)' to a@example.invalid",
            "mail SENT 'job 1 is done (by worker B)' to b@example.invalid",
            "mail API 3 delivery attempt(s), 2 e-mail(s) sent: a@example.invalid, "
            "b@example.invalid",
            "DOUBLE E-MAIL: the stale worker A's e-mail went out next to B's",
        ],
    )
    assert "REFUSED" not in out
    _assert_cleaned_up(run.stdout, engine, redis_client)


def test_without_procrastinate_the_side_effects_demo_says_what_to_install() -> None:
    code = (
        "import sys; sys.modules['procrastinate'] = None\n"
        "from sa_fence.cli.main import main\n"
        f"sys.exit(main(['demo', '--side-effects', '--pg', {PG_SERVER!r}]))"
    )
    run = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
        check=False,
    )
    assert run.returncode == 2, run.stdout + run.stderr
    assert "pip install 'sa-fence[side-effects]'" in run.stderr
    assert run.stdout == ""
