from sqlalchemy.orm import Session, sessionmaker

import sa_fence
from tests.models import Job


def test_a_bound_session_inserts_with_the_lease_token(
    fencer: sa_fence.Fencer, make_session: sessionmaker[Session]
) -> None:
    with fencer.lease("job:1", 5) as lease, make_session() as session:
        lease.bind(session)
        session.add(Job(id=1, result="x"))
        session.commit()
        assert session.get(Job, 1).fence == lease.token
