"""Export carried patches as upstream pull requests, with their evidence: one PR
directory per patch (:mod:`hybridpd.upstreaming.layout`), and ``hybridpd export-pr``
itself (a fresh stock checkout, the export, ``--verify``)."""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hybridpd import gitops, guard, scratch
from hybridpd.progress import Log, quiet
from hybridpd.series.checkout import checkout
from hybridpd.series.model import Pin, Series
from hybridpd.upstreaming.author import resolve_author
from hybridpd.upstreaming.checks import run_checks
from hybridpd.upstreaming.commits import build_commits, prerequisites
from hybridpd.upstreaming.evidence import pr_evidence
from hybridpd.upstreaming.layout import ExportPrError, PrExport, refuse_foreign, seal
from hybridpd.upstreaming.render import write_pr
from hybridpd.upstreaming.verify import pytest_runner, verify


def export_prs(
    series: Series,
    pin: Pin,
    patch_ids: Sequence[str],
    stock: Path,
    out_dir: Path,
    log: Log = quiet,
    tests_root: Path | None = None,
    force: bool = False,
    *,
    author: str,
) -> list[PrExport]:
    """Write one PR directory per patch of ``patch_ids`` into ``out_dir``, its commits
    authored by ``author`` (``Name <email>``: the submitter).

    ``stock`` is a checkout of ``pin`` (``hybridpd checkout``); it is left as it was
    (the work happens in a detached worktree of it). A directory is replaced only
    when export-pr wrote all of it (its :data:`MANIFEST` says so) or with ``force``;
    otherwise nothing is written (see :func:`refuse_foreign`).
    """
    out_dir = out_dir.absolute()
    carried = [p.id for p in series.carried(pin)]
    if not force:
        for patch_id in patch_ids:
            refuse_foreign(out_dir / patch_id)
    for patch_id in patch_ids:
        if patch_id not in carried:
            state = series.patch(patch_id)
            if state is None:
                raise ExportPrError(f"{patch_id} has no record in series.toml")
            pin_state = state.pins.get(pin.version)
            why = (
                f"upstream since {pin_state.release}" if pin_state and pin_state.release
                else "not carried"
            )
            raise ExportPrError(f"{patch_id} is {why} on {pin.version}: nothing to export")
    exports = []
    with scratch.tree("export-pr-") as tmp:
        work = tmp / "work"
        base = gitops.resolve(stock, pin.tag) or gitops.head(stock)
        with gitops.worktree(stock, base, work):
            for patch_id in patch_ids:
                deps = prerequisites(work, base, series, pin, patch_id)
                if deps:
                    log(f"export-pr: {patch_id} needs {', '.join(deps)} to apply on stock")
                built = build_commits(
                    work, base, series, pin, [*deps, patch_id], tests_root, author=author
                )
                target = out_dir / patch_id
                if target.exists():
                    shutil.rmtree(target)
                target.mkdir(parents=True)
                for commit, content in built:
                    (target / commit.filename).write_bytes(content)
                guard.fault("export-pr:written")  # unsealed: the next run refuses it
                export = PrExport(
                    patch_id,
                    pin,
                    target,
                    [c for c, _ in built],
                    deps,
                    material_root=tests_root,
                    thread=series.patch(patch_id).upstream_thread,
                )
                if not export.own.tests:
                    export.warnings.append(
                        f"no upstream-style test kept for {patch_id} on {pin.version} "
                        f"(data/upstream_tests/{series.slug(pin)}/{patch_id}/tests/)"
                    )
                chosen, stale = pr_evidence(series, pin, export, log)
                export.warnings += stale
                for line in export.warnings:
                    log(f"warning: {patch_id}: {line}")
                write_pr(export, series, chosen, stale)
                seal(target)
                guard.fault("export-pr:sealed")
                exports.append(export)
    return exports


# The command ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ExportPrResult:
    """What ``hybridpd export-pr`` wrote (the ``--json`` contract)."""

    pin: str
    exports: tuple[PrExport, ...]

    @property
    def failed(self) -> list[str]:
        """The patches whose ``--verify`` failed."""
        return [e.patch_id for e in self.exports if e.verification and not e.verification["ok"]]

    def to_json(self) -> dict[str, Any]:
        return {"pin": self.pin, "exports": [e.to_json() for e in self.exports]}


def run(
    series: Series,
    pin: Pin,
    patch_id: str | None,
    out_dir: Path,
    verify_them: bool = False,
    log: Log = quiet,
    force: bool = False,
    author: str | None = None,
) -> ExportPrResult:
    """Export ``patch_id`` (None: every patch carried on ``pin``) into ``out_dir``, from a
    fresh stock checkout, and with ``verify_them`` prove each directory on it (see
    :func:`verify`). The commits are authored by ``author``, else the git identity
    configured here; with neither, UsageError before anything is written."""
    submitter = resolve_author(author)
    ids = [patch_id] if patch_id else [p.id for p in series.carried(pin)]
    with scratch.tree("export-pr-") as tmp:
        stock = tmp / "stock"
        log(f"export-pr: checking out stock {pin.version}")
        checkout(series, pin, stock, source="sdist")
        guard.fault("export-pr:checked-out")
        exports = export_prs(
            series, pin, ids, stock, out_dir, log=log, force=force, author=submitter
        )
        if verify_them:
            runner = pytest_runner(series, pin, stock, Path(tmp), log=log)
            for export in exports:
                verify(export, stock, runner, series, pin, log=log,
                       checks=lambda tree, files: run_checks(tree, files, log=log))
                write_pr(export, series, *pr_evidence(series, pin, export))
                seal(export.dir)
    return ExportPrResult(pin.version, tuple(exports))
