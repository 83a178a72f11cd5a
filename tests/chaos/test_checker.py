"""The checker on hand-made histories: it finds each anomaly, and nothing in a clean one."""

from __future__ import annotations

from typing import Any

from tests.chaos import checker
from tests.chaos.checker import Change, Transaction

DECODED = [
    "BEGIN 700",
    "table public.sa_fence_leases: INSERT: name[text]:'row:1' token[bigint]:1 "
    "granted_at[timestamp with time zone]:'2026-01-01 00:00:00+00' previous[bigint]:null",
    "COMMIT 700",
    "BEGIN 701",
    "table public.chaos_rows: UPDATE: id[integer]:1 value[bigint]:1 fence[bigint]:1",
    "table public.chaos_items: INSERT: id[bigint]:1 row_id[integer]:1 uow[character varying]:'0-1'"
    " fence[bigint]:1",
    "table public.chaos_audit: INSERT: id[bigint]:1 uow[character varying]:'0-1' "
    "kind[character varying]:'rmw' worker[integer]:0 op[integer]:1 "
    "name[character varying]:'row:1' token[bigint]:1 row_id[integer]:1 read_value[bigint]:0 "
    "new_value[bigint]:1",
    "COMMIT 701",
]


def grant(name: str, token: int) -> Transaction:
    return Transaction(0, [Change("sa_fence_leases", "UPDATE", {"name": name, "token": token})])


def uow(uow: str, token: int, read: int, *, fence: int | None = None, row: int = 1) -> Transaction:
    audit = {
        "uow": uow,
        "kind": "rmw",
        "name": f"row:{row}",
        "token": token,
        "row_id": row,
        "read_value": read,
        "new_value": read + 1,
    }
    return Transaction(
        0,
        [
            Change("chaos_rows", "UPDATE", {"id": row, "value": read + 1, "fence": fence or token}),
            Change("chaos_items", "INSERT", {"uow": uow}),
            Change("chaos_audit", "INSERT", audit),
        ],
    )


def attempt(uow: str, outcome: str, token: int | None) -> dict[str, Any]:
    return {"uow": uow, "outcome": outcome, "token": token, "name": "row:1", "t0": 0.0}


def final(audit: list[str], value: int, fence: int) -> dict[str, Any]:
    return {"audit": audit, "items": audit, "rows": {1: (value, fence)}}


def kinds(result: checker.CheckResult) -> dict[str, int]:
    return dict(result.by_kind())


def test_decoding_output_is_parsed_into_transactions_in_commit_order() -> None:
    transactions = checker.parse_decoding(DECODED)
    assert [t.xid for t in transactions] == [700, 701]
    assert transactions[0].changes[0].values["token"] == 1
    assert transactions[0].changes[0].values["previous"] is None
    audit = transactions[1].changes[2]
    assert (audit.table, audit.op, audit.values["name"], audit.values["read_value"]) == (
        "chaos_audit",
        "INSERT",
        "row:1",
        0,
    )


def test_a_clean_history_has_no_anomaly() -> None:
    stream = [grant("row:1", 1), uow("0-1", 1, 0), grant("row:1", 2), uow("1-1", 2, 1)]
    attempts = [attempt("0-1", "ok", 1), attempt("1-1", "ok", 2), attempt("0-2", "stale", 3)]
    result = checker.check(attempts, stream, final(["0-1", "1-1"], 2, 2), rows=1)
    assert result.anomalies == []


def test_a_holder_committing_after_a_newer_grant_is_a_stale_commit() -> None:
    stream = [grant("row:1", 1), grant("row:1", 2), uow("1-1", 2, 0), uow("0-1", 1, 1)]
    attempts = [attempt("0-1", "ok", 1), attempt("1-1", "ok", 2)]
    result = checker.check(attempts, stream, final(["0-1", "1-1"], 2, 1), rows=1)
    assert kinds(result) == {"stale-commit": 1, "fence-went-down": 1}


def test_an_update_of_an_old_read_is_a_lost_update() -> None:
    stream = [grant("row:1", 1), uow("0-1", 1, 0), grant("row:1", 2), uow("1-1", 2, 0)]
    attempts = [attempt("0-1", "ok", 1), attempt("1-1", "ok", 2)]
    result = checker.check(attempts, stream, final(["0-1", "1-1"], 1, 2), rows=1)
    assert kinds(result) == {"lost-update": 1}


def test_missing_acknowledged_and_present_refused_commits_are_found() -> None:
    stream = [grant("row:1", 1), uow("0-1", 1, 0)]
    attempts = [attempt("0-1", "stale", 1), attempt("0-2", "ok", 1)]
    result = checker.check(attempts, stream, final(["0-1"], 1, 1), rows=1)
    assert kinds(result) == {
        "refused-commit-present": 1,
        "acknowledged-commit-missing": 1,
        "token-issued-twice": 1,
    }


def test_a_unit_of_work_committed_in_part_is_found() -> None:
    torn = uow("0-1", 1, 0)
    torn.changes = [c for c in torn.changes if c.table != "chaos_items"]
    result = checker.check(
        [attempt("0-1", "ok", 1)],
        [grant("row:1", 1), torn],
        {"audit": ["0-1"], "items": [], "rows": {1: (1, 1)}},
        rows=1,
    )
    assert kinds(result) == {"partial-unit-of-work": 1}


def test_tables_that_disagree_with_the_commit_stream_are_found() -> None:
    stream = [grant("row:1", 1), uow("0-1", 1, 0)]
    result = checker.check([attempt("0-1", "ok", 1)], stream, final(["0-1"], 5, 1), rows=1)
    assert kinds(result) == {"final-state-differs": 1}


def test_unknown_outcomes_may_go_either_way() -> None:
    stream = [grant("row:1", 1), uow("0-1", 1, 0)]
    attempts = [attempt("0-1", "unknown", 1), attempt("0-2", "unknown", None)]
    result = checker.check(attempts, stream, final(["0-1"], 1, 1), rows=1)
    assert result.anomalies == []
    assert (result.unknown_total, result.unknown_committed) == (2, 1)


def test_availability_counts_operations_begun_during_each_fault() -> None:
    faults = [checker.FaultWindow("pg-crash", 10.0, 11.0)]
    attempts = [
        {**attempt("a", "ok", 1), "t0": 5.0},
        {**attempt("b", "failed", None), "t0": 10.5},
        {**attempt("c", "ok", 2), "t0": 10.9},
    ]
    assert checker.availability(attempts, faults) == {"none": (1, 1), "pg-crash": (1, 2)}
