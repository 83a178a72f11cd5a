"""Bad URLs given to the ``sa-fence`` command: a one-line error and exit status 2,
never a traceback, and never the password, parsed or not.

Every subcommand option that takes a URL is found in the argparse set-up
(:func:`sa_fence.cli.main.build_parser`), so a new command or option is
covered without being listed here.  The commands run as a user types them,
in subprocesses, all at once (each pays the interpreter's start-up).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from sa_fence.cli import main as cli

pytestmark = pytest.mark.slow  # subprocesses

ROOT = Path(__file__).resolve().parents[2]
SECRET = "Pw0rd-s3cret"
#: reachable-looking, valid URLs for the options a case does not test (nothing connects:
#: the bad URL is refused first)
GOOD = {
    "--url": "postgresql+psycopg://postgres@127.0.0.1:5432/postgres",
    "--pg": "postgresql+psycopg://postgres@127.0.0.1:5432",
    "--redis": "redis://127.0.0.1:6379/0",
}
#: the bad URLs, per kind of option: (a) not parsable, (b) a port that is not a number
BAD = {
    "database": {
        "unparsable": f"postgresql+psycopg//u:{SECRET}@h/db",  # "//" without its ":"
        "bad-port": f"postgresql+psycopg://u:{SECRET}@h:notaport/db",
    },
    "redis": {
        "unparsable": f"redis//:{SECRET}@h/0",
        "bad-port": f"redis://:{SECRET}@h:bad/0",
    },
}
KIND = {"--url": "database", "--pg": "database", "--redis": "redis"}
#: --url from $SA_FENCE_DATABASE_URL too: bench checks its --url in argparse, the others
#: after it (one of each: a subprocess costs seconds)
ENV_COMMANDS = {"bench", "check"}
#: what a command needs besides its URLs to get as far as reading them
REQUIRED = {
    "create-guard": ["jobs"],
    "prune": ["--older-than", "30d", "--longest-lease", "1h"],
}


def url_options() -> dict[str, list[str]]:
    """subcommand -> its options that take a URL (metavar URL), from the parser itself."""
    parser = cli.build_parser()
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    found = {}
    for name, sub in commands.choices.items():
        options = [a.option_strings[-1] for a in sub._actions if a.metavar == "URL"]
        if options:
            found[name] = options
    return found


@dataclass(frozen=True)
class Case:
    command: str
    option: str
    problem: str  # a key of BAD[...]
    via_env: bool = False  # --url from $SA_FENCE_DATABASE_URL instead of the flag

    @property
    def id(self) -> str:
        return f"{self.command} {self.option} {self.problem}" + (" (env)" if self.via_env else "")

    def argv(self) -> tuple[list[str], dict[str, str]]:
        bad = BAD[KIND[self.option]][self.problem]
        env = {}
        argv = [self.command, *REQUIRED.get(self.command, [])]
        for option in url_options()[self.command]:
            value = bad if option == self.option else GOOD[option]
            if option == "--url" and self.via_env:
                env[cli.DATABASE_URL_ENV] = value
            else:
                argv += [option, value]
        return argv, env


def cases() -> list[Case]:
    found = []
    for command, options in url_options().items():
        for option in options:
            for problem in BAD[KIND[option]]:
                found.append(Case(command, option, problem))
                if option == "--url" and command in ENV_COMMANDS:
                    found.append(Case(command, option, problem, via_env=True))
    return found


CASES = cases()


def run(argv: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("SA_FENCE_")}
    return subprocess.Popen(
        [sys.executable, "-m", "sa_fence", *argv],
        cwd=ROOT,
        env={**base, "PYTHONPATH": str(ROOT), **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.fixture(scope="module")
def results() -> dict[str, tuple[int, str, str]]:
    """Every case's (exit status, stdout, stderr), the processes run side by side."""
    started = {case.id: run(*case.argv()) for case in CASES}
    done = {}
    for key, process in started.items():
        out, err = process.communicate(timeout=180)
        done[key] = (process.returncode, out, err)
    return done


def test_the_cases_cover_every_url_option_of_every_command() -> None:
    options = url_options()
    # the commands known to take a URL today: a new one is covered, none may be lost
    assert {"demo", "check", "repair-sequence", "bench", "status", "create-guard", "prune"} <= set(
        options
    )
    assert {o for found in options.values() for o in found} <= set(KIND)  # a new kind: add it
    assert "--redis" in options["bench"]


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_a_bad_url_is_one_line_exit_2_and_never_shows_the_password(
    case: Case, results: dict[str, tuple[int, str, str]]
) -> None:
    status, out, err = results[case.id]
    assert SECRET not in out + err, err
    assert "Traceback" not in err, err
    assert status == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert case.option in lines[0], err  # refused for its URL, not for something else
    assert lines[0].startswith(f"sa-fence {case.command}: error: "), err


def test_a_url_given_as_a_stray_argument_is_not_echoed() -> None:
    """argparse quotes what it cannot place: ``unrecognized arguments: URL``."""
    process = run(["check", f"postgresql+psycopg://u:{SECRET}@h/db"], {})
    out, err = process.communicate(timeout=180)
    assert process.returncode == 2, err
    assert "unrecognized arguments" in err
    assert SECRET not in out + err, err


def test_a_password_query_parameter_is_not_shown_when_the_database_is_unreachable() -> None:
    process = run(
        ["check", "--url", f"postgresql+psycopg://u@127.0.0.1:1/db?password={SECRET}"], {}
    )
    out, err = process.communicate(timeout=180)
    assert process.returncode == 3, err
    assert "cannot connect to postgresql+psycopg://u:***@127.0.0.1:1/db" in err
    assert SECRET not in out + err, err


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        (f"postgresql+psycopg//u:{SECRET}@h/db", "postgresql+psycopg//u:***@h/db"),
        (f"postgresql+psycopg://u:{SECRET}@h:notaport/db", "postgresql+psycopg://u:***@h:notaport/db"),
        (f"redis//:{SECRET}@h/0", "redis//:***@h/0"),
        (f"postgresql+psycopg:u:{SECRET}@h/db", "postgresql+psycopg:***@h/db"),
        (f"postgresql://u:a b/c@{SECRET}@h/db", "postgresql://u:***@h/db"),
        (f"postgresql://u@h/db?sslmode=require&password={SECRET}", "postgresql://u@h/db?sslmode=require&password=***"),
        (f"host=h password={SECRET} dbname=x", "host=h password=*** dbname=x"),
        ("postgresql://u@h/db", "postgresql://u@h/db"),
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
        ("::not a url::", "::not a url::"),
    ],
)  # fmt: skip
def test_redact_url_hides_the_password_of_what_does_not_parse_too(text: str, shown: str) -> None:
    from sa_fence.cli.redact import redact_url

    assert redact_url(text) == shown


def test_redact_text_hides_each_url_like_word_of_a_message() -> None:
    from sa_fence.cli.redact import redact_text

    message = (
        f"unrecognized arguments: postgresql+psycopg//u:{SECRET}@h/db; expected e.g. "
        f"postgresql+psycopg://user@host:5432/dbname, not 'redis://:{SECRET}@h:x/0'"
    )
    assert redact_text(message) == (
        "unrecognized arguments: postgresql+psycopg//u:***@h/db; expected e.g. "
        "postgresql+psycopg://user@host:5432/dbname, not 'redis://:***@h:x/0'"
    )
