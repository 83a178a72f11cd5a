"""Ways to use a lease without writing its lifecycle: the repository-layer
decorators (:mod:`.decorators`) and side effects that leave only from current
holders (:mod:`.side_effects`).  The Alembic integration is the public
:mod:`sa_fence.alembic`.
"""
