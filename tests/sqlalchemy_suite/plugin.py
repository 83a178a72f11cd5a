"""pytest plugin for SQLAlchemy's own test suite: ``sa_fence.install(self)`` on every Session.

Loaded with ``-p tests.sqlalchemy_suite.plugin`` by ``python -m
tests.sqlalchemy_suite`` for the fenced run.  Every ``Session`` made while
the suite runs (those of ``sessionmaker``, of ``Session`` subclasses, and the
sync session inside every ``AsyncSession``) gets the fenced-flush hook as a
user's own session would; no lease is bound and no ``Fenced`` class is
mapped, so nothing may change (issue 18).
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
from sqlalchemy.orm import Session

import sa_fence

_plain_init = Session.__init__


@functools.wraps(_plain_init)
def _installing_init(self: Session, *args: Any, **kwargs: Any) -> None:
    _plain_init(self, *args, **kwargs)
    sa_fence.install(self)


def pytest_configure(config: pytest.Config) -> None:
    Session.__init__ = _installing_init  # type: ignore[method-assign]


def pytest_unconfigure(config: pytest.Config) -> None:
    Session.__init__ = _plain_init  # type: ignore[method-assign]


def pytest_report_header(config: pytest.Config) -> str:
    return "sa-fence: sa_fence.install() on every new Session (no lease bound)"
