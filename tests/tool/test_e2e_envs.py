"""The e2e checkout: a kept one follows the current series, whatever a past run left."""

from __future__ import annotations

from pathlib import Path

import pytest
from builders import FIX_ADD, standard_project
from hybridpd import gitops
from hybridpd.apply import TRAILER
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
