"""The patch series: pinned releases and logical patches, read from ``series.toml``.

``series.toml`` is the single source of truth for which releases are pinned and which
patches exist, in what order, and what each patch's state is on each pin. Patch files
live next to it, in ``<series dir>/<version>/<id>.patch``; their order is the order of
the ``[[patches]]`` records, never anything in a file name.

A :class:`Series` returned by :func:`load` is complete and consistent: every required
field is present, ids are unique, and every patch has a state on every pin. Whether
the patch *files* agree with the records is a separate question, answered by
``hybridpd check`` (:mod:`hybridpd.series.export`).
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on Python 3.10
    import tomli as tomllib

from packaging.version import InvalidVersion, Version

from hybridpd.connectors import KNOWN as KNOWN_CONNECTORS
from hybridpd.errors import SeriesError, UnknownPinError

SCHEMA = 1
SERIES_FILE = "series.toml"
SERIES_ENV = "HYBRIDPD_SERIES"

State = Literal["carried", "upstream", "dropped"]
STATES: tuple[State, ...] = ("carried", "upstream", "dropped")

_ID = re.compile(r"[a-z0-9][a-z0-9-]*")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_PATCH_FIELDS = ("id", "title", "why", "design", "upstream", "removal")
_PIN_FIELDS = ("version", "tag", "sdist", "sha256")


def release_key(release: str) -> Version:
    """The one order of releases (pins, upstream releases, torch builds): PEP 440, a
    leading ``v`` accepted ("v0.20.2" is 0.20.2, "2.11.0+cpu" has its local part).
    InvalidVersion for text that is not a release."""
    return Version(release)


@dataclass(frozen=True)
class Pin:
    """A pinned upstream release: its version, git tag and source distribution.

    ``ported`` is False for a pin the series has not been ported to yet
    (``hybridpd port`` does it): its patches have no state on it, nothing is
    carried on it and ``apply`` refuses it.
    """

    version: str
    tag: str
    sdist: str
    sha256: str
    ported: bool = True


@dataclass(frozen=True)
class PinState:
    """A patch's state on one pin; ``release`` is set exactly when it is upstream.

    ``carried``: the pin's patch file is applied. ``upstream``: the release has the
    change. ``dropped``: the series no longer carries it and upstream does not have it
    either (the record's ``dropped`` field says why, with the evidence).
    """

    state: State
    release: str | None = None


@dataclass(frozen=True)
class Patch:
    """The record of one logical patch; ``pins`` has a state for every ported pin."""

    id: str
    title: str
    why: str
    design: str
    upstream: str
    removal: str
    pins: Mapping[str, PinState]
    dropped: str | None = None
    #: An open upstream pull request (``owner/repo#N``) that makes the same change:
    #: the change goes to its thread as a comment (``export-pr`` writes COMMENT.md,
    #: not a PR) while it is open.
    upstream_thread: str | None = None

    @property
    def why_dropped(self) -> str | None:
        """The first sentence of ``dropped``, on one line (what ``list`` prints)."""
        if self.dropped is None:
            return None
        flat = " ".join(self.dropped.split())
        found = re.search(r"\.\s+(?=[A-Z])", flat)  # not at "e.g. " or "v0.32.0 "
        return flat if found is None else flat[: found.start() + 1]


#: The deployment facts a risk's ``when`` table may name, and what each takes.
#: ``connectors``: KV connector class names, any of them in the set (a MultiConnector's
#: children included; ``"*"``: any); ``speculative_decoding``, ``prefix_caching``: on or off;
#: ``mamba_cache_mode``: the modes it applies in; ``max_num_batched_tokens_at_least_blocks``:
#: applies when ``--max-num-batched-tokens`` is at least that many KV cache blocks.
RISK_CONDITIONS = {
    "connectors": 'a list of KV connector class names ("*": any)',
    "speculative_decoding": "true or false",
    "prefix_caching": "true or false",
    "mamba_cache_mode": 'a list of "none", "align", "all"',
    "max_num_batched_tokens_at_least_blocks": "an integer >= 1",
}
#: An upstream issue or pull request: ``owner/repo#number``.
_LINK = re.compile(r"[A-Za-z0-9][A-Za-z0-9-]*/[A-Za-z0-9._-]+#[0-9]+")


@dataclass(frozen=True)
class Risk:
    """A known correctness risk of a deployment (``[[risks]]`` record): what goes
    wrong, the deployments it applies to (``when``, keys of :data:`RISK_CONDITIONS`),
    the upstream issues and pull requests about it (``owner/repo#N``), what else
    avoids it (``unless``, free text: something no deployment flag says), and the
    patch of this series that fixes it (``fixed_by``; the fix's state on each pin is
    that patch's, so whether a pin is fixed is never written twice)."""

    id: str
    says: str
    when: Mapping[str, Any]
    links: tuple[str, ...] = ()
    unless: str | None = None
    fixed_by: str | None = None

    @staticmethod
    def url(link: str) -> str:
        """The GitHub page of ``owner/repo#N`` (GitHub redirects an issue number
        that is a pull request)."""
        repo, number = link.split("#")
        return f"https://github.com/{repo}/issues/{number}"


@dataclass(frozen=True)
class TestSetup:
    """Where a series' patch tests live and what they run in (``[test]`` table).

    ``patch_tests``: the directory of the red->green patch tests (default
    ``../tests/patches`` from the series file). ``host_series`` / ``host_pin``: for a
    project tested inside another one's pin (LMCache's tests run in the test
    environment of a vLLM pin, with its stock tree on ``PYTHONPATH``); None for vLLM.
    """

    patch_tests: Path
    host_series: Path | None = None
    host_pin: str | None = None


@dataclass(frozen=True)
class Series:
    """A loaded, validated ``series.toml``; ``patches`` are in apply order."""

    path: Path
    package: str
    upstream_git: str
    default_pin: str
    pins: tuple[Pin, ...]
    patches: tuple[Patch, ...]
    #: How messages name the project ("vLLM", "LMCache"); the package name if unset.
    name: str = ""
    test: TestSetup | None = None
    #: Known correctness risks (``[[risks]]``), in file order.
    risks: tuple[Risk, ...] = ()

    @property
    def project(self) -> str:
        """The project's display name."""
        return self.name or self.package

    @property
    def dir(self) -> Path:
        """The directory holding ``series.toml`` and the per-pin patch directories."""
        return self.path.parent

    def slug(self, pin: Pin) -> str:
        """``pin``'s name in cache paths: the version for vLLM (the first project),
        ``<package>-<version>`` for the others."""
        return pin.version if self.package == "vllm" else f"{self.package}-{pin.version}"

    @property
    def tests(self) -> TestSetup:
        """The ``[test]`` table, with its defaults."""
        return self.test or TestSetup(self.dir.parent / "tests" / "patches")

    def pin(self, text: str) -> Pin:
        """The pin ``text`` names ("0.20.2" or "v0.20.2"); UnknownPinError if none. The
        one place a version given as text becomes a :class:`Pin`."""
        wanted = text.removeprefix("v")
        for pin in self.pins:
            if pin.version == wanted:
                return pin
        known = ", ".join(p.version for p in self.pins)
        try:
            Version(wanted)
        except InvalidVersion:
            raise UnknownPinError(f"{text} is not a pinned version (pins: {known})") from None
        option = "" if self.package == "vllm" else f" --series {self.relative(self.path)}"
        raise UnknownPinError(
            f"{text} is not a pinned version (pins: {known}; "
            f"`hybridpd{option} pin add {wanted}` makes it one)"
        )

    @property
    def default(self) -> Pin:
        """The pin a command takes when none is named: ``default_pin`` (always ported)."""
        return self.pin(self.default_pin)

    def newest(self) -> Pin:
        """The ported pin with the highest release version; SeriesError if none."""
        ported = [p for p in self.pins if p.ported]
        if not ported:
            raise SeriesError("no pin is ported yet")
        return max(ported, key=lambda p: release_key(p.version))

    def patch(self, patch_id: str) -> Patch | None:
        """The record with ``patch_id``, or None."""
        return next((p for p in self.patches if p.id == patch_id), None)

    def patch_dir(self, pin: Pin) -> Path:
        """Where the patch files for ``pin`` live."""
        return self.dir / pin.version

    def patch_path(self, pin: Pin, patch_id: str) -> Path:
        """The file of patch ``patch_id`` for ``pin`` (which may not exist)."""
        return self.patch_dir(pin) / f"{patch_id}.patch"

    def state(self, pin: Pin, patch_id: str) -> PinState:
        """The state of patch ``patch_id`` on ``pin``; KeyError for an unknown id
        or a pin the series is not ported to."""
        patch = self.patch(patch_id)
        if patch is None:
            raise KeyError(patch_id)
        return patch.pins[pin.version]

    def records(self, pin: Pin) -> list[tuple[Patch, PinState]]:
        """Every patch with its state on ``pin``, in apply order (none when the
        series is not ported to ``pin``)."""
        return [(p, p.pins[pin.version]) for p in self.patches if pin.version in p.pins]

    def carried(self, pin: Pin) -> list[Patch]:
        """The patches carried on ``pin``, in apply order."""
        return [p for p, state in self.records(pin) if state.state == "carried"]

    def fixes_lost_on(self, source: str, target: str) -> list[str]:
        """The patches pin ``source`` records upstream since a release after ``target``
        (a release that is missing or cannot be read counts as after: it cannot be
        proven earlier). ``source`` has no patch file for them, and ``target`` does not
        have the fix: taking ``source``'s records onto ``target`` would drop it."""
        try:
            limit = release_key(target)
        except InvalidVersion:
            raise SeriesError(f"{target!r} is not a release version") from None

        def after(release: str | None) -> bool:
            try:
                return release is None or release_key(release) > limit
            except InvalidVersion:
                return True

        return [p.id for p in self.patches
                if (state := p.pins.get(source)) is not None and state.state == "upstream"
                and after(state.release)]

    def pin_json(self, pin: Pin) -> dict[str, Any]:
        """``pin`` and its patches' states (an entry of ``hybridpd list --json``)."""
        patches = []
        for patch, state in self.records(pin):
            entry = {"id": patch.id, "title": patch.title, "state": state.state}
            if state.release:
                entry["release"] = state.release
            if state.state == "dropped":
                entry["dropped"] = patch.dropped
            patches.append(entry)
        return {
            "version": pin.version,
            "tag": pin.tag,
            "sha256": pin.sha256,
            "ported": pin.ported,
            "patches": patches,
        }

    def relative(self, path: Path) -> str:
        """``path`` relative to the directory above the series dir, for messages."""
        try:
            return str(path.relative_to(self.dir.parent))
        except ValueError:
            return str(path)


def locate(explicit: Path | None = None, cwd: Path | None = None) -> Path:
    """Find ``series.toml``.

    In order: ``explicit`` (a file, or a directory holding ``series.toml`` or
    ``patches/series.toml``); ``$HYBRIDPD_SERIES``; ``patches/series.toml`` in ``cwd``
    or a parent; the source checkout this package is installed from (editable).
    """
    given = explicit or (Path(os.environ[SERIES_ENV]) if os.environ.get(SERIES_ENV) else None)
    if given is not None:
        for candidate in (given, given / SERIES_FILE, given / "patches" / SERIES_FILE):
            if candidate.is_file():
                # Absolute: commands run git in other directories (check's temporary
                # trees), where a relative path to a patch file would not resolve.
                return candidate.absolute()
        raise SeriesError(f"no series file at {given}")
    start = (cwd or Path.cwd()).resolve()
    for directory in (start, *start.parents):
        candidate = directory / "patches" / SERIES_FILE
        if candidate.is_file():
            return candidate
    installed = Path(__file__).resolve().parents[3] / "patches" / SERIES_FILE
    if installed.is_file():
        return installed
    raise SeriesError(f"no patches/{SERIES_FILE} above {start}; pass --series or set {SERIES_ENV}")


def load(path: Path) -> Series:
    """Read and validate the series file at ``path``; SeriesError names the bad field."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SeriesError(f"{path}: {exc}") from exc
    return parse(text, path)


def parse(text: str, path: Path) -> Series:
    """Validate ``text`` as the series file that would live at ``path``."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SeriesError(f"{path}: {exc}") from exc
    return _Parser(path).series(data)


class _Parser:
    """Turns the TOML document into a :class:`Series`, failing on the first problem."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def fail(self, where: str, problem: str) -> SeriesError:
        return SeriesError(f"{self.path}: {where}: {problem}")

    def text(self, table: Mapping[str, Any], key: str, where: str) -> str:
        value = table.get(key)
        if not isinstance(value, str) or not value.strip():
            raise self.fail(where, f'field "{key}" is missing or empty')
        return value

    def optional_text(self, table: Mapping[str, Any], key: str, where: str) -> str:
        if key not in table:
            return ""
        return self.text(table, key, where)

    def series(self, data: Mapping[str, Any]) -> Series:
        if data.get("schema") != SCHEMA:
            raise self.fail("top level", f'field "schema" must be {SCHEMA}')
        pins = self.pins(data.get("pins"))
        versions = [p.version for p in pins]
        ported = [p.version for p in pins if p.ported]
        default_pin = self.text(data, "default_pin", "top level")
        if default_pin not in versions:
            raise self.fail("top level", f'"default_pin" {default_pin} is not a pin')
        if default_pin not in ported:
            raise self.fail(
                "top level", f'"default_pin" {default_pin} is not ported (see hybridpd port)'
            )
        patches = self.patches(data.get("patches", []), versions, ported)
        return Series(
            path=self.path,
            package=self.text(data, "package", "top level"),
            upstream_git=self.text(data, "upstream_git", "top level"),
            default_pin=default_pin,
            pins=pins,
            patches=patches,
            name=self.optional_text(data, "name", "top level"),
            test=self.test_setup(data.get("test")),
            risks=self.risks(data.get("risks", []), {p.id for p in patches}),
        )

    def tables(self, raw: Any, name: str) -> Iterator[tuple[str, dict]]:
        """The tables of the ``[[name]]`` array, each with its place for errors."""
        if not isinstance(raw, list):
            raise self.fail("top level", f"[[{name}]] must be an array of tables")
        for index, table in enumerate(raw):
            if not isinstance(table, dict):
                raise self.fail(f"{name}[{index}]", "must be a table")
            raw_id = table.get("id")
            yield (f'{name}[{index}] (id "{raw_id}")' if raw_id else f"{name}[{index}]"), table

    def risks(self, raw: Any, patch_ids: set[str]) -> tuple[Risk, ...]:
        risks: list[Risk] = []
        for where, table in self.tables(raw, "risks"):
            unknown = set(table) - {"id", "says", "when", "links", "unless", "fixed_by"}
            if unknown:
                raise self.fail(where, f"unknown field(s) {', '.join(sorted(unknown))}")
            risk_id = self.text(table, "id", where)
            if not _ID.fullmatch(risk_id):
                raise self.fail(where, 'field "id" must match [a-z0-9][a-z0-9-]*')
            if any(r.id == risk_id for r in risks):
                raise self.fail(where, 'duplicate "id"')
            links = table.get("links", [])
            if not isinstance(links, list) or not all(
                    isinstance(l, str) and _LINK.fullmatch(l) for l in links):
                raise self.fail(where, 'field "links" must be a list of "owner/repo#N"')
            fixed_by = table.get("fixed_by")
            if fixed_by is not None and fixed_by not in patch_ids:
                raise self.fail(where, f'"fixed_by" {fixed_by!r} is not a patch of this series')
            unless = self.text(table, "unless", where) if "unless" in table else None
            risks.append(Risk(risk_id, " ".join(self.text(table, "says", where).split()),
                              self.conditions(table.get("when"), where), tuple(links),
                              unless, fixed_by))
        return tuple(risks)

    def conditions(self, raw: Any, where: str) -> dict[str, Any]:
        if not isinstance(raw, dict) or not raw:
            raise self.fail(where, 'field "when" must be a table of at least one of '
                                   + ", ".join(RISK_CONDITIONS))
        for key, value in raw.items():
            if key not in RISK_CONDITIONS:
                raise self.fail(where, f'when.{key}: not one of {", ".join(RISK_CONDITIONS)}')
            ok = {
                "connectors": isinstance(value, list) and bool(value) and all(
                    isinstance(v, str) and (v == "*" or v.isidentifier()) for v in value),
                "speculative_decoding": isinstance(value, bool),
                "prefix_caching": isinstance(value, bool),
                "mamba_cache_mode": isinstance(value, list) and bool(value) and all(
                    v in ("none", "align", "all") for v in value),
                "max_num_batched_tokens_at_least_blocks": isinstance(value, int)
                and not isinstance(value, bool) and value >= 1,
            }[key]
            if not ok:
                raise self.fail(where, f"when.{key} must be {RISK_CONDITIONS[key]}")
            unknown = sorted(set(value) - KNOWN_CONNECTORS - {"*"}) if key == "connectors" else []
            if unknown:
                raise self.fail(where, f"when.connectors: not a known connector: "
                                       f"{', '.join(unknown)} (known: "
                                       f"{', '.join(sorted(KNOWN_CONNECTORS))}, or \"*\")")
        return dict(raw)

    def test_setup(self, raw: Any) -> TestSetup | None:
        if raw is None:
            return None
        if not isinstance(raw, dict):
            raise self.fail("test", "must be a table")
        here = self.path.parent
        tests = here / self.text(raw, "patch_tests", "test") if "patch_tests" in raw else (
            here.parent / "tests" / "patches"
        )
        host = raw.get("host")
        if host is None:
            return TestSetup(tests.resolve())
        if not isinstance(host, dict):
            raise self.fail("test", 'field "host" must be a table {series = ..., pin = ...}')
        return TestSetup(
            tests.resolve(),
            (here / self.text(host, "series", "test.host")).resolve(),
            self.text(host, "pin", "test.host"),
        )

    def pins(self, raw: Any) -> tuple[Pin, ...]:
        if not isinstance(raw, list) or not raw:
            raise self.fail("top level", "at least one [[pins]] entry is required")
        pins: list[Pin] = []
        for index, table in enumerate(raw):
            where = f"pins[{index}]"
            if not isinstance(table, dict):
                raise self.fail(where, "must be a table")
            ported = table.get("ported", True)
            if not isinstance(ported, bool):
                raise self.fail(where, 'field "ported" must be true or false')
            pin = Pin(*(self.text(table, key, where) for key in _PIN_FIELDS), ported=ported)
            if not _SHA256.fullmatch(pin.sha256):
                raise self.fail(where, 'field "sha256" must be 64 lowercase hex digits')
            if any(p.version == pin.version for p in pins):
                raise self.fail(where, f'duplicate "version" {pin.version}')
            pins.append(pin)
        return tuple(pins)

    def patches(self, raw: Any, versions: list[str], ported: list[str]) -> tuple[Patch, ...]:
        patches: list[Patch] = []
        for where, table in self.tables(raw, "patches"):
            fields = {key: self.text(table, key, where) for key in _PATCH_FIELDS}
            if not _ID.fullmatch(fields["id"]):
                raise self.fail(where, 'field "id" must match [a-z0-9][a-z0-9-]*')
            if any(p.id == fields["id"] for p in patches):
                raise self.fail(where, 'duplicate "id"')
            states = self.states(table.get("pins"), versions, ported, where)
            dropped = table.get("dropped")
            is_dropped = any(st.state == "dropped" for st in states.values())
            if is_dropped:
                if not (isinstance(dropped, str) and dropped.strip()):
                    raise self.fail(
                        where,
                        'field "dropped" is required when a pin drops the patch '
                        "(why, with the evidence)",
                    )
            elif dropped is not None:
                raise self.fail(where, 'field "dropped" is set but no pin drops the patch')
            thread = table.get("upstream_thread")
            if thread is not None and not (
                isinstance(thread, str) and _LINK.fullmatch(thread)
            ):
                raise self.fail(
                    where, 'field "upstream_thread" must be an upstream PR, owner/repo#N'
                )
            patches.append(
                Patch(**fields, pins=states, dropped=dropped, upstream_thread=thread)
            )
        return tuple(patches)

    def states(
        self, raw: Any, versions: list[str], ported: list[str], where: str
    ) -> dict[str, PinState]:
        if not isinstance(raw, dict):
            raise self.fail(where, 'field "pins" is missing (a state per pin is required)')
        for version in raw:
            if version not in versions:
                raise self.fail(where, f'pins."{version}" is not a pinned version')
            if version not in ported:
                raise self.fail(
                    where, f'pins."{version}": the series is not ported to {version} yet'
                )
        states = {}
        for version in ported:
            table = raw.get(version)
            field = f'pins."{version}"'
            if not isinstance(table, dict):
                raise self.fail(where, f"{field} is missing (every pin needs a state)")
            state = table.get("state")
            if state not in STATES:
                raise self.fail(where, f"{field}.state must be one of {', '.join(STATES)}")
            release = table.get("release")
            if state == "upstream" and not (isinstance(release, str) and release.strip()):
                raise self.fail(where, f"{field}.release is required for an upstream patch")
            if state != "upstream" and release is not None:
                raise self.fail(where, f"{field}.release is only for an upstream patch")
            states[version] = PinState(state, release if state == "upstream" else None)
        return states
