"""Choosing what to upstream: which carried patches have no upstream release yet
(candidates to propose), and which can be dropped where.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from packaging.version import InvalidVersion, Version

from hybridpd.series.model import Series, release_key

# Versions ---------------------------------------------------------------------------


def _release_order(release: str) -> tuple[bool, Version | None]:
    """:func:`~hybridpd.series.model.release_key`, except that a recorded release that is
    not PEP 440 (the series parser does not require one) sorts after every release, as
    :meth:`~hybridpd.series.model.Series.fixes_lost_on` counts it: it cannot be proven
    earlier."""
    try:
        return False, release_key(release)
    except InvalidVersion:
        return True, None


# Upstream candidates ----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Candidate:
    """Where one patch stands on its way upstream.

    ``since``: the earliest release recorded as having the change (None: no pin has
    it upstream). ``drop_from``: pins that still carry it although their version is at
    or after ``since``. ``keep_on``: pins that carry it and predate ``since``.
    """

    id: str
    title: str
    reference: str
    carried: tuple[str, ...]
    upstream: dict[str, str]
    since: str | None
    drop_from: tuple[str, ...]
    keep_on: tuple[str, ...]

    @property
    def status(self) -> str:
        """``candidate`` (carried, upstream nowhere yet: to be proposed), ``drop``
        (some pin carries it past its upstream release) or ``upstream``."""
        if self.since is None:
            return "candidate"
        return "drop" if self.drop_from else "upstream"

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "title": self.title,
            "status": self.status,
            "reference": self.reference,
            "carried": list(self.carried),
            "upstream": dict(self.upstream),
            "since": self.since,
            "drop_from": list(self.drop_from),
            "keep_on": list(self.keep_on),
        }


def upstream_candidates(series: Series) -> list[Candidate]:
    """Every patch's upstream standing, from the records' states (reads nothing else).
    A patch no pin carries or has upstream (dropped everywhere) is left out."""
    result = []
    for patch in series.patches:
        if patch.pins and all(s.state == "dropped" for s in patch.pins.values()):
            continue
        carried = tuple(v for v, s in patch.pins.items() if s.state == "carried")
        upstream = {
            v: s.release or "?" for v, s in patch.pins.items() if s.state == "upstream"
        }
        since = min(upstream.values(), key=_release_order) if upstream else None
        drop, keep = [], []
        for version in carried:
            if since is not None and _release_order(version) >= _release_order(since):
                drop.append(version)
            else:
                keep.append(version)
        result.append(
            Candidate(
                patch.id,
                patch.title,
                patch.upstream,
                carried,
                upstream,
                since,
                tuple(drop),
                tuple(keep) if since is not None else (),
            )
        )
    return result


def format_candidates(candidates: Sequence[Candidate]) -> list[str]:
    """Human lines for ``hybridpd list --upstream-candidates``."""
    lines = []
    for c in candidates:
        if c.since is None:
            lines.append(
                f"candidate  {c.id}: carried on {', '.join(c.carried) or '(no pin)'}; "
                f"no upstream release yet (reference: {c.reference})"
            )
            continue
        where = ", ".join(c.upstream)
        line = f"upstream   {c.id}: upstream since {c.since} (on {where})"
        if c.keep_on:
            line += f"; still needed on {', '.join(c.keep_on)} (older than {c.since})"
        lines.append(line)
        if c.drop_from:
            lines.append(
                f"drop       {c.id}: carried on {', '.join(c.drop_from)}, upstream since "
                f"{c.since} on {where}: drop from pins >= {c.since}"
            )
    return lines
