"""Rendering the PR text: ``PR.md`` of a PR directory (what, why, design,
alternatives, test plan, results, AI assistance), for the project it goes to."""

from __future__ import annotations

from collections.abc import Sequence

from hybridpd.e2e import report as e2e_report
from hybridpd.series.model import SERIES_FILE, Patch, Pin, Series
from hybridpd.upstreaming.commits import strip_trailer
from hybridpd.upstreaming.conventions import CHECKLIST, VLLM, Upstream, upstream_of
from hybridpd.upstreaming.evidence import Report, e2e_command
from hybridpd.upstreaming.layout import COMMENT_FILE, NOTES_FILE, PrExport, material, pytest_command


def series_option(series: Series) -> str:
    """``--series <dir> `` for hybridpd commands on ``series``, relative to the
    project that holds it; empty for the project's default series
    (``patches/series.toml``)."""
    for root in series.dir.parents:
        if (root / "patches" / SERIES_FILE).is_file():
            if series.path == root / "patches" / SERIES_FILE:
                return ""
            return f"--series {series.dir.relative_to(root).as_posix()} "
    return ""


def _checkout_hint(pin: Pin, patch_id: str, series: Series) -> str:
    tree = f"{series.package}-{pin.version}"
    return (
        f"hybridpd {series_option(series)}checkout {pin.version} --dir {tree} && cd {tree} && "
        f"git am --keep-non-patch ../{patch_id}/0*.patch"
    )


def render_notes(
    export: PrExport,
    patch: Patch,
    reports: Sequence[Report],
    stale: Sequence[str],
    series: Series,
) -> str:
    """``SUBMITTING.md`` of ``export``: what the submitter needs and upstream does not
    (how the directory was made and is re-checked, the DCO and AI-attribution rules,
    what it depends on, the GPU plan to run, hybridpd's own measurements). Nothing of
    it belongs in the PR text."""
    pin, upstream, option = export.pin, upstream_of(series), series_option(series)
    out = [f"# Submitting `{export.patch_id}` to {upstream.name}", ""]
    out += [
        f"Exported by `hybridpd export-pr` from the hybridpd series (patch "
        f"`{export.patch_id}`, {upstream.link} v{pin.version}). Apply: "
        f"`{_checkout_hint(pin, export.patch_id, series)}` (`--keep-non-patch` keeps the "
        f"`{upstream.prefix}`-style subject prefixes). Re-check the directory: "
        f"`hybridpd {option}export-pr {export.patch_id} --pin {pin.version} --to DIR "
        "--verify --author \"Name <email>\"`. "
        + (f"This change goes to {patch.upstream_thread}'s thread as a comment, not as a "
           f"PR of its own, while that PR is open: `{COMMENT_FILE}` is the comment."
           if patch.upstream_thread else "`PR.md` is the PR text."),
        "",
        "- **DCO:** the commits carry no `Signed-off-by`; sign them off yourself before "
        "opening the PR (`git am --signoff ...`, or `git rebase --signoff` afterwards). "
        "The sign-off certifies the person who submits, who is the commits' author.",
        *(f"- {note.removeprefix('> ')}" for note in upstream.notes),
    ]
    if export.prerequisites:
        deps = ", ".join(f"`{i}`" for i in export.prerequisites)
        out.append(
            f"- **Depends on** the PR of {deps}: its commit(s) come first in this directory "
            f"({', '.join(c.filename for c in export.commits[:-1])}) so that it applies to "
            f"stock v{pin.version}; open this PR on top of that one (or after it merges), "
            "drop them from this branch and name that PR under Related."
        )
    out.append(f"- Carried downstream (hybridpd) until: {_text(patch.removal)}")
    for line in stale:
        out.append(f"- **Warning:** {line}")
    kept = material(series.slug(pin), export.patch_id, export.material_root)
    if kept.test_plan:
        out += ["", "## More to run before submitting", "",
                "Add what you ran, with its result, to the PR's test plan and results.",
                "", kept.test_plan]
    if upstream.vllm_e2e:
        out += ["", "## GPU plan to run before submitting", "",
                "Add it to the PR's test plan and its measured numbers to Results once "
                "you have run it; the PR text states only what was run.", ""]
        out += _gpu_plan()
    out += ["", "## hybridpd's measurements (context, not PR results)", ""]
    out += _evidence(export, reports, upstream)
    return "\n".join(out).rstrip() + "\n"


