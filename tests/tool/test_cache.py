"""The store (``hybridpd.cache``): markers, owned directories, entry locks."""

from __future__ import annotations

from pathlib import Path

import pytest
from hybridpd import cache
from hybridpd.errors import LocalFileError


def test_a_marker_is_complete_json_or_nothing(tmp_path: Path) -> None:
    marker = cache.Marker(tmp_path / "entry" / "marker.json")
    assert marker.read() is None
    marker.write({"hash": "abc", "n": 1})
    assert marker.read() == {"hash": "abc", "n": 1}
    # Half a file (an older writer killed mid-write) or not an object: no marker.
    marker.path.write_text('{"hash": "ab')
    assert marker.read() is None
    marker.path.write_text("[1, 2]")
    assert marker.read() is None
    assert sorted(p.name for p in marker.path.parent.iterdir()) == ["marker.json"]


def test_an_owned_directory_is_removed_when_filling_it_fails(tmp_path: Path) -> None:
    dest = tmp_path / "new" / "dest"
    with pytest.raises(RuntimeError):
        with cache.owned(dest, LocalFileError):
            (dest / "half").write_text("x")
            raise RuntimeError("killed")
    assert not (tmp_path / "new").exists()

    # A directory that was there (empty) is kept, emptied.
    dest.mkdir(parents=True)
    with pytest.raises(RuntimeError):
        with cache.owned(dest, LocalFileError):
            (dest / "sub").mkdir()
            raise RuntimeError("killed")
    assert dest.is_dir() and list(dest.iterdir()) == []


def test_an_owned_directory_another_process_filled_is_refused(tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "theirs").write_text("x")
    with pytest.raises(LocalFileError, match="already exists and is not an empty directory"):
        with cache.owned(dest, LocalFileError):
            pass
    assert (dest / "theirs").read_text() == "x"


_HOLDER = """
import select, sys
from pathlib import Path
from hybridpd import cache

entry = Path(sys.argv[1])
with cache.lock(entry, lambda _m: None):
    print("held", flush=True)
    # Hold the lock until the waiter says it waits (at most 60 s, then fail).
    ready, _, _ = select.select([sys.stdin], [], [], 60)
    if not ready or sys.stdin.readline().strip() != "waiting":
        sys.exit(3)
    entry.write_text("theirs")
"""


def test_an_entry_lock_waits_for_its_holder_and_says_so_once(tmp_path: Path) -> None:
    import subprocess
    import sys

    entry = tmp_path / "entry"
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(entry)], stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, text=True, start_new_session=True,
    )
    try:
        assert holder.stdout.readline() == "held\n"
        said: list[str] = []

        def log(message: str) -> None:  # called once we block: let the holder finish
            said.append(message)
            holder.stdin.write("waiting\n")
            holder.stdin.flush()

        with cache.lock(entry, log):
            # The holder finished writing before we got in.
            assert entry.read_text() == "theirs"
        assert holder.wait(timeout=60) == 0
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
    assert said == [f"waiting for another hybridpd process that is writing {entry}"]
    assert not (tmp_path / ".entry.lock").exists()
