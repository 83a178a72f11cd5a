"""How `make sqlalchemy-suite` (tests/sqlalchemy_suite) compares: JUnit XML in, differences out.

The run itself (SQLAlchemy's own tests, plain and with sa-fence installed)
is ``python -m tests.sqlalchemy_suite``, which ``make test`` runs after
pytest; these tests pin how its outcomes are read and compared.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.sqlalchemy_suite import plugin
from tests.sqlalchemy_suite.__main__ import ALLOWLIST, RECORDINGS, allowed, groups_for
from tests.sqlalchemy_suite.compare import (
    Outcome,
    Recorded,
    differences,
    ids_digest,
    node_id,
    read_allowlist,
    read_junit,
    read_recorded,
    to_run_again,
    write_recorded,
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


def _recorded(tmp_path: Path, plain: dict[str, Outcome]) -> Recorded:
    path = tmp_path / "recorded" / "sqlalchemy-2.1.9.txt"
    write_recorded(path, plain, "how it was recorded\non two lines")
    recorded = read_recorded(path)
    assert recorded is not None
    return recorded


def test_a_recorded_plain_run_keeps_the_count_the_ids_and_what_did_not_pass(
    tmp_path: Path,
) -> None:
    plain = {"a": Outcome("passed"), "b": Outcome("skipped", "no backend"), "c": Outcome("failed")}
    recorded = _recorded(tmp_path, plain)
    text = (tmp_path / "recorded" / "sqlalchemy-2.1.9.txt").read_text().splitlines()
    assert text[:2] == ["# how it was recorded", "# on two lines"]
    assert text[3:] == ["skipped b", "failed c"]  # a test that passed is only counted
    assert (recorded.count, recorded.digest) == (3, ids_digest({"a", "b", "c"}))
    assert recorded.outcomes({"a", "b", "c"}) == {
        "a": Outcome("passed"),
        "b": Outcome("skipped"),
        "c": Outcome("failed"),
    }
    assert read_recorded(tmp_path / "none.txt") is None
    bad = tmp_path / "bad.txt"
    bad.write_text("tests 1 abc\nbroken a::b\n")
    with pytest.raises(ValueError, match=r"bad\.txt:2: not a recorded outcome"):
        read_recorded(bad)


def test_against_a_recording_only_what_differs_or_failed_in_it_runs_again(
    tmp_path: Path,
) -> None:
    recorded = _recorded(
        tmp_path,
        {
            "a": Outcome("passed"),
            "b": Outcome("skipped"),
            "c": Outcome("failed"),
            "d": Outcome("passed"),
        },
    )
    same = {
        "a": Outcome("passed"),
        "b": Outcome("skipped"),
        "c": Outcome("failed"),
        "d": Outcome("passed"),
    }
    # c failed in the recorded plain run: were sa-fence to break it as well, the two
    # outcomes would agree, so it runs again side by side all the same
    assert to_run_again(recorded, same) == ["c"]
    broken = {**same, "d": Outcome("failed", "sa-fence broke it")}
    assert to_run_again(recorded, broken) == ["c", "d"]


def test_a_recording_that_names_other_tests_is_not_trusted(tmp_path: Path) -> None:
    recorded = _recorded(tmp_path, {"a": Outcome("passed"), "b": Outcome("passed")})
    assert to_run_again(recorded, {"a": Outcome("passed")}) is None  # b was not collected
    renamed = {"a": Outcome("passed"), "b2": Outcome("passed")}  # as many, other ids
    assert to_run_again(recorded, renamed) is None


def test_each_recording_is_of_a_version_the_constraints_pin() -> None:
    """A recording is kept for the pinned and the lowest SQLAlchemy (make test runs
    both); one for a version no longer pinned is stale and goes."""
    root = RECORDINGS.parent.parent.parent
    pinned = {
        line.split("==", 1)[1].split(";")[0].strip()
        for name in ("constraints/test.txt", "constraints/floors.txt")
        for line in (root / name).read_text().splitlines()
        if line.lower().startswith("sqlalchemy==")
    }
    recorded = {
        p.name.removeprefix("sqlalchemy-").removesuffix(".txt") for p in RECORDINGS.glob("*.txt")
    }
    assert recorded == pinned
