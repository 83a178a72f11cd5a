"""Fresh virtual environments holding the built wheel, as a stranger installs it.

``dist`` builds the sdist and the wheel once per run (``python -m build``,
the build backend from the package index as pip fetches it).  ``fresh_venvs``
makes one venv per distinct install line and reuses it for the run: venvs
cost seconds each, and a page's install line is what is under test, not
the venv.  ``sa-fence`` in an install line means the wheel just built; every
other requirement is installed as written, at the versions of
constraints/test.txt (the same ones the suite runs, so a new release
elsewhere cannot turn a run red; pip's cache serves them).

Programs run in these venvs get a clean environment: no ``PYTHONPATH``, no
``SA_FENCE_*`` variable of the caller's, the venv's ``bin`` first on
``PATH``, and a working directory outside the checkout, so nothing of the
checkout can be imported by accident.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CONSTRAINTS = ROOT / "constraints" / "test.txt"
#: Building and installing a venv on a busy 2-core machine.
INSTALL_TIMEOUT = 600


@dataclass(frozen=True)
class Dist:
    sdist: Path
    wheel: Path


def _run(
    args: list[str], cwd: Path | None = None, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        args,
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=INSTALL_TIMEOUT,
        check=False,
    )
    assert proc.returncode == 0, f"{' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.fixture(scope="session")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Dist:
    out = tmp_path_factory.mktemp("dist")
    _run([sys.executable, "-m", "build", "--outdir", str(out), str(ROOT)])
    (sdist,) = out.glob("*.tar.gz")
    (wheel,) = out.glob("*.whl")
    return Dist(sdist=sdist, wheel=wheel)


@dataclass
class Venv:
    root: Path

    @property
    def bin(self) -> Path:
        return self.root / "bin"

    @property
    def python(self) -> Path:
        return self.bin / "python"

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment a reader's shell has in this venv, plus ``extra``."""
        base = {
            k: v
            for k, v in os.environ.items()
            if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")
            and not k.startswith(("SA_FENCE_", "CELERY_"))
            and k not in ("DATABASE_URL", "REDIS_URL")
        }
        return {
            **base,
            "VIRTUAL_ENV": str(self.root),
            "PATH": os.pathsep.join([str(self.bin), base.get("PATH", "")]),
            **(extra or {}),
        }


@dataclass
class FreshVenvs:
    root: Path
    dist: Dist
    made: dict[tuple[str, ...], Venv] = field(default_factory=dict)

    def with_install_line(self, requirements: tuple[str, ...]) -> Venv:
        """A venv with ``pip install <requirements>`` done (``sa-fence``: the wheel)."""
        if requirements not in self.made:
            venv = Venv(self.root / f"venv{len(self.made)}")
            # No pip seeded into the venv, no bytecode compiled ahead: this
            # interpreter's pip installs into it (--python), which saves
            # seconds a venv and changes nothing of what gets installed.
            _run([sys.executable, "-m", "venv", "--without-pip", str(venv.root)])
            args = [self._requirement(r) for r in requirements]
            _run(
                [
                    sys.executable, "-m", "pip", "--python", str(venv.python), "install",
                    "--quiet", "--no-compile", "-c", str(CONSTRAINTS), *args,
                ],
                cwd=self.root,
                env=venv.env(),
            )  # fmt: skip
            self.made[requirements] = venv
        return self.made[requirements]

    def _requirement(self, requirement: str) -> str:
        name, bracket, extras = requirement.partition("[")
        if name != "sa-fence":
            return requirement
        return f"sa-fence{bracket}{extras} @ {self.dist.wheel.as_uri()}"


@pytest.fixture(scope="session")
def fresh_venvs(tmp_path_factory: pytest.TempPathFactory, dist: Dist) -> FreshVenvs:
    return FreshVenvs(root=tmp_path_factory.mktemp("venvs"), dist=dist)
