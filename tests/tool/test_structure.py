"""The tool's layering, checked on its source: one runner, a click-free library, thin
commands, and the floors of the wings (see docs/layout.md)."""

from __future__ import annotations

import ast
from pathlib import Path

import click
import pytest

from hybridpd.cli.main import main

TOOL = Path(__file__).resolve().parents[2] / "tool" / "hybridpd"
#: The only modules that start processes or use GitPython.
RUNNERS = {TOOL / "proc.py", TOOL / "gitops.py"}
CLI = TOOL / "cli"
MAX_COMMAND_LINES = 30


def _modules() -> list[Path]:
    return sorted(p for p in TOOL.rglob("*.py") if "data" not in p.relative_to(TOOL).parts)


def _imported(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_only_proc_and_gitops_start_processes_or_use_gitpython() -> None:
    found = {
        str(path.relative_to(TOOL)): sorted(_imported(path) & {"subprocess", "git", "pty"})
        for path in _modules()
        if path not in RUNNERS
    }
    assert {k: v for k, v in found.items() if v} == {}


def test_the_library_does_not_import_click() -> None:
    found = [
        str(path.relative_to(TOOL))
        for path in _modules()
        if CLI not in path.parents and "click" in _imported(path)
    ]
    assert found == []


def _commands(group: click.Group) -> list[click.Command]:
    found = []
    for command in group.commands.values():
        if isinstance(command, click.Group):
            found += _commands(command)
        found.append(command)
    return found


def _length(function) -> int:
    """Lines of ``function`` from its ``def`` to its end, without its docstring."""
    code = function.__code__
    node = next(
        n for n in ast.walk(ast.parse(Path(code.co_filename).read_text(encoding="utf-8")))
        if isinstance(n, ast.FunctionDef) and n.name == function.__name__
        and min([n.lineno, *(d.lineno for d in n.decorator_list)]) == code.co_firstlineno
    )
    lines = node.end_lineno - node.lineno + 1
    doc = node.body[0]
    if isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant):
        lines -= doc.end_lineno - doc.lineno + 1
    return lines


@pytest.mark.parametrize("command", _commands(main), ids=lambda c: c.name)
def test_every_command_is_thin(command: click.Command) -> None:
    callback = command.callback
    while hasattr(callback, "__wrapped__"):  # click.pass_obj / pass_context
        callback = callback.__wrapped__
    assert Path(callback.__code__.co_filename).parent == CLI
    assert _length(callback) <= MAX_COMMAND_LINES, f"{command.name}: parse, call, render"


_LOG_TYPE = ("Callable[[str], None]", "typing.Callable[[str], None]")


def _is_log_alias(node: ast.AST) -> bool:
    """``X = Callable[[str], None]`` (or ``X: TypeAlias = ...``): a private ``progress.Log``."""
    value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
    return value is not None and ast.unparse(value) in _LOG_TYPE


def _is_silent(node: ast.AST) -> bool:
    """A module-level function of one argument, or a lambda, that does nothing: a
    private ``progress.quiet``."""
    if isinstance(node, ast.Lambda):
        return len(node.args.args) == 1 and isinstance(node.body, ast.Constant) \
            and node.body.value is None
    if not isinstance(node, ast.FunctionDef) or len(node.args.args) != 1:
        return False
    body = [s for s in node.body if not (isinstance(s, ast.Expr)
                                         and isinstance(s.value, ast.Constant))]
    return all(isinstance(s, ast.Pass) for s in body)


