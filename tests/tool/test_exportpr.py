"""hybridpd export-pr and list --upstream-candidates, on fixture projects (no network).

The fixture series on pin 1.0: ``fix-add`` changes ``proj/core.py``; ``follow-up``
changes the same lines again (it cannot apply without ``fix-add``); ``feature`` adds a
file. Each has an upstream-style test in a fixture material directory. The test
runner is a stand-in: a test file's first line ``# requires: <path> <text>`` passes
when the tree's file contains the text.
"""

from __future__ import annotations

import dataclasses
import importlib.machinery
import json
import shlex
import subprocess
from pathlib import Path

import pytest
from builders import FEATURE, FIX_ADD, PACKAGE, Project, commit_patch, stub_pin
from click.testing import CliRunner
from hybridpd import gitops
from hybridpd.errors import HybridpdError
from hybridpd.upstreaming import author, commits, evidence, layout, render, verify
from hybridpd.upstreaming.export import export_prs
from hybridpd.proof import hfsnap, pytestrun, testenv, testrun
from hybridpd.cli.main import main
from hybridpd.series.export import export
from hybridpd.proof.pytestrun import SuiteResult
from hybridpd.series.model import load
from hybridpd.series.model import TestSetup as Setup  # not a test class

#: The committed vLLM series (the host of LMCache's tests).
VLLM_SERIES = Path(__file__).resolve().parents[2] / "patches" / "series.toml"

pytestmark = pytest.mark.usefixtures("isolated")

FOLLOW_UP = {
    "proj/core.py": FIX_ADD["proj/core.py"].replace("    return total\n", "    return int(total)\n")
}
TESTS = {
    "fix-add": ("tests/test_add.py", "# requires: proj/core.py total = a + b\n"),
    "follow-up": ("tests/test_int.py", "# requires: proj/core.py int(total)\n"),
    "feature": ("tests/test_feature.py", "# requires: proj/feature.py 2 * x\n"),
}


def _project(root: Path, with_git: bool = True) -> tuple[Project, Path]:
    project = Project(root)
    project.release("1.0")
    project.release("2.0")
    project.record("fix-add", {"1.0": "carried", "2.0": "carried"})
    project.record("follow-up", {"1.0": "carried", "2.0": "carried"})
    project.record("feature", {"1.0": "carried", "2.0": "upstream:2.0"})
    series = project.write()
    author = project.checkout("1.0", "author")
    commit_patch(author, "fix-add", FIX_ADD, "[Core] Keep the sum in a local")
    commit_patch(author, "follow-up", FOLLOW_UP, "[Core] Return an int")
    commit_patch(author, "feature", FEATURE, "[Feature] Add doubling")
    export(series, author)
    # 2.0 carries the first two (same files: 2.0's tree equals 1.0's).
    (series.dir / "2.0").mkdir()
    for patch_id in ("fix-add", "follow-up"):
        (series.dir / "2.0" / f"{patch_id}.patch").write_bytes(
            (series.dir / "1.0" / f"{patch_id}.patch").read_bytes()
        )
    material = root / "material"
    for version in ("1.0", "2.0"):
        key = series.slug(series.pin(version))  # proj-<version>
        for patch_id, (rel, text) in TESTS.items():
            path = material / key / patch_id / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        (material / key / "fix-add" / "alternatives.md").write_text(
            "- **Return a + b directly.** Loses the local.\n"
        )
    if with_git:
        gitops.init(series.dir.parent, "main")
        gitops.commit_all(series.dir.parent, "series")  # dated 2000-01-01
    return project, material


#: The submitter of the test PRs: a placeholder on a reserved domain (RFC 2606), no person.
SUBMITTER = "PR Submitter <submitter@example.invalid>"

GPU_MODEL = "Qwen/Qwen3.5-35B-A3B"
TINY_MODEL = "/cache/e2e/models/hybridpd-tiny-qwen3_5"


def _commit_report(
    repo: Path, date: str, pin: str = "1.0", command=None, device="cuda", model=GPU_MODEL
) -> None:
    report = {
        **({"command": command} if command else {}),
        "pin": pin,
        "device": device,
        "model": model,
        "scenario": "smoke",
        "runs": [
            {
                "build": build,
                "connector": "nixl",
                "requests": [
                    {
                        "label": "r2",
                        "prompt_tokens": 1400,
                        "decode_local_hit_tokens": hit,
                        "kv_bytes_transferred": kv,
                        "ttft_ms": ttft,
                    }
                ],
                "outputs_match_baseline": True,
            }
            for build, hit, kv, ttft in (("stock", 0, 9000, 120.5), ("patched", 1280, 800, 40.25))
        ],
    }
    path = repo / "reports" / "e2e" / "report.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report))
    gitops.check(repo, "add", "reports")
    gitops.check(
        repo,
        "commit",
        "--quiet",
        "-m",
        "e2e report",
        env={"GIT_AUTHOR_DATE": date, "GIT_COMMITTER_DATE": date},
    )


def _export(project: Project, material: Path, ids: list[str], tmp_path: Path, pin: str = "1.0"):
    series = load(project.series_path)
    stock = project.checkout(pin, f"stock-{pin}")
    logged: list[str] = []
    exports = export_prs(
        series, series.pin(pin), ids, stock, tmp_path / "out", logged.append, material,
        author=SUBMITTER,
    )
    return series, stock, exports, logged