def _diff(export: PrExport) -> tuple[list[str], list[str]]:
    """The own commit's diff, split into the change (source files) and its tests."""
    text = (export.dir / export.own.filename).read_text(encoding="utf-8")
    diff = text.split("\n---\n", 1)[-1]
    source, tests = [], []
    for part in diff.split("diff --git ")[1:]:
        path = part.split(" ", 1)[0].removeprefix("a/")
        body = ("diff --git " + part).rstrip("\n").removesuffix("\n--").rstrip("\n")
        (tests if path in export.own.tests else source).append(body)
    return source, tests


def render_comment(export: PrExport, patch: Patch, series: Series) -> str:
    """``COMMENT.md`` of a change that goes to an open upstream PR's thread
    (``upstream_thread``) instead of a PR of its own: the problem, the exact count
    (the kept comment text and the diff), the tests with the command that runs them
    and what it measured, in the project's words."""
    pin, upstream = export.pin, upstream_of(series)
    source, tests = _diff(export)
    out = [f"<!-- A comment for {patch.upstream_thread} -->", ""]
    out += [_text(patch.why), "", _text(patch.design), ""]
    kept = material(series.slug(pin), export.patch_id, export.material_root)
    if kept.comment:
        out += [kept.comment, ""]
    out += [f"The exact change, on v{pin.version}:", "", "```diff", *source, "```", ""]
    if tests:
        own = export.own
        how = " and ".join(
            verb for verb, files in (
                ("added to", [t for t in own.tests if t not in own.edited]),
                ("edited in", own.edited),
            ) if files
        )
        them = "tests" if len(tests) > 1 else "test"
        out += [f"The {them} ({how} {upstream.name}'s tests, CPU):", "",
                "```diff", *tests, "```", ""]
        out += [f"To run {'them' if len(tests) > 1 else 'it'} from the {upstream.name} "
                "tree root, without and with the change:", "",
                "```bash", pytest_command(export.tests), "```", ""]
    out += _results(export, upstream, pin)[2:]
    out += ["AI assistance was used to prepare this comment; before posting it, the "
            "poster ticks:", "", CHECKLIST.split("\n- [ ] The `Assisted-by:`")[0], ""]
    return "\n".join(out).rstrip() + "\n"


def render_pr(
    export: PrExport,
    patch: Patch,
    reports: Sequence[Report],
    stale: Sequence[str],
    series: Series,
) -> str:
    """The PR body of ``export`` (Markdown), in the words of ``series``' project: no
    hybridpd file, command or jargon (those are in :func:`render_notes`); its test plan
    and results are what ``--verify`` ran and measured."""
    own = export.own
    upstream = upstream_of(series)
    out = [f"# {own.subject}", ""]
    body, overlap = _split_overlap(strip_trailer(own.body, "Assisted-by"))
    out += ["## What", ""]
    out += [body or patch.title + ".", ""]
    changed = [f for f in own.files if f not in own.tests]
    out += ["Changed: " + ", ".join(f"`{f}`" for f in changed) + "."]
    added = [t for t in own.tests if t not in own.edited]
    if added:
        out += ["Tests added: " + ", ".join(f"`{t}`" for t in added) + "."]
    if own.edited:
        out += ["Tests edited: " + ", ".join(f"`{t}`" for t in own.edited) + "."]
    out += ["", "## Why", "", _text(patch.why), "", "## Design", "", _text(patch.design), ""]
    out += ["## Alternatives considered", ""]
    kept = material(series.slug(pin := export.pin), export.patch_id, export.material_root)
    out += [kept.alternatives or "(none)", ""]
    out += ["## Related", "", f"- {_text(patch.upstream)}"]
    out += [f"- {paragraph}" for paragraph in overlap]
    out += [""]
    out += _test_plan(export, upstream)
    out += _results(export, upstream, pin)
    out += ["## AI assistance", "", upstream.ai, ""]
    return "\n".join(out).rstrip() + "\n"


def _text(paragraph: str) -> str:
    """A series.toml paragraph (hard-wrapped) as one Markdown paragraph."""
    return " ".join(paragraph.split())


def _split_overlap(body: str) -> tuple[str, list[str]]:
    """``body`` without its ``Overlap:`` paragraphs, and those paragraphs (unwrapped):
    the PR's statement of what it shares with other open PRs, shown under Related."""
    kept, overlap = [], []
    for paragraph in body.strip().split("\n\n"):
        if paragraph.startswith("Overlap:"):
            overlap.append(_text(paragraph))
        else:
            kept.append(paragraph)
    return "\n\n".join(kept), overlap


