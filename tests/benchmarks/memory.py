"""Memory: resident set size after 1k lease cycles and after 100k.

A lease cycle is ``Fencer.acquire()`` + ``Lease.release()`` against the real
servers.  RSS is read from ``/proc/self/statm`` (Linux; elsewhere the peak
RSS from ``resource.getrusage``), after a ``gc.collect()``.  Growth beyond
5 MB between the two readings misses the target: something per lease would
be kept (a listener, a renewer entry, a cached statement per token...).
"""

from __future__ import annotations

import gc
import os
import resource
import sys
import time
from dataclasses import dataclass

import sa_fence
from sa_fence.cli.bench import Progress

from .common import Config, Target

TARGET_MB = 5.0
BASELINE_CYCLES = 1_000


def rss_bytes() -> int:
    gc.collect()
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # not Linux: peak RSS (KiB on Linux, bytes on macOS)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024


@dataclass
class MemoryResult:
    baseline_cycles: int
    cycles: int
    rss_baseline: int
    rss_after: int
    seconds: float

    @property
    def growth_mb(self) -> float:
        return (self.rss_after - self.rss_baseline) / 1e6


def run(fencer: sa_fence.Fencer, config: Config, progress: Progress) -> MemoryResult:
    total = 200 if config.quick else config.memory_cycles
    baseline = min(BASELINE_CYCLES, total // 2) if config.quick else BASELINE_CYCLES
    steps = 20
    progress.start(f"memory: {total:,} lease cycles", steps)
    for _ in range(baseline):
        fencer.acquire("memory", 30).release()
    rss_baseline = rss_bytes()
    started = time.perf_counter()
    done = baseline
    for step in range(1, steps + 1):
        until = baseline + (total - baseline) * step // steps
        while done < until:
            fencer.acquire("memory", 30).release()
            done += 1
        progress.step()
    seconds = time.perf_counter() - started
    progress.finish()
    return MemoryResult(baseline, total, rss_baseline, rss_bytes(), seconds)


def report(result: MemoryResult) -> list[Target]:
    rate = (result.cycles - result.baseline_cycles) / result.seconds
    print(
        f"\nmemory: RSS {result.rss_baseline / 1e6:.1f} MB after {result.baseline_cycles:,} "
        f"lease cycles, {result.rss_after / 1e6:.1f} MB after {result.cycles:,} "
        f"(growth {result.growth_mb:+.2f} MB; {rate:,.0f} cycles/s)"
    )
    return [Target(f"RSS growth, {result.cycles:,} cycles", result.growth_mb, TARGET_MB, "MB")]
