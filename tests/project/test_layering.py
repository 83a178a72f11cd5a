"""The package's modules import one another in one direction only.

A cycle among sa_fence modules, at run time or under ``if TYPE_CHECKING:``, means
two modules cannot be read, tested or moved apart; this test parses every module
with :mod:`ast` (imports at the top, inside functions and under ``TYPE_CHECKING``
alike) and fails naming the first cycle it finds.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "sa_fence"


def _module_name(path: Path, root: Path) -> str:
    parts = [root.name, *path.relative_to(root).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(current: str, is_package: bool, level: int, module: str | None) -> str:
    """The absolute name of ``from <level dots><module> import ...`` in ``current``."""
    if level == 0:
        return module or ""
    base = current.split(".")
    drop = level - 1 if is_package else level
    base = base[: len(base) - drop]
    return ".".join([*base, module] if module else base)


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the package modules it imports, anywhere in its source."""
    modules = {_module_name(path, root): path for path in sorted(root.rglob("*.py"))}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(name, is_package, node.level, node.module)
                # ``from . import _flush`` imports the module _flush, not the package
                targets = [base, *(f"{base}.{alias.name}" for alias in node.names)]
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                # a submodule importing its own package's __init__ is not a dependency
                # worth a cycle (Python runs __init__ first anyway)
                if target and target != name and not name.startswith(target + "."):
                    graph[name].add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as [a, b, ..., a], or None."""
    done: set[str] = set()
    for start in sorted(graph):
        if start in done:
            continue
        path: list[str] = [start]
        on_path = {start}
        stack = [iter(sorted(graph[start]))]
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                stack.pop()
                done.add(on_path_node := path.pop())
                on_path.discard(on_path_node)
                continue
            if nxt in on_path:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in done:
                path.append(nxt)
                on_path.add(nxt)
                stack.append(iter(sorted(graph[nxt])))
    return None


TOOLS = "sa_fence.cli"
#: The one core module that may import the tools: ``python -m sa_fence`` runs the command.
TOOLS_ENTRY_POINTS = {"sa_fence.__main__"}


def core_imports_of_tools(graph: dict[str, set[str]], tools: str = TOOLS) -> list[str]:
    """``module -> tool`` for each core module importing the tools subpackage,
    at the top, inside a function or under ``TYPE_CHECKING`` (``import_graph``)."""
    return sorted(
        f"{module} -> {target}"
        for module, targets in graph.items()
        if module != tools and not module.startswith(tools + ".")
        for target in targets
        if target == tools or target.startswith(tools + ".")
    )


def test_the_core_never_imports_the_tools() -> None:
    graph = import_graph(PACKAGE)
    assert any(name.startswith(TOOLS + ".") for name in graph)  # the subpackage is there
    found = [
        entry
        for entry in core_imports_of_tools(graph)
        if entry.split(" -> ")[0] not in TOOLS_ENTRY_POINTS
    ]
    assert found == [], "the core imports sa_fence.cli (tools depend on the core): " + "; ".join(
        found
    )


@pytest.mark.parametrize(
    "source",
    [
        pytest.param("from .tools import cli\n", id="run-time"),
        pytest.param("def f():\n    from .tools.cli import main\n", id="inside-a-function"),
        pytest.param(
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.tools.cli\n",
            id="type-checking",
        ),
    ],
)
def test_a_core_import_of_the_tools_is_found(tmp_path: Path, source: str) -> None:
    files = {
        "__init__.py": "",
        "core.py": source,
        "tools/__init__.py": "",
        "tools/cli.py": "from ..core import f\n",
    }
    graph = import_graph(_write(tmp_path, files))
    assert "pkg.core -> pkg.tools.cli" in core_imports_of_tools(graph, tools="pkg.tools")


#: The core's line budget (issue 20's 7,000 lines, a ratchet) is withdrawn (issue 47): it
#: measured the wrong thing and began to shape the code.  What replaces it are measures a
#: maintainer would block a merge on: no import cycle, no import from a lower layer to a
#: higher one, no core module over MODULE_LINES, no function over McCabe 15 (ruff's C901,
#: pyproject.toml), other libraries' private members listed in one place.

#: The package's rooms from the bottom up: a module may import its own room and the rooms
#: below it, never one above (docs/architecture.md draws them).
LAYERS = (
    "sa_fence.errors",
    "sa_fence._failures",
    "sa_fence.db",
    "sa_fence._lease_view",
    "sa_fence.telemetry",
    "sa_fence.scope",
    "sa_fence.orm",
    "sa_fence.lease",
    "sa_fence.integrations",
    "sa_fence.alembic",
    "sa_fence.testing",
    "sa_fence",
    "sa_fence.cli",
    "sa_fence.__main__",
)
#: The most lines a module of the library may have (the command line's are not counted).
MODULE_LINES = 800
#: The most modules directly under sa_fence/ (the rest live in the rooms).
TOP_LEVEL_MODULES = 8


def layer_of(module: str, layers: tuple[str, ...] = LAYERS) -> int:
    """The index in ``layers`` of the longest entry that is ``module`` or its package."""
    best = max(
        (entry for entry in layers if module == entry or module.startswith(entry + ".")),
        key=len,
    )
    return layers.index(best)


def upward_imports(graph: dict[str, set[str]], layers: tuple[str, ...] = LAYERS) -> list[str]:
    """``module -> target`` for each import from a lower room to a higher one."""
    return sorted(
        f"{module} -> {target}"
        for module, targets in graph.items()
        for target in targets
        if layer_of(target, layers) > layer_of(module, layers)
    )


def test_no_import_cycle_among_package_modules() -> None:
    cycle = find_cycle(import_graph(PACKAGE))
    assert cycle is None, "import cycle among sa_fence modules: " + " -> ".join(cycle or [])


def test_every_import_runs_down_the_layers() -> None:
    graph = import_graph(PACKAGE)
    unplaced = [m for m in graph if m != "sa_fence" and layer_of(m) == LAYERS.index("sa_fence")]
    assert unplaced == [], "a module in no room of LAYERS: " + ", ".join(unplaced)
    found = upward_imports(graph)
    assert found == [], "an import runs back up the layers (LAYERS): " + "; ".join(found)


def test_an_import_back_up_the_layers_is_found(tmp_path: Path) -> None:
    files = {
        "__init__.py": "",
        "low/__init__.py": "",
        "low/a.py": "def f():\n    from ..high import b\n",
        "high/__init__.py": "",
        "high/b.py": "from ..low.a import f\n",
    }
    layers = ("pkg.low", "pkg.high", "pkg")
    graph = import_graph(_write(tmp_path, files))
    assert upward_imports(graph, layers) == ["pkg.low.a -> pkg.high", "pkg.low.a -> pkg.high.b"]
    assert upward_imports(graph, ("pkg.high", "pkg.low", "pkg")) == ["pkg.high.b -> pkg.low.a"]


def test_no_library_module_is_over_its_size() -> None:
    over = {
        str(path.relative_to(PACKAGE.parent)): lines
        for path in PACKAGE.rglob("*.py")
        if TOOLS.replace(".", "/") not in path.as_posix()
        and (lines := len(path.read_text(encoding="utf-8").splitlines())) > MODULE_LINES
    }
    assert over == {}, f"split these by concern (at most {MODULE_LINES} lines a module): {over}"


def test_few_modules_sit_directly_in_the_package() -> None:
    top = sorted(path.name for path in PACKAGE.glob("*.py"))
    assert len(top) <= TOP_LEVEL_MODULES, f"move some into a room: {top}"


def test_no_function_is_over_the_complexity_pyproject_allows() -> None:
    """ruff's C901 at pyproject.toml's max-complexity (15), run as ``make lint`` runs it."""
    import subprocess
    import sys

    ruff = Path(sys.executable).with_name("ruff")
    done = subprocess.run(
        [str(ruff), "check", "--select", "C901", "--output-format", "concise", str(PACKAGE)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def _write(root: Path, files: dict[str, str]) -> Path:
    package = root / "pkg"
    for name, source in files.items():
        path = package / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source, encoding="utf-8")
    return package


@pytest.mark.parametrize(
    "files",
    [
        pytest.param(
            {"__init__.py": "", "a.py": "from .b import x\n", "b.py": "from .a import y\n"},
            id="run-time",
        ),
        pytest.param(
            {
                "__init__.py": "",
                "a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                "    from .b import x\n",
                "b.py": "from . import c\n",
                "c.py": "import pkg.a\n",
            },
            id="type-checking",
        ),
        pytest.param(
            {
                "__init__.py": "",
                "a.py": "def f():\n    from . import b\n",
                "b.py": "from .a import f\n",
            },
            id="inside-a-function",
        ),
    ],
)
def test_a_cycle_is_found_and_named(tmp_path: Path, files: dict[str, str]) -> None:
    cycle = find_cycle(import_graph(_write(tmp_path, files)))
    assert cycle is not None
    assert cycle[0] == cycle[-1]
    assert {"pkg.a", "pkg.b"} <= set(cycle)


def test_imports_in_one_direction_are_no_cycle(tmp_path: Path) -> None:
    files = {
        "__init__.py": "from .b import x\nfrom .a import y\n",
        "a.py": "from .b import x\nfrom . import c\n",
        "b.py": "from .c import z\nimport pkg\n",
        "c.py": "z = 1\n",
    }
    assert find_cycle(import_graph(_write(tmp_path, files))) is None


#: Private names one module still takes from another (none: give them public names).
PRIVATE_IMPORTS_ALLOWED: set[tuple[str, str]] = set()


def private_names_taken(root: Path) -> list[str]:
    """``module -> other: _name`` for each private name a module takes from another.

    Both forms count: ``from ._other import _name`` and ``_other._name`` where
    ``_other`` was imported as a module (``from . import _other [as alias]``).
    """
    modules = {_module_name(path, root): path for path in sorted(root.rglob("*.py"))}
    found: list[str] = []
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        aliases: dict[str, str] = {}  # local name -> package module it stands for
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            base = _resolve(name, is_package, node.level, node.module)
            for alias in node.names:
                if f"{base}.{alias.name}" in modules:
                    aliases[alias.asname or alias.name] = f"{base}.{alias.name}"
                elif (
                    base in modules
                    and base != name
                    and alias.name.startswith("_")
                    and not alias.name.startswith("__")
                ):
                    found.append(f"{name} -> {base}: {alias.name}")
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                found.append(f"{name} -> {aliases[node.value.id]}: {node.attr}")
    return sorted(
        entry
        for entry in set(found)
        if tuple(entry.split(":")[0].split(" -> ")) not in PRIVATE_IMPORTS_ALLOWED
    )


def test_no_module_takes_another_modules_private_names() -> None:
    taken = private_names_taken(PACKAGE)
    assert taken == [], "give the owner a name without a leading underscore: " + "; ".join(taken)


def test_a_private_name_taken_is_found(tmp_path: Path) -> None:
    files = {
        "__init__.py": "",
        "a.py": "_x = 1\ny = 2\n",
        "b.py": "from .a import _x, y\n",
        "c.py": "from . import a as m\nprint(m._x, m.y)\n",
    }
    assert private_names_taken(_write(tmp_path, files)) == [
        "pkg.b -> pkg.a: _x",
        "pkg.c -> pkg.a: _x",
    ]


def test_a_sqlalchemy_without_the_connection_methods_sa_fence_overrides_is_refused() -> None:
    """sa-fence fences a connection by overriding private Connection methods
    (sa_fence.orm.statements.FencedConnection); one renamed in a SQLAlchemy release
    would never be called, so the import refuses instead of leaving writes open."""
    import pytest
    from sqlalchemy import Connection

    from sa_fence.orm import statements

    statements.check_connection_api(Connection)  # this SQLAlchemy: accepted

    class Renamed(Connection):
        _commit_impl = None  # type: ignore[assignment]

    with pytest.raises(ImportError, match=r"Connection\._commit_impl is missing"):
        statements.check_connection_api(Renamed)

    class OtherArguments(Connection):
        def _begin_impl(self, transaction: object, extra: object = None) -> None: ...

    with pytest.raises(ImportError, match="takes other arguments"):
        statements.check_connection_api(OtherArguments)


#: Private members of other libraries that sa-fence reads, by (reading module,
#: member): each with why there is no public equivalent, or none that costs nothing.
THIRD_PARTY_PRIVATE_READS: dict[tuple[str, str], str] = {
    ("sa_fence.db.fitness", "_mapping"): "SQLAlchemy Row._mapping is public API despite the _",
    ("sa_fence.orm.flush", "_new"): "Session._new: pending objects without copying Session.new",
    ("sa_fence.orm.flush", "_deleted"): "Session._deleted: deleted objects without a copy",
    ("sa_fence.orm.statements", "_dict"): "IdentityMap._dict: a state by its key, no call a row",
    ("sa_fence.orm.flush", "_modified"): "IdentityMap._modified: changed states, no public set",
    ("sa_fence.orm.flush", "_parent"): "SessionTransaction.parent is a property: a call per end",
    (
        "sa_fence.scope.arming",
        "_start_query",
    ): "psycopg's BEGIN generator, wrapped to send the arm in it",
    ("sa_fence.scope.arming", "_sync_gen"): "psycopg's pipeline sync step, sent after the arm",
    ("sa_fence.scope.arming", "_encoding"): "psycopg PGconn's encoding, for error_from_result",
    ("sa_fence.scope.arming", "_pipeline"): "psycopg's pipeline in progress (None outside one)",
    (
        "sa_fence.scope.arming",
        "_handle_dbapi_exception",
    ): "a failed COMMIT handled as SQLAlchemy does",
    ("sa_fence.scope.arming", "_num_transactions"): "psycopg's count of open transaction() blocks",
    ("sa_fence.orm.statements", "_is_table"): "Table or alias, with no call on each unfenced write",
    ("sa_fence.orm.statements", "_deannotate"): "the ORM's annotated table back to the plain Table",
    ("sa_fence.orm.session_state", "_transaction"): "the flush's subtransaction (not the root)",
    ("sa_fence.orm.session_state", "_annotations"): "an ORM bulk statement's mark (no reader)",
    ("sa_fence.orm.statements", "_annotations"): "the table an ORM bulk statement writes",
    ("sa_fence.orm.session_state", "_compiled_cache"): "the unit of work's statement cache",
    ("sa_fence.orm.model", "_mapper_registries"): "SQLAlchemy's registries: every mapped class",
    ("sa_fence.orm.model", "_managers"): "a registry's classes, mapped or not (registry.mappers "
    "raises for a class whose mapping failed; it reads the same)",
    ("sa_fence.orm.model", "_equivalent_columns"): "the columns inheritance conditions equate",
    ("sa_fence.orm.rewrite", "_generate"): "SQLAlchemy's statement copy, to add the fence clauses",
    ("sa_fence.orm.rewrite", "_clone"): "SQLAlchemy's clause copy (no public one)",
    ("sa_fence.orm.rewrite", "_values"): "an UPDATE's or INSERT's SET values (no public reader)",
    ("sa_fence.orm.rewrite", "_ordered_values"): "an ordered UPDATE's SET values",
    ("sa_fence.orm.rewrite", "_multi_values"): "a multi-row INSERT's values",
    ("sa_fence.orm.rewrite", "_select_names"): "an INSERT FROM SELECT's columns",
    ("sa_fence.orm.rewrite", "_post_values_clause"): "an upsert's ON CONFLICT clause",
    ("sa_fence.orm.rewrite", "_deannotate"): "the ORM's annotated table back to the plain Table",
    ("sa_fence.telemetry", "_tracer"): "OpenTelemetry's proxy tracer: no span without a provider",
    ("sa_fence.telemetry", "_real_instrument"): "OpenTelemetry's proxy histogram: idle?",
    ("sa_fence.db.tokens", "_invalidate"): "Pool._invalidate: recycle the pool as on a disconnect",
    ("sa_fence.db.tokens", "_sequences"): "MetaData._sequences: a Sequence declared on no column "
    "(no public reader), checked fit where it is declared",
    ("sa_fence.cli.demo", "_exit"): "os._exit is public API despite the _",
}


def _defined(tree: ast.AST) -> set[str]:
    """The names a module defines: functions, classes, assigned names (class
    attributes included) and ``self.``/``cls.`` attributes it sets."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name)
            and node.value.id in ("self", "cls")
        ):
            names.add(node.attr)
    return names


