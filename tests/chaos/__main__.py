"""``python -m tests.chaos`` (``make chaos``): a fenced run and the same run unfenced.

Prints, for each: operations by outcome, faults by kind, anomalies, and
availability per fault kind.  Exit status 0 when the fenced run has no
anomaly and the unfenced run has some (the checker sees what it must);
1 otherwise.  ``--mode row-fence-only`` runs the fenced workers with lease
scope off (the row fence alone), which must show anomalies too.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path

from tests.chaos.nemesis import DEFAULT_FAULTS
from tests.chaos.run import ChaosConfig, chaos_environment, run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.chaos", description=__doc__)
    parser.add_argument("--ops", type=int, default=10_000, help="operations per run")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=240.0, help="time bound per run")
    parser.add_argument("--ttl", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=int(time.time()) % 100_000)
    parser.add_argument("--fault-interval", type=float, default=1.0)
    parser.add_argument(
        "--faults", default=",".join(DEFAULT_FAULTS), help="comma-separated fault kinds"
    )
    parser.add_argument(
        "--mode",
        choices=["both", "fenced", "unfenced", "row-fence-only"],
        default="both",
        help="both: fenced, then unfenced; row-fence-only: fenced with lease scope off",
    )
    parser.add_argument(
        "--unfenced-ops", type=int, default=None, help="operations of the unfenced run"
    )
    parser.add_argument(
        "--history",
        type=Path,
        default=None,
        help="keep each run's history here (attempts, faults, commits in commit order, "
        "anomalies; JSON lines)",
    )
    args = parser.parse_args(argv)
    # SIGTERM (a CI timeout, kill) ends the run through the finally blocks, so
    # the private servers are stopped and their folders removed.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    config = ChaosConfig(
        workers=args.workers,
        ops=args.ops,
        max_seconds=args.seconds,
        rows=args.rows,
        ttl=args.ttl,
        seed=args.seed,
        fault_interval=args.fault_interval,
        faults=tuple(k for k in args.faults.split(",") if k),
    )
    status = 0

    def progress(message: str) -> None:
        print(f"... {message}", file=sys.stderr, flush=True)

    with chaos_environment() as env:
        if args.mode == "row-fence-only":
            result = run(env, replace(config, lease_scope=False), progress=progress)
            print(result.report(), flush=True)
            if args.history:
                print(f"  history: {result.save(args.history)}")
            return 0 if result.anomalies else 1
        if args.mode in ("both", "fenced"):
            result = run(env, config, progress=progress)
            print(result.report(), flush=True)
            if args.history:
                print(f"  history: {result.save(args.history)}")
            if result.anomalies:
                status = 1
        if args.mode in ("both", "unfenced"):
            unfenced = replace(config, fenced=False, ops=args.unfenced_ops or config.ops)
            result = run(env, unfenced, progress=progress)
            print(result.report(), flush=True)
            if args.history:
                print(f"  history: {result.save(args.history)}")
            if not result.anomalies:
                print("  (expected anomalies here: the checker missed them)")
                status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
