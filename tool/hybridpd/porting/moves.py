"""Where upstream moved a file between two releases: what a port's stop names.

A patch of the series names the paths of its source release. When the target release
renamed such a file, or turned it into a module that only re-exports names defined
elsewhere (vLLM does both when it splits a module), git either merges nothing or puts
conflict markers over the whole file, and neither says where the code went. This module
answers from the two release commits of the port repository:

- ``renamed``: git's rename detection between the releases pairs the path with another;
- ``re-export``: the path still exists in the target, but every statement of it is an
  import (or ``__all__``, a docstring), while the source release defined code there: the
  modules it imports from are where the code went.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import PurePosixPath

from hybridpd import gitops


@dataclass(frozen=True)
class Move:
    """``path`` (the source release's) and where the target release has its code."""

    path: str
    how: str  # "renamed" or "re-export"
    to: tuple[str, ...]

    def describe(self, release: str) -> str:
        where = ", ".join(self.to)
        if self.how == "renamed":
            return f"{self.path}: renamed to {where} in {release}"
        return (f"{self.path}: only re-exports names in {release}; its code moved to "
                f"{where}")

    def to_json(self) -> dict:
        return {"path": self.path, "how": self.how, "to": list(self.to)}


def moves(repo, old_rev: str, new_rev: str, paths) -> tuple[Move, ...]:
    """The moves of ``paths`` from commit ``old_rev`` to ``new_rev`` in ``repo``."""
    paths = sorted(set(paths))
    if not paths:
        return ()
    renamed = _renames(repo, old_rev, new_rev)
    out = []
    for path in paths:
        if path in renamed:
            out.append(Move(path, "renamed", (renamed[path],)))
            continue
        new = _text(repo, new_rev, path)
        old = _text(repo, old_rev, path)
        if new is None or old is None or not path.endswith(".py"):
            continue
        targets = _reexported_from(new, path)
        if targets and _defines_code(old):
            found = tuple(t for t in targets if _text(repo, new_rev, t) is not None)
            if found:
                out.append(Move(path, "re-export", found))
    return tuple(out)


def _renames(repo, old_rev: str, new_rev: str) -> dict[str, str]:
    out = gitops.check(repo, "diff", "-M", "--name-status", "--diff-filter=R", "-z",
                       old_rev, new_rev)
    fields = out.split("\0")
    renames = {}
    for i in range(0, len(fields) - 2, 3):
        if fields[i].startswith("R"):
            renames[fields[i + 1]] = fields[i + 2]
    return renames


def _text(repo, rev: str, path: str) -> str | None:
    try:
        return gitops.read_blob(repo, rev, path).decode("utf-8", errors="replace")
    except gitops.GitError:  # no such file at rev
        return None


def _body(text: str) -> list[ast.stmt] | None:
    try:
        return ast.parse(text).body
    except SyntaxError:
        return None


def _defines_code(text: str) -> bool:
    body = _body(text) or []
    return any(isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
               for s in body)


def _reexported_from(text: str, path: str) -> tuple[str, ...]:
    """The files of the modules a pure re-export module imports from (empty: the module
    has code of its own)."""
    body = _body(text)
    if not body:
        return ()
    modules = []
    for stmt in body:
        if isinstance(stmt, ast.ImportFrom):
            modules.append(_module_path(stmt, path))
        elif isinstance(stmt, ast.Import):
            modules += [n.name.replace(".", "/") for n in stmt.names]
        elif isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
            continue  # a docstring
        elif isinstance(stmt, (ast.Assign, ast.AnnAssign)) and _assigns_all(stmt):
            continue
        else:
            return ()
    found = []
    for module in dict.fromkeys(m for m in modules if m and not m.startswith("__future__")):
        found += [f"{module}.py", f"{module}/__init__.py"]
    return tuple(found)


def _assigns_all(stmt) -> bool:
    targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
    return all(isinstance(t, ast.Name) and t.id == "__all__" for t in targets)


def _module_path(stmt: ast.ImportFrom, path: str) -> str:
    if stmt.level == 0:
        return (stmt.module or "").replace(".", "/")
    package = PurePosixPath(path).parent
    for _ in range(stmt.level - 1):
        package = package.parent
    tail = (stmt.module or "").replace(".", "/")
    return str(package / tail) if tail else str(package)
