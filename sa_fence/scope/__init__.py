"""Lease scope: a bound transaction carries its lease's arm, and PostgreSQL
refuses its COMMIT unless that lease is still the newest (:mod:`.arming`).

Every driver detail the arm needs lives here: psycopg's BEGIN and pipeline,
and the reading of SQL text that ends or opens a transaction, done by
PostgreSQL's own parser (:mod:`.transaction_sql`).
"""
