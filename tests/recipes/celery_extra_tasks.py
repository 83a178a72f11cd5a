"""Test-only tasks on the Celery recipe's app (loaded by the worker with -I).

They produce, deterministically, errors the recipe's tasks meet only under
races, so the suite can check that each comes back through the result
backend as itself.
"""

from __future__ import annotations

from celery_tasks import Job, Session, app, fencer

import sa_fence
from sa_fence.testing import expire


@app.task
@sa_fence.fenced("job:{job_id}", ttl=30, fencer=fencer, session=Session)
def overtaken(job_id: int) -> None:
    """Write job ``job_id`` after a newer holder of its lease wrote it: StaleTokenError."""
    mine = sa_fence.current_session()
    mine.get(Job, job_id)  # loaded under this lease...
    expire(sa_fence.current_lease())  # ...which then runs out, as if this worker paused
    with fencer.acquire(f"job:{job_id}", ttl=30) as newer, Session() as session:
        newer.bind(session)
        session.merge(Job(id=job_id, result="by the newer holder"))
        session.commit()
    mine.merge(Job(id=job_id, result="stale"))
    mine.flush()  # the row fence refuses it
