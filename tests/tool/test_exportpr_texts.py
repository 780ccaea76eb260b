"""Every PR text of the committed series (vLLM 0.33.0, LMCache 0.5.6) is in the
upstream project's words: rendered from the same sources ``export-pr`` uses (the
record, the committed patch's commit message, the kept upstream-style material), it
names no hybridpd file, module or command and never calls vllm#42524 "the seed".
"""

from __future__ import annotations

import email
import email.policy
import re
from pathlib import Path

import pytest
from hybridpd.series.model import load
from hybridpd.upstreaming import render
from hybridpd.upstreaming.commits import strip_trailer, with_assisted_by
from hybridpd.upstreaming.layout import PrCommit, PrExport, material

ROOT = Path(__file__).resolve().parents[2]
SERIES = {
    "0.33.0": ROOT / "patches" / "series.toml",
    "0.5.6": ROOT / "patches" / "lmcache" / "series.toml",
}

#: What a PR text must not say: hybridpd's name, files, modules and commands, and
#: the series' jargon for vllm#42524.
FORBIDDEN = re.compile(
    r"hybridpd|tests/patches/|tests/lmcache_patches/|(?<![\w./-])tool/|(?<![\w./-])patches/"
    r"|\bthe seed\b|\bseed's\b|long sweep|the CPU e2e",
    re.IGNORECASE,
)

#: hybridpd's own test files, by name: a PR's test plan names upstream's tests only.
OWN_TESTS = sorted({
    p.name for d in ("tests/patches", "tests/lmcache_patches")
    for p in (ROOT / d).rglob("test_*.py")
})
NAMES_OWN_TEST = re.compile("|".join(map(re.escape, OWN_TESTS))) if OWN_TESTS else None



def _commit(path: Path, patch_id: str, tests: tuple[str, ...]) -> PrCommit:
    """The exported commit of a committed patch file, as ``build_commits`` makes it."""
    message = email.message_from_bytes(path.read_bytes(), policy=email.policy.default)
    subject = " ".join(str(message["Subject"]).split())
    payload = message.get_payload(decode=True).decode("utf-8")
    body = payload.split("\n---\n", 1)[0]
    text = with_assisted_by(strip_trailer(f"{subject}\n\n{body}"))
    files = tuple(dict.fromkeys(re.findall(r"^diff --git a/(\S+) b/", payload, re.M)))
    return PrCommit(patch_id, f"0001-{patch_id}.patch", subject,
                    text.partition("\n")[2].strip(), tests, files + tests)


def _cases():
    for version, path in SERIES.items():
        series = load(path)
        pin = series.pin(version)
        for patch in series.carried(pin):
            yield pytest.param(path, version, patch.id, id=f"{version}-{patch.id}")


def test_own_test_names_are_known():
    assert "test_mamba_state_property.py" in OWN_TESTS


def test_the_admission_fix_is_a_comment_for_vllm_46892():
    patch = load(SERIES["0.33.0"]).patch("mamba-align-admission-counts-sync-load")
    assert patch.upstream_thread == "vllm-project/vllm#46892"


def _text(series_path: Path, version: str, patch_id: str, tmp_path: Path) -> str:
    """The text export-pr writes for a committed patch (no verification): the PR body,
    or the comment for an open PR's thread."""
    series = load(series_path)
    pin = series.pin(version)
    kept = material(series.slug(pin), patch_id)
    commit = _commit(series.patch_path(pin, patch_id), patch_id, tuple(kept.tests))
    patch = series.patch(patch_id)
    export = PrExport(patch_id, pin, tmp_path, [commit], [], thread=patch.upstream_thread)
    (tmp_path / commit.filename).write_bytes(series.patch_path(pin, patch_id).read_bytes())
    return (render.render_comment(export, patch, series) if patch.upstream_thread
            else render.render_pr(export, patch, [], [], series))


def test_the_admission_comment_gives_the_count_and_a_scheduler_level_test(tmp_path):
    """The comment for vllm#46892: the exact count, and a scheduler-level full-pool
    test in vLLM's own style (its helpers, no hybridpd code), described."""
    patch_id = "mamba-align-admission-counts-sync-load"
    series = load(SERIES["0.33.0"])
    scheduler_test = "tests/v1/core/test_mamba_kv_load_admission.py"
    source = material(series.slug(series.pin("0.33.0")), patch_id).tests[scheduler_test]
    for used in (b"from tests.v1.kv_connector.unit.utils import", b"DecodeBenchConnector",
                 b'mamba_cache_mode="align"', b"scheduler.schedule()"):
        assert used in source, used
    assert b"hybridpd" not in source.lower()

    text = _text(SERIES["0.33.0"], "0.33.0", patch_id, tmp_path)
    assert ("int(loaded > held) + min(required - max(held, loaded), physical_block_cap)"
            in text)
    # The comment describes the test (the diff and the command that runs it are the
    # exported commit's; test_exportpr.py checks those).
    assert f"`{scheduler_test}` (new) runs the crash through a real\n  `Scheduler`" in text
    assert "`ValueError: Cannot get 1 free blocks from the pool`" in text


@pytest.mark.parametrize(("series_path", "version", "patch_id"), list(_cases()))
def test_pr_text_is_in_the_upstream_projects_words(series_path, version, patch_id, tmp_path):
    text = _text(series_path, version, patch_id, tmp_path)

    def said(line: str) -> list[str]:
        found = [m.group(0) for m in FORBIDDEN.finditer(line)]
        return found + ([m.group(0) for m in NAMES_OWN_TEST.finditer(line)]
                        if NAMES_OWN_TEST else [])

    found = sorted({word for line in text.splitlines() for word in said(line)})
    lines = [ln for ln in text.splitlines() if said(ln)]
    assert not found, f"{patch_id}: says {found}: " + " | ".join(ln[:160] for ln in lines)
