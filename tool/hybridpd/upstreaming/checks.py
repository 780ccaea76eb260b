"""The target project's own checks, for ``--verify``: the hooks its
``.pre-commit-config.yaml`` runs, without ``pre-commit`` (which fetches its hooks from
GitHub). Each hook's tool is installed at the version the config pins, from the
package index, into a tool environment cached under the hybridpd cache (keyed by its
requirements), and run in the tree after ``git am`` on the files the exported commits
touch, the way the hook runs it (its files/exclude/types filters, its arguments, less
any ``--fix``: a check reports, it does not rewrite).

Runnable offline: the hooks of the remote repositories in :data:`REMOTE` (ruff,
isort, codespell, mirrors-mypy) and the ``local`` hooks (``python`` ones with their
``additional_dependencies``; ``system``/``script`` ones as the entry says). Any other
remote hook that would run on the touched files is listed as not run, never as passed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shlex
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from hybridpd import cache, proc
from hybridpd.progress import Log, quiet
from hybridpd.upstreaming.layout import ExportPrError

CONFIG = ".pre-commit-config.yaml"


@dataclasses.dataclass(frozen=True)
class Hook:
    """One hook of a ``.pre-commit-config.yaml`` (the fields a check needs)."""

    id: str
    repo: str  # the repository URL, or "local"
    rev: str | None = None
    entry: str | None = None
    language: str | None = None
    args: tuple[str, ...] | None = None  # None: the hook's default arguments
    files: str | None = None
    exclude: str | None = None
    types: tuple[str, ...] = ()
    types_or: tuple[str, ...] = ()
    additional_dependencies: tuple[str, ...] = ()
    pass_filenames: bool = True
    always_run: bool = False
    stages: tuple[str, ...] = ()

    @property
    def version(self) -> str | None:
        """The pinned version of a remote hook's tool (``rev`` without its ``v``)."""
        if not self.rev:
            return None
        return self.rev[1:] if re.fullmatch(r"v\d.*", self.rev) else self.rev


@dataclasses.dataclass(frozen=True)
class Config:
    hooks: tuple[Hook, ...]
    exclude: str | None = None  # the config's top-level exclude
    stages: tuple[str, ...] = ()  # default_stages


