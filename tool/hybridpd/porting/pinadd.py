"""``hybridpd pin add``: make a release a pin of the series, so that ``port`` can reach it.

A pin is a version, its git tag, its sdist's file name and the sdist's sha256 (the
``[[pins]]`` tables of series.toml). :func:`add_pin` finds the sdist on the indexes pip
is configured for (:mod:`hybridpd.pkgindex`), downloads it into the cache (verified
against the index's hash where the index gives one; the sha256 recorded is the one of
the bytes downloaded), and writes the pin in version order with ``ported = false``:
nothing is carried on it until ``hybridpd port`` ports the series to it. The tag and the
sdist's name follow the pins already there.

It also proposes the pin to port from (:func:`hybridpd.series.source.propose_source`,
which says how).

Invariant: series.toml changes only when the sdist was found and verified and the
proposal computed; the write itself is all-or-nothing (:mod:`hybridpd.series.edit`). An
index that lists the sdist without a hash gets the downloaded file's hash recorded.
"""

from __future__ import annotations

from dataclasses import dataclass

from packaging.version import InvalidVersion

from hybridpd import cache, pkgindex
from hybridpd.errors import HybridpdError, UsageError
from hybridpd.progress import Log, quiet
from hybridpd.series import edit as seriesedit
from hybridpd.series.model import Pin, Series, release_key
# The proposal (which ported pin to port from) is the series' own knowledge.
from hybridpd.series.source import SourceCandidate, propose_source


@dataclass(frozen=True)
class PinAdded:
    """The pin written, where its sdist came from, and the sources to port it from."""

    pin: Pin
    url: str
    #: The ported pins, best source first; empty when none is ported.
    candidates: tuple[SourceCandidate, ...] = ()
    #: The index's yank reason when the release is yanked (see add_pin), else None.
    yanked: str | None = None

    @property
    def proposed(self) -> SourceCandidate | None:
        return self.candidates[0] if self.candidates else None

    def reason(self) -> str:
        best = self.proposed
        if best is None:
            return "no pin is ported yet"
        others = ", ".join(
            f"{c.version} {c.applying}/{c.hunks}"
            + (f" and would lose {', '.join(c.would_lose)}" if c.would_lose else "")
            for c in self.candidates[1:]
        )
        text = (f"{best.applying} of the {best.hunks} hunks of its patches apply to "
                f"{self.pin.version} as they are")
        if best.would_lose:
            text += (f"; it records {', '.join(best.would_lose)} upstream since a release "
                     f"after {self.pin.version}: replay them (port --continue), do not skip")
        return text + (f" (other pins: {others})" if others else "")

    def to_json(self) -> dict:
        return {
            "version": self.pin.version,
            "tag": self.pin.tag,
            "sdist": self.pin.sdist,
            "sha256": self.pin.sha256,
            "url": self.url,
            "yanked": self.yanked,
            "ported": False,
            "proposed_from": self.proposed.version if self.proposed else None,
            "reason": self.reason(),
            "candidates": [c.to_json() for c in self.candidates],
        }


def add_pin(
    series: Series, release: str, allow_yanked: bool = False, log: Log = quiet
) -> PinAdded:
    """Make ``release`` (not a pin yet) a pin of ``series`` (see the module docstring). A
    yanked sdist (PEP 592: the project withdrew the release) is refused unless
    ``allow_yanked``."""
    release = _release(series, release)
    pin = _new_pin(series, release)
    settings = pkgindex.pip_settings()
    found = pkgindex.find_file(series.package, pin.sdist, settings)
    if found.yanked is not None and not allow_yanked:
        reason = f" ({found.yanked})" if found.yanked else ""
        raise HybridpdError(
            f"{pin.sdist} is yanked on the index{reason}; pin it anyway with --allow-yanked"
        )
    log(f"found {pin.sdist} at {found.url}" + (" (yanked)" if found.yanked is not None else ""))
    archive, sha256 = cache.sdist_listed(series.package, found, settings)
    if found.sha256 is None:
        log(f"the index lists no hash for {pin.sdist}: recording the downloaded file's")
    pin = Pin(release, pin.tag, pin.sdist, sha256, ported=False)
    candidates = propose_source(series, archive, release)
    with seriesedit.edit(series.path) as editor:
        editor.add_pin(pin)
    log(f"wrote pin {release} to {series.relative(series.path)} (ported = false)")
    return PinAdded(pin, found.url, candidates, found.yanked)


def _release(series: Series, release: str) -> str:
    """``release`` as the index names it (a leading v dropped), checked not to be a pin."""
    wanted = release.removeprefix("v")
    try:
        parsed = release_key(wanted)
    except InvalidVersion:
        raise UsageError(f"{release!r} is not a release version") from None
    if str(parsed) != wanted:
        raise UsageError(f"{release!r} is not a release version as the index names it "
                         f"(did you mean {parsed}?)")
    if any(p.version == wanted for p in series.pins):
        raise HybridpdError(f"{wanted} is already a pin of {series.relative(series.path)}")
    return wanted


def _new_pin(series: Series, release: str) -> Pin:
    """The pin of ``release``: its tag and sdist name formed as the existing pins' are."""
    model = series.pins[-1]  # a series has at least one pin (series.parse)
    return Pin(
        release,
        model.tag.replace(model.version, release),
        model.sdist.replace(model.version, release),
        "",
    )
