"""upstream: selection, the regression rule, baselines; testenv's pure parts (offline, fast)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from builders import stub_pin
from hybridpd.proof import testenv, upstream
from hybridpd.proof.pytestrun import SuiteResult

SDISTS = Path("/tmp/sd")  # extracted release sdists, where a machine has them


# --- selection ------------------------------------------------------------------------

def test_reduced_is_a_subset_without_the_big_files() -> None:
    for version, full in upstream.FULL_SELECTION.items():
        reduced = upstream.REDUCED_SELECTION[version]
        assert set(reduced) < set(full)
        assert not any(f.endswith(("test_kv_cache_utils.py", "test_nixl_connector.py"))
                       for f in reduced)
        assert "tests/v1/core/test_prefix_caching.py" in reduced
        # every pin carries a change to scheduler.py
        assert "tests/v1/core/test_scheduler.py" in reduced


@pytest.mark.parametrize("version", sorted(upstream.FULL_SELECTION))
def test_selected_files_exist_in_the_release(version: str) -> None:
    tree = SDISTS / f"vllm-{version}"
    if not tree.is_dir():
        pytest.skip(f"{tree} not here")
    assert [f for f in upstream.selection(stub_pin(version)) if not (tree / f).is_file()] == []


# --- comparison -----------------------------------------------------------------------

STOCK = {
    "t.py::a": "passed",
    "t.py::b": "passed",
    "t.py::c": "failed",
    "t.py::d": "skipped",
    "t.py::e": "passed",
    "t.py::f": "error",
    "u.py::g": "passed",
}
PATCHED = {
    "t.py::a": "passed",      # same
    "t.py::b": "failed",      # regression
    "t.py::c": "passed",      # fix
    # d missing: regression although it was skipped
    "t.py::e": "skipped",     # regression: a pass turned into a skip
    "t.py::f": "failed",      # failed before, fails now: not a regression
    "t.py::h": "failed",      # new: listed, not judged
}


def test_compare_rule() -> None:
    c = upstream.compare(STOCK, PATCHED)
    assert c.regressions == {
        "t.py::b": ("passed", "failed"),
        "t.py::d": ("skipped", "missing"),
        "t.py::e": ("passed", "skipped"),
        "u.py::g": ("passed", "missing"),
    }
    assert c.fixes == {"t.py::c": ("failed", "passed")}
    assert c.new == {"t.py::h": "failed"}
    assert not c.ok and c.compared == 7


def test_compare_restricted_to_files_run() -> None:
    c = upstream.compare(STOCK, PATCHED, files=["t.py"])
    assert "u.py::g" not in c.regressions and c.compared == 6


def test_collection_error_on_patched_is_a_regression() -> None:
    c = upstream.compare({"t.py::a": "passed"}, {"t.py": "error"})
    assert c.regressions == {"t.py::a": ("passed", "missing")}


def test_identical_runs_are_ok() -> None:
    assert upstream.compare(STOCK, STOCK).ok


# --- baselines ------------------------------------------------------------------------

def _result(outcomes: dict[str, str], status: str = "failures") -> SuiteResult:
    r = SuiteResult(outcomes=dict(outcomes), status=status, exit_code=1,
                    wall_seconds=12.5, command=["pytest", "t.py"])
    for o in outcomes.values():
        key = {"passed": "passed", "failed": "failed", "error": "errors"}.get(o, "skipped")
        setattr(r, key, getattr(r, key) + 1)
    r.file_seconds = {"t.py": 3.0, "u.py": 1.0}
    return r


def test_baseline_round_trip_and_compare(tmp_path: Path) -> None:
    path = upstream.write_baseline(_result(STOCK), stub_pin("9.9.9"), ["t.py", "u.py"],
                                   tree="vllm-9.9.9.tar.gz sha256 x",
                                   env={"torch": "2.13.0+cpu"}, path=tmp_path / "b.json")
    doc = upstream.load_baseline(stub_pin("9.9.9"), path)
    assert doc["outcomes"] == STOCK
    assert doc["counts"] == {"passed": 4, "failed": 1, "skipped": 1, "errors": 1}
    assert doc["per_file"]["u.py"] == {"passed": 1, "failed": 0, "skipped": 0,
                                       "errors": 0, "seconds": 1.0}
    assert doc["produced"]["command"] == ["pytest", "t.py"]
    assert doc["produced"]["wall_seconds"] == 12.5
    assert list(doc["outcomes"]) == sorted(doc["outcomes"])  # stable diffs
    c = upstream.compare_to_baseline(_result(PATCHED), doc)
    assert set(c.regressions) == {"t.py::b", "t.py::d", "t.py::e", "u.py::g"}


def test_baseline_records_causes(tmp_path: Path) -> None:
    r = _result({"t.py::a": "passed", "t.py::b": "failed", "t.py::c": "failed"})
    r.messages = {
        "t.py::b": "RuntimeError: Cannot access accelerator device when none is available.",
        "t.py::c": "AssertionError: something new",
    }
    doc = upstream.baseline_dict(r, stub_pin("9.9.9"), ["t.py"], tree="x")
    assert doc["causes"]["t.py::b"].startswith("GPU-only test")
    assert doc["causes"]["t.py::c"] == "AssertionError: something new"
    assert "t.py::a" not in doc["causes"]


def test_crashed_run_is_not_recorded(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="crashed"):
        upstream.write_baseline(_result({}, status="crashed"), stub_pin("9.9.9"), [], tree="x",
                                path=tmp_path / "b.json")


def test_committed_baselines_are_well_formed() -> None:
    for path in sorted(upstream.BASELINE_DIR.glob("*-stock.json")):
        version = path.name[: -len("-stock.json")]
        doc = upstream.load_baseline(stub_pin(version))
        counts = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0}
        for o in doc["outcomes"].values():
            counts[{"error": "errors", "xfailed": "skipped"}.get(o, o)] += 1
        assert counts == doc["counts"], path
        # A baseline records the full selection, or at least the reduced one
        # that ci/test.sh compares with (hybridpd test runs stock for the rest).
        assert doc["files"] in (
            list(upstream.selection(stub_pin(version))),
            list(upstream.selection(stub_pin(version), reduced=True)),
        ), path


def test_report_lists_regressions(tmp_path: Path) -> None:
    report = upstream.UpstreamReport(
        "9.9.9", ["t.py"], _result(PATCHED), upstream.compare(STOCK, PATCHED),
        baseline=tmp_path / "b.json")
    text = upstream.format_report(report)
    assert "REGRESSION t.py::b: passed -> failed" in text and not report.ok


# --- testenv (the environment the gate runs in) -----------------------------------------

def test_relaxation_rewrites_only_the_named_line() -> None:
    text = "certifi >= 2026.10.19\ncertifi-extra==1\nnumpy\n# certifi comment\n"
    out, applied = testenv.relax_requirements(text)
    lines = out.splitlines()
    assert lines[0].startswith("certifi  # hybridpd relaxed: certifi >= 2026.10.19")
    assert lines[1:] == ["certifi-extra==1", "numpy", "# certifi comment"]
    assert [r.package for r in applied] == ["certifi"]
    assert testenv.relax_requirements("numpy\n") == ("numpy\n", [])


def test_test_requirements_take_the_release_pins(tmp_path: Path) -> None:
    lock = tmp_path / "requirements" / "test" / "cuda.txt"
    lock.parent.mkdir(parents=True)
    lock.write_text("pytest==8.3.5\n    # via -r x\nray[cgraph]==2.48.0\ntorchvision==0.26.0+cu130\n")
    reqs = testenv.test_requirements(tmp_path)
    assert "pytest==8.3.5" in reqs and "ray==2.48.0" in reqs
    assert "tblib" in reqs  # not pinned there: left unpinned


def test_env_inputs_hash(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "requirements").mkdir()
    (tmp_path / "requirements" / "common.txt").write_text("numpy\n")
    monkeypatch.delenv(testenv.TORCH_ENV_VAR, raising=False)
    a = testenv.env_inputs(stub_pin("1.0"), tmp_path)
    assert a["torch_spec"] == testenv.DEFAULT_TORCH_SPEC
    assert a["hash"] == testenv.env_inputs(stub_pin("1.0"), tmp_path)["hash"]
    monkeypatch.setenv(testenv.TORCH_ENV_VAR, "torch==2.13.0+cpu")
    b = testenv.env_inputs(stub_pin("1.0"), tmp_path)
    assert b["torch_spec"] == "torch==2.13.0+cpu" and b["hash"] != a["hash"]
    assert testenv.env_inputs(stub_pin("1.0"), tmp_path,
                              torch_spec="torch")["torch_spec"] == "torch"


def test_half_built_env_is_not_reused(tmp_path: Path) -> None:
    venv = testenv.env_dir(tmp_path, stub_pin("1.0"))
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    assert testenv.read_marker(venv) is None
    (venv / testenv.MARKER_NAME).write_text(json.dumps({"hash": "x"}))
    assert testenv.read_marker(venv) == {"hash": "x"}


def _wheel(dest: Path, name: str, version: str) -> Path:
    """A minimal pure-Python wheel of ``name`` (module ``name``) for pip to install."""
    import zipfile

    path = dest / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{name}/__init__.py", f"VERSION = {version!r}\n")
        zf.writestr(f"{info}/METADATA",
                    f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        zf.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr(f"{info}/RECORD", "")
    return path


def test_layers_are_built_once_beside_the_env_and_only_for_their_releases(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _wheel(wheels, "demolayer", "1.0")
    _wheel(wheels, "demolayer", "2.0")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    venv = testenv.env_dir(tmp_path / "cache", stub_pin("1.0"))
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    layer = testenv.Layer("demo", ("demolayer==1.0",), ">=0.5", "a test")
    monkeypatch.setattr(testenv, "LAYERS", (layer,))
    said: list[str] = []

    (path,) = testenv.ensure_layers(venv, stub_pin("1.0"), said.append)
    assert path == venv.parent / "1.0-cpu.layers" / "demo"
    assert (path / "demolayer" / "__init__.py").read_text() == "VERSION = '1.0'\n"
    assert any("install layer demo" in line for line in said)
    said.clear()
    assert testenv.ensure_layers(venv, stub_pin("1.0"), said.append) == [path]
    assert said == []  # reused
    assert testenv.ensure_layers(venv, stub_pin("0.4"), said.append) == []  # not for that release
    # A changed requirement rebuilds; a build that died half-way is not reused.
    monkeypatch.setattr(testenv, "LAYERS", (testenv.Layer("demo", ("demolayer==2.0",),
                                                          ">=0.5", "a test"),))
    (path.with_name("demo.tmp")).mkdir()
    (path.with_name("demo.tmp") / "junk").write_text("")
    testenv.ensure_layers(venv, stub_pin("1.0"), said.append)
    assert (path / "demolayer" / "__init__.py").read_text() == "VERSION = '2.0'\n"
    assert not path.with_name("demo.tmp").exists()
    monkeypatch.setattr(testenv, "LAYERS", (testenv.Layer("demo", ("demolayer==3.0",),
                                                          ">=0.5", "a test"),))
    with pytest.raises(testenv.TestEnvError, match="install layer demo"):
        testenv.ensure_layers(venv, stub_pin("1.0"))
    assert (path / "demolayer" / "__init__.py").read_text() == "VERSION = '2.0'\n"


def test_layers_go_after_the_tree_on_pythonpath(tmp_path: Path) -> None:
    from hybridpd.proof import pytestrun

    env = pytestrun.pytest_env(tmp_path / "venv", tmp_path / "tree", tmp_path / "hf",
                               base={}, layers=[tmp_path / "l1", tmp_path / "l2"])
    assert env["PYTHONPATH"].split(":") == [str(tmp_path / p) for p in ("tree", "l1", "l2")]


# --- run_upstream wiring (fake pytest: a shell script that writes JUnit XML) ----------

def _junit(cases: str) -> str:
    return f'<testsuites><testsuite name="pytest">{cases}</testsuite></testsuites>'


PASS_BOTH = ('<testcase classname="tests.test_x" name="test_a"/>'
             '<testcase classname="tests.test_x" name="test_b"/>')
FAIL_B = ('<testcase classname="tests.test_x" name="test_a"/>'
          '<testcase classname="tests.test_x" name="test_b"><failure message="boom"/></testcase>')


def _tree(root: Path, name: str, xml: str) -> Path:
    tree = root / name
    (tree / "vllm.egg-info").mkdir(parents=True)
    (tree / "vllm.egg-info" / "PKG-INFO").write_text("Name: vllm\nVersion: 9.9.9\n")
    (tree / "tests").mkdir()
    (tree / "tests" / "test_x.py").write_text("")
    (tree / "junit.xml").write_text(xml)  # what the fake pytest reports for this tree
    return tree


def _fake_venv(root: Path) -> Path:
    exe = root / "venv" / "bin" / "pytest"
    exe.parent.mkdir(parents=True)
    exe.write_text('#!/bin/sh\nfor a in "$@"; do case $a in --junitxml=*) x=${a#--junitxml=};; '
                   'esac; done\ncp junit.xml "$x"\ngrep -q failure junit.xml && exit 1\nexit 0\n')
    exe.chmod(0o755)
    return exe.parent.parent


def test_run_upstream_live_stock(tmp_path: Path) -> None:
    report = upstream.run_upstream(
        _fake_venv(tmp_path), _tree(tmp_path, "stock", _junit(PASS_BOTH)),
        _tree(tmp_path, "patched", _junit(FAIL_B)), ["tests/test_x.py"], tmp_path / "out",
        pin=stub_pin("9.9.9"))
    assert report.stock.counts()["passed"] == 2
    assert report.comparison.regressions == {"tests/test_x.py::test_b": ("passed", "failed")}
    assert not report.ok
    assert (tmp_path / "out" / "hf" / "hub" / "models--facebook--opt-125m").is_dir()


def test_run_upstream_against_baseline(tmp_path: Path) -> None:
    venv = _fake_venv(tmp_path)
    stock = upstream.run_upstream(
        venv, _tree(tmp_path, "stock", _junit(FAIL_B)), _tree(tmp_path, "p1", _junit(FAIL_B)),
        ["tests/test_x.py"], tmp_path / "o1", pin=stub_pin("9.9.9"))
    path = upstream.write_baseline(stock.stock, stub_pin("9.9.9"), ["tests/test_x.py"], tree="x",
                                   path=tmp_path / "b.json")
    report = upstream.run_upstream(
        venv, None, _tree(tmp_path, "p2", _junit(PASS_BOTH)), ["tests/test_x.py"],
        tmp_path / "o2", pin=stub_pin("9.9.9"), baseline=path)
    assert report.ok and report.stock is None and report.baseline == path
    assert report.comparison.fixes == {"tests/test_x.py::test_b": ("failed", "passed")}


def test_a_torch_other_than_the_releases_is_a_warning(tmp_path: Path) -> None:
    """The environment takes DEFAULT_TORCH_SPEC where the release's CPU torch is not on
    the index: said in one line naming both, not silently."""
    req = tmp_path / "requirements"
    req.mkdir()
    (req / "cuda.txt").write_text("torch==2.11.0\n")
    assert testenv.release_torch(tmp_path) == "2.11.0"
    (req / "cpu.txt").write_text(
        "# comment\ntorch==2.11.0+cpu; platform_machine == \"x86_64\"\ntorch==2.11.0; x\n")
    assert testenv.release_torch(tmp_path) == "2.11.0"
    assert testenv.torch_substitution(stub_pin("0.20.2"), "2.11.0", "2.13.0+cpu") == (
        "testenv: warning: vLLM 0.20.2 pins torch==2.11.0; this environment uses torch "
        "2.13.0+cpu ($HYBRIDPD_TORCH chooses another)")
    assert testenv.torch_substitution(stub_pin("0.32.0"), "2.13.0", "2.13.0+cpu") is None
    assert testenv.torch_substitution(stub_pin("x"), None, "2.13.0") is None
    assert testenv.release_torch(tmp_path / "nothing") is None