def test_directory_layout_trailer_stripped_and_test_added(tmp_path):
    project, material = _project(tmp_path)
    _, stock, (result,), _ = _export(project, material, ["fix-add"], tmp_path)

    target = tmp_path / "out" / "fix-add"
    assert sorted(p.name for p in target.iterdir()) == [
        layout.MANIFEST, "0001-fix-add.patch", "PR.md", layout.NOTES_FILE
    ]
    patch = (target / "0001-fix-add.patch").read_text()
    assert "Hybridpd-Patch" not in patch
    assert "Subject: [Core] Keep the sum in a local" in patch
    assert "Signed-off-by" not in patch
    # The AI-attribution trailer placeholder ends the commit message.
    assert "\n\n" + commits.ASSISTED_BY + "\n" in patch
    # The upstream-style test is in the same commit as the change.
    assert "diff --git a/tests/test_add.py b/tests/test_add.py" in patch
    assert "diff --git a/proj/core.py b/proj/core.py" in patch
    assert result.prerequisites == []
    assert result.own.tests == ("tests/test_add.py",)
    # It applies with git am to a stock checkout, which export left untouched.
    assert not gitops.is_dirty(stock)
    assert gitops.am(stock, [target / "0001-fix-add.patch"], three_way=False).ok
    assert (stock / "tests" / "test_add.py").is_file()
    assert "total = a + b" in (stock / "proj" / "core.py").read_text()
    assert gitops.message(stock).rstrip().endswith(commits.ASSISTED_BY)


def test_dependency_is_included_first(tmp_path):
    project, material = _project(tmp_path)
    _, stock, (result,), logged = _export(project, material, ["follow-up"], tmp_path)

    target = tmp_path / "out" / "follow-up"
    assert result.prerequisites == ["fix-add"]
    assert [c.filename for c in result.commits] == [
        "0001-fix-add.patch",
        "0002-follow-up.patch",
    ]
    assert result.tests == ["tests/test_add.py", "tests/test_int.py"]
    assert any("follow-up needs fix-add" in line for line in logged)
    pr = (target / layout.NOTES_FILE).read_text()
    assert "**Depends on** the PR of `fix-add`" in pr
    # Self-contained: the directory applies to stock as it is.
    patches = sorted(target.glob("0*.patch"))
    assert gitops.am(stock, patches, three_way=False).ok
    assert "int(total)" in (stock / "proj" / "core.py").read_text()


def test_independent_patch_has_no_prerequisites(tmp_path):
    project, material = _project(tmp_path)
    _, _, (result,), _ = _export(project, material, ["feature"], tmp_path)
    assert result.prerequisites == []
    assert [c.filename for c in result.commits] == ["0001-feature.patch"]


def test_pr_md_sections(tmp_path):
    project, material = _project(tmp_path)
    _export(project, material, ["fix-add"], tmp_path)

    pr = (tmp_path / "out" / "fix-add" / "PR.md").read_text()
    assert pr.startswith("# [Core] Keep the sum in a local\n")
    for heading in (
        "## What",
        "## Why",
        "## Design",
        "## Alternatives considered",
        "## Test plan",
        "## Results",
    ):
        assert f"\n{heading}\n" in pr
    assert "why of fix-add" in pr and "design of fix-add" in pr
    assert "Return a + b directly" in pr
    for heading in ("## Related", "## AI assistance"):
        assert f"\n{heading}\n" in pr
    # The test plan holds only the commands --verify runs, in vLLM's tree; the GPU plan
    # (not run here) is the submitter's to run and add.
    plan = pr.split("\n## Test plan\n", 1)[1].split("\n## Results\n", 1)[0]
    assert "pytest -v tests/test_add.py" in plan
    assert "hybridpd" not in pr and "vllm bench" not in pr
    assert "Not measured yet" in pr.split("\n## Results\n", 1)[1]
    notes = (tmp_path / "out" / "fix-add" / layout.NOTES_FILE).read_text()
    gpu = notes.split("\n## GPU plan to run before submitting\n", 1)[1]
    assert "bash tests/v1/kv_connector/nixl_integration/run_mamba_prefix_cache_test.sh" in gpu
    assert "vllm bench serve --model Qwen/Qwen3.5-35B-A3B" in gpu
    assert "--dataset-name prefix_repetition" in gpu
    for flag in ("--prefix-repetition-prefix-len 16384", "--prefix-repetition-suffix-len 1024",
                 "--num-prompts 512", "--max-concurrency 256"):
        assert flag in gpu
    assert render.GPU_SERVE_FLAGS in gpu
    assert '"NixlConnector"' in gpu and '"OffloadingConnector"' in gpu
    assert "LMCacheMPConnector" in gpu
    # The sign-off stays the submitter's; AI assistance is disclosed and attributed.
    assert "DCO" in notes and "--signoff" in notes
    assert "certifies the person who submits" in notes
    assert "`Assisted-by:` trailer placeholder" in notes
    assert "AI assistance was used" in pr
    # A checklist the submitter ticks, not a claim that a review happened.
    ai = pr.split("\n## AI assistance\n", 1)[1]
    assert "- [ ] I reviewed every changed line" in ai
    assert "- [ ] I ran the test plan above" in ai
    assert "has reviewed" not in pr
    assert "a person must review every changed line, run the test plan" in notes
    # The trailer is the commit's, not the PR text's.
    assert commits.ASSISTED_BY not in pr


def test_no_reports_is_said_explicitly(tmp_path):
    project, material = _project(tmp_path)
    _export(project, material, ["fix-add"], tmp_path)

    pr = (tmp_path / "out" / "fix-add" / layout.NOTES_FILE).read_text()
    assert "No GPU measurement of this change is committed" in pr
    assert "Warning" not in pr