def _log_problems(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = [node for node in tree.body if _is_log_alias(node) or _is_silent(node)]
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            args = node.args
            positional = args.posonlyargs + args.args
            pairs = list(zip(positional[len(positional) - len(args.defaults):], args.defaults))
            pairs += [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None]
            for arg, default in pairs:
                if arg.arg == "log" and _is_silent(default):
                    found.append(default)
                if arg.arg in ("log", "status") and arg.annotation is not None \
                        and ast.unparse(arg.annotation) in _LOG_TYPE:
                    found.append(arg)
        if isinstance(node, ast.keyword) and node.arg == "log":
            value = node.value
            if isinstance(value, ast.IfExp):
                value = value.body if _is_silent(value.body) else value.orelse
            if _is_silent(value):
                found.append(value)
    return [f"{path.relative_to(TOOL)}:{node.lineno}" for node in found]


def test_progress_has_one_log_type_and_one_silent_default() -> None:
    """``progress.Log`` is the type of every ``log``, ``progress.quiet`` the one silence."""
    found = [p for path in _modules() if path != TOOL / "progress.py" for p in _log_problems(path)]
    assert found == []


def test_only_the_store_and_guard_take_locks() -> None:
    """Cache entries lock through ``cache.lock``, repositories and destinations through
    ``guard``: no third lock implementation."""
    found = [
        str(path.relative_to(TOOL))
        for path in _modules()
        if path not in (TOOL / "cache.py", TOOL / "guard.py") and "fcntl" in _imported(path)
    ]
    assert found == []


# The floor plan: each wing imports only from the floors below it (and from itself); the
# plumbing is the flat top level. A wing's rank is its floor; wings on one floor do not
# import each other.
PLUMBING = {"__init__", "cache", "connectors", "errors", "gitlocks", "gitops", "guard", "pkgindex",
            "proc", "progress", "scratch", "speculative"}
FLOORS = {
    "series": 1,
    "porting": 2, "proof": 2,
    "envs": 3,
    "e2e": 4, "bench": 4,
    "explain": 5, "upstreaming": 5,
    "cli": 6,
}


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _wing(module: str) -> str | None:
    """``hybridpd.<wing>.…``'s wing, or None for the plumbing."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 else None


def _floor(module: str) -> int:
    wing = _wing(module)
    return 0 if wing is None else FLOORS[wing]


def _imports(root: Path, path: Path) -> set[str]:
    """Every hybridpd module ``path`` imports: at module level or inside a function, by an
    import statement or by ``importlib.import_module``/``__import__`` of a literal name."""
    module = _module_name(root, path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            found.add(base)
            # ``from hybridpd.series import model``: the module, not only its package.
            found |= {f"{base}.{alias.name}" for alias in node.names
                      if (root.parent / f"{base}.{alias.name}".replace(".", "/")).with_suffix(".py").is_file()}
        elif isinstance(node, ast.Call) and node.args \
                and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str) \
                and ast.unparse(node.func) in ("importlib.import_module", "import_module",
                                               "__import__"):
            found.add(node.args[0].value)
    return {name for name in found if name.split(".")[0] == root.name and name != module}


def _layering_problems(root: Path) -> list[str]:
    """Upward or sideways imports between wings, top-level modules that are not plumbing,
    and import loops, in the package at ``root``."""
    problems = []
    modules = sorted(p for p in root.rglob("*.py") if "data" not in p.relative_to(root).parts)
    graph = {}
    for path in modules:
        name = _module_name(root, path)
        if path.parent == root and path.stem not in PLUMBING:
            problems.append(f"{name}: a top-level module that is not plumbing (give it a wing)")
        if _wing(name) is not None and _wing(name) not in FLOORS:
            problems.append(f"{name}: a wing without a floor in FLOORS")
            continue
        graph[name] = _imports(root, path)
        for target in sorted(graph[name]):
            if _wing(target) == _wing(name) or _wing(target) not in (None, *FLOORS):
                continue
            if _floor(target) >= _floor(name):
                problems.append(f"{name} imports {target}: not from a lower floor")
    # Loops, with packages standing for their __init__ (``from hybridpd.cli import x``).
    state: dict[str, int] = {}

    def visit(name: str, trail: list[str]) -> None:
        state[name] = 1
        for target in sorted(graph.get(name, ())):
            if target not in graph:
                continue
            if state.get(target) == 1:
                problems.append("import loop: " + " -> ".join(trail[trail.index(target):]
                                                              + [target]))
            elif target not in state:
                visit(target, trail + [target])
        state[name] = 2

    for name in graph:
        if name not in state:
            visit(name, [name])
    return problems


def test_wings_import_only_from_lower_floors_and_never_in_a_loop() -> None:
    assert _layering_problems(TOOL) == []


@pytest.mark.parametrize("planted", [
    # an upward import at module level, inside a function, and by importlib
    ("series/model.py", "\nfrom hybridpd.cli import options\n", "imports hybridpd.cli"),
    ("proc.py", "\ndef _f():\n    from hybridpd.envs import build\n", "imports hybridpd.envs"),
    ("e2e/report.py", "\nimport importlib\n_m = importlib.import_module('hybridpd.bench.env')\n",
     "imports hybridpd.bench.env"),
    # a loop inside one wing
    ("e2e/metrics.py", "\nfrom hybridpd.e2e import client\n", "import loop"),
    # a shim at the top
    ("build.py", "from hybridpd.envs.build import *\n", "not plumbing"),
])
def test_the_layering_check_goes_red_on_a_planted_import(tmp_path: Path, planted) -> None:
    import shutil

    root = tmp_path / "hybridpd"
    shutil.copytree(TOOL, root, ignore=shutil.ignore_patterns("data", "__pycache__"))
    relative, code, expected = planted
    with open(root / relative, "a", encoding="utf-8") as handle:
        handle.write(code)
    assert any(expected in problem for problem in _layering_problems(root))


#: Parameter names that hold a pin. Outside ``cli/`` a pin is a :class:`Pin`, resolved
#: once where a command starts (``cli.options.pin_option``); a release that is not (yet)
#: a pin is a ``release``.
_PIN_PARAMS = ("version", "pin", "pin_version")


def _str_pin_params(path: Path, root: Path = TOOL) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            for arg in args.posonlyargs + args.args + args.kwonlyargs:
                annotation = ast.unparse(arg.annotation) if arg.annotation else ""
                if arg.arg in _PIN_PARAMS and "Pin" not in annotation:
                    found.append(f"{path.relative_to(root)}:{node.lineno} "
                                 f"{node.name}({arg.arg}: {annotation or '?'})")
    return found


def test_library_functions_take_a_pin_not_a_version_string() -> None:
    found = [p for path in _modules() if CLI not in path.parents
             for p in _str_pin_params(path)]
    assert found == []


def test_the_pin_check_goes_red_on_a_version_string(tmp_path: Path) -> None:
    planted = tmp_path / "planted.py"
    planted.write_text("from hybridpd.series.model import Pin\n\n"
                       "def ok(pin: Pin, release: str): ...\n"
                       "def bad(series, version: str): ...\n"
                       "def worse(pin): ...\n")
    assert _str_pin_params(planted, tmp_path) == ["planted.py:4 bad(version: str)",
                                                  "planted.py:5 worse(pin: ?)"]


@pytest.mark.parametrize("option", ["--pin", "--torch", "--connector"])
def test_shared_options_are_declared_once(option: str) -> None:
    """Every command's ``--pin`` comes from ``cli.options.pin_option`` (its default rule a
    parameter), ``--torch`` and ``--connector`` from their factories there: no command
    declares its own."""
    found = [f"{path.relative_to(TOOL)}:{node.lineno}"
             for path in sorted(CLI.glob("*.py")) if path.name != "options.py"
             for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
             if isinstance(node, ast.Call) and ast.unparse(node.func) == "click.option"
             and any(isinstance(a, ast.Constant) and a.value == option for a in node.args)]
    assert found == []


def test_every_pin_is_resolved_by_the_factory() -> None:
    pins = [p for c in _commands(main) for p in c.params if "--pin" in getattr(p, "opts", ())]
    assert pins and all(p.callback.__qualname__.startswith("_resolve_pin") for p in pins)
