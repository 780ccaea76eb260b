"""``export-pr --verify`` runs the target project's own checks: the hooks of its
``.pre-commit-config.yaml`` at their pins (:mod:`hybridpd.upstreaming.checks`).

The configs below have the shape of vLLM 0.33.0's and LMCache 0.5.6's. The runs use
the real ruff 0.14.0 and mypy 1.20.2 (the ``[test]`` extra installs them at vLLM's
pins), offline: the tool environment is this test environment, after checking that it
holds exactly the pinned versions.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from importlib import metadata
from pathlib import Path

import pytest
from hybridpd.upstreaming import checks
from hybridpd.upstreaming.layout import ExportPrError

pytestmark = pytest.mark.usefixtures("isolated")

VLLM_CONFIG = """\
default_install_hook_types:
  - pre-commit
  - commit-msg
default_stages:
  - pre-commit # Run locally
  - manual # Run in CI
exclude: 'vllm/third_party/.*'
repos:
- repo: https://github.com/astral-sh/ruff-pre-commit
  rev: v0.14.0
  hooks:
  - id: ruff-check
    args: [--output-format, github, --fix]
  - id: ruff-format
- repo: https://github.com/crate-ci/typos
  rev: v1.43.5
  hooks:
  - id: typos
    args: [--force-exclude]
- repo: https://github.com/DavidAnson/markdownlint-cli2
  rev: v0.21.0
  hooks:
  - id: markdownlint-cli2
    args: [--config, tools/pre_commit/.markdownlint.yaml, --fix]
- repo: local
  hooks:
  - id: mypy # TODO: Use https://github.com/pre-commit/mirrors-mypy
    name: Run mypy for the oldest supported Python version
    entry: python tools/pre_commit/mypy.py "3.11"
    language: python
    types_or: [python, pyi]
    require_serial: true
    additional_dependencies: ["mypy==1.20.2", regex, "pydantic==2.13.5"]
  - id: signoff-commit
    name: Sign-off Commit
    entry: bash
    args:
      - -c
      - |
        echo sign
    language: system
    stages: [commit-msg]
  - id: check-filenames
    name: Check for spaces in all filenames
    entry: bash
    args:
      - -c
      - 'git ls-files | grep " " && echo "Filenames should not contain spaces!" && exit 1 || exit 0'
    language: system
    always_run: true
    pass_filenames: false
  - id: check-trust-remote-code
    name: Check for hardcoded trust_remote_code=True
    entry: python tools/pre_commit/check_trust_remote_code.py
    language: python
    types: [python]
    files: ^vllm/
"""

LMCACHE_CONFIG = """\
exclude: 'lmcache/integration/vllm/lmcache_mp_connector_.*\\.py'
repos:
- repo: local
  hooks:
  - id: check-spdx-header
    name: Check SPDX headers
    entry: python tools/check_spdx_header.py
    language: python
    types: [python]
  - id: ban-raw-timeout-error
    name: Ban raw raise of builtin TimeoutError
    entry: >-
      bash -c '
      matches=$(grep -rHnE "raise[[:space:]]+TimeoutError" "$@");
      if [ -n "$matches" ]; then
        echo "$matches";
        exit 1;
      fi' --
    language: system
    types: [python]
    files: ^lmcache/
    exclude: |
      (?x)^(
        lmcache/.*/gpu_connector/.*|
        lmcache/v1/platform/.*
      )$
- repo: https://github.com/PyCQA/isort
  rev: 6.0.1
  hooks:
  - id: isort
- repo: https://github.com/astral-sh/ruff-pre-commit
  rev: v0.11.7
  hooks:
  - id: ruff
    args: [--output-format, github, --fix]
  - id: ruff-format
- repo: https://github.com/codespell-project/codespell
  rev: v2.4.1
  hooks:
  - id: codespell
    additional_dependencies: ['tomli']
    args: ['--toml', 'pyproject.toml']
- repo: https://github.com/pre-commit/mirrors-clang-format
  rev: v20.1.3
  hooks:
  - id: clang-format
    types_or: [c++, cuda]
- repo: https://github.com/pre-commit/mirrors-mypy
  rev: 'v1.17.1'
  hooks:
  - id: mypy
    language_version: python3.12
    args: [--config-file=pyproject.toml]
    additional_dependencies:
      - tokenize-rt==6.1.0 # For better dynamic analysis performance
      - types-requests
- repo: local
  hooks:
  - id: rust-fmt
    name: Rust Format Check
    entry: bash -c 'cd rust/raw_block && cargo fmt --check'
    language: system
    types: [text]
    files: ^rust/raw_block/.*\\.rs$