def test_fresh_report_numbers_and_command(tmp_path):
    project, material = _project(tmp_path)
    _commit_report(project.series_path.parent.parent, "2001-06-01T00:00:00Z")
    _, _, (result,), _ = _export(project, material, ["fix-add"], tmp_path)

    pr = (tmp_path / "out" / "fix-add" / layout.NOTES_FILE).read_text()
    assert "reports/e2e/report.json" in pr
    assert "1 280" in pr and "40" in pr  # ON hit, ON TTFT
    assert f"hybridpd e2e --pin 1.0 --device cuda --model {GPU_MODEL} --scenario smoke" in pr
    assert "--compare stock" in pr
    assert "# rebuilt: the report does not record its command" in pr
    assert result.warnings == []
    assert "Warning" not in pr
    # The PR text cites none of it: it measured the whole series, not this PR.
    text = (tmp_path / "out" / "fix-add" / "PR.md").read_text()
    assert "1 280" not in text and "reports/" not in text and "hybridpd" not in text


def test_cpu_timing_report_is_not_cited(tmp_path):
    project, material = _project(tmp_path)
    _commit_report(
        project.series_path.parent.parent, "2001-06-01T00:00:00Z", device="cpu",
        model=TINY_MODEL,
    )
    _, _, (result,), logged = _export(project, material, ["fix-add"], tmp_path)

    pr = (tmp_path / "out" / "fix-add" / layout.NOTES_FILE).read_text()
    assert "No GPU measurement of this change is committed" in pr
    assert "reports/e2e/report.json" not in pr and "1 280" not in pr
    assert any("reports/e2e/report.json is a CPU run" in line for line in logged)
    assert result.warnings == []


def test_overlap_paragraphs_move_to_related():
    body = "What it does.\n\nOverlap: vllm#1 (open)\nreconciles it too.\n\nMore."
    assert render._split_overlap(body) == (
        "What it does.\n\nMore.",
        ["Overlap: vllm#1 (open) reconciles it too."],
    )


def test_assisted_by_joins_an_existing_trailer_block_once():
    message = "Subject\n\nBody.\n\nCo-authored-by: A <a@x>\n"
    once = commits.with_assisted_by(message)
    assert once == message + commits.ASSISTED_BY + "\n"
    assert commits.with_assisted_by(once) == once
    assert commits.with_assisted_by("Subject\n\nBody.\n") == (
        "Subject\n\nBody.\n\n" + commits.ASSISTED_BY + "\n"
    )


def test_pr_cites_the_command_the_report_recorded(tmp_path):
    project, material = _project(tmp_path)
    command = ["hybridpd", "e2e", "--pin", "1.0", "--tiny", "--scenario", "smoke",
               "--role", "kv_producer/kv_consumer", "--server-arg", "--enforce-eager",
               "--gpus", "2,3"]
    _commit_report(project.series_path.parent.parent, "2001-06-01T00:00:00Z", command=command)
    _export(project, material, ["fix-add"], tmp_path)
    pr = (tmp_path / "out" / "fix-add" / layout.NOTES_FILE).read_text()
    assert "\n" + shlex.join(command) + "\n" in pr
    assert "rebuilt" not in pr


def test_stale_numbers_warn(tmp_path):
    project, material = _project(tmp_path)
    # Committed before the patch files (dated 2000-01-01).
    _commit_report(project.series_path.parent.parent, "1999-01-01T00:00:00Z")
    _, _, (result,), logged = _export(project, material, ["fix-add"], tmp_path)

    pr = (tmp_path / "out" / "fix-add" / layout.NOTES_FILE).read_text()
    assert "**Warning:** the numbers in reports/e2e/report.json (1999-01-01) are older " in pr
    assert "patches/1.0/fix-add.patch" in pr
    assert any("warning: fix-add: the numbers" in line for line in logged)
    assert result.warnings


def test_uncommitted_report_is_not_used(tmp_path):
    project, material = _project(tmp_path)
    path = project.series_path.parent.parent / "reports" / "x" / "report.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"pin": "1.0", "scenario": "smoke", "runs": []}))
    _, _, _, logged = _export(project, material, ["fix-add"], tmp_path)

    pr = (tmp_path / "out" / "fix-add" / layout.NOTES_FILE).read_text()
    assert "No GPU measurement of this change is committed" in pr
    assert any("reports/x/report.json is not committed" in line for line in logged)


def test_patch_not_carried_is_refused(tmp_path):
    project, material = _project(tmp_path)
    with pytest.raises(layout.ExportPrError, match="upstream since 2.0 on 2.0"):
        _export(project, material, ["feature"], tmp_path, pin="2.0")


def test_a_directory_with_the_users_work_is_refused_unless_forced(tmp_path):
    project, material = _project(tmp_path)
    series = load(project.series_path)
    stock = project.checkout("1.0", "stock")

    def export_pr(patch_id: str, force: bool = False):
        return export_prs(series, series.pin("1.0"), [patch_id], stock,
                                   tmp_path / "out", tests_root=material,
                                   author=SUBMITTER,
                                   **({"force": True} if force else {}))

    (first,) = export_pr("fix-add")
    export_pr("fix-add")  # its own work: replaced
    (first.dir / "PR.md").write_text("my edited PR body\n")
    (first.dir / "notes.txt").write_text("mine\n")
    with pytest.raises(layout.ExportPrError) as refused:
        export_pr("fix-add")
    assert str(refused.value) == (
        f"{first.dir} is not empty and holds work export-pr did not write "
        "(PR.md changed, notes.txt added); move it away, or pass --force to replace it"
    )
    assert (first.dir / "PR.md").read_text() == "my edited PR body\n"
    assert (first.dir / "notes.txt").is_file()
    # A non-empty directory export-pr never wrote is refused too; --force replaces.
    other = tmp_path / "out" / "feature"
    other.mkdir()
    (other / "draft.md").write_text("draft\n")
    with pytest.raises(layout.ExportPrError, match="it was not written by export-pr"):
        export_pr("feature")
    export_pr("fix-add", force=True)
    assert not (first.dir / "notes.txt").exists()