#: The served model, flags and workload of the GPU plan: vllm#42524's measurement.
GPU_MODEL = "Qwen/Qwen3.5-35B-A3B"
GPU_SERVE_FLAGS = (
    "--enforce-eager --enable-prefix-caching --mamba-cache-mode align --block-size 128 "
    "--no-disable-hybrid-kv-cache-manager --async-scheduling"
)
GPU_KV_CONFIG = (
    '{"kv_connector":"MultiConnector","kv_role":"kv_both","kv_connector_extra_config":'
    '{"connectors":[{"kv_connector":"NixlConnector","kv_role":"kv_both"},'
    '{"kv_connector":"OffloadingConnector","kv_role":"kv_both",'
    '"kv_connector_extra_config":{"cpu_bytes_to_use":100000000000}}]}}'
)
GPU_BENCH = (
    f"vllm bench serve --model {GPU_MODEL} --port 8192 --dataset-name prefix_repetition \\\n"
    "  --prefix-repetition-prefix-len 16384 --prefix-repetition-suffix-len 1024 \\\n"
    "  --prefix-repetition-num-prefixes 2 --prefix-repetition-output-len 1024 \\\n"
    "  --num-prompts 512 --max-concurrency 256"
)


def _gpu_plan() -> list[str]:
    """Commands of vLLM's tree for the GPU half of the test plan."""
    return [
        "GPU (2 GPUs, 1 prefill + 1 decode), from the vLLM tree root. vLLM's own hybrid "
        "PD prefix-cache test, and the NIXL + offloading gsm8k accuracy test on a small "
        "Qwen3.5 model (one with an expected value in `test_accuracy.py`):",
        "",
        "```bash",
        "bash tests/v1/kv_connector/nixl_integration/run_mamba_prefix_cache_test.sh",
        "MODEL_NAMES=Qwen/Qwen3.5-0.8B BLOCK_SIZE=128 "
        "VLLM_SERVE_EXTRA_ARGS=--enable-prefix-caching,--mamba-cache-mode,align \\",
        "  bash tests/v1/kv_connector/nixl_integration/run_multi_connector_accuracy_test.sh",
        "```",
        "",
        f"Performance, as the original report measured it ({GPU_MODEL}, prefix_repetition "
        "prefix 16 384, suffix 1 024, 512 prompts, concurrency 256), with "
        "MultiConnector[NixlConnector, OffloadingConnector] on both instances (for "
        "NIXL + LMCache MP, use `LMCacheMPConnector` as the second child, with "
        "lmcache installed and its server running). Run it on `main` and on this "
        "branch; compare TTFT, output throughput and the decode instance's prefix-cache "
        "hits (`vllm:prefix_cache_hits` on port 8200's `/metrics`):",
        "",
        "```bash",
        f"KV='{GPU_KV_CONFIG}'",
        f"CUDA_VISIBLE_DEVICES=0 VLLM_NIXL_SIDE_CHANNEL_PORT=5559 vllm serve {GPU_MODEL} "
        f"--port 8100 {GPU_SERVE_FLAGS} --kv-transfer-config \"$KV\" &",
        f"CUDA_VISIBLE_DEVICES=1 VLLM_NIXL_SIDE_CHANNEL_PORT=5659 vllm serve {GPU_MODEL} "
        f"--port 8200 {GPU_SERVE_FLAGS} --kv-transfer-config \"$KV\" &",
        "python3 tests/v1/kv_connector/nixl_integration/toy_proxy_server.py --port 8192 "
        "--prefiller-ports 8100 --decoder-ports 8200 &",
        GPU_BENCH,
        "```",
        "",
    ]


def _test_plan(export: PrExport, upstream: Upstream = VLLM) -> list[str]:
    """The commands ``--verify`` runs, as a contributor types them in the tree root:
    the added tests, and the project's own checks on the changed files."""
    out = ["## Test plan", ""]
    if not export.own.tests:
        return out + ["No unit test is added by this PR yet.", ""]
    files = export.tests
    out += [
        f"Unit tests {'added or edited' if export.own.edited else 'added'} by this PR, "
        f"on CPU, from the {upstream.name} tree root, without and with this PR:",
        "",
        "```bash",
        pytest_command(files),
        "```",
        "",
    ]
    checks = (export.verification or {}).get("checks") or {}
    if checks.get("checks"):
        out += [
            f"{upstream.name}'s pre-commit hooks on the changed files, with the versions "
            "its `.pre-commit-config.yaml` pins:",
            "",
            "```bash",
            *(c["command"] for c in checks["checks"]),
            "```",
            "",
        ]
    return out