"""


def _by_hook(found: list[checks.Check]) -> dict[str, checks.Check]:
    return {c.hook: c for c in found}


def test_vllm_shaped_config_pins_and_commands():
    config = checks.parse_config(VLLM_CONFIG)
    files = ["vllm/v1/core/sched/scheduler.py", "tests/v1/core/test_x.py",
             "vllm/third_party/skip.py"]

    planned, not_run = checks.plan(config, files)

    by = _by_hook(planned)
    assert list(by) == ["ruff-check", "ruff-format", "mypy", "check-filenames",
                        "check-trust-remote-code"]  # signoff-commit: commit-msg stage only
    assert by["ruff-check"].requirements == ("ruff==0.14.0",)
    # A check reports: --fix and the CI output format are dropped.
    assert by["ruff-check"].command == (
        "ruff", "check", "--force-exclude", "--no-fix", "--output-format=concise")
    assert by["ruff-format"].command == ("ruff", "format", "--force-exclude", "--check")
    # The config's exclude applies to every hook.
    assert by["ruff-format"].files == ("vllm/v1/core/sched/scheduler.py", "tests/v1/core/test_x.py")
    # mypy runs the way the project's pre-commit runs it: its own script, its pins.
    assert by["mypy"].command == ("python", "tools/pre_commit/mypy.py", "3.11")
    assert by["mypy"].requirements == ("mypy==1.20.2", "regex", "pydantic==2.13.5")
    assert by["check-trust-remote-code"].files == ("vllm/v1/core/sched/scheduler.py",)
    assert by["check-filenames"].pass_filenames is False
    # typos would run on these files but has no offline runner: said, not passed.
    # markdownlint only runs on Markdown: not listed.
    assert not_run == ["typos: https://github.com/crate-ci/typos has no offline runner here"]


def test_lmcache_shaped_config_pins_and_commands():
    config = checks.parse_config(LMCACHE_CONFIG)
    files = ["lmcache/v1/storage.py", "lmcache/v1/platform/dev.py",
             "lmcache/integration/vllm/lmcache_mp_connector_0_20.py", "tests/v1/test_s.py"]

    planned, not_run = checks.plan(config, files)

    by = _by_hook(planned)
    assert list(by) == ["check-spdx-header", "ban-raw-timeout-error", "isort", "ruff",
                        "ruff-format", "codespell", "mypy"]
    assert by["isort"].requirements == ("isort==6.0.1",)
    assert by["isort"].command == ("isort", "--check-only", "--filter-files")
    assert by["ruff"].requirements == ("ruff==0.11.7",)
    assert by["codespell"].requirements == ("codespell==2.4.1", "tomli")
    assert by["codespell"].command == ("codespell", "--toml", "pyproject.toml")
    assert by["mypy"].requirements == ("mypy==1.17.1", "tokenize-rt==6.1.0", "types-requests")
    assert by["mypy"].command == ("mypy", "--config-file=pyproject.toml")
    # The verbose-regex exclude and files of a local hook; its bash entry kept whole.
    assert by["ban-raw-timeout-error"].files == ("lmcache/v1/storage.py",)
    assert by["ban-raw-timeout-error"].command[:2] == ("bash", "-c")
    assert by["ban-raw-timeout-error"].command[-1] == "--"
    assert by["check-spdx-header"].requirements == ()
    assert not_run == []  # clang-format and rust-fmt touch no file here


def test_a_malformed_config_is_one_line():
    with pytest.raises(ExportPrError, match="no list of repos"):
        checks.parse_config("repos: 3\n")
    with pytest.raises(ExportPrError, match="not valid YAML"):
        checks.parse_config("repos: [\n")


# Real tools -------------------------------------------------------------------------

MYPY_SCRIPT = '''\
"""Shaped like vLLM's tools/pre_commit/mypy.py: group the files, run mypy."""
import subprocess
import sys