def _fake_runner(calls: list[tuple[str, list[str]]]):
    def run(tree: Path, files, label: str) -> SuiteResult:
        calls.append((label, list(files)))
        outcomes = {}
        for rel in files:
            _, _, path, text = (tree / rel).read_text().splitlines()[0].split(" ", 3)
            target = tree / path
            ok = target.is_file() and text in target.read_text()
            outcomes[f"{rel}::test_it"] = "passed" if ok else "failed"
        log = tree.parent / f"{label}.log"
        log.write_text("log\n")
        return SuiteResult(outcomes=outcomes, status="ok", log_path=log)

    return run


def test_verify_red_on_stock_green_after_am(tmp_path):
    project, material = _project(tmp_path)
    series, stock, (result,), _ = _export(project, material, ["follow-up"], tmp_path)
    calls: list = []

    report = verify.verify(result, stock, _fake_runner(calls), series, series.pin("1.0"))

    assert report["ok"], report["problems"]
    assert [label for label, _ in calls] == ["stock", "without", "patched"]
    assert report["stock"]["failed"] == 2
    # With only fix-add applied, follow-up's own test still fails.
    assert calls[1][1] == ["tests/test_int.py"]
    assert report["without"]["failed"] == 1
    assert report["patched"] == {**report["patched"], "passed": 2, "failed": 0}
    saved = json.loads((result.dir / "verify.json").read_text())
    assert saved["ok"] and saved["applies"]
    assert "edited" not in saved  # the tests are new files
    assert (result.dir / "verify-logs" / "stock.log").is_file()
    assert not gitops.is_dirty(stock)
    render.write_pr(result, series, [], [])
    pr = (result.dir / "PR.md").read_text()
    results = pr.split("\n## Results\n", 1)[1]
    # The results are what the verify run measured, with the command a contributor types.
    assert "`pytest -v tests/test_add.py tests/test_int.py` (" in results
    assert "| v1.0, without this PR | 0 | 2 | 0 | 0 |" in results
    assert "| v1.0 with only the PRs this PR depends on | 0 | 1 | 0 | 0 |" in results
    assert "| v1.0 with this PR | 2 | 0 | 0 | 0 |" in results
    assert "Not ready" not in results


def _collection_error_runner(calls: list, interrupted: tuple[str, ...]):
    """The fake runner, except that the runs named in ``interrupted`` end as pytest
    ends on a test module that cannot import (one error per file, interrupted)."""
    fake = _fake_runner(calls)

    def run(tree: Path, files, label: str) -> SuiteResult:
        result = fake(tree, files, label)
        if label in interrupted:
            result.outcomes = {rel: "error" for rel in files}
            result.status, result.reason = "interrupted", "interrupted: 1 error during collection"
        return result

    return run


def test_verify_counts_a_collection_error_without_the_patch_as_red(tmp_path):
    project, material = _project(tmp_path)
    series, stock, (result,), _ = _export(project, material, ["follow-up"], tmp_path)

    report = verify.verify(result, stock, _collection_error_runner([], ("stock", "without")),
                           series, series.pin("1.0"))

    assert report["ok"], report["problems"]
    assert report["stock"]["errors"] == 2 and report["without"]["errors"] == 1


def test_verify_refuses_an_interrupted_run_after_am(tmp_path):
    project, material = _project(tmp_path)
    series, stock, (result,), _ = _export(project, material, ["follow-up"], tmp_path)

    with pytest.raises(layout.ExportPrError, match="patched: pytest did not finish"):
        verify.verify(result, stock, _collection_error_runner([], ("patched",)),
                      series, series.pin("1.0"))


def test_verify_fails_when_nothing_is_red_on_stock(tmp_path):
    project, material = _project(tmp_path)
    # A test that passes without the patch proves nothing.
    (material / f"{PACKAGE}-1.0" / "feature" / "tests" / "test_feature.py").write_text(
        "# requires: proj/core.py def add\n"
    )
    series, stock, (result,), _ = _export(project, material, ["feature"], tmp_path)

    report = verify.verify(result, stock, _fake_runner([]), series, series.pin("1.0"))

    assert not report["ok"]
    assert "no added test fails on stock" in report["problems"]


def _list_project(root: Path) -> Project:
    project = Project(root)
    for version in ("1.0", "2.0", "3.0"):
        project.release(version)
    project.record("old-fix", {"1.0": "carried", "2.0": "upstream:2.0", "3.0": "upstream:2.0"})
    project.record("late", {"1.0": "carried", "2.0": "carried", "3.0": "upstream:2.0"})
    project.record("proposal", {"1.0": "carried", "2.0": "carried", "3.0": "carried"})
    project.record("dead", {"1.0": "dropped", "2.0": "dropped", "3.0": "dropped"})
    project.write()
    return project


def test_list_upstream_candidates_text(tmp_path):
    project = _list_project(tmp_path)
    result = CliRunner().invoke(
        main, ["--series", str(project.series_path), "list", "--upstream-candidates"]
    )
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert (
        "upstream   old-fix: upstream since 2.0 (on 2.0, 3.0); still needed on 1.0 "
        "(older than 2.0)"
    ) in lines
    assert (
        "drop       late: carried on 2.0, upstream since 2.0 on 3.0: drop from pins >= 2.0"
        in lines
    )
    assert (
        "candidate  proposal: carried on 1.0, 2.0, 3.0; no upstream release yet "
        "(reference: example/proj#1)"
    ) in lines
    assert not any("dead" in line for line in lines)


