"""The suite itself: a failing test must not leave later tests stalled behind its locks."""

from __future__ import annotations

import pytest

pytest_plugins = ("pytester",)

# The suite's fixtures, with the autouse teardown that a star import leaves out.
_CONFTEST = """
from tests.conftest import *  # noqa: F403
from tests.conftest import _clean_tables  # noqa: F401
"""

_INNER = """
import sqlalchemy as sa


def test_fails_while_its_session_holds_a_lock(make_session):
    session = make_session()
    session.execute(sa.text("LOCK TABLE jobs IN ACCESS EXCLUSIVE MODE"))
    assert False, "fails before closing its session, as a helper's caller might"


def test_the_next_test_is_not_blocked(engine):
    with engine.begin() as conn:
        conn.execute(sa.text("SET LOCAL lock_timeout = '2s'"))
        conn.execute(sa.text("SELECT count(*) FROM jobs"))
"""


@pytest.mark.slow
def test_a_session_left_open_by_a_failing_test_is_closed_before_the_next_test(
    pytester: pytest.Pytester,
) -> None:
    pytester.makeconftest(_CONFTEST)
    pytester.makepyfile(test_inner=_INNER)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-q")
    result.assert_outcomes(passed=1, failed=1)
