"""``hybridpd pin add``: make a release a pin of the series, so that ``port`` can reach it.

A pin is a version, its git tag, its sdist's file name and the sdist's sha256 (the
``[[pins]]`` tables of series.toml). :func:`add_pin` finds the sdist on the indexes pip
is configured for (:mod:`hybridpd.pkgindex`), downloads it into the cache (verified
against the index's hash where the index gives one; the sha256 recorded is the one of
the bytes downloaded), and writes the pin in version order with ``ported = false``:
nothing is carried on it until ``hybridpd port`` ports the series to it. The tag and the
sdist's name follow the pins already there.

It also proposes the pin to port from (:func:`propose_source`): the ported pin whose
carried patches have the most hunks that apply to the new release as they are (the
hunk's context and removed lines found, in order, in the release's file), a fraction of
the pin's hunks; on a tie the nearest version wins. A hunk that applies needs no merge,
so the best source leaves the fewest for ``port``'s 3-way merges. A hunk on top of an
earlier patch of the series never applies to a release: it counts against every pin
alike.

Invariant: series.toml changes only when the sdist was found and verified; the write
itself is all-or-nothing (:mod:`hybridpd.seriesedit`).
"""

from __future__ import annotations

import re
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

from packaging.version import InvalidVersion, Version

from hybridpd import cache, pkgindex, seriesedit
from hybridpd.errors import HybridpdError, UsageError
from hybridpd.progress import Log, quiet
from hybridpd.series import Pin, Series


@dataclass(frozen=True)
class SourceCandidate:
    """How much of the series carried on a ported pin applies to the new release."""

    version: str
    applying: int  # hunks whose pre-image is in the new release's file, as it is
    hunks: int  # hunks of the patches carried on this pin

    def to_json(self) -> dict:
        return {"version": self.version, "hunks_applying": self.applying, "hunks": self.hunks}


@dataclass(frozen=True)
class PinAdded:
    pin: Pin
    url: str
    #: The ported pins, best source first; empty when none is ported.
    candidates: list[SourceCandidate] = field(default_factory=list)

    @property
    def proposed(self) -> SourceCandidate | None:
        return self.candidates[0] if self.candidates else None

    def reason(self) -> str:
        best = self.proposed
        if best is None:
            return "no pin is ported yet: nothing to port from"
        others = ", ".join(f"{c.version} {c.applying}/{c.hunks}" for c in self.candidates[1:])
        return (
            f"{best.applying} of the {best.hunks} hunks of its patches apply to "
            f"{self.pin.version} as they are"
            + (f" (other pins: {others})" if others else "")
        )

    def to_json(self) -> dict:
        return {
            "version": self.pin.version,
            "tag": self.pin.tag,
            "sdist": self.pin.sdist,
            "sha256": self.pin.sha256,
            "url": self.url,
            "ported": False,
            "proposed_from": self.proposed.version if self.proposed else None,
            "reason": self.reason(),
            "candidates": [c.to_json() for c in self.candidates],
        }


def add_pin(series: Series, version: str, log: Log = quiet) -> PinAdded:
    """Make ``version`` a pin of ``series`` (see the module docstring)."""
    version = _version(series, version)
    pin = _new_pin(series, version)
    settings = pkgindex.pip_settings()
    found = pkgindex.find_file(series.package, pin.sdist, settings)
    log(f"found {pin.sdist} at {found.url}")
    sha256 = found.sha256 or _sha256_by_download(found, settings, log)
    pin = Pin(version, pin.tag, pin.sdist, sha256, ported=False)
    archive = cache.sdist(series.package, pin.sdist, sha256)
    with seriesedit.edit(series.path) as editor:
        editor.add_pin(pin.version, pin.tag, pin.sdist, pin.sha256)
    log(f"wrote pin {version} to {series.relative(series.path)} (ported = false)")
    return PinAdded(pin, found.url, propose_source(series, archive, version))


def _version(series: Series, version: str) -> str:
    wanted = version.removeprefix("v")
    try:
        parsed = Version(wanted)
    except InvalidVersion:
        raise UsageError(f"{version!r} is not a release version") from None
    if str(parsed) != wanted:
        raise UsageError(f"{version!r} is not a release version as the index names it "
                         f"(did you mean {parsed}?)")
    if any(p.version == wanted for p in series.pins):
        raise HybridpdError(f"{wanted} is already a pin of {series.relative(series.path)}")
    return wanted


def _new_pin(series: Series, version: str) -> Pin:
    """The pin's tag and sdist name, formed as the existing pins' are."""
    if not series.pins:
        return Pin(version, f"v{version}", f"{series.package}-{version}.tar.gz", "")
    model = series.pins[-1]
    return Pin(
        version,
        model.tag.replace(model.version, version),
        model.sdist.replace(model.version, version),
        "",
    )


def _sha256_by_download(found: pkgindex.IndexFile, settings, log: Log) -> str:
    """The sha256 of ``found`` when the index gives none: download it once to hash it
    (the cache then verifies the same bytes)."""
    log(f"the index gives no hash for {found.filename}; downloading it to compute one")
    return pkgindex.download_sha256(found.url, settings)


def propose_source(series: Series, archive: Path, version: str) -> list[SourceCandidate]:
    """The ported pins, best source for ``version`` (whose sdist is ``archive``) first
    (see the module docstring)."""
    hunks = {pin.version: _hunks(series, pin) for pin in series.pins if pin.ported}
    texts = _archive_texts(archive, {path for found in hunks.values() for path, _ in found})

    def rank(c: SourceCandidate) -> tuple[float, float]:
        share = c.applying / c.hunks if c.hunks else 0.0
        return (-share, abs(_release_number(c.version) - _release_number(version)))

    return sorted(
        (SourceCandidate(v, sum(pre in texts.get(path, "") for path, pre in found), len(found))
         for v, found in hunks.items()),
        key=rank,
    )


def _release_number(version: str) -> float:
    """A version's release as one number (major, minor, micro), for distances."""
    major, minor, micro = (list(Version(version).release) + [0, 0])[:3]
    return major * 1e6 + minor * 1e3 + micro


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
    found: list[tuple[str, str]] = []
    lines = text.splitlines(keepends=True)
    file = None
    i = 0
    while i < len(lines):
        line = lines[i]
        i += 1
        if line.startswith("diff --git "):
            file = line.rstrip("\n").rsplit(" b/", 1)[-1]
            continue
        match = _HUNK.match(line)
        if not match or file is None:
            continue
        old = int(match.group(1) or 1)
        new = int(match.group(2) or 1)
        pre = []
        while (old or new) and i < len(lines):
            body = lines[i]
            i += 1
            if body.startswith("\\"):  # "\ No newline at end of file"
                continue
            kind, rest = body[:1], body[1:]
            if kind in (" ", "-", "\n"):
                pre.append(rest if kind != "\n" else "\n")
                old -= 1
            if kind in (" ", "+", "\n"):
                new -= 1
        if pre:
            found.append((file, "".join(pre)))
    return found


def _archive_texts(archive: Path, paths: set[str]) -> dict[str, str]:
    """The text of ``paths`` (relative to the sdist's top directory) in ``archive``."""
    out: dict[str, str] = {}
    try:
        with tarfile.open(archive, "r:gz") as tar:
            for member in tar:
                _, _, rel = member.name.partition("/")
                if rel in paths and member.isfile():
                    out[rel] = tar.extractfile(member).read().decode("utf-8", "replace")
    except (OSError, tarfile.TarError) as exc:
        raise HybridpdError(f"cannot read {archive}: {exc}") from exc
    return out