def test_list_says_why_a_patch_was_dropped(tmp_path):
    project = _list_project(tmp_path)
    result = CliRunner().invoke(
        main, ["--series", str(project.series_path), "list", "--pin", "3.0"]
    )
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    dead = lines.index("  dropped   dead: title of dead")
    assert lines[dead + 1] == "            why dropped: dropped of dead."
    patch = dataclasses.replace(
        load(project.series_path).patches[0], dropped="Dead, e.g. on v0.32.0 too.  See\n vllm#1."
    )
    assert patch.why_dropped == "Dead, e.g. on v0.32.0 too."
    as_json = CliRunner().invoke(
        main, ["--series", str(project.series_path), "list", "--pin", "3.0", "--json"]
    )
    (pin,) = json.loads(as_json.output)["pins"]
    entry = next(p for p in pin["patches"] if p["id"] == "dead")
    assert entry == {
        "id": "dead", "title": "title of dead", "state": "dropped",
        "dropped": "dropped of dead. Evidence.",
    }


def test_list_upstream_candidates_json(tmp_path):
    project = _list_project(tmp_path)
    result = CliRunner().invoke(
        main, ["--series", str(project.series_path), "list", "--upstream-candidates", "--json"]
    )
    assert result.exit_code == 0, result.output
    by_id = {p["id"]: p for p in json.loads(result.output)["patches"]}
    assert by_id["proposal"]["status"] == "candidate"
    assert by_id["proposal"]["since"] is None
    assert by_id["late"]["status"] == "drop"
    assert by_id["late"]["drop_from"] == ["2.0"]
    assert by_id["late"]["keep_on"] == ["1.0"]
    assert by_id["old-fix"]["status"] == "upstream"
    assert by_id["old-fix"]["upstream"] == {"2.0": "2.0", "3.0": "2.0"}
    assert "dead" not in by_id


def test_list_upstream_candidates_refuses_pin(tmp_path):
    project = _list_project(tmp_path)
    result = CliRunner().invoke(
        main,
        ["--series", str(project.series_path), "list", "--upstream-candidates", "--pin", "1.0"],
    )
    assert result.exit_code == 2


