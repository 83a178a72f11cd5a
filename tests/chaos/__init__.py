"""A Jepsen-style harness: fenced workers under faults, a recorded history, a checker.

N worker processes (:mod:`tests.chaos.worker`) run units of work on a few
rows of a private PostgreSQL cluster, each under the Redis lease of its row:
read the row, add one to its value, insert an item (a fenced INSERT) and an
audit line (an unfenced table), commit.  A nemesis (:mod:`tests.chaos.nemesis`)
meanwhile freezes workers past their TTL, flushes and restarts the private
Redis, kills PostgreSQL backends, crashes and restarts PostgreSQL, and delays
or cuts traffic through TCP proxies.  Every attempt is recorded by its worker
(lease name, token, outcome, times); PostgreSQL records the commit order
itself (a logical decoding slot created before the workers start).  The
checker (:mod:`tests.chaos.checker`) then looks for anomalies:

* per lease name, a commit of a holder after a newer grant was committed;
* per row, a fence that went down, or an update that read a value that was
  not the last committed one (a lost update);
* an acknowledged commit that is missing, or a refused one that is present;
* a unit of work committed in part; a token handed to two holders.

With ``--unfenced`` the same workers use plain sessions (no lease scope, no
row fence; the token is still written to the row, uncompared), and the same
checker must report anomalies: that pair is what shows the checker works.

``python -m tests.chaos`` (``make chaos``) runs about 10,000 operations in
both modes and prints operations, faults by kind, anomalies and availability
per fault kind; tests/chaos/test_chaos.py runs a short one in ``make test``.
"""
