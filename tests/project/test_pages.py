"""Every recipe page runs as written, from a fresh venv.

A reader copies a page's commands and its code: the one ``pip install``
line, the ``export`` lines (the test sets exactly the variables a page shows,
to this run's servers), each code block saved under the name its title gives,
then each command in order
in an empty folder and a fresh, empty database: servers (``uvicorn``,
``flask run``, ``celery worker``) are started in the background and waited
for, the other commands (``curl``, ``python ...``) must exit 0 and print the
output the page shows under them.  No table, sequence or register is made by
the test: a page that does not create its schema, or name the command that
does, fails here.

sa-fence is not on the package index yet, so the install line a page gives
installs it from the reader's clone of the repository, next to the reader's
folder (``pip install ../sa-fence ...``): the test runs that line with
``../sa-fence`` being this checkout.  Under it, a comment gives the line that
will work once sa-fence is released (``# once released ...: pip install
sa-fence ...``), the same requirements with the package's name for the path.

Each page's code block is also docs/recipes/<name>.py, byte for byte, which
the other recipe tests import (tests/integrations/test_recipes.py,
tests/integrations/test_recipe_celery.py) and ruff checks: the page is what a repository
browser shows, the file is what the tests exercise, and the fast test below
keeps them one text.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests._fresh_db import fresh_database
from tests._fresh_venv import FreshVenvs
from tests._redis_server import RedisServer, free_port, private_redis

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
RECIPES = DOCS / "recipes"
#: each recipe page and the files its code blocks are, in the page's order
RECIPE_PAGES = {
    "celery.md": ("celery_tasks.py", "stalled_delivery.py"),
    "fastapi.md": ("fastapi_app.py",),
    "flask.md": ("flask_app.py",),
    "sqlmodel.md": ("sqlmodel_models.py",),
    "scoped-session.md": ("scoped.py",),
    "cron.md": ("cron_job.py",),
}
#: where a page's install line finds sa-fence until it is released: the
#: reader's clone, next to the folder the page's commands run in
CHECKOUT = "../sa-fence"
#: the comment under it giving the line that works once sa-fence is released
RELEASED = re.compile(r"^#\s*once released[^:]*:\s*(pip install .*)$")
#: what every recipe page shows and the test sets (to this run's servers)
ENVIRONMENT = {"DATABASE_URL", "REDIS_URL", "SA_FENCE_KEY_PREFIX"}
#: commands that keep running: started in the background and waited for
SERVERS = re.compile(r"^(uvicorn |flask .*\brun\b|celery .*\bworker\b)")
#: the port a page's server listens on and its requests go to
PAGE_PORT = re.compile(r"(?<=--port )8000\b|(?<=127\.0\.0\.1:)8000\b")
STARTUP = 60.0
FENCE = re.compile(r"^```([\w-]*)([^\n]*)\n(.*?)^```[ \t]*$", flags=re.MULTILINE | re.DOTALL)


@dataclass
class Step:
    """The commands of one ``sh`` block, and the ``text`` block shown under it."""

    commands: list[str]
    expected: str | None = None


@dataclass
class Page:
    install: tuple[str, ...] = ()
    released: tuple[str, ...] = ()
    environment: dict[str, str] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)
    steps: list[Step] = field(default_factory=list)


def shell_lines(body: str) -> list[str]:
    joined = re.sub(r"\\\n\s*", " ", body)
    return [line.strip() for line in joined.splitlines() if line.strip() and line[0] != "#"]


def read_page(name: str) -> Page:
    page = Page()
    installs: list[tuple[str, ...]] = []
    released: list[tuple[str, ...]] = []
    previous_step: Step | None = None
    for match in FENCE.finditer((DOCS / name).read_text(encoding="utf-8")):
        lang, info, body = match.groups()
        step, previous_step = previous_step, None
        if lang == "python":
            title = re.search(r'title="([^"]+)"', info)
            assert title, f'{name}: a ```python block without title="<file name>"'
            page.files[title.group(1)] = body
        elif lang == "sh":
            for line in body.splitlines():
                if found := RELEASED.match(line.strip()):
                    released.append(tuple(shlex.split(found.group(1))[2:]))
            commands = []
            for line in shell_lines(body):
                if line.startswith("pip install "):
                    installs.append(tuple(shlex.split(line)[2:]))
                elif line.startswith("export "):
                    key, _, value = line.removeprefix("export ").partition("=")
                    page.environment[key] = value
                else:
                    commands.append(line)
            if commands:
                previous_step = Step(commands)
                page.steps.append(previous_step)
        elif lang == "text" and step is not None:
            step.expected = body
    assert len(installs) == 1, f"{name} gives {len(installs)} pip install lines, not one"
    assert len(released) == 1, (
        f"{name} gives {len(released)} '# once released: pip install ...' lines, not one"
    )
    page.install, page.released = installs[0], released[0]
    return page


@pytest.mark.parametrize("name", sorted(RECIPE_PAGES))
def test_a_recipe_page_shows_its_code_its_install_line_and_its_environment(name: str) -> None:
    text = (DOCS / name).read_text(encoding="utf-8")
    assert "--8<--" not in text, f"{name}: show the code on the page, not only an include"
    page = read_page(name)
    recipes = RECIPE_PAGES[name]
    assert tuple(page.files) == recipes
    for recipe in recipes:
        assert page.files[recipe] == (RECIPES / recipe).read_text(encoding="utf-8"), (
            f"the code block of docs/{name} differs from docs/recipes/{recipe}: "
            "copy the file into the block (they are one text)"
        )
    # until released, from the reader's clone; the line for then, marked as such
    assert page.install[0] == CHECKOUT, page.install
    assert page.released == ("sa-fence", *page.install[1:]), (page.install, page.released)
    assert "not on the package index yet" in text, f"{name} does not say why it installs so"
    assert set(page.environment) == ENVIRONMENT, page.environment
    assert page.steps, f"{name} shows no command to run"


# ------------------------------------------------------------------ the runs


class Background:
    """A server command a reader leaves running in another shell."""

    def __init__(self, command: str, cwd: Path, env: dict[str, str]) -> None:
        self.command = command
        self.proc = subprocess.Popen(
            ["bash", "-c", f"exec {command}"],
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # its children (a prefork pool) are stopped with it
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def wait_ready(self, port: int) -> None:
        deadline = time.monotonic() + STARTUP
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.command!r} exited {self.proc.returncode}:\n{self.log}")
            if "--port" in self.command:
                with socket.socket() as probe:
                    if probe.connect_ex(("127.0.0.1", port)) == 0:
                        return
            elif " ready." in self.log:  # celery worker
                return
            assert time.monotonic() < deadline, f"{self.command!r} not ready:\n{self.log}"
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        self._reader.join(timeout=5)


@pytest.fixture(scope="module")
def page_redis() -> Iterator[RedisServer]:
    """A Redis of the runs' own: the Celery page's broker queues are nobody else's."""
    with private_redis() as server:
        yield server


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(RECIPE_PAGES))
def test_a_recipe_page_runs_as_written_from_a_fresh_venv(
    name: str, fresh_venvs: FreshVenvs, page_redis: RedisServer, tmp_path: Path
) -> None:
    page = read_page(name)
    # the line as the page gives it, run from the reader's folder next to the clone
    # (this checkout): FreshVenvs installs paths as they are, so give it the clone's
    venv = fresh_venvs.with_install_line(
        tuple(str(ROOT) if r == CHECKOUT else r for r in page.install)
    )
    folder = tmp_path / "reader"  # an empty folder: the page's files only
    folder.mkdir()
    for filename, code in page.files.items():
        (folder / filename).write_text(code, encoding="utf-8")
    port = free_port()
    servers: list[Background] = []
    with fresh_database("page") as engine:  # empty: no table, sequence or register
        env = venv.env(
            {
                "DATABASE_URL": engine.url.render_as_string(hide_password=False),
                "REDIS_URL": f"redis://127.0.0.1:{page_redis.port}/0",
                "SA_FENCE_KEY_PREFIX": f"page:{name}:",
            }
        )
        try:
            for step in page.steps:
                printed = []
                for written in step.commands:
                    command = PAGE_PORT.sub(str(port), written)
                    program = shlex.split(command)[0]
                    assert shutil.which(program, path=env["PATH"]), (
                        f"{name} runs {program!r}, which is not on PATH here: install it "
                        f"(e.g. apt-get install {program})"
                    )
                    if SERVERS.match(command):
                        servers.append(Background(command, folder, env))
                        servers[-1].wait_ready(port)
                        continue
                    proc = subprocess.run(
                        ["bash", "-c", command],
                        cwd=folder,
                        env=env,
                        capture_output=True,
                        text=True,
                        timeout=90,
                        check=False,
                    )
                    logs = "".join(f"\n--- {s.command}:\n{s.log}" for s in servers)
                    assert proc.returncode == 0, (
                        f"{name}: {written!r} exited {proc.returncode}:\n"
                        f"{proc.stdout}\n{proc.stderr}{logs}"
                    )
                    printed.append(proc.stdout)
                if step.expected is not None:
                    assert "".join(printed).strip() == step.expected.strip(), (
                        f"{name}: {step.commands} printed {''.join(printed)!r}, "
                        f"the page shows {step.expected!r}"
                    )
        finally:
            for server in servers:
                server.stop()
    for server in servers:
        assert "Traceback" not in server.log, f"{server.command!r}:\n{server.log}"
