"""Which ported pin to port a new release from (what ``hybridpd pin add`` proposes, and
``apply`` names for a pin not ported yet).

The ported pin whose carried patches have the largest share of hunks that apply to the
new release as they are (the hunk's context and removed lines found, in order and from a
line start, in the release's file). A hunk on top of an earlier patch of the series never
applies to a release: it counts against every pin alike. A pin that records a patch
upstream since a release after the new one ranks below every pin that records none:
``port`` copies such a record, and the new release would lose a fix it does not have
(``would_lose``). Ties go to the nearest version (the full release tuple), then to the
older pin.
"""

from __future__ import annotations

import re
import tarfile
from dataclasses import dataclass
from pathlib import Path

from packaging.version import Version

from hybridpd import cache
from hybridpd.errors import HybridpdError
from hybridpd.series.model import Pin, Series, release_key


@dataclass(frozen=True)
class SourceCandidate:
    """How much of the series carried on a ported pin applies to the new release."""

    version: str
    applying: int  # hunks whose pre-image is in the new release's file, as it is
    hunks: int  # hunks of the patches carried on this pin
    #: Patches this pin records upstream since a release after the new one.
    would_lose: tuple[str, ...] = ()

    def to_json(self) -> dict:
        return {"version": self.version, "hunks_applying": self.applying, "hunks": self.hunks,
                "would_lose": list(self.would_lose)}


def proposed_for(series: Series, pin: Pin) -> SourceCandidate | None:
    """The source :func:`add_pin` proposed for ``pin`` (a pin not ported yet), computed
    again from its sdist in the cache; without that copy (it is never downloaded here),
    from the records and versions alone: the nearest pin that loses no fix."""
    archive = cache.cache_dir() / "sdists" / pin.sdist
    if not (archive.is_file() and cache.file_sha256(archive) == pin.sha256):
        archive = None
    candidates = propose_source(series, archive, pin.version)
    return candidates[0] if candidates else None


def propose_source(
    series: Series, archive: Path | None, release: str
) -> tuple[SourceCandidate, ...]:
    """The ported pins, best source for ``release`` (whose sdist is ``archive``; None:
    no hunk counts as applying) first (see the module docstring)."""
    target = release_key(release)
    hunks = {pin.version: _hunks(series, pin) for pin in series.pins if pin.ported}
    texts = (_archive_texts(archive, {path for found in hunks.values() for path, _ in found})
             if archive is not None else {})
    candidates = []
    for pin_version, found in hunks.items():
        lose = tuple(series.fixes_lost_on(pin_version, release))
        applying = sum(("\n" + pre) in ("\n" + texts.get(path, "")) for path, pre in found)
        candidates.append(SourceCandidate(pin_version, applying, len(found), lose))

    def rank(c: SourceCandidate) -> tuple:
        share = c.applying / c.hunks if c.hunks else 0.0
        return (bool(c.would_lose), -share, _distance(release_key(c.version), target),
                release_key(c.version) > target)

    return tuple(sorted(candidates, key=rank))


def _distance(a: Version, b: Version) -> tuple[int, ...]:
    """How far apart two releases are, most significant component first."""
    width = max(len(a.release), len(b.release))
    pad = (0,) * width
    return tuple(abs(x - y) for x, y in zip((a.release + pad)[:width], (b.release + pad)[:width]))


_HUNK = re.compile(r"^@@ -\d+(?:,(\d+))? \+\d+(?:,(\d+))? @@")


def _hunks(series: Series, pin: Pin) -> list[tuple[str, str]]:
    """``(path, pre-image)`` of every hunk of the patches carried on ``pin``: the
    lines a hunk needs in the file (context and removed lines), in order."""
    found: list[tuple[str, str]] = []
    for patch in series.carried(pin):
        path = series.patch_path(pin, patch.id)
        if path.is_file():
            found += _patch_hunks(path.read_text(encoding="utf-8", errors="replace"))
    return found


def _patch_hunks(text: str) -> list[tuple[str, str]]:
    """``(path, pre-image)`` of each hunk of a ``git format-patch`` text; the path is the
    file before the change (``--- a/...``), new files have none."""
    found: list[tuple[str, str]] = []
    lines = [line + "\n" for line in text.split("\n")]
    file = None
    i = 0
    while i < len(lines):
        line = lines[i]
        i += 1
        if line.startswith("diff --git "):
            file = None
        elif line.startswith("--- "):
            name = line[4:].rstrip("\n")
            file = name[2:] if name.startswith("a/") else None
        match = _HUNK.match(line)
        if not match or file is None:
            continue
        old, new = int(match.group(1) or 1), int(match.group(2) or 1)
        pre: list[str] = []
        last = ""
        while (old or new) and i < len(lines):
            body = lines[i]
            i += 1
            kind, rest = (" ", "\n") if body == "\n" else (body[:1], body[1:])
            if kind == "\\":  # "\ No newline at end of file": of the line before
                if last in (" ", "-") and pre:
                    pre[-1] = pre[-1].removesuffix("\n")
                continue
            if kind in (" ", "-"):
                pre.append(rest)
                old -= 1
            if kind in (" ", "+"):
                new -= 1
            last = kind
        if i < len(lines) and lines[i].startswith("\\") and last in (" ", "-") and pre:
            pre[-1] = pre[-1].removesuffix("\n")
        if pre:
            found.append((file, "".join(pre)))
    return found


def _archive_texts(archive: Path, paths: set[str]) -> dict[str, str]:
    """The text of ``paths`` (relative to the sdist's top directory) in ``archive``."""
    out: dict[str, str] = {}
    try:
        with tarfile.open(archive, "r:gz") as tar:
            for member in tar:
                _, _, rel = member.name.removeprefix("./").partition("/")
                if rel in paths and member.isfile():
                    out[rel] = tar.extractfile(member).read().decode("utf-8", "replace")
    except (OSError, tarfile.TarError) as exc:
        raise HybridpdError(f"cannot read {archive}: {exc}") from exc
    return out
