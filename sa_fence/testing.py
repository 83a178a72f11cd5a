"""Helpers for your own tests: reproduce "my lease expired mid-work" without sleeping.

A lease that expires in production is just a Redis key that is gone (or
belongs to someone else) while the worker still holds a ``Lease`` object.
:func:`expire` makes that happen on demand, so a test can run the seeds'
scenario deterministically against real servers::

    from sa_fence.testing import expire

    def test_a_worker_that_lost_its_lease_cannot_overwrite_the_new_holder(fencer, Session):
        a = fencer.acquire("job:1", ttl=30)
        session_a = a.bind(Session())
        session_a.get(Job, 1).result = "A"
        expire(a)                                   # A "pauses" past its TTL
        with fencer.lease("job:1", ttl=30) as b, Session() as session_b:
            b.bind(session_b)
            session_b.get(Job, 1).result = "B"
            session_b.commit()
        with pytest.raises(sa_fence.StaleTokenError):
            session_a.commit()
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._lease import Lease

__all__ = ["expire"]


def expire(lease: Lease) -> bool:
    """End ``lease`` in Redis now, as if its TTL had run out.

    Owner-checked like :meth:`Lease.release` (it never removes another
    owner's lease), but the ``Lease`` object is left believing it still holds
    the lease, exactly like a paused worker.  Returns True when the key was
    removed, False when it had already expired or been taken over.
    """
    return bool(int(lease.fencer._release(keys=[lease.key], args=[lease._value])))
