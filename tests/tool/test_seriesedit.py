from __future__ import annotations

from pathlib import Path

import pytest
from builders import Project
from hybridpd.series import edit as seriesedit
from hybridpd.errors import SeriesError
from hybridpd.series.model import PinState, load

pytestmark = pytest.mark.usefixtures("isolated")

COMMENTED = """\
# The series.  A comment the edit must keep.
schema = 1
package = "proj"
upstream_git = "file:///nonexistent/proj.git"
default_pin = "1.0"

[[pins]]
version = "1.0"
tag = "v1.0"
sdist = "proj-1.0.tar.gz"
sha256 = "{sha}"

[[pins]]
version = "2.0"
tag = "v2.0"
sdist = "proj-2.0.tar.gz"
sha256 = "{sha}"
ported = false  # not yet

# --- patches ---

[[patches]]
id = "one"
title = "t"
why = \"\"\"
Why, on
two lines.\"\"\"
design = "d"
upstream = "u"
removal = "r"

[patches.pins."1.0"]
state = "carried"  # keep me

[[patches]]
id = "two"
title = "t"
why = "w"
design = "d"
upstream = "u"
removal = "r"

[patches.pins."1.0"]
state = "upstream"
release = "0.9"
"""

PORTED = """\
# The series.  A comment the edit must keep.
schema = 1
package = "proj"
upstream_git = "file:///nonexistent/proj.git"
default_pin = "1.0"

[[pins]]
version = "1.0"
tag = "v1.0"
sdist = "proj-1.0.tar.gz"
sha256 = "{sha}"

[[pins]]
version = "2.0"
tag = "v2.0"
sdist = "proj-2.0.tar.gz"
sha256 = "{sha}"

# --- patches ---

[[patches]]
id = "one"
title = "t"
why = \"\"\"
Why, on
two lines.\"\"\"
design = "d"
upstream = "u"
removal = "r"

[patches.pins."1.0"]
state = "carried"  # keep me

[patches.pins."2.0"]
state = "carried"

[[patches]]
id = "two"
title = "t"
why = "w"
design = "d"
upstream = "u"
removal = "r"

[patches.pins."1.0"]
state = "upstream"
release = "0.9"

[patches.pins."2.0"]
state = "upstream"
release = "0.9"
"""


@pytest.fixture
def path(tmp_path: Path) -> Path:
    path = tmp_path / "series.toml"
    path.write_text(COMMENTED.format(sha="0" * 64))
    return path


def port(path: Path) -> None:
    pin = load(path).pin("2.0")
    with seriesedit.edit(path) as editor:
        editor.set_pin_ported(pin, True)
        editor.set_patch_state("one", pin, "carried")
        editor.set_patch_state("two", pin, "upstream", "0.9")


def test_porting_a_pin_changes_only_its_lines(path: Path) -> None:
    port(path)
    assert path.read_text() == PORTED.format(sha="0" * 64)
    series = load(path)
    assert series.pin("2.0").ported
    assert series.state(series.pin("2.0"), "two") == PinState("upstream", "0.9")


def test_state_is_updated_in_place(path: Path) -> None:
    port(path)
    series = seriesedit.set_patch_state(path, "one", load(path).pin("2.0"), "upstream", "2.0")
    assert series.state(series.pin("2.0"), "one") == PinState("upstream", "2.0")
    series = seriesedit.set_patch_state(path, "one", load(path).pin("2.0"), "carried")
    assert series.state(series.pin("2.0"), "one") == PinState("carried")
    assert path.read_text() == PORTED.format(sha="0" * 64)


def test_invalid_result_restores_the_file(path: Path) -> None:
    # Ported, but no patch has a state on 2.0 yet: series.load refuses it.
    with pytest.raises(SeriesError, match=r'pins."2.0" is missing'):
        seriesedit.set_pin_ported(path, load(path).pin("2.0"), True)
    assert path.read_text() == COMMENTED.format(sha="0" * 64)


def test_unporting_and_bad_arguments(path: Path) -> None:
    port(path)
    with pytest.raises(SeriesError, match="not ported to 2.0"):
        # the states on 2.0 are still there
        seriesedit.set_pin_ported(path, load(path).pin("2.0"), False)
    with pytest.raises(SeriesError, match="needs a release"):
        seriesedit.set_patch_state(path, "one", load(path).pin("2.0"), "upstream")
    with pytest.raises(SeriesError, match="no single \\[\\[patches\\]\\] entry with id = 'nope'"):
        seriesedit.set_patch_state(path, "nope", load(path).pin("2.0"), "carried")
    assert path.read_text() == PORTED.format(sha="0" * 64)


def test_edits_the_builders_layout(tmp_path: Path) -> None:
    project = Project(tmp_path)
    project.release("1.0")
    project.release("2.0")
    project.unported.add("2.0")
    project.record("fix-add", {"1.0": "carried"})
    series = project.write()
    with seriesedit.edit(series.path) as editor:
        editor.set_pin_ported(series.pin("2.0"), True)
        editor.set_patch_state("fix-add", series.pin("2.0"), "carried")
    assert load(series.path).carried(series.pin("2.0"))[0].id == "fix-add"


def test_a_write_killed_half_way_leaves_the_old_file(path: Path, monkeypatch) -> None:
    """The process dies (here: an interrupt) after writing half of the new text."""
    import builtins
    import io

    real_open = io.open
    before = path.read_text()
    others = sorted(p.name for p in path.parent.iterdir())

    class HalfWriter:
        def __init__(self, f):
            self.f = f

        def write(self, text):
            self.f.write(text[: len(text) // 2])
            self.f.flush()
            raise KeyboardInterrupt

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def __getattr__(self, name):
            return getattr(self.f, name)

    def dying_open(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        return HalfWriter(f) if "w" in mode and Path(file).parent == path.parent else f

    monkeypatch.setattr(io, "open", dying_open)
    monkeypatch.setattr(builtins, "open", dying_open)
    with pytest.raises(KeyboardInterrupt):
        seriesedit.set_patch_state(path, "one", load(path).pin("1.0"), "upstream", "1.0")
    monkeypatch.undo()
    assert path.read_text() == before
    assert sorted(p.name for p in path.parent.iterdir()) == others  # no temporary file left