def test_cli_export_pr_all_defaults_to_newest_pin(tmp_path, monkeypatch):
    project, material = _project(tmp_path)
    monkeypatch.setattr(layout, "UPSTREAM_TESTS_DIR", material)
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "cli-out"
    calls: list = []
    monkeypatch.setattr(
        "hybridpd.upstreaming.export.pytest_runner",
        lambda series, pin, stock, work, log: _fake_runner(calls),
    )
    result = CliRunner().invoke(
        main,
        # A relative --to: git am runs elsewhere, so the paths must not stay relative.
        ["--series", str(project.series_path), "export-pr", "--all", "--to", "cli-out",
         "--verify", "--json", "--author", SUBMITTER],
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["pin"] == "2.0"
    assert [e["id"] for e in data["exports"]] == ["fix-add", "follow-up"]
    assert data["exports"][1]["prerequisites"] == ["fix-add"]
    assert sorted(p.name for p in out.iterdir()) == ["fix-add", "follow-up"]
    assert [e["verification"]["ok"] for e in data["exports"]] == [True, True]
    assert [label for label, _ in calls] == ["stock", "patched", "stock", "without", "patched"]
    assert "| v2.0 with this PR | 2 | 0 | 0 | 0 |" in (out / "follow-up" / "PR.md").read_text()
    # The fixture release has no .pre-commit-config.yaml: no check ran, and it is said.
    assert data["exports"][1]["verification"]["checks"]["not_run"] == [
        "the tree has no .pre-commit-config.yaml"]


def test_cli_export_pr_usage(tmp_path):
    project, _ = _project(tmp_path, with_git=False)
    runner = CliRunner()
    base = ["--series", str(project.series_path), "export-pr", "--to", str(tmp_path / "o")]
    assert runner.invoke(main, base).exit_code == 2
    assert runner.invoke(main, [*base, "fix-add", "--all"]).exit_code == 2


def test_strip_trailer_keeps_other_trailers():
    message = "Subject\n\nBody.\n\nCo-authored-by: A <a@x>\nHybridpd-Patch: x\n"
    assert commits.strip_trailer(message) == "Subject\n\nBody.\n\nCo-authored-by: A <a@x>\n"


# Another project's series (LMCache) ---------------------------------------------------


def _as_lmcache(series, hosted: bool = False):
    """``series`` as the LMCache series would read (package, name; a [test] table
    that runs it in vLLM 0.32.0's environment)."""
    test = Setup(series.dir / "tests", VLLM_SERIES, "0.32.0") if hosted else None
    return dataclasses.replace(series, package="lmcache", name="LMCache", test=test)


def test_material_is_kept_per_series_slug(tmp_path):
    """A pin's material sits under the series' slug (``proj-1.0``, LMCache's
    ``lmcache-0.5.6``): a vLLM version's directory of the same number is not read."""
    project, material = _project(tmp_path)
    (material / "1.0").mkdir()
    (material / f"{PACKAGE}-1.0").rename(material / "1.0" / "moved")
    _, _, (result,), _ = _export(project, material, ["fix-add"], tmp_path)
    assert result.own.tests == ()
    assert result.warnings[0] == (
        "no upstream-style test kept for fix-add on 1.0 "
        f"(data/upstream_tests/{PACKAGE}-1.0/fix-add/tests/)"
    )


def test_a_test_file_the_tree_has_is_edited_in_the_commit(tmp_path):
    """Material at the path of an existing test file replaces it: the commit edits
    it, PR.md says so, and verify says which of its tests are red on stock."""
    project = Project(tmp_path)
    project.release("1.0", {"tests/test_core.py": "# requires: proj/core.py def add\n"})
    project.record("fix-add", {"1.0": "carried"})
    series = project.write()
    author = project.checkout("1.0", "author")
    commit_patch(author, "fix-add", FIX_ADD, "[Core] Keep the sum in a local")
    export(series, author)
    material = tmp_path / "material" / f"{PACKAGE}-1.0" / "fix-add" / "tests"
    material.mkdir(parents=True)
    (material / "test_core.py").write_text("# requires: proj/core.py total = a + b\n")
    (material / "test_new.py").write_text("# requires: proj/core.py return total\n")

    series, stock, (result,), _ = _export(project, tmp_path / "material", ["fix-add"], tmp_path)

    assert result.own.tests == ("tests/test_core.py", "tests/test_new.py")
    assert result.own.edited == ("tests/test_core.py",)
    patch = (result.dir / "0001-fix-add.patch").read_text()
    sections = {d.split(" b/", 1)[0]: d for d in patch.split("diff --git a/")[1:]}
    assert "new file mode" not in sections["tests/test_core.py"]
    assert "-# requires: proj/core.py def add" in sections["tests/test_core.py"]
    assert "new file mode" in sections["tests/test_new.py"]
    pr = (result.dir / "PR.md").read_text()
    assert "Tests added: `tests/test_new.py`.\nTests edited: `tests/test_core.py`." in pr
    assert "Unit tests added or edited by this PR" in pr

    report = verify.verify(result, stock, _fake_runner([]), series, series.pin("1.0"))
    assert report["ok"], report["problems"]
    assert report["edited"] == ["tests/test_core.py"]
    render.write_pr(result, series, [], [])
    assert (
        "The counts include the tests `tests/test_core.py` already had (this PR edits "
        "those files); failing without this PR: `tests/test_core.py::test_it`, "
        "`tests/test_new.py::test_it`.\n"
    ) in (result.dir / "PR.md").read_text()


def test_material_of_a_test_file_the_patch_edits_only_adds_to_it(tmp_path):
    """A patch may edit the project's own tests itself (LMCache's series does): the
    material of that file is the patched file with tests added, so the commit edits it
    once, as the patch does; material that rewrites the patch's lines is refused."""
    project = Project(tmp_path)
    stub = "# requires: proj/core.py def add\n"
    project.release("1.0", {"tests/test_core.py": stub})
    project.record("fix-add", {"1.0": "carried"})
    series = project.write()
    author = project.checkout("1.0", "author")
    patched = "# requires: proj/core.py total = a + b\n"
    commit_patch(
        author, "fix-add", {**FIX_ADD, "tests/test_core.py": patched},
        "[Core] Keep the sum in a local",
    )
    export(series, author)
    material = tmp_path / "material" / f"{PACKAGE}-1.0" / "fix-add" / "tests"
    material.mkdir(parents=True)
    (material / "test_core.py").write_text(patched + "# one more test\n")

    series, stock, (result,), _ = _export(project, tmp_path / "material", ["fix-add"], tmp_path)
    assert result.own.edited == ("tests/test_core.py",)
    patch = (result.dir / "0001-fix-add.patch").read_text()
    assert f"-{stub}+{patched}+# one more test\n" in patch

    (material / "test_core.py").write_text(stub + "# one more test\n")
    with pytest.raises(layout.ExportPrError, match="start it from the patched file"):
        export_prs(
            series, series.pin("1.0"), ["fix-add"], stock, tmp_path / "again",
            tests_root=tmp_path / "material", author=SUBMITTER,
        )


def test_lmcache_pr_body(tmp_path):
    """A PR to LMCache names and links LMCache, its base branch and its hybridpd
    commands, keeps its test plan, and carries none of vLLM's GPU plan, rules or
    e2e reports."""
    project, material = _project(tmp_path)
    _commit_report(project.series_path.parent.parent, "2001-06-01T00:00:00Z")
    series, _, (result,), _ = _export(project, material, ["fix-add"], tmp_path)
    kept = material / "lmcache-1.0" / "fix-add"
    kept.mkdir(parents=True)
    (kept / "alternatives.md").write_text("- **Another way.** Worse.\n")
    (kept / "test_plan.md").write_text("Also run `pytest -v tests/v1/multiprocess`.\n")
    lmcache = _as_lmcache(series)
    logged: list[str] = []

    reports, stale = evidence.pr_evidence(lmcache, lmcache.pin("1.0"), result, logged.append)
    assert (reports, stale, logged) == ([], [], [])
    pr = render.render_pr(result, lmcache.patch("fix-add"), reports, stale, lmcache)
    notes = render.render_notes(result, lmcache.patch("fix-add"), reports, stale, lmcache)

    assert "(patch `fix-add`, [LMCache](https://github.com/LMCache/LMCache) v1.0)" in notes
    assert "`hybridpd checkout 1.0 --dir lmcache-1.0 && cd lmcache-1.0 && git am" in notes
    assert "LMCache takes pull requests against `dev`" in notes
    assert "DCO" in notes and "--signoff" in notes
    assert "- **Another way.** Worse." in pr
    plan = pr.split("\n## Test plan\n", 1)[1].split("\n## Results\n", 1)[0]
    assert "on CPU, from the LMCache tree root" in plan
    assert "pytest -v tests/test_add.py" in plan
    # More to run is the submitter's until it ran: not in the PR's test plan.
    assert "Also run `pytest -v tests/v1/multiprocess`." in notes
    assert "tests/v1/multiprocess" not in pr
    assert "hybridpd" not in pr
    assert "No end-to-end measurement of this change is committed" in notes
    assert "no such run is committed" in notes
    for vllm_only in ("vllm bench", "NixlConnector", "OffloadingConnector", "GPU plan",
                      "run_mamba_prefix_cache_test", "vLLM's contributing guide",
                      "pure agent PRs", "vllm-1.0", "reports/e2e/report.json", "1 280"):
        assert vllm_only not in pr + notes, vllm_only
    assert "AI assistance was used" in pr


def test_series_option_names_a_series_beside_the_default_one(tmp_path):
    project, _ = _project(tmp_path, with_git=False)
    series = load(project.series_path)
    assert render.series_option(series) == ""
    other = series.dir / "lmcache" / "series.toml"
    other.parent.mkdir()
    other.write_text(project.series_path.read_text())
    assert render.series_option(load(other)) == "--series patches/lmcache "
    lmcache = _as_lmcache(load(other))
    assert render._checkout_hint(lmcache.pin("1.0"), "x", lmcache) == (
        "hybridpd --series patches/lmcache checkout 1.0 --dir lmcache-1.0 && "
        "cd lmcache-1.0 && git am --keep-non-patch ../x/0*.patch"
    )


SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0]


