"""Tests that start programs of their own: skip locally when one is missing, fail on CI.

A developer without ``pgbouncer`` or PostgreSQL's server binaries can still run
the rest of the suite; on CI (``CI=true``) a missing program would silently
skip whole suites, so there the test fails and says how to install it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import NoReturn

import pytest


def on_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in {"1", "true", "yes"}


def missing(what: str, install_hint: str) -> NoReturn:
    """Skip (or, under ``CI=true``, fail) a test that needs ``what``, saying how to get it."""
    message = f"{what}: {install_hint}"
    if on_ci():
        pytest.fail(f"{message} (CI=true: a missing tool fails the run instead of skipping)")
    pytest.skip(message)


def wait_for(condition: Callable[[], object], timeout: float, what: str) -> None:
    """Poll ``condition`` until it is true; fail naming ``what`` after ``timeout`` seconds.

    For background work (renewals, a worker's progress) a bounded wait on the
    outcome replaces a sleep that races the schedule on a loaded machine.
    """
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} did not happen within {timeout:g} s")
        time.sleep(0.005)
