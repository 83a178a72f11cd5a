"""sa-fence: fencing tokens for SQLAlchemy, so a worker whose Redis lease
expired mid-work cannot overwrite the result of the worker that took over.

Quick tour (the full, tested quickstart is in ``docs/quickstart.md``)::

    class Job(sa_fence.Fenced, Base): ...              # adds the ``fence`` column
    sa_fence.fence_schema(Base.metadata)             # the token sequence and register
    Base.metadata.create_all(engine)
    Session = sa_fence.install(sessionmaker(engine))   # the flush hook
    fencer = sa_fence.Fencer(redis.Redis(), engine)

    with fencer.acquire("job:1", ttl=30) as lease, Session() as session:
        lease.bind(session)                    # flushes now compare the token
        session.get(Job, 1).result = "done"
        session.commit()                       # StaleTokenError if a newer holder wrote
"""

from typing import TYPE_CHECKING, Any

#: The one place the version is written (the build and ``sa-fence --version`` read it).
__version__ = "0.1.0.dev0"

from . import telemetry as telemetry  # sa_fence.telemetry.Telemetry after `import sa_fence`
from .db.prune import PruneResult
from .db.tokens import fence_schema
from .errors import (
    FenceError,
    FencingConfigError,
    LeaseBackendError,
    LeaseLostError,
    LeaseNotAcquiredError,
    StaleTokenError,
    UnfencedWriteError,
)
from .integrations.decorators import (
    SKIPPED,
    Skipped,
    current_lease,
    current_session,
    fenced,
    fenced_methods,
)
from .integrations.side_effects import SideEffect, side_effect, side_effect_async
from .lease.sync import Fencer, Lease
from .orm.create_guard import create_fence_guard, drop_fence_guard
from .orm.flush import fence_connection, install, unbind, unfenced, uninstall
from .orm.model import Fenced, fence_column

if TYPE_CHECKING:  # the "as" form re-exports them to type checkers (see _LAZY)
    from .lease.aio import AsyncFencer as AsyncFencer
    from .lease.aio import AsyncLease as AsyncLease

#: Public names imported on first use (the asyncio front end needs greenlet),
#: and kept out of ``__all__`` so that ``from sa_fence import *`` does not load it.
#: Not a module of their own (sa_fence.asyncio, as SQLAlchemy and redis-py have): only
#: these two classes differ between the front ends; install, the decorators, the side
#: effects, the mixin and the errors are one API for both, which a second module would
#: split over two import paths (docs/asyncio.md).
_LAZY = ("AsyncFencer", "AsyncLease")

__all__ = [
    "SKIPPED",
    "FenceError",
    "Fenced",
    "Fencer",
    "FencingConfigError",
    "Lease",
    "LeaseBackendError",
    "LeaseLostError",
    "LeaseNotAcquiredError",
    "PruneResult",
    "SideEffect",
    "Skipped",
    "StaleTokenError",
    "UnfencedWriteError",
    "create_fence_guard",
    "current_lease",
    "current_session",
    "drop_fence_guard",
    "fence_column",
    "fence_connection",
    "fence_schema",
    "fenced",
    "fenced_methods",
    "install",
    "side_effect",
    "side_effect_async",
    "unbind",
    "unfenced",
    "uninstall",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from .lease import aio

        return getattr(aio, name)
    raise AttributeError(f"module 'sa_fence' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
