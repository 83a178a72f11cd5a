"""A stalled, redelivered task, played against the worker you started.

The first delivery of ``finish_job(42, ...)`` runs here, in this process,
with the task's own code (Celery's ``apply()``: the decorator takes the lease,
opens and binds a session, runs the body, commits).  Right after taking the
lease it stalls past its TTL: ``sa_fence.testing.expire`` ends the lease in
Redis as the TTL running out would, without a sleep.  Meanwhile the broker
gives the task to another worker (the one you started), which takes the
lease with a larger token and commits.  Then the first delivery wakes up,
writes its result, and its late commit is refused.

Run it with a worker started (``celery -A celery_tasks worker``)::

    python stalled_delivery.py
"""

from __future__ import annotations

from celery_tasks import Job, Session, finish_job
from sqlalchemy import event

import sa_fence
from sa_fence.testing import expire

JOB_ID = 42


@event.listens_for(Session, "after_begin", once=True)
def stall(*_: object) -> None:
    """The first delivery's pause (a GC pause, swap, SIGSTOP), past its lease's TTL."""
    expire(sa_fence.current_lease())  # the lease ends in Redis; this run does not know
    # The broker redelivers the unacknowledged task: the worker runs it now.
    token = finish_job.delay(JOB_ID, "redelivered").get(timeout=30)
    print(f"redelivered run: took the lease with token {token} and committed")


try:
    finish_job.apply(args=(JOB_ID, "first delivery"), throw=True)
except sa_fence.StaleTokenError as exc:
    print(f"stalled run (token {exc.token}): late commit refused with StaleTokenError")

with Session() as session:
    job = session.get_one(Job, JOB_ID)
    print(f"job {JOB_ID} keeps the redelivered run's result (fence {job.fence})")
