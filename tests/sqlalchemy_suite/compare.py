"""Outcomes from JUnit XML, the allowlist, and what differs between two runs."""

from __future__ import annotations

import hashlib
import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

#: Worst first: a test case reporting several of these takes the first.
OUTCOMES = ("error", "failed", "xfailed", "skipped", "passed")


@dataclass(frozen=True)
class Outcome:
    outcome: str
    message: str = ""


def read_junit(path: Path) -> dict[str, Outcome]:
    """``{test id: outcome}`` from a pytest ``--junitxml`` file.

    The id is ``classname::name`` as pytest writes them (``test.orm.
    test_unitofwork.SomeTest::test_x``); see :func:`node_id` for the id
    pytest takes on its command line.
    """
    found: dict[str, Outcome] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        test_id = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome = Outcome("passed")
        for child in case:
            kind = {"error": "error", "failure": "failed", "skipped": "skipped"}.get(child.tag)
            if kind == "skipped" and child.get("type") == "pytest.xfail":
                kind = "xfailed"
            if kind is None:
                continue
            message = (child.get("message") or child.text or "").strip().splitlines()
            candidate = Outcome(kind, message[0][:300] if message else "")
            if OUTCOMES.index(candidate.outcome) < OUTCOMES.index(outcome.outcome):
                outcome = candidate
        previous = found.get(test_id)
        if previous is None or OUTCOMES.index(outcome.outcome) < OUTCOMES.index(previous.outcome):
            found[test_id] = outcome  # a teardown error is reported as a second case
    return found


#: The suffix SQLAlchemy's plugin gives a ``__backend__`` test class per database
#: (``SessionTransactionTest_postgresql+psycopg_15_20``) after collection.
BACKEND_SUFFIX = re.compile(r"_[A-Za-z0-9]+\+[A-Za-z0-9_]+$")


def node_id(test_id: str, root: Path) -> str:
    """The pytest node id (``test/orm/test_x.py::Cls::test_y``) of a JUnit test id.

    A backend class is selected by the name it was collected under, without
    the database suffix its JUnit id carries.
    """
    classname, _, name = test_id.partition("::")
    parts = classname.split(".")
    for cut in range(len(parts), 0, -1):
        module = Path(*parts[:cut]).with_suffix(".py")
        if (root / module).is_file():
            classes = [BACKEND_SUFFIX.sub("", c) for c in parts[cut:]]
            return "::".join([module.as_posix(), *classes, name])
    raise ValueError(f"no test file under {root} for {test_id!r}")


@dataclass(frozen=True)
class Difference:
    test_id: str
    plain: Outcome | None  # None: not run in that mode
    fenced: Outcome | None

    def describe(self) -> str:
        def one(o: Outcome | None) -> str:
            if o is None:
                return "not run"
            return o.outcome + (f" ({o.message})" if o.message and o.outcome != "passed" else "")

        return f"{self.test_id}\n    plain:  {one(self.plain)}\n    fenced: {one(self.fenced)}"


def differences(plain: dict[str, Outcome], fenced: dict[str, Outcome]) -> list[Difference]:
    """Tests whose outcome (not message) differs, or that ran in one mode only."""
    found = []
    for test_id in sorted(plain.keys() | fenced.keys()):
        a, b = plain.get(test_id), fenced.get(test_id)
        if a is None or b is None or a.outcome != b.outcome:
            found.append(Difference(test_id, a, b))
    return found


def matches(pattern: str, test_id: str) -> bool:
    """Whether ``test_id`` matches an allowlist ``pattern``, where only ``*`` is special
    (test ids carry brackets: ``test_x[True-False]``)."""
    regex = ".*".join(re.escape(part) for part in pattern.split("*"))
    return re.fullmatch(regex, test_id) is not None


def read_allowlist(path: Path) -> dict[str, str]:
    """``{test id: why}``; every entry must say why (``<test id>  # <reason>``)."""
    entries: dict[str, str] = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        test_id, _, why = text.partition("#")
        test_id, why = test_id.strip(), why.strip()
        if not why or not test_id:
            raise ValueError(
                f"{path}:{number}: every allowlist entry is '<test id>  # <why its outcome "
                f"may differ>'; got {text!r}"
            )
        if test_id in entries:
            raise ValueError(f"{path}:{number}: {test_id!r} is listed twice")
        entries[test_id] = why
    return entries


# ------------------------------------------------------------ recorded plain runs
#
# The plain run's outcomes depend on SQLAlchemy's version, the server and this machine
# kind, never on sa-fence: `make test` reads them from a file recorded once per SQLAlchemy
# version (`python -m tests.sqlalchemy_suite --record`) and runs only the fenced mode,
# which halves the suite's time.  A recording is trusted only while it names exactly the
# tests this run collected (their ids carry the server's version); every test whose
# fenced outcome differs from it, and every test it records as failing, is then run
# again side by side in both modes, so a verdict still rests on a plain run made here.


@dataclass(frozen=True)
class Recorded:
    """A plain run as recorded: how many tests, a digest of their ids, and the outcome
    of each test that did not pass (every other one passed)."""

    count: int
    digest: str
    not_passed: dict[str, Outcome]

    def outcomes(self, test_ids: set[str]) -> dict[str, Outcome]:
        """The recorded plain outcome of each of ``test_ids``."""
        return {t: self.not_passed.get(t, Outcome("passed")) for t in test_ids}


def ids_digest(test_ids: set[str]) -> str:
    return hashlib.sha256("\n".join(sorted(test_ids)).encode()).hexdigest()


def write_recorded(path: Path, plain: dict[str, Outcome], header: str) -> None:
    """Record a plain run: a header comment, the count and digest, then ``<outcome> <id>``
    for each test that did not pass."""
    lines = [f"# {line}" for line in header.splitlines()]
    lines.append(f"tests {len(plain)} {ids_digest(set(plain))}")
    lines += [f"{o.outcome} {t}" for t, o in sorted(plain.items()) if o.outcome != "passed"]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


def read_recorded(path: Path) -> Recorded | None:
    """The recording at ``path``, or None when there is none."""
    if not path.is_file():
        return None
    count, digest, not_passed = -1, "", {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        kind, _, rest = line.partition(" ")
        if kind == "tests":
            size, _, digest = rest.partition(" ")
            count = int(size)
        elif kind in OUTCOMES and kind != "passed" and rest:
            not_passed[rest] = Outcome(kind)
        else:
            raise ValueError(f"{path}:{number}: not a recorded outcome: {line!r}")
    if count < 0 or not digest:
        raise ValueError(f"{path}: no 'tests <count> <digest>' line")
    return Recorded(count, digest, not_passed)


def to_run_again(recorded: Recorded, fenced: dict[str, Outcome]) -> list[str] | None:
    """The tests to run again side by side, given the fenced run and the recording: each
    whose fenced outcome differs from the recorded plain one, and each recorded as failing
    or in error (a sa-fence failure would otherwise hide behind it).  None when the
    recording does not name exactly the tests the fenced run collected: then the plain
    mode must run in full."""
    if len(fenced) != recorded.count or ids_digest(set(fenced)) != recorded.digest:
        return None
    plain = recorded.outcomes(set(fenced))
    again = {d.test_id for d in differences(plain, fenced)}
    again |= {t for t, o in recorded.not_passed.items() if o.outcome in ("error", "failed")}
    return sorted(again)