def main():
    python_version = sys.argv[1]
    args = ["mypy", "--python-version", python_version]
    print(f"$ {' '.join(args)}")
    return subprocess.run(args + sys.argv[2:], check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
'''

CLEAN = '''\
class Connector:
    def supports(self) -> bool:
        return True


def gate(connector: Connector | None) -> bool:
    if connector is None:
        return False
    return connector.supports()
'''

TOOLS_CONFIG = """\
repos:
- repo: https://github.com/astral-sh/ruff-pre-commit
  rev: v0.14.0
  hooks:
  - id: ruff-check
    args: [--output-format, github, --fix]
  - id: ruff-format
- repo: local
  hooks:
  - id: mypy
    entry: python tools/pre_commit/mypy.py "3.11"
    language: python
    types_or: [python, pyi]
    additional_dependencies: ["mypy==1.20.2"]
"""


def _pinned_here(requirements: tuple[str, ...]) -> Path:
    """This environment, as the tool environment of ``requirements``: only when it
    holds each pinned package at exactly its pin."""
    for req in requirements:
        name, _, version = req.partition("==")
        assert metadata.version(name) == version, f"{req} is not what the test env holds"
    return Path(sys.prefix)


def _tree(tmp_path: Path, source: str) -> Path:
    tree = tmp_path / "proj"
    (tree / "tools" / "pre_commit").mkdir(parents=True)
    (tree / "tools" / "pre_commit" / "mypy.py").write_text(MYPY_SCRIPT)
    (tree / "proj").mkdir()
    (tree / "proj" / "__init__.py").write_text("")
    (tree / "proj" / "sched.py").write_text(source)
    (tree / ".pre-commit-config.yaml").write_text(TOOLS_CONFIG)
    (tree / "pyproject.toml").write_text(
        "[tool.ruff]\nline-length = 88\n[tool.mypy]\nignore_missing_imports = true\n"
    )
    subprocess.run(["git", "init", "-q", str(tree)], check=True)
    return tree


@pytest.fixture(scope="module")
def mypy_cache(tmp_path_factory) -> Path:
    """One mypy cache for the runs here: only the first pays for the standard library."""
    return tmp_path_factory.mktemp("mypy-cache")


@pytest.fixture(autouse=True)
def _shared_mypy_cache(monkeypatch, mypy_cache):
    monkeypatch.setenv("MYPY_CACHE_DIR", str(mypy_cache))


def _run(tree: Path) -> dict:
    return checks.run_checks(tree, ["proj/sched.py", "proj/gone.py"], _pinned_here)


def test_clean_code_passes_the_projects_checks(tmp_path):
    report = _run(_tree(tmp_path, CLEAN))

    assert report["findings"] == []
    assert [(c["hook"], c["ok"]) for c in report["checks"]] == [
        ("ruff-check", True), ("ruff-format", True), ("mypy", True)]
    # The deleted file is not passed; the command is the one a contributor types.
    assert report["checks"][2]["command"] == "python tools/pre_commit/mypy.py 3.11 proj/sched.py"


def test_a_format_difference_is_a_finding(tmp_path):
    planted = CLEAN.replace("return connector.supports()", "return connector.supports( )")

    report = _run(_tree(tmp_path, planted))

    assert report["findings"] == ["ruff-format: Would reformat: proj/sched.py"]


def test_a_union_attr_error_is_a_finding(tmp_path):
    planted = CLEAN.replace("    if connector is None:\n        return False\n", "")

    report = _run(_tree(tmp_path, planted))

    assert len(report["findings"]) == 1
    assert report["findings"][0].startswith("mypy: proj/sched.py:7: error: Item \"None\"")
    assert report["findings"][0].endswith("[union-attr]")


def test_a_tree_without_a_config_runs_no_check(tmp_path):
    tree = tmp_path / "bare"
    tree.mkdir()
    report = checks.run_checks(tree, ["a.py"], _pinned_here)
    assert report == {"checks": [], "not_run": ["the tree has no .pre-commit-config.yaml"],
                      "findings": []}


def test_a_failure_without_a_finding_line_is_one_line():
    check = checks.Check("hook", (), ("x",), ())
    assert checks.findings(check, 0, "anything") == []
    assert checks.findings(check, 2, "boom\nlast words\n") == [
        "hook: failed (exit 2): last words"]


def test_tool_environment_is_cached_by_its_requirements(tmp_path, monkeypatch):
    made: list[tuple[str, ...]] = []

    def fake_run(cmd, **kwargs):
        made.append(tuple(str(c) for c in cmd))
        if "venv" in cmd:
            (Path(str(cmd[-1])) / "bin").mkdir(parents=True)
        from hybridpd.proc import Completed
        return Completed(tuple(map(str, cmd)), 0, "", "")

    monkeypatch.setattr(checks.proc, "run", fake_run)
    first = checks.tool_env(("ruff==0.14.0",))
    again = checks.tool_env(("ruff==0.14.0",))
    other = checks.tool_env(("ruff==0.11.7",))

    assert first == again != other
    assert first.parent == tmp_path / "cache" / "tools"
    installs = [c for c in made if "install" in c]
    assert [c[-1] for c in installs] == ["ruff==0.14.0", "ruff==0.11.7"]  # built once each


# LMCache's hook shapes: its local hooks (a Python script, a bash grep), ruff under its
# older hook id ``ruff``, and mypy through mirrors-mypy with LMCache's arguments. The
# remote hooks' revs are the pins this environment holds (ruff 0.14.0, mypy 1.20.2), so
# that they run offline; LMCache 0.5.6 pins ruff 0.11.7 and mypy 1.17.1.

LMCACHE_TOOLS_CONFIG = """\
repos:
- repo: local
  hooks:
  - id: check-spdx-header
    name: Check SPDX headers
    entry: python tools/check_spdx_header.py
    language: python
    types: [python]
  - id: ban-raw-timeout-error
    name: Ban raw raise of builtin TimeoutError
    entry: >-
      bash -c '
      matches=$(grep -rHnE "raise[[:space:]]+(asyncio\\\\.)?TimeoutError\\\\b" "$@");
      if [ -n "$matches" ]; then
        echo "  BANNED: raw raise of builtin TimeoutError";
        echo "$matches";
        exit 1;
      fi' --
    language: system
    types: [python]
    files: ^lmcache/
- repo: https://github.com/astral-sh/ruff-pre-commit
  rev: v0.14.0
  hooks:
  - id: ruff
    args: [--output-format, github, --fix]
  - id: ruff-format
- repo: https://github.com/pre-commit/mirrors-mypy
  rev: 'v1.20.2'
  hooks:
  - id: mypy
    args: [--config-file=pyproject.toml]
"""

SPDX_SCRIPT = '''\
"""Shaped like LMCache's tools/check_spdx_header.py (which also adds the header)."""
import sys

PREFIX = "# SPDX-License-Identifier:"


def main():
    print("Running checker")
    missing = [p for p in sys.argv[1:]
               if not any(ln.startswith(PREFIX) for ln in open(p, encoding="utf-8"))]
    if missing:
        print("The following files are missing the SPDX header:")
        for path in missing:
            print(f"  {path}")
    sys.exit(1 if missing else 0)


if __name__ == "__main__":
    main()
'''

LMCACHE_CLEAN = "# SPDX-License-Identifier: Apache-2.0\n" + CLEAN + '''

def wait(done: bool) -> None:
    if not done:
        raise RuntimeError("not done")
'''


def _lmcache_tree(tmp_path: Path, source: str) -> Path:
    tree = tmp_path / "lmcache-proj"
    (tree / "tools").mkdir(parents=True)
    (tree / "tools" / "check_spdx_header.py").write_text(SPDX_SCRIPT)
    (tree / "lmcache").mkdir()
    (tree / "lmcache" / "__init__.py").write_text("")
    (tree / "lmcache" / "sched.py").write_text(source)
    (tree / ".pre-commit-config.yaml").write_text(LMCACHE_TOOLS_CONFIG)
    (tree / "pyproject.toml").write_text(
        "[tool.ruff]\nline-length = 88\n[tool.mypy]\nignore_missing_imports = true\n"
    )
    subprocess.run(["git", "init", "-q", str(tree)], check=True)
    return tree


def _run_lmcache(tree: Path) -> dict:
    return checks.run_checks(tree, ["lmcache/sched.py"], _pinned_here)


def test_clean_code_passes_lmcache_shaped_checks(tmp_path):
    report = _run_lmcache(_lmcache_tree(tmp_path, LMCACHE_CLEAN))

    assert report["findings"] == []
    assert [(c["hook"], c["ok"]) for c in report["checks"]] == [
        ("check-spdx-header", True), ("ban-raw-timeout-error", True), ("ruff", True),
        ("ruff-format", True), ("mypy", True)]
    assert report["checks"][4]["command"] == (
        "mypy --config-file=pyproject.toml lmcache/sched.py")


@pytest.mark.parametrize(
    ("planted", "hook", "tail"),
    [
        (lambda s: s.replace("# SPDX-License-Identifier: Apache-2.0\n", ""),
         "check-spdx-header", "lmcache/sched.py"),
        (lambda s: s.replace('RuntimeError("not done")', "TimeoutError"),
         "ban-raw-timeout-error", "raise TimeoutError"),
        (lambda s: s.replace("class Connector", "import os\n\n\nclass Connector"),
         "ruff", "`os` imported but unused"),
        (lambda s: s.replace("connector.supports()", "connector.supports( )"),
         "ruff-format", "Would reformat: lmcache/sched.py"),
        (lambda s: s.replace("    if connector is None:\n        return False\n", ""),
         "mypy", "[union-attr]"),
    ],
    ids=["spdx", "timeout-error", "ruff", "ruff-format", "mypy"],
)
def test_a_planted_finding_makes_lmcache_shaped_checks_red(tmp_path, planted, hook, tail):
    report = _run_lmcache(_lmcache_tree(tmp_path, planted(LMCACHE_CLEAN)))

    assert report["findings"], "a planted finding passed"
    assert {f.split(":", 1)[0] for f in report["findings"]} == {hook}
    assert any(f.endswith(tail) for f in report["findings"]), report["findings"]
    assert [c["hook"] for c in report["checks"] if not c["ok"]] == [hook]