def _strs(value: Any, what: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise ExportPrError(f"{CONFIG}: {what} is not a list")
    return tuple(str(v) for v in value)


def parse_config(text: str) -> Config:
    """The hooks of a ``.pre-commit-config.yaml`` text; ExportPrError on a malformed one."""
    import yaml

    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ExportPrError(f"{CONFIG} is not valid YAML: {str(exc).splitlines()[0]}") from exc
    if not isinstance(data, dict) or not isinstance(data.get("repos"), list):
        raise ExportPrError(f"{CONFIG} has no list of repos")
    hooks = []
    for repo in data["repos"]:
        if not isinstance(repo, dict) or not isinstance(repo.get("hooks"), list):
            raise ExportPrError(f"{CONFIG}: a repo entry has no list of hooks")
        url = str(repo.get("repo", ""))
        for raw in repo["hooks"]:
            if not isinstance(raw, dict) or "id" not in raw:
                raise ExportPrError(f"{CONFIG}: a hook of {url} has no id")
            hooks.append(
                Hook(
                    id=str(raw["id"]),
                    repo=url,
                    rev=None if repo.get("rev") is None else str(repo["rev"]),
                    entry=None if raw.get("entry") is None else str(raw["entry"]),
                    language=raw.get("language"),
                    args=_strs(raw["args"], f"args of {raw['id']}") if "args" in raw else None,
                    files=raw.get("files"),
                    exclude=raw.get("exclude"),
                    types=_strs(raw.get("types"), f"types of {raw['id']}"),
                    types_or=_strs(raw.get("types_or"), f"types_or of {raw['id']}"),
                    additional_dependencies=_strs(
                        raw.get("additional_dependencies"), f"dependencies of {raw['id']}"
                    ),
                    pass_filenames=bool(raw.get("pass_filenames", True)),
                    always_run=bool(raw.get("always_run", False)),
                    stages=_strs(raw.get("stages"), f"stages of {raw['id']}"),
                )
            )
    return Config(tuple(hooks), data.get("exclude"), _strs(data.get("default_stages"), "default_stages"))


def read_config(tree: Path) -> Config:
    path = tree / CONFIG
    if not path.is_file():
        raise ExportPrError(f"the tree has no {CONFIG}: its own checks are unknown")
    return parse_config(path.read_text(encoding="utf-8"))


# What each known remote hook runs ---------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Tool:
    """A remote hook repository's tool: its package and, per hook id, the command the
    hook's manifest runs (a check: ``--check`` where the hook would rewrite), its
    default arguments and file types."""

    package: str
    commands: dict[str, tuple[str, ...]]
    default_args: dict[str, tuple[str, ...]]
    types_or: tuple[str, ...]


#: Remote hook repositories (``owner/name``, lower case) whose tool is a package.
REMOTE: dict[str, Tool] = {
    "astral-sh/ruff-pre-commit": Tool(
        "ruff",
        {
            "ruff": ("ruff", "check", "--force-exclude", "--no-fix", "--output-format=concise"),
            "ruff-check": ("ruff", "check", "--force-exclude", "--no-fix", "--output-format=concise"),
            "ruff-format": ("ruff", "format", "--force-exclude", "--check"),
        },
        {},
        ("python", "pyi"),
    ),
    "pycqa/isort": Tool(
        "isort", {"isort": ("isort", "--check-only")}, {"isort": ("--filter-files",)},
        ("python", "pyi"),
    ),
    "codespell-project/codespell": Tool("codespell", {"codespell": ("codespell",)}, {}, ()),
    "pre-commit/mirrors-mypy": Tool(
        "mypy", {"mypy": ("mypy",)},
        {"mypy": ("--ignore-missing-imports", "--scroll-output")}, ("python", "pyi"),
    ),
}

#: The file filters of remote hooks that are not run here (their manifests' own), so
#: that one is listed as not run only where it would have run on the touched files.
UNRUN_FILTERS: dict[str, Hook] = {
    "markdownlint-cli2": Hook("markdownlint-cli2", "", types_or=("markdown",)),
    "actionlint": Hook("actionlint", "", files=r"^\.github/workflows/.*\.ya?ml$"),
    "shellcheck": Hook("shellcheck", "", types=("shell",)),
    "check-json": Hook("check-json", "", types=("json",)),
    "clang-format": Hook("clang-format", "", types_or=("c++", "cuda")),
}

#: Arguments a check drops (it reports; it does not rewrite), with their values.
_DROPPED = {"--fix": 0, "--output-format": 1}


def _repo_key(url: str) -> str:
    return "/".join(url.rstrip("/").removesuffix(".git").split("/")[-2:]).lower()


def _check_args(args: Sequence[str]) -> list[str]:
    out, skip = [], 0
    for arg in args:
        if skip:
            skip -= 1
            continue
        name = arg.split("=", 1)[0]
        if name in _DROPPED:
            skip = 0 if "=" in arg else _DROPPED[name]
            continue
        out.append(arg)
    return out


# File selection (pre-commit's filters) ---------------------------------------------

_SUFFIXES = {
    "python": (".py", ".pyi"), "pyi": (".pyi",), "cython": (".pyx", ".pxd"),
    "jupyter": (".ipynb",), "c++": (".cc", ".cpp", ".cxx", ".h", ".hpp", ".cuh"),
    "cuda": (".cu", ".cuh"), "rust": (".rs",), "proto": (".proto",), "png": (".png",),
    "yaml": (".yaml", ".yml"), "json": (".json",), "markdown": (".md",),
    "shell": (".sh",), "toml": (".toml",),
}


def _has_type(path: str, tag: str) -> bool:
    if tag in ("file", "text"):
        return not path.endswith((".png", ".jpg", ".gif", ".so", ".whl"))
    return path.endswith(_SUFFIXES.get(tag, ("\0",)))


def select(hook: Hook, files: Iterable[str], config_exclude: str | None = None,
           types_or: tuple[str, ...] = ()) -> list[str]:
    """The files of ``files`` the hook runs on (pre-commit's files/exclude/types)."""
    types_or = hook.types_or or (types_or if not hook.types else ())
    out = []
    for path in files:
        if config_exclude and re.search(config_exclude, path):
            continue
        if hook.files and not re.search(hook.files, path):
            continue
        if hook.exclude and re.search(hook.exclude, path):
            continue
        if hook.types and not all(_has_type(path, t) for t in hook.types):
            continue
        if types_or and not any(_has_type(path, t) for t in types_or):
            continue
        out.append(path)
    return out


# The plan ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Check:
    """One hook to run: its requirements (the tool environment), its command (files
    appended unless ``pass_filenames`` is false) and the files it runs on."""

    hook: str
    requirements: tuple[str, ...]
    command: tuple[str, ...]
    files: tuple[str, ...]
    pass_filenames: bool = True

    @property
    def shown(self) -> str:
        """The command as a contributor would type it, in the tree root."""
        return shlex.join([*self.command, *(self.files if self.pass_filenames else ())])


def plan(config: Config, files: Sequence[str]) -> tuple[list[Check], list[str]]:
    """The checks to run on ``files``, and one line per hook that would run on them
    but cannot be run offline (not run, so not passed)."""
    checks, not_run = [], []
    for hook in config.hooks:
        stages = hook.stages or config.stages
        if stages and not {"pre-commit", "commit", "manual"} & set(stages):
            continue
        if hook.repo == "local":
            chosen = select(hook, files, config.exclude)
            if not chosen and not hook.always_run:
                continue
            if hook.language not in ("python", "system", "script") or not hook.entry:
                not_run.append(f"{hook.id}: local hook of language {hook.language}")
                continue
            entry = shlex.split(hook.entry)
            if hook.language == "script":
                entry[0] = f"./{entry[0]}"
            checks.append(
                Check(hook.id, hook.additional_dependencies if hook.language == "python" else (),
                      (*entry, *(hook.args or ())), tuple(chosen), hook.pass_filenames)
            )
            continue
        tool = REMOTE.get(_repo_key(hook.repo))
        command = tool.commands.get(hook.id) if tool else None
        chosen = select(hook, files, config.exclude, tool.types_or if tool else ())
        known = UNRUN_FILTERS.get(hook.id)
        if command is None and known and not (hook.files or hook.types or hook.types_or):
            chosen = select(dataclasses.replace(known, exclude=hook.exclude), chosen)
        if not chosen and not hook.always_run:
            continue
        if tool is None or command is None or not hook.version:
            not_run.append(f"{hook.id}: {hook.repo} has no offline runner here")
            continue
        args = hook.args if hook.args is not None else tool.default_args.get(hook.id, ())
        checks.append(
            Check(hook.id, (f"{tool.package}=={hook.version}", *hook.additional_dependencies),
                  (*command, *_check_args(args)), tuple(chosen), hook.pass_filenames)
        )
    return checks, not_run


# Tool environments ------------------------------------------------------------------

#: Gives the directory of a Python environment (``bin/`` inside) holding requirements.
Environments = Callable[[tuple[str, ...]], Path]


def tool_env(requirements: tuple[str, ...], log: Log = quiet) -> Path:
    """A virtual environment with ``requirements`` installed from the package index,
    cached under ``<cache>/tools/`` (keyed by the requirements and this Python); built
    once, reused while its marker records the same requirements."""
    key = json.dumps({"python": sys.version.split()[0], "requirements": sorted(requirements)})
    root = cache.cache_dir() / "tools" / hashlib.sha256(key.encode()).hexdigest()[:16]
    marker = cache.Marker(root / ".hybridpd-tools.json")
    root.parent.mkdir(parents=True, exist_ok=True)
    with cache.lock(root, log):
        if marker.read() == json.loads(key):
            return root
        if root.exists():
            import shutil

            shutil.rmtree(root)
        log(f"installing {' '.join(requirements) or 'a bare environment'} for the "
            f"project's checks into {root}")
        proc.run([sys.executable, "-m", "venv", root], check=True, what="python -m venv")
        if requirements:
            done = proc.run([root / "bin" / "python", "-m", "pip", "install", "-q",
                             *requirements])
            if not done.ok:
                raise ExportPrError(
                    f"cannot install {' '.join(requirements)} for the project's checks: "
                    + ((done.stderr or done.stdout).strip().splitlines() or ["pip failed"])[-1]
                )
        marker.write(json.loads(key))
    return root


# Running them -----------------------------------------------------------------------

_FINDING = re.compile(r"^(\S+:\d+|Would reformat|ERROR: )")
_NOISE = re.compile(r"^\S+:\d+(:\d+)?: note: ")


def findings(check: Check, returncode: int | None, output: str) -> list[str]:
    """One line per finding of a check's run (``<hook>: <tool's line>``); a failure
    without a recognisable finding line is one line with its last output line."""
    if returncode == 0:
        return []
    lines = [ln.strip() for ln in output.splitlines()
             if _FINDING.match(ln.strip()) and not _NOISE.match(ln.strip())]
    if not lines:
        tail = [ln.strip() for ln in output.splitlines() if ln.strip()]
        lines = [f"failed (exit {returncode})" + (f": {tail[-1]}" if tail else "")]
    return [f"{check.hook}: {ln}" for ln in lines]


def run_checks(
    tree: Path,
    files: Sequence[str],
    environments: Environments | None = None,
    log: Log = quiet,
) -> dict[str, Any]:
    """Run the tree's own checks on ``files`` (relative to ``tree``, deleted ones left
    out); ``{"checks": [{hook, command, requirements, ok}], "not_run", "findings"}``."""
    environments = environments or (lambda reqs: tool_env(reqs, log))
    present = [f for f in files if (tree / f).is_file()]
    if not (tree / CONFIG).is_file():
        return {"checks": [], "not_run": [f"the tree has no {CONFIG}"], "findings": []}
    checks, not_run = plan(read_config(tree), present)
    ran, found = [], []
    for check in checks:
        env_dir = environments(check.requirements)
        env = proc.clean_env({
            "PATH": f"{env_dir / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
            "VIRTUAL_ENV": str(env_dir),
        })
        env.pop("PYTHONPATH", None)
        command = [*check.command, *(check.files if check.pass_filenames else ())]
        log(f"check {check.hook}: {check.shown}")
        done = proc.run(command, cwd=tree, env=env, timeout=1800)
        output = (done.stdout or "") + (done.stderr or "")
        lines = findings(check, None if done.timed_out else done.returncode, output)
        found += lines
        ran.append({"hook": check.hook, "command": check.shown,
                    "requirements": list(check.requirements), "ok": not lines})
    return {"checks": ran, "not_run": not_run, "findings": found}
