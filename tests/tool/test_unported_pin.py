"""A pin the series is not ported to yet (``ported = false``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from builders import Project
from click.testing import CliRunner
from hybridpd.series.apply import apply
from hybridpd.cli.main import main
from hybridpd.errors import ApplyError, SeriesError
from hybridpd.series.export import check

pytestmark = pytest.mark.usefixtures("isolated")


@pytest.fixture
def project(tmp_path: Path) -> Project:
    project = Project(tmp_path)
    project.release("1.0")
    project.release("2.0")
    project.unported.add("2.0")
    project.record("fix-add", {"1.0": "carried"})
    project.write()
    return project


def test_unported_pin_has_no_patches_in_list(project: Project) -> None:
    result = CliRunner().invoke(
        main, ["--series", str(project.series_path), "list", "--pin", "2.0", "--json"]
    )
    assert result.exit_code == 0, result.output
    (pin,) = json.loads(result.stdout)["pins"]
    assert pin["ported"] is False
    assert pin["patches"] == []


def test_apply_refuses_an_unported_pin(project: Project) -> None:
    repo = project.checkout("2.0")
    with pytest.raises(ApplyError, match=r"not ported to 2\.0 yet \(hybridpd port --from 1\.0"):
        apply(project.write(), repo)


def test_state_on_an_unported_pin_is_rejected(project: Project) -> None:
    project.records[0]["states"]["2.0"] = "carried"
    with pytest.raises(SeriesError, match=r'pins."2.0": the series is not ported to 2.0'):
        project.write()


def test_check_flags_patch_files_of_an_unported_pin(project: Project) -> None:
    series = project.write()
    stray = series.patch_dir(series.pin("2.0")) / "fix-add.patch"
    stray.parent.mkdir(parents=True)
    stray.write_text("x")
    problems = check(series, round_trip=False)
    assert any("which the series is not ported to" in p for p in problems)


def test_apply_on_an_unported_pin_names_the_pin_pin_add_proposes(tmp_path: Path) -> None:
    """2.1 is nearer to 2.0, but records a fix upstream since 2.0.1, a release after 2.0:
    `pin add` proposes 1.0 (2.1 would lose the fix), and so does apply's advice."""
    from hybridpd.series.source import proposed_for

    project = Project(tmp_path)
    for version in ("1.0", "2.0", "2.1"):
        project.release(version)
    project.unported.add("2.0")
    project.record("fix-add", {"1.0": "carried", "2.1": "carried"})
    project.record("landed", {"1.0": "carried", "2.1": "upstream:2.0.1"})
    series = project.write()
    assert proposed_for(series, series.pin("2.0")).version == "1.0"
    repo = project.checkout("2.0")
    result = CliRunner().invoke(main, ["--series", str(series.path), "apply", "--dir", str(repo)])
    assert result.exit_code == 1
    assert result.stderr.splitlines() == [
        "Error: the series is not ported to 2.0 yet (hybridpd port --from 1.0 --to 2.0, "
        "the pin `hybridpd pin add` proposes)"]
