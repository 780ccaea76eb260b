"""A release checkout that hybridpd keeps in its cache and reuses from run to run.

The e2e environments and ``apply --installed`` each keep one per pin. A kept checkout
goes back to the release tag before the series is applied, so it is always the current
series on the release: a patch dropped or edited since the last run never meets the
commits it left behind. Patch commits are reproducible (fixed identity and dates), so an
unchanged series gives the same head, and whatever was built from it can be reused.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path

from hybridpd import gitops, guard
from hybridpd.progress import Log
from hybridpd.series.apply import apply, apply_only
from hybridpd.series.checkout import checkout
from hybridpd.series.model import Pin, Series


def prepare(
    series: Series, pin: Pin, src: Path, *, patched: bool, log: Log,
    baseline: Sequence[str] = (),
) -> str:
    """Make ``src`` the release of ``pin`` (plus its series when ``patched``, else plus
    the carried patches named in ``baseline``); its head.

    Raises what checkout and apply raise (one-line HybridpdErrors).
    """
    if src.exists() and not (gitops.is_repo(src) and gitops.resolve(src, "HEAD")):
        shutil.rmtree(src)  # a half-made checkout of ours
    if src.exists():
        with guard.operation(src, "reset") as recovered:  # a killed apply is undone first
            if recovered:
                log(recovered)
            if gitops.head(src) != gitops.resolve(src, pin.tag):
                log(f"resetting {src} to {pin.tag}")
                gitops.reset_hard(src, pin.tag)
    else:
        src.parent.mkdir(parents=True, exist_ok=True)
        log(f"checking out {pin.version} into {src}")
        checkout(series, pin, src, source="sdist")
    if patched:
        result = apply(series, src, pin)
        if result.applied:
            log(f"applied {', '.join(result.applied)}")
    elif baseline:
        applied = apply_only(series, src, pin, baseline)
        if applied:
            log(f"applied {', '.join(applied)} (the release needs it to run)")
    return gitops.head(src)
