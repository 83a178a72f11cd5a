"""Flask-SQLAlchemy: the hook on ``db.session``, a lease per request.

``sa_fence.install(db.session)`` installs the hook on the scoped session's
factory (``db.session.session_factory``), so every session Flask-SQLAlchemy
makes is fenced; ``lease.bind(db.session)`` binds the current request's
session.  Run it with ``flask --app flask_app run``; the app factory creates
the table, the token sequence and the lease register when they are missing.
The configuration comes from ``DATABASE_URL``, ``REDIS_URL`` and
``SA_FENCE_KEY_PREFIX``.
"""

from __future__ import annotations

import os

import redis
from flask import Flask, abort, current_app, request
from flask_sqlalchemy import SQLAlchemy
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

import sa_fence

DATABASE_URL = os.environ.get("DATABASE_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/app")
REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
KEY_PREFIX = os.environ.get("SA_FENCE_KEY_PREFIX", "sa_fence:")


class Base(DeclarativeBase):
    pass


sa_fence.fence_schema(Base.metadata)
db = SQLAlchemy(model_class=Base)


class Job(sa_fence.Fenced, db.Model):  # type: ignore[name-defined, misc]
    __tablename__ = "flask_jobs"

    id: Mapped[int] = mapped_column(primary_key=True)
    result: Mapped[str | None]


def create_app() -> Flask:
    app = Flask(__name__)
    app.config["SQLALCHEMY_DATABASE_URI"] = DATABASE_URL
    db.init_app(app)
    sa_fence.install(db.session)  # on its session_factory: every db.session is fenced
    with app.app_context():
        # The table, the sequence and the register, when missing (or: Alembic).
        db.create_all()
        app.extensions["sa_fence"] = sa_fence.Fencer(
            redis.Redis.from_url(REDIS_URL, socket_timeout=5), db.engine, key_prefix=KEY_PREFIX
        )

    @app.put("/jobs/<int:job_id>")
    def finish_job(job_id: int) -> dict[str, object]:
        fencer: sa_fence.Fencer = current_app.extensions["sa_fence"]
        try:
            lease = fencer.acquire(f"job:{job_id}", ttl=30, renew=True)
        except sa_fence.LeaseNotAcquiredError:
            abort(409, f"job {job_id} is being worked on elsewhere")
        with lease:
            lease.bind(db.session)  # this request's session
            job = db.session.get(Job, job_id) or Job(id=job_id)
            job.result = request.get_json()["result"]
            db.session.add(job)
            try:
                db.session.commit()
            except sa_fence.StaleTokenError as exc:
                db.session.rollback()
                abort(409, str(exc))
            return {"id": job.id, "result": job.result, "fence": job.fence}

    return app
