"""The e2e checkout: a kept one follows the current series, whatever a past run left."""

from __future__ import annotations

from pathlib import Path

import pytest
from builders import FIX_ADD, standard_project
from hybridpd import gitops
from hybridpd.series.apply import TRAILER
from hybridpd.e2e.envs import source

pytestmark = pytest.mark.usefixtures("isolated")


def _patches(repo: Path) -> list[list[str]]:
    return [c.trailer_values(TRAILER) for c in gitops.commits(repo, "v1.0..HEAD")]


def test_kept_patched_checkout_follows_a_dropped_patch(tmp_path: Path) -> None:
    project, series = standard_project(tmp_path)
    src = tmp_path / "e2e" / "src"
    lines: list[str] = []
    first = source(series, series.pin("1.0"), "patched", src, lines.append)
    assert _patches(src) == [["fix-add"], ["feature"]]
    # The same series again: same head, so the venv built from it is reused.
    assert source(series, series.pin("1.0"), "patched", src, lines.append) == first

    # `feature` is dropped on 1.0 since that run (CI kept the cache).
    project.records[1]["states"]["1.0"] = "dropped"
    series = project.write()
    head = source(series, series.pin("1.0"), "patched", src, lines.append)
    assert _patches(src) == [["fix-add"]]
    assert head == gitops.head(src) != first
    assert not (src / "proj" / "feature.py").exists()
    assert (src / "proj" / "core.py").read_text() == FIX_ADD["proj/core.py"]
    assert any("resetting" in line for line in lines)


def test_kept_stock_checkout_is_put_back_at_the_tag(tmp_path: Path) -> None:
    _, series = standard_project(tmp_path)
    src = tmp_path / "e2e" / "src"
    pin = series.pin("1.0")
    source(series, pin, "patched", src, print)
    head = source(series, pin, "stock", src, print)
    assert head == gitops.resolve(src, "v1.0")
    assert _patches(src) == []


def test_stock_build_carries_only_the_patches_it_needs_to_run(tmp_path: Path) -> None:
    _, series = standard_project(tmp_path)
    src = tmp_path / "e2e" / "src"
    pin = series.pin("1.0")
    lines: list[str] = []
    head = source(series, pin, "stock", src, lines.append, ("fix-add", "not-carried"))
    assert _patches(src) == [["fix-add"]]
    assert head == gitops.head(src) != gitops.resolve(src, "v1.0")
    assert (src / "proj" / "core.py").read_text() == FIX_ADD["proj/core.py"]
    assert any("applied fix-add" in line for line in lines)
    # Without a baseline the kept checkout is the release again.
    assert source(series, pin, "stock", src, print) == gitops.resolve(src, "v1.0")


def test_stock_baseline_is_per_device_and_only_what_the_pin_carries(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hybridpd.e2e import envs

    project, series = standard_project(tmp_path)
    monkeypatch.setattr(envs, "STOCK_NEEDS", {"cpu": ("feature", "not-carried")})
    assert envs.stock_baseline(series, series.pin("1.0"), "cpu") == ("feature",)
    assert envs.stock_baseline(series, series.pin("1.0"), "cuda") == ()
    project.records[1]["states"]["1.0"] = "dropped"
    series = project.write()
    assert envs.stock_baseline(series, series.pin("1.0"), "cpu") == ()


@pytest.fixture
def made(monkeypatch: pytest.MonkeyPatch) -> _Calls:
    """``install.environment`` (tested in test_install.py) and pip, recorded."""
    from types import SimpleNamespace

    from hybridpd.envs import build as build_mod
    from hybridpd import proc
    from hybridpd.envs import install
    from hybridpd.e2e import envs

    def environment(pin, tree, venv, *, variant, torch, require_nixl, log):
        calls.append(("environment", pin.version, tree, venv, variant, require_nixl))
        if calls.nixl_error and require_nixl:
            raise build_mod.BuildError(calls.nixl_error)
        built = SimpleNamespace(python=venv / "bin" / "python", timings={"total": 1.5})
        built.python.parent.mkdir(parents=True, exist_ok=True)
        built.python.touch()
        return install.InstallResult(tree, venv, None, built, "1.0")

    def run(cmd, **_kwargs):
        calls.append(("pip", *map(str, cmd[2:])))
        return SimpleNamespace(ok=True)

    calls = _Calls()
    monkeypatch.setattr(install, "environment", environment)
    monkeypatch.setattr(proc, "run", run)
    # the import hook (tested in test_e2e_qwen35.py) is written into every e2e venv
    monkeypatch.setattr(envs.qwen35, "install", lambda py: calls.append(("qwen35", py)))
    monkeypatch.setattr(envs.pdextras, "requirement", lambda src, name: f"{name}==1.0")
    return calls


class _Calls(list):
    nixl_error: str | None = None


def test_e2e_environments_are_made_by_install_and_reused_by_their_marker(
    tmp_path: Path, made
) -> None:
    import json

    from hybridpd import cache
    from hybridpd.e2e.envs import MARKER, prepare

    _, series = standard_project(tmp_path)
    root = tmp_path / "e2e" / "1.0-cpu-patched"
    env = prepare(series, series.pin("1.0"), "patched", "cpu", print, root=root)
    assert made == [
        ("environment", "1.0", root / "src", root / "venv", "cpu", True),
        ("pip", "pip", "install", "-q", "matplotlib"),
        ("qwen35", root / "venv" / "bin" / "python"),
    ]
    marker = cache.Marker(root / MARKER).read()
    assert marker["want"]["head"] == env.head == gitops.head(root / "src")
    assert marker["timings_s"]["build"] == 1.5

    # Same inputs: reused, nothing built, also from a marker an older hybridpd wrote
    # (unsorted keys). Another torch: built again.
    (root / MARKER).write_text(json.dumps({"want": marker["want"], "timings_s": {}}, indent=2))
    made.clear()
    assert prepare(series, series.pin("1.0"), "patched", "cpu", print, root=root).python == env.python
    assert made == [("qwen35", env.python)]  # a venv built before the hook gets it too
    made.clear()
    prepare(series, series.pin("1.0"), "patched", "cpu", print, torch="torch==9", root=root)
    assert made[0][0] == "environment"


def test_an_e2e_environment_without_nixl_is_an_error_and_never_marked_complete(
    tmp_path: Path, made
) -> None:
    from hybridpd import cache
    from hybridpd.e2e.envs import MARKER, prepare
    from hybridpd.e2e.servers import E2EError

    _, series = standard_project(tmp_path)
    root = tmp_path / "e2e" / "1.0-cpu-stock"
    made.nixl_error = "pip could not install nixl-cu12==1.0"
    with pytest.raises(E2EError, match=r"^\[stock\] pip could not install nixl-cu12==1.0$"):
        prepare(series, series.pin("1.0"), "stock", "cpu", print, root=root)
    assert cache.Marker(root / MARKER).read() is None
