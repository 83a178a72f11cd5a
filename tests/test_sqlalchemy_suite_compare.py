"""How `make sqlalchemy-suite` (tests/sqlalchemy_suite) compares: JUnit XML in, differences out.

The run itself (SQLAlchemy's own tests, plain and with sa-fence installed)
is ``python -m tests.sqlalchemy_suite``, which ``make test`` runs after
pytest; these tests pin how its outcomes are read and compared.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.sqlalchemy_suite import plugin
from tests.sqlalchemy_suite.__main__ import ALLOWLIST, allowed, groups_for
from tests.sqlalchemy_suite.compare import (
    Outcome,
    differences,
    node_id,
    read_allowlist,
    read_junit,
)

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest">
  <testcase classname="test.orm.test_x.SomeTest" name="test_passes" time="0.1"/>
  <testcase classname="test.orm.test_x.SomeTest" name="test_fails" time="0.1">
    <failure message="AttributeError: 'Label' object has no attribute 'info'">trace</failure>
  </testcase>
  <testcase classname="test.orm.test_x.SomeTest" name="test_skipped" time="0.0">
    <skipped type="pytest.skip" message="no such backend">skipped</skipped>
  </testcase>
  <testcase classname="test.orm.test_x.SomeTest" name="test_xfails" time="0.0">
    <skipped type="pytest.xfail" message="known">xfail</skipped>
  </testcase>
  <testcase classname="test.orm.test_x.SomeTest" name="test_teardown" time="0.1"/>
  <testcase classname="test.orm.test_x.SomeTest" name="test_teardown" time="0.1">
    <error message="error at teardown">trace</error>
  </testcase>
  <testcase classname="test.orm.test_x.Other_postgresql+psycopg_15" name="test_p[a-1]"/>
</testsuite></testsuites>
"""


def test_junit_outcomes_are_read_worst_first(tmp_path: Path) -> None:
    path = tmp_path / "run.xml"
    path.write_text(JUNIT)
    found = read_junit(path)
    assert {k.rsplit("::", 1)[1]: v.outcome for k, v in found.items()} == {
        "test_passes": "passed",
        "test_fails": "failed",
        "test_skipped": "skipped",
        "test_xfails": "xfailed",
        "test_teardown": "error",  # the teardown error outranks the pass
        "test_p[a-1]": "passed",
    }
    assert "'Label'" in found["test.orm.test_x.SomeTest::test_fails"].message


def test_an_outcome_that_differs_or_a_test_run_in_one_mode_only_is_a_difference() -> None:
    plain = {"a": Outcome("passed"), "b": Outcome("failed", "x"), "c": Outcome("passed")}
    fenced = {"a": Outcome("passed"), "b": Outcome("failed", "other message"), "d": Outcome("x")}
    found = {d.test_id: (d.plain, d.fenced) for d in differences(plain, fenced)}
    assert found == {"c": (Outcome("passed"), None), "d": (None, Outcome("x"))}
    plain["a"] = Outcome("failed", "AttributeError")
    described = next(d for d in differences(plain, fenced) if d.test_id == "a").describe()
    assert "plain:  failed (AttributeError)" in described
    assert "fenced: passed" in described


def test_a_junit_id_maps_back_to_the_node_id_pytest_takes(tmp_path: Path) -> None:
    (tmp_path / "test" / "orm").mkdir(parents=True)
    (tmp_path / "test" / "orm" / "test_x.py").write_text("")
    assert node_id("test.orm.test_x.SomeTest::test_p[a-1]", tmp_path) == (
        "test/orm/test_x.py::SomeTest::test_p[a-1]"
    )
    assert node_id("test.orm.test_x.Tx_postgresql+psycopg_15_20::test_y", tmp_path) == (
        "test/orm/test_x.py::Tx::test_y"  # collected as Tx; the suffix comes later
    )
    with pytest.raises(ValueError, match="no test file"):
        node_id("test.orm.test_missing.SomeTest::test_y", tmp_path)


def test_every_allowlist_entry_says_why(tmp_path: Path) -> None:
    entries = read_allowlist(ALLOWLIST)
    assert all(why for why in entries.values())
    bad = tmp_path / "allowlist.txt"
    bad.write_text("# comment\ntest.orm.test_x.SomeTest::test_fails\n")
    with pytest.raises(ValueError, match=r"allowlist.txt:2: every allowlist entry"):
        read_allowlist(bad)
    bad.write_text("a::b  # why\na::b  # again\n")
    with pytest.raises(ValueError, match="listed twice"):
        read_allowlist(bad)
    assert allowed("test.orm.X_postgresql+psycopg_15::t", {"test.orm.X_*::t": "mock"}) == "mock"
    assert allowed("test.orm.Y::t", {"test.orm.X_*::t": "mock"}) is None
    assert allowed("m.C::t[True-False]", {"m.C::t[*]": "why"}) == "why"  # brackets are text
    assert allowed("m.C::tx", {"m.C::t[*]": "why"}) is None


def test_the_asyncio_files_run_with_the_async_driver() -> None:
    assert groups_for(["test/orm/test_a.py", "test/ext/asyncio/test_session.py::T::t"]) == [
        ("postgresql+psycopg", ["test/orm/test_a.py"]),
        ("postgresql+psycopg_async", ["test/ext/asyncio/test_session.py::T::t"]),
    ]


def test_the_plugin_installs_sa_fence_on_every_new_session_and_unconfigure_undoes_it(
    pytestconfig: pytest.Config,
) -> None:
    from sqlalchemy.orm import Session

    from sa_fence.orm import flush

    plain_init = Session.__init__
    plugin.pytest_configure(pytestconfig)
    try:
        assert flush.is_installed(Session())
    finally:
        plugin.pytest_unconfigure(pytestconfig)
    assert Session.__init__ is plain_init
    assert not flush.is_installed(Session())
