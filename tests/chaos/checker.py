"""The checker: a recorded history and PostgreSQL's own commit order, judged.

Inputs, none of them trusted to the workers alone:

* the attempts each worker recorded (:mod:`tests.chaos.worker`);
* every committed transaction, in commit order, as logical decoding
  (``test_decoding``) reports it from the WAL: the register's grants and
  withdrawals, the rows' updates, the items and audit lines inserted;
* the tables' final contents.

Anomalies (each with an example):

``stale-commit``
    a unit of work under lease (name, token) committed while the register,
    at that point of the commit order, held a newer token for the name: a
    holder committed after a newer grant was committed.
``fence-went-down``
    an update of a row wrote a smaller fence than the one it replaced.
``lost-update``
    a read-modify-write read a value other than the row's last committed one.
``partial-unit-of-work``
    a committed transaction holds part of a unit of work (an audit line
    without its item or row update, or the reverse).
``acknowledged-commit-missing``
    the worker saw its commit return, yet the unit of work is not committed.
``refused-commit-present``
    the worker saw its unit of work refused or failed before COMMIT, yet it
    is committed.
``token-issued-twice``
    two attempts were granted the same token.
``final-state-differs``
    the tables' final contents disagree with the commit stream replayed.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

#: Outcomes after which nothing of the unit of work may be committed.
DEFINITELY_NOT_COMMITTED = ("stale", "lost", "failed", "busy", "acquire-failed")


@dataclass
class Change:
    table: str
    op: str
    values: dict[str, Any]


@dataclass
class Transaction:
    xid: int
    changes: list[Change] = field(default_factory=list)
    #: the LSN of its commit record (the position in the commit order)
    lsn: str = ""


@dataclass
class Anomaly:
    kind: str
    detail: str


@dataclass
class CheckResult:
    anomalies: list[Anomaly]
    committed_uows: set[str]
    #: outcome "unknown": how many turned out committed
    unknown_committed: int
    unknown_total: int

    def by_kind(self) -> Counter[str]:
        return Counter(a.kind for a in self.anomalies)


# ------------------------------------------------------ the commit stream

_HEADER = re.compile(r"^table ([^ ]+): (INSERT|UPDATE|DELETE):(.*)$")
_COLUMN = re.compile(r"(\w+)\[([^\]]+)\]:('(?:[^']|'')*'|\S+)")


def _value(type_name: str, text: str) -> Any:
    if text == "null":
        return None
    if text.startswith("'"):
        return text[1:-1].replace("''", "'")
    if type_name in ("integer", "bigint", "smallint"):
        return int(text)
    return text


def parse_decoding(lines: Iterable[str | tuple[str, str]]) -> list[Transaction]:
    """``test_decoding`` output (with ``include-xids``) -> transactions in commit order.

    Each line is the ``data`` column, or an ``(lsn, data)`` pair: the COMMIT
    line's LSN is then the transaction's commit LSN.
    """
    transactions: list[Transaction] = []
    current: Transaction | None = None
    for entry in lines:
        lsn, line = entry if isinstance(entry, tuple) else ("", entry)
        if line.startswith("BEGIN"):
            current = Transaction(int(line.split()[1]))
        elif line.startswith("COMMIT"):
            if current is not None and current.changes:
                current.lsn = lsn
                transactions.append(current)
            current = None
        else:
            match = _HEADER.match(line)
            if match is None or current is None:
                continue
            table = match.group(1).rsplit(".", 1)[-1].strip('"')
            values = {
                name: _value(type_name, text)
                for name, type_name, text in _COLUMN.findall(match.group(3))
            }
            current.changes.append(Change(table, match.group(2), values))
    return transactions


# ------------------------------------------------------------- the check


def check(
    attempts: list[dict[str, Any]],
    transactions: list[Transaction],
    final: dict[str, Any],
    *,
    rows: int,
) -> CheckResult:
    """Judge a run: ``final`` holds ``audit`` (uows), ``items`` (uows), ``rows``
    (id -> (value, fence)); rows start at value 0, fence 0."""
    anomalies: list[Anomaly] = []
    register: dict[str, int] = {}
    fences = dict.fromkeys(range(1, rows + 1), 0)
    values = dict.fromkeys(range(1, rows + 1), 0)
    committed: dict[str, int] = {}  # uow -> position in the commit order
    committed_items: set[str] = set()

    for position, txn in enumerate(transactions):
        audits = [c.values for c in txn.changes if c.table == "chaos_audit" and c.op == "INSERT"]
        items = [c.values for c in txn.changes if c.table == "chaos_items" and c.op == "INSERT"]
        updates = [c.values for c in txn.changes if c.table == "chaos_rows" and c.op == "UPDATE"]
        grants = [
            c.values for c in txn.changes if c.table == "sa_fence_leases" and c.op != "DELETE"
        ]
        # lease scope: every unit of work commits at its name's newest grant
        for audit in audits:
            newest = register.get(audit["name"])
            if newest != audit["token"]:
                anomalies.append(
                    Anomaly(
                        "stale-commit",
                        f"unit of work {audit['uow']} under {audit['name']} token "
                        f"{audit['token']} committed while the register held "
                        f"{newest} (commit #{position}, LSN {txn.lsn})",
                    )
                )
        for grant in grants:
            register[grant["name"]] = grant["token"]
        # rows: fences never go down, no update is lost
        for update in updates:
            row = update["id"]
            if update["fence"] < fences[row]:
                anomalies.append(
                    Anomaly(
                        "fence-went-down",
                        f"row {row}: fence {fences[row]} -> {update['fence']} (commit #{position})",
                    )
                )
            fences[row] = update["fence"]
        for audit in audits:
            if audit["kind"] != "rmw":
                continue
            row = audit["row_id"]
            if audit["read_value"] != values[row]:
                anomalies.append(
                    Anomaly(
                        "lost-update",
                        f"unit of work {audit['uow']} read {audit['read_value']} from row "
                        f"{row}, whose last committed value was {values[row]} "
                        f"(commit #{position})",
                    )
                )
            values[row] = audit["new_value"]
        # whole units of work only
        item_uows = {item["uow"] for item in items}
        audit_uows = {audit["uow"] for audit in audits}
        updated = {(u["id"], u["value"]) for u in updates}
        expected_updates = {(a["row_id"], a["new_value"]) for a in audits if a["kind"] == "rmw"}
        if item_uows != audit_uows or updated != expected_updates:
            anomalies.append(
                Anomaly(
                    "partial-unit-of-work",
                    f"commit #{position}: audit {sorted(audit_uows)}, items "
                    f"{sorted(item_uows)}, row updates {sorted(updated)}",
                )
            )
        for uow in audit_uows:
            committed[uow] = position
        committed_items |= item_uows

    unknown_total = unknown_committed = 0
    granted: dict[int, str] = {}
    for attempt in attempts:
        outcome, uow = attempt["outcome"], attempt["uow"]
        if outcome == "ok" and uow not in committed:
            anomalies.append(Anomaly("acknowledged-commit-missing", f"{uow} ({attempt['name']})"))
        if outcome in DEFINITELY_NOT_COMMITTED and uow in committed:
            anomalies.append(
                Anomaly(
                    "refused-commit-present",
                    f"{uow} was {outcome} ({attempt.get('error', '')}) yet committed",
                )
            )
        if outcome == "unknown":
            unknown_total += 1
            unknown_committed += uow in committed
        token = attempt.get("token")
        if token is not None:
            if token in granted:
                anomalies.append(
                    Anomaly("token-issued-twice", f"token {token}: {granted[token]} and {uow}")
                )
            granted[token] = uow

    # the tables agree with the commit stream replayed
    differences = []
    if set(final["audit"]) != set(committed):
        differences.append("audit lines")
    if set(final["items"]) != committed_items:
        differences.append("items")
    for row, (value, fence) in final["rows"].items():
        if (value, fence) != (values[row], fences[row]):
            differences.append(f"row {row} ({value}, {fence}) != ({values[row]}, {fences[row]})")
    if differences:
        anomalies.append(Anomaly("final-state-differs", "; ".join(differences)))
    return CheckResult(anomalies, set(committed), unknown_committed, unknown_total)


# ------------------------------------------------------------ the figures


@dataclass
class FaultWindow:
    kind: str
    start: float
    end: float
    detail: str = ""


def availability(
    attempts: list[dict[str, Any]], faults: list[FaultWindow]
) -> dict[str, tuple[int, int]]:
    """kind -> (ok, attempts) for attempts that began during a fault of that kind
    (``none``: during no fault)."""
    buckets: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for attempt in attempts:
        kinds = {f.kind for f in faults if f.start <= attempt["t0"] <= f.end} or {"none"}
        for kind in kinds:
            buckets[kind][1] += 1
            buckets[kind][0] += attempt["outcome"] == "ok"
    return {kind: (ok, total) for kind, (ok, total) in buckets.items()}
