"""The tool's layering, checked on its source: one runner, a click-free library, thin
commands (see README's "Layout")."""

from __future__ import annotations

import ast
from pathlib import Path

import click
import pytest

from hybridpd.cli import main

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