def _private_reads(root: Path) -> list[tuple[str, int, str, str, list[str]]]:
    """(module, line, expression, member, the modules defining it) for each
    ``X._name`` a module reads or sets (not on ``self``/``cls``, not a dunder)
    whose ``_name`` it does not define itself."""
    modules = {_module_name(path, root): path for path in sorted(root.rglob("*.py"))}
    trees = {
        name: ast.parse(path.read_text(encoding="utf-8"), str(path))
        for name, path in modules.items()
    }
    defined = {name: _defined(tree) for name, tree in trees.items()}
    return [
        (
            name,
            node.lineno,
            ast.unparse(node),
            node.attr,
            sorted(o for o, d in defined.items() if node.attr in d),
        )
        for name, tree in trees.items()
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr.startswith("_")
        and not node.attr.startswith("__")
        and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
        and node.attr not in defined[name]
    ]


def _room(module: str) -> str:
    """The subpackage a module belongs to (``sa_fence.orm`` for ``sa_fence.orm.flush``); a
    module directly in the package is a room of its own.  A room's modules share its
    private members, as one module's functions do."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 else module


def private_members_read(
    root: Path, allowed: dict[tuple[str, str], str] = THIRD_PARTY_PRIVATE_READS
) -> list[str]:
    """``module:line expression (why)`` for each private member a module takes
    from another sa_fence module, or from another library unless ``allowed``."""
    return sorted(
        {
            f"{module}:{line} {expression} ("
            + (
                f"{member} is defined by {', '.join(owners)}"
                if owners
                else "another library's private member, not in THIRD_PARTY_PRIVATE_READS"
            )
            + ")"
            for module, line, expression, member, owners in _private_reads(root)
            if (module, member) not in allowed
            and not any(_room(owner) == _room(module) for owner in owners)
        }
    )


def test_no_module_reads_another_modules_private_members() -> None:
    found = private_members_read(PACKAGE)
    assert found == [], (
        "a module reaches into another's private members; use the owner's interface "
        "(sa_fence._lease_view.LeaseView, docs/architecture.md): " + "; ".join(found)
    )


def test_every_third_party_private_read_listed_is_still_made() -> None:
    made = {(module, member) for module, _, _, member, _ in _private_reads(PACKAGE)}
    stale = sorted(
        f"{module}: {member}" for module, member in set(THIRD_PARTY_PRIVATE_READS) - made
    )
    assert stale == [], "no longer read, remove from THIRD_PARTY_PRIVATE_READS: " + "; ".join(stale)


def test_a_private_member_read_is_found(tmp_path: Path) -> None:
    files = {
        "__init__.py": "",
        "core.py": "class Lease:\n    _state = None\n\n    def ok(self):\n"
        "        return self._state\n",
        "hook.py": "def f(lease):\n    return lease._state.lost, lease.__class__\n",
        "own.py": "class A:\n    _x = 1\n\ndef g(a):\n    return a._x\n",
        "other.py": "import os\n\ndef h():\n    os._exit(0)\n",
    }
    assert private_members_read(_write(tmp_path, files), allowed={}) == [
        "pkg.hook:2 lease._state (_state is defined by pkg.core)",
        "pkg.other:4 os._exit (another library's private member, not in THIRD_PARTY_PRIVATE_READS)",
    ]
    assert private_members_read(
        _write(tmp_path, files), allowed={("pkg.other", "_exit"): "public"}
    ) == ["pkg.hook:2 lease._state (_state is defined by pkg.core)"]


def test_a_rooms_modules_share_its_private_members(tmp_path: Path) -> None:
    files = {
        "__init__.py": "",
        "room/__init__.py": "",
        "room/state.py": "class State:\n    _mark = False\n",
        "room/hook.py": "def f(state):\n    return state._mark\n",
        "outside.py": "def g(state):\n    return state._mark\n",
    }
    assert private_members_read(_write(tmp_path, files), allowed={}) == [
        "pkg.outside:2 state._mark (_mark is defined by pkg.room.state)",
    ]
