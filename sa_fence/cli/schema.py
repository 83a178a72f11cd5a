"""Locate and run the ``migrations/`` environment (the demo's schema).

The repository keeps one copy of the migrations, at the top level in
``migrations/``.  The wheel ships that same directory as
``sa_fence/_migrations`` (``[tool.hatch.build.targets.wheel.force-include]``
in pyproject.toml), so ``sa-fence demo`` finds it from a wheel and from a
source tree alike.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from alembic import command
from alembic.config import Config

if TYPE_CHECKING:
    import sqlalchemy as sa

#: the package (sa_fence/), where the wheel puts its copy of migrations/
_PACKAGE_DIR = Path(__file__).resolve().parent.parent


def migrations_dir() -> Path:
    """The migrations environment: the wheel's copy, else the source tree's."""
    for candidate in (_PACKAGE_DIR / "_migrations", _PACKAGE_DIR.parent / "migrations"):
        if (candidate / "env.py").is_file():
            return candidate
    raise FileNotFoundError(
        "sa-fence's migrations environment is missing: looked for "
        f"{_PACKAGE_DIR / '_migrations'} (installed wheel) and "
        f"{_PACKAGE_DIR.parent / 'migrations'} (source tree). Reinstall sa-fence."
    )


def alembic_config(connection: sa.Connection | None = None) -> Config:
    """An Alembic ``Config`` for migrations/, running on ``connection`` when given."""
    config = Config()
    config.set_main_option("script_location", str(migrations_dir()))
    if connection is not None:
        config.attributes["connection"] = connection
    return config


def upgrade_demo_schema(engine: sa.Engine, revision: str = "head") -> None:
    """``alembic upgrade head`` for migrations/ on ``engine``'s database."""
    with engine.begin() as conn:
        command.upgrade(alembic_config(conn), revision)
