"""Tests that start programs of their own: skip locally when one is missing, fail on CI.

A developer without ``pgbouncer`` or PostgreSQL's server binaries can still run
the rest of the suite; on CI (``CI=true``) a missing program would silently
skip whole suites, so there the test fails and says how to install it.
"""

from __future__ import annotations

import os
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
