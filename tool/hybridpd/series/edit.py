"""Edit ``series.toml`` in place, keeping its comments, order and layout.

:mod:`hybridpd.series.model` reads the file with ``tomllib``, which forgets everything but
the values; maintainers, though, review series.toml as a text file with comments. So
machine edits go through tomlkit, which round-trips a document: an edit changes only
the lines it is about.

Invariants:

* A write never leaves an invalid or partial series behind: the new text is
  validated with :func:`hybridpd.series.model.parse` before anything is written (a
  :class:`~hybridpd.errors.SeriesError` otherwise), then written to a temporary file
  beside the series and renamed over it.
* Several edits that are only valid together (marking a pin ported *and* giving every
  patch a state on it) are made on one :class:`Editor` inside :func:`edit`, and
  written and validated once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import tomlkit
from tomlkit.items import AoT, Comment, Table, Whitespace
from tomlkit.toml_document import TOMLDocument

from hybridpd import guard
from hybridpd.errors import SeriesError
from hybridpd.series.model import STATES, Pin, Series, load, parse, release_key


class Editor:
    """A parsed series.toml being edited; see :func:`edit`."""

    def __init__(self, path: Path, text: str) -> None:
        self.path = path
        try:
            self.doc: TOMLDocument = tomlkit.parse(text)
        except tomlkit.exceptions.TOMLKitError as exc:
            raise SeriesError(f"{path}: {exc}") from exc

    def set_pin_ported(self, pin: Pin, ported: bool) -> None:
        """Mark ``pin`` ported (drop its ``ported`` line) or not (``ported = false``)."""
        table = self._find("pins", "version", pin.version)
        if ported:
            if "ported" in table:
                del table["ported"]
        else:
            table["ported"] = False

    def set_patch_state(
        self, patch_id: str, pin: Pin, state: str, release: str | None = None
    ) -> None:
        """Set the state of patch ``patch_id`` on ``pin``.

        ``release`` is required for "upstream" and refused otherwise, the same
        rule :mod:`hybridpd.series.model` enforces. An existing state table is updated in
        place; a new one is appended after the patch's other pin states.
        """
        if state not in STATES:
            raise SeriesError(f"state must be one of {', '.join(STATES)}, not {state!r}")
        if (state == "upstream") != bool(release):
            raise SeriesError(
                f"{patch_id} on {pin.version}: an upstream state needs a release, "
                "no other state has one"
            )
        patch = self._find("patches", "id", patch_id)
        if "pins" not in patch:
            patch["pins"] = tomlkit.table(is_super_table=True)
        pins = patch["pins"]
        if pin.version in pins:
            table = pins[pin.version]
            table["state"] = state
            if release:
                table["release"] = release
            elif "release" in table:
                del table["release"]
            return
        table = tomlkit.table() if isinstance(pins, Table) else tomlkit.inline_table()
        table["state"] = state
        if release:
            table["release"] = release
        if isinstance(pins, Table):
            _append_table(pins, pin.version, table)
        else:
            pins[pin.version] = table

    def add_pin(self, pin: Pin) -> None:
        """Add a ``[[pins]]`` entry for ``pin``, not ported, before the first pin with a
        higher version (release order, as the pins are read)."""
        pins = self.doc.get("pins")
        if not isinstance(pins, AoT):
            raise SeriesError(f"{self.path}: no [[pins]] entries to add {pin.version} beside")
        table = tomlkit.table()
        table["version"] = pin.version
        table["tag"] = pin.tag
        table["sdist"] = pin.sdist
        table["sha256"] = pin.sha256
        table["ported"] = False
        later = [i for i, t in enumerate(pins)
                 if release_key(str(t["version"])) > release_key(pin.version)]
        if later:
            table.add(tomlkit.nl())
            pins.insert(later[0], table)
            return
        # tomlkit keeps what follows the last pin (a blank line, the comment that opens
        # the patches) inside it: the new last pin takes it over.
        body = pins[-1].value.body
        trailing = []
        while body and body[-1][0] is None and isinstance(body[-1][1], (Whitespace, Comment)):
            trailing.insert(0, body.pop()[1])
        pins[-1].add(tomlkit.nl())
        for item in trailing or [tomlkit.nl()]:
            table.add(item)
        pins.append(table)

    def text(self) -> str:
        return tomlkit.dumps(self.doc)

    def _find(self, array: str, key: str, value: str) -> Table:
        tables = self.doc.get(array)
        matches = [t for t in tables or () if isinstance(t, Table) and t.get(key) == value]
        if not isinstance(tables, AoT) or len(matches) != 1:
            raise SeriesError(f"{self.path}: no single [[{array}]] entry with {key} = {value!r}")
        return matches[0]


def _append_table(parent: Table, key: str, table: Table) -> None:
    """Add ``table`` as the last sub-table of ``parent``, separated by a blank line.

    tomlkit keeps the blank line that ends a table inside that table, so a table
    appended after it would start right below the previous one and end with no gap
    before the next header. The new table takes over the previous one's trailing
    blank line, and the previous one gets one before the new header.
    """
    siblings = [v for v in parent.value.values() if isinstance(v, Table)]
    if siblings:
        body = siblings[-1].value.body
        trailing = ""
        while body and body[-1][0] is None and isinstance(body[-1][1], Whitespace):
            trailing = body.pop()[1].s + trailing
        siblings[-1].add(tomlkit.nl())
        if trailing:
            table.add(tomlkit.ws(trailing))
    parent[key] = table


@contextlib.contextmanager
def edit(path: Path) -> Iterator[Editor]:
    """Edit the series file at ``path``; on leaving the block, write and validate it.

    Nothing is written if the block raises. See the module invariants.
    """
    before = path.read_text(encoding="utf-8")
    editor = Editor(path, before)
    yield editor
    write_validated(path, editor.text(), before)


def write_validated(path: Path, text: str, before: str) -> Series:
    """Write ``text`` to ``path`` if it parses as a valid series; else raise, writing nothing.

    The write is atomic (a temporary file beside ``path``, then a rename): a reader,
    or a process killed mid-write, sees the old file or the new one, never a part.
    """
    if text == before:
        return load(path)
    series = parse(text, path)
    guard.remove_temporaries(path)  # what a write killed before its rename left
    guard.write_atomic(path, text)
    return series


def set_pin_ported(path: Path, pin: Pin, ported: bool) -> Series:
    """Mark ``pin`` of the series at ``path`` ported or not; return the series."""
    with edit(path) as editor:
        editor.set_pin_ported(pin, ported)
    return load(path)


def set_patch_state(
    path: Path, patch_id: str, pin: Pin, state: str, release: str | None = None
) -> Series:
    """Set one patch state in the series at ``path`` (see :meth:`Editor.set_patch_state`)."""
    with edit(path) as editor:
        editor.set_patch_state(patch_id, pin, state, release)
    return load(path)
