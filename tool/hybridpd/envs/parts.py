"""A file carried in parts of at most N bytes, each with its sha256.

:class:`PartWriter` is a write-only file object: what is written goes to
``<stem>.000``, ``<stem>.001``, ... in a directory, a new part whenever the current one
holds ``limit`` bytes, and the sha256 of every part and of the whole stream is kept as
it is written (nothing is read back). :func:`verify` checks parts against their records
before anything uses them and refuses a missing or corrupt one in one line;
:class:`PartReader` reads them back as one stream.
"""

from __future__ import annotations

import hashlib
import io
from pathlib import Path
from typing import Sequence

from hybridpd.errors import HybridpdError

MIB = 1 << 20


class PartsError(HybridpdError):
    """A part is missing, has the wrong size or the wrong sum."""


class PartWriter(io.RawIOBase):
    """Write a stream into ``directory/<stem>.NNN`` parts of at most ``limit`` bytes."""

    def __init__(self, directory: Path, stem: str, limit: int) -> None:
        super().__init__()
        if limit < 1:
            raise ValueError(f"a part holds at least one byte, not {limit}")
        self.directory, self.stem, self.limit = Path(directory), stem, limit
        self.parts: list[dict] = []
        self.total = hashlib.sha256()
        self.size = 0
        self._file = None
        self._hash = None
        self._used = 0

    def writable(self) -> bool:
        return True

    def _next(self) -> None:
        self._finish_part()
        name = f"{self.stem}.{len(self.parts):03d}"
        self._file = open(self.directory / name, "wb")  # noqa: SIM115 (closed in _finish_part)
        self._hash = hashlib.sha256()
        self._used = 0
        self.parts.append({"file": name})

    def _finish_part(self) -> None:
        if self._file is None:
            return
        self._file.close()
        self.parts[-1].update(size=self._used, sha256=self._hash.hexdigest())
        self._file = None

    def write(self, data) -> int:  # type: ignore[override]
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            if self._file is None or self._used == self.limit:
                self._next()
            chunk = view[done:done + self.limit - self._used]
            self._file.write(chunk)
            self._hash.update(chunk)
            self.total.update(chunk)
            self._used += len(chunk)
            done += len(chunk)
        self.size += done
        return done

    def close(self) -> None:
        if not self.closed:
            if not self.parts:  # an empty stream is one empty part
                self._next()
            self._finish_part()
        super().close()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(MIB):
            h.update(chunk)
    return h.hexdigest()


def verify(directory: Path, parts: Sequence[dict]) -> None:
    """Every part of ``parts`` (records ``{"file", "size", "sha256"}``) is in
    ``directory`` with its size and sum; PartsError naming the first that is not."""
    if not parts:
        raise PartsError(f"the manifest lists no parts for {directory}")
    for i, part in enumerate(parts, 1):
        path = Path(directory) / part["file"]
        where = f"part {i}/{len(parts)} {part['file']}"
        if not path.is_file():
            raise PartsError(f"{where} is missing in {directory}")
        size = path.stat().st_size
        if size != part["size"]:
            raise PartsError(
                f"{where} is corrupt: {size} bytes, the manifest says {part['size']}"
            )
        if _sha256(path) != part["sha256"]:
            raise PartsError(f"{where} is corrupt: its sha256 is not the manifest's")


class PartReader(io.RawIOBase):
    """The parts, in order, as one readable stream (verify them first)."""

    def __init__(self, directory: Path, parts: Sequence[dict]) -> None:
        super().__init__()
        self._paths = [Path(directory) / p["file"] for p in parts]
        self._file = None

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:  # type: ignore[override]
        while True:
            if self._file is None:
                if not self._paths:
                    return 0
                self._file = open(self._paths.pop(0), "rb")  # noqa: SIM115 (closed below)
            n = self._file.readinto(buffer)
            if n:
                return n
            self._file.close()
            self._file = None

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        super().close()