def _layer(root: Path, version: str = "1.0") -> Path:
    """A test-environment layer holding lmcache ``version``'s release build."""
    (root / "lmcache").mkdir(parents=True)
    (root / "lmcache" / "__init__.py").write_text("")
    (root / "lmcache" / f"lmcache_native{SUFFIX}").write_bytes(b"\x7fELF")
    (root / f"lmcache-{version}.dist-info").mkdir()
    return root


def test_link_compiled_takes_the_release_build_of_the_same_version(tmp_path):
    tree = tmp_path / "tree"
    (tree / "lmcache").mkdir(parents=True)
    host, layer = tmp_path / "host-vllm", _layer(tmp_path / "layer")
    host.mkdir()
    native = f"lmcache_native{SUFFIX}"

    made = verify.link_compiled(tree, "lmcache", stub_pin("1.0"), [host, layer])

    assert made == [tree / "lmcache" / native]
    assert (tree / "lmcache" / native).resolve() == layer / "lmcache" / native
    assert verify.link_compiled(tree, "lmcache", stub_pin("1.0"), [host, layer]) == []
    with pytest.raises(layout.ExportPrError, match="holds lmcache 1.0, not 2.0"):
        verify.link_compiled(tree, "lmcache", stub_pin("2.0"), [layer])
    with pytest.raises(layout.ExportPrError, match="no layer .* lmcache 1.0 build"):
        verify.link_compiled(tree, "lmcache", stub_pin("1.0"), [host])


def _fake_environment(monkeypatch, tmp_path: Path):
    """Stand-ins for the test environment: what was checked out, built, run."""
    seen: dict = {"checkouts": [], "runs": []}

    def checkout(series, pin, dest, source):
        seen["checkouts"].append((series.package, pin.version, dest, source))
        dest.mkdir(parents=True)

    def ensure_test_env(pin, tree, cache_dir, torch_spec=None, log=None):
        seen["env"] = (pin.version, tree)
        return tmp_path / "venv"

    def run_pytest(venv, tree, files, out, **kw):
        seen["runs"].append((venv, tree, list(files), kw["layers"]))
        return SuiteResult(status="ok")

    monkeypatch.setattr(testrun, "checkout", checkout)
    monkeypatch.setattr(testenv, "ensure_test_env", ensure_test_env)
    monkeypatch.setattr(testenv, "ensure_layers", lambda venv, pin, log: [
        _layer(tmp_path / "layers" / "lmcache")
    ])
    monkeypatch.setattr(hfsnap, "write_snapshots", lambda home: None)
    monkeypatch.setattr(pytestrun, "run_pytest", run_pytest)
    return seen


def test_verify_runs_lmcache_in_its_host_pins_environment(tmp_path, monkeypatch):
    """As ``hybridpd test`` does: vLLM 0.32.0's environment, its stock tree and the
    layers after the LMCache tree, and the release's compiled modules in the tree."""
    project, _ = _project(tmp_path, with_git=False)
    lmcache = _as_lmcache(load(project.series_path), hosted=True)
    seen = _fake_environment(monkeypatch, tmp_path)
    work, tree = tmp_path / "work", tmp_path / "verify" / "lmcache"
    (tree / "lmcache").mkdir(parents=True)

    run = verify.pytest_runner(lmcache, lmcache.pin("1.0"), tmp_path / "stock", work)
    run(tree, ["tests/v1/test_x.py"], "stock")

    host = work / "host-0.32.0"
    assert seen["checkouts"] == [("vllm", "0.32.0", host, "sdist")]
    assert seen["env"] == ("0.32.0", host)
    layer = tmp_path / "layers" / "lmcache"
    assert seen["runs"] == [(tmp_path / "venv", tree, ["tests/v1/test_x.py"], [host, layer])]
    assert (tree / "lmcache" / f"lmcache_native{SUFFIX}").is_symlink()


def test_verify_runs_vllm_in_its_own_pins_environment(tmp_path, monkeypatch):
    project, _ = _project(tmp_path, with_git=False)
    series = load(project.series_path)
    seen = _fake_environment(monkeypatch, tmp_path)
    stock, tree = tmp_path / "stock", tmp_path / "verify" / "vllm"
    tree.mkdir(parents=True)

    run = verify.pytest_runner(series, series.pin("1.0"), stock, tmp_path / "work")
    run(tree, ["tests/test_add.py"], "stock")

    assert seen["checkouts"] == []
    assert seen["env"] == ("1.0", stock)
    assert seen["runs"] == [(tmp_path / "venv", tree, ["tests/test_add.py"], [])]
    assert not (tmp_path / "layers").exists()


# The author: the submitter --------------------------------------------------------


def test_commits_are_authored_by_the_submitter_not_the_project(tmp_path):
    project, material = _project(tmp_path)
    _, _, (result,), _ = _export(project, material, ["follow-up"], tmp_path)

    for commit in result.commits:
        text = (result.dir / commit.filename).read_text()
        assert f"From: {SUBMITTER}\n" in text
        assert "hybridpd@localhost" not in text.split("\n\n", 1)[0]


def _cli_export(project: Project, tmp_path: Path, *extra: str):
    return CliRunner().invoke(
        main, ["--series", str(project.series_path), "export-pr", "fix-add", "--pin", "1.0",
               "--to", str(tmp_path / "cli-out"), *extra],
    )


