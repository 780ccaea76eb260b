"""``hybridpd install``: checkout + apply + build in one step."""

from __future__ import annotations

from pathlib import Path

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
        return "built"

    monkeypatch.setattr(install_mod.build_mod, "build", fake_build)
    return calls


def test_install_checks_out_applies_and_builds(tmp_path: Path, built) -> None:
    project, series = standard_project(tmp_path)
    dest, venv = tmp_path / "vllm", tmp_path / "venv"

    result = install_mod.install(series, "1.0", dest, venv, variant="cpu")

    assert result.applied.applied == ("fix-add", "feature")
    assert built == [(dest, venv, "1.0", "v1.0", "cpu")]

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
