"""SQLAlchemy's own test suite, run plain and with sa-fence installed on every Session.

``python -m tests.sqlalchemy_suite`` (``make sqlalchemy-suite``; ``make test``
runs it after pytest, then again in ``.venv-floors`` with the lowest
SQLAlchemy allowed) checks "nothing changes until a lease is bound"
against tests nobody here wrote (issue 18):

1. downloads the sdist of the *installed* SQLAlchemy version with ``pip
   download`` into a cache under ``.venv`` (``SA_FENCE_SQLA_CACHE`` moves
   it), once per version; SQLAlchemy's tests are never part of this repo;
2. creates two databases of its own on the test PostgreSQL
   (``SA_FENCE_TEST_PG``, as the suite's), dropped at the end;
3. runs :data:`SYNC_FILES` with ``postgresql+psycopg://`` and
   :data:`ASYNC_FILES` with ``postgresql+psycopg_async://``, once plain and
   once with :mod:`tests.sqlalchemy_suite.plugin` (``sa_fence.install()`` on
   every new Session), the two runs side by side, each writing JUnit XML;
4. compares every test's outcome; a test whose outcome differs is run again
   on its own in both modes, and what still differs, less the entries of
   ``allowlist.txt`` (each says why), fails the run with the test ids named.

The plain mode's outcomes depend on SQLAlchemy, the server and the machine,
never on sa-fence, so they are recorded once per SQLAlchemy version in
``recorded/`` (``--record``), and by default only the fenced mode runs: its
outcomes are compared with the recording, and each test that differs from it,
or that the recording has failing, runs again in both modes side by side, so
a verdict still rests on a plain run made here.  A recording that does not
name exactly the tests collected (another server version, other files) is
not used: the plain mode then runs in full, as with ``--side-by-side``.
"""

from __future__ import annotations