def _results(export: PrExport, upstream: Upstream, pin: Pin) -> list[str]:
    """What ``--verify`` measured: the test plan's counts without and with the PR, and
    the checks' verdict; nothing when it has not run."""
    out = ["## Results", ""]
    verification = export.verification
    this = "the change" if export.thread else "this PR"
    if not verification:
        plan = "the tests above" if export.thread else "the test plan"
        return out + [f"Not measured yet: run {plan} on the release and with {this} "
                      "and paste the counts here.", ""]
    rows = {
        "stock": f"v{pin.version}, without {this}",
        "without": f"v{pin.version} with only the PRs {this} depends on",
        "patched": f"v{pin.version} with {this}",
    }
    out += [f"`{verification.get('command') or pytest_command(export.tests)}` "
            f"({verification.get('date', '')}):", "",
            "| tree | passed | failed | errors | skipped |", "|---|---:|---:|---:|---:|"]
    for label, name in rows.items():
        run = verification.get(label)
        if run:
            out.append(f"| {name} | {run['passed']} | {run['failed']} | {run['errors']} "
                       f"| {run['skipped']} |")
    out.append("")
    edited = verification.get("edited")
    if edited and verification.get("stock"):
        red = [
            test for test, outcome in verification["stock"]["tests"].items()
            if outcome in ("failed", "error")
        ]
        out += [
            "The counts include the tests " + ", ".join(f"`{f}`" for f in edited)
            + f" already had ({this} edits those files); failing without {this}: "
            + (", ".join(f"`{t}`" for t in red) or "none") + ".",
            "",
        ]
    checks = verification.get("checks") or {}
    if checks.get("checks"):
        found = checks.get("findings") or []
        out += [f"Pre-commit hooks: {len(checks['checks'])} run, "
                + ("no finding." if not found else f"{len(found)} findings:")]
        out += [f"- `{line}`" for line in found]
        out += [""]
    other = [p for p in verification.get("problems", [])
             if p not in (checks.get("findings") or [])]
    if other:
        out += ["**Not ready:** " + "; ".join(other) + ".", ""]
    return out


def _evidence(
    export: PrExport, reports: Sequence[Report], upstream: Upstream = VLLM
) -> list[str]:
    """hybridpd's e2e reports of the whole series (for the submitter; the PR text
    cites only what this PR's own runs measured)."""
    if not reports:
        return [upstream.no_results, ""]
    out = []
    for report in reports:
        other = "" if report.pin == export.pin.version else f" (measured on v{report.pin})"
        out += [
            f"`{report.path}`: scenario {report.scenario}, device "
            f"{report.e2e.device}, model `{report.e2e.model}`"
            f"{other}, committed {report.date.date().isoformat()}. OFF = stock "
            "(upstream's behaviour), ON = patched (the whole hybridpd series of that pin).",
            "",
            *_report_table(report),
            "",
            "Produced by:",
            "",
            "```bash",
            e2e_command(report),
            "```",
            "",
        ]
    return out


def _report_table(report: Report) -> list[str]:
    try:
        return e2e_report.table(report.e2e)
    except (KeyError, TypeError, ValueError, AttributeError):
        # An older or partial report: show the request fields we know.
        lines = [
            "| build | connector | prompt tokens | decode local hit | KV bytes | TTFT (ms) |",
            "|---|---|---:|---:|---:|---:|",
        ]
        for run in report.e2e.runs:
            for r in run.requests:
                lines.append(
                    f"| {run.build} | {run.connector} | {r.get('prompt_tokens')} "
                    f"| {r.get('decode_local_hit_tokens')} | {r.get('kv_bytes_transferred')} "
                    f"| {r.get('ttft_ms')} |"
                )
        return lines


def write_pr(
    export: PrExport, series: Series, reports: Sequence[Report], stale: Sequence[str]
) -> None:
    """(Re)write ``PR.md`` (the PR text) and ``SUBMITTING.md`` (notes to the
    submitter) of ``export``."""
    patch = series.patch(export.patch_id)
    assert patch is not None
    if patch.upstream_thread:
        (export.dir / COMMENT_FILE).write_text(
            render_comment(export, patch, series), encoding="utf-8"
        )
    else:
        (export.dir / "PR.md").write_text(
            render_pr(export, patch, reports, stale, series), encoding="utf-8"
        )
    (export.dir / NOTES_FILE).write_text(
        render_notes(export, patch, reports, stale, series), encoding="utf-8"
    )