def test_without_author_or_git_identity_export_pr_refuses_in_one_line(tmp_path, monkeypatch):
    project, material = _project(tmp_path)
    monkeypatch.setattr(layout, "UPSTREAM_TESTS_DIR", material)
    monkeypatch.chdir(tmp_path)  # no repository: no local identity; none global (isolated)

    result = _cli_export(project, tmp_path)

    assert result.exit_code == 1
    assert result.output.strip().splitlines() == [f"Error: {author.MISSING}"]
    assert not (tmp_path / "cli-out").exists()


@pytest.mark.parametrize("bad", ["Ada", "ada@example.invalid", "<a@b.c>", "A <no-at>",
                                 "A <a@b.c> x", "hybridpd <hybridpd@localhost>"])
def test_a_bad_author_is_one_line_and_nothing_is_written(tmp_path, monkeypatch, bad):
    project, material = _project(tmp_path, with_git=False)
    monkeypatch.setattr(layout, "UPSTREAM_TESTS_DIR", material)

    result = _cli_export(project, tmp_path, "--author", bad)

    assert result.exit_code == 2  # bad usage: click's usage lines, then the one error
    errors = [ln for ln in result.output.splitlines() if ln.startswith("Error")]
    assert len(errors) == 1 and errors[0].startswith(f"Error: --author {bad!r} is ")
    assert not (tmp_path / "cli-out").exists()


def test_the_configured_git_identity_is_the_default_author(tmp_path, monkeypatch):
    repo = tmp_path / "where-it-runs"
    repo.mkdir()
    gitops.init(repo, "main")
    for key, value in (("user.name", "PR Submitter"),
                       ("user.email", "submitter@example.invalid")):
        subprocess.run(["git", "-C", str(repo), "config", key, value], check=True)

    assert author.resolve_author(None, repo) == SUBMITTER
    assert author.resolve_author("Other  Person <o@example.invalid>", repo) == (
        "Other  Person <o@example.invalid>")
    # The project identity configured is nobody's: refused, not used.
    subprocess.run(["git", "-C", str(repo), "config", "user.email", "hybridpd@localhost"],
                   check=True)
    with pytest.raises(HybridpdError, match="pass --author"):
        author.resolve_author(None, repo)


# A change for an open upstream PR's thread ----------------------------------------


def _with_thread(project: Project, patch_id: str, thread: str) -> None:
    text = project.series_path.read_text()
    line = f'id = "{patch_id}"\n'
    project.series_path.write_text(text.replace(line, line + f'upstream_thread = "{thread}"\n'))


def test_a_change_for_an_open_prs_thread_is_a_comment_not_a_pr(tmp_path):
    project, material = _project(tmp_path)
    _with_thread(project, "fix-add", "example/proj#7")
    (material / f"{PACKAGE}-1.0" / "fix-add" / layout.COMMENT_TEXT_FILE).write_text(
        "The exact sum: `total = a + b`, where the PR returns `a + b`.\n"
    )
    series, stock, (result,), _ = _export(project, material, ["fix-add"], tmp_path)

    assert series.patch("fix-add").upstream_thread == "example/proj#7"
    names = sorted(p.name for p in result.dir.iterdir())
    assert names == [layout.MANIFEST, "0001-fix-add.patch", layout.COMMENT_FILE,
                     layout.NOTES_FILE]
    assert result.to_json()["files"] == ["0001-fix-add.patch", "COMMENT.md", "SUBMITTING.md"]
    comment = (result.dir / layout.COMMENT_FILE).read_text()
    # The problem, the exact change and the test, as diffs upstream can apply.
    assert "why of fix-add" in comment and "design of fix-add" in comment
    change = comment.split("The exact change, on v1.0:\n\n```diff\n", 1)[1].split("```")[0]
    assert change.startswith("diff --git a/proj/core.py b/proj/core.py")
    assert "+    total = a + b" in change and "tests/" not in change
    test = comment.split("The test (added to vLLM's tests, CPU):\n\n```diff\n", 1)[1]
    assert test.startswith("diff --git a/tests/test_add.py b/tests/test_add.py")
    # The kept comment text before the change; the command that runs the test after it.
    assert comment.index("The exact sum: `total = a + b`, where the PR returns `a + b`.") < (
        comment.index("The exact change, on v1.0:"))
    run = test.split("```\n\n", 1)[1]
    assert run.startswith("To run it from the vLLM tree root, without and with the change:\n"
                          "\n```bash\npytest -v tests/test_add.py\n```\n")
    assert "Not measured yet: run the tests above on the release and with the change" in run
    assert "hybridpd" not in comment
    notes = (result.dir / layout.NOTES_FILE).read_text()
    assert "goes to example/proj#7's thread as a comment, not as a PR" in notes

    # --verify still proves the test red on stock and green with the change, and the
    # comment then carries what it measured.
    report = verify.verify(result, stock, _fake_runner([]), series, series.pin("1.0"))
    assert report["ok"], report["problems"]
    assert (report["stock"]["failed"], report["patched"]["passed"]) == (1, 1)
    render.write_pr(result, series, [], [])
    comment = (result.dir / layout.COMMENT_FILE).read_text()
    assert "`pytest -v tests/test_add.py` (" in comment
    assert "| v1.0, without the change | 0 | 1 | 0 | 0 |" in comment
    assert "| v1.0 with the change | 1 | 0 | 0 | 0 |" in comment
    assert not (result.dir / "PR.md").exists()


def test_upstream_thread_must_name_an_upstream_pr(tmp_path):
    project, _ = _project(tmp_path, with_git=False)
    _with_thread(project, "fix-add", "see the thread")
    with pytest.raises(Exception, match='"upstream_thread" must be an upstream PR'):
        load(project.series_path)
