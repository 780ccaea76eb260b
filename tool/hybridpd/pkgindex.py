"""Find and download release files on the package indexes pip is configured to use.

No index host is written here: the indexes are the ones pip would use -- its
environment variables, then its configuration (``pip config list``), then pip's own
built-in default -- so a mirror, proxy or air-gapped ``file://`` index set up for pip
works unchanged. Project pages are read as PEP 691 JSON when the index offers it and
as PEP 503 HTML otherwise. Only the standard library's ``urllib`` is used.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import json
import os
import re
import ssl
import sys
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from email.message import Message
from html.parser import HTMLParser
from pathlib import Path
from typing import Any, Protocol

from hybridpd import __version__, proc, progress
from hybridpd.errors import ChecksumError, LocalFileError, PackageIndexError

_ACCEPT = "application/vnd.pypi.simple.v1+json, text/html;q=0.1"
_JSON_TYPE = "application/vnd.pypi.simple.v1+json"
# pip config sections, lowest precedence first; ":env:" holds PIP_* variables.
_SECTIONS = ("global", "install", "download", ":env:")
_DEFAULT_TIMEOUT = 15.0
_CHUNK = 1 << 20


class _NotFound(PackageIndexError):
    """The URL names nothing (HTTP 404, or a missing ``file://`` path)."""

    def __init__(self, url: str, what: str) -> None:
        super().__init__(f"{url}: {what}")
        self.url, self.what = url, what


class _Response(Protocol):
    """What both urllib's HTTP and file responses offer."""

    headers: Message

    def read(self, size: int = -1) -> bytes: ...

    def geturl(self) -> str: ...


_ARCHIVES = (".whl", ".tar.gz", ".zip", ".tar.bz2")


@dataclass(frozen=True)
class PipSettings:
    """The parts of pip's configuration that say where and how to fetch files."""

    index_urls: tuple[str, ...]
    cert: str | None = None
    timeout: float = _DEFAULT_TIMEOUT
    find_links: tuple[str, ...] = ()

    def ssl_context(self) -> ssl.SSLContext:
        """Verification context honouring pip's ``cert`` (CA bundle) setting."""
        return ssl.create_default_context(cafile=self.cert)


@dataclass(frozen=True)
class IndexFile:
    """A file listed on a project page; ``sha256`` is None if the index gives none.
    ``yanked``: the reason, "" if none was given, None if not yanked (PEP 592)."""

    filename: str
    url: str
    sha256: str | None
    yanked: str | None = None


def pip_settings() -> PipSettings:
    """Read the index URLs (index-url first, then extra-index-urls), cert and timeout.

    Precedence, highest first: ``PIP_*`` environment variables, then ``pip config``
    keys by section (``download``, ``install``, ``global``), then pip's default index.
    """
    sections = parse_config_list(_pip_config_list())
    values: dict[str, str] = {}
    for section in _SECTIONS:
        values.update(sections.get(section, {}))
    env = {
        "index-url": os.environ.get("PIP_INDEX_URL"),
        "extra-index-url": os.environ.get("PIP_EXTRA_INDEX_URL"),
        "cert": os.environ.get("PIP_CERT"),
        "find-links": os.environ.get("PIP_FIND_LINKS"),
        "timeout": os.environ.get("PIP_TIMEOUT") or os.environ.get("PIP_DEFAULT_TIMEOUT"),
    }
    values.update({key: value for key, value in env.items() if value})
    index = values.get("index-url") or _pip_default_index()
    extras = values.get("extra-index-url", "").split()
    timeout = values.get("timeout") or values.get("default-timeout")
    return PipSettings(
        index_urls=tuple(dict.fromkeys([index, *extras])),
        cert=values.get("cert") or None,
        timeout=float(timeout) if timeout else _DEFAULT_TIMEOUT,
        find_links=tuple(values.get("find-links", "").split()),
    )


def find_links_files(settings: PipSettings) -> list[IndexFile]:
    """The files pip's ``find-links`` offer: a local directory's archives, or the
    links of an HTML page. A location that cannot be read offers none (pip warns and
    goes on as well)."""
    files: list[IndexFile] = []
    for location in settings.find_links:
        parsed = urllib.parse.urlparse(location)
        local = (
            Path(urllib.request.url2pathname(parsed.path)) if parsed.scheme == "file"
            else Path(location) if not parsed.scheme else None
        )
        if local is not None and local.is_dir():
            files += [
                IndexFile(p.name, p.absolute().as_uri(), None)
                for p in sorted(local.iterdir())
                if p.is_file() and p.name.endswith(_ARCHIVES)
            ]
            continue
        if local is not None and not local.is_file():
            continue
        url = local.absolute().as_uri() if local is not None else location
        try:
            with _open(url, settings, accept="text/html") as response:
                html = response.read().decode("utf-8", errors="replace")
                base = response.geturl()
        except PackageIndexError:
            continue
        files += _files_from_html(html, base)
    return files


def parse_config_list(text: str) -> dict[str, dict[str, str]]:
    """Parse ``pip config list`` output (``section.key='value'`` lines) by section.

    Keys are normalized as pip does (``index_url`` is ``index-url``).
    """
    sections: dict[str, dict[str, str]] = {}
    for line in text.splitlines():
        match = re.fullmatch(r"(:env:|[\w-]+)\.([\w-]+)=(.*)", line.strip())
        if match:
            section, key, raw = match.groups()
            sections.setdefault(section, {})[key.replace("_", "-")] = _unquote(raw)
    return sections


def _unquote(raw: str) -> str:
    if len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "'\"":
        return raw[1:-1]
    return raw


def _pip_config_list() -> str:
    """``pip config list`` of the running interpreter ('' if pip cannot say)."""
    done = proc.run([sys.executable, "-m", "pip", "config", "list"], timeout=60)
    return done.stdout if done.ok else ""


def _pip_default_index() -> str:
    try:
        from pip._internal.models.index import PyPI
    except ImportError as exc:
        raise PackageIndexError(
            "no package index configured and pip is not importable; set PIP_INDEX_URL"
        ) from exc
    return PyPI.simple_url


def find_file(package: str, filename: str, settings: PipSettings) -> IndexFile:
    """Find ``filename`` on the project page of ``package``, trying each index in turn.

    Indexes that do not have the project, or cannot be reached, are skipped; the
    error lists what each index said when none has the file.
    """
    tried = []
    for index in settings.index_urls:
        try:
            files = project_files(index, package, settings)
        except PackageIndexError as exc:
            tried.append(f"{index}: {exc.message}")
            continue
        for entry in files:
            if entry.filename == filename:
                return entry
        tried.append(f"{index}: no {filename}")
    raise PackageIndexError(f"{filename} not found ({'; '.join(tried)})")


def project_files(index: str, package: str, settings: PipSettings) -> list[IndexFile]:
    """The files on ``index``'s page for ``package`` (PEP 691 JSON or PEP 503 HTML).

    An index without a page for ``package`` has no files; an unreachable one raises.
    """
    url = f"{index.rstrip('/')}/{_normalize(package)}/"
    try:
        with _open(url, settings, accept=_ACCEPT) as response:
            body = response.read()
            base = response.geturl()
            content_type = response.headers.get_content_type()
    except _NotFound:
        return []
    if content_type == _JSON_TYPE:
        return _files_from_json(json.loads(body), base)
    return _files_from_html(body.decode("utf-8", errors="replace"), base)


def _normalize(name: str) -> str:
    """PEP 503 project name normalization."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _files_from_json(page: Mapping[str, Any], base: str) -> list[IndexFile]:
    return [
        IndexFile(f["filename"], urllib.parse.urljoin(base, f["url"]), f["hashes"].get("sha256"),
                  _yanked(f.get("yanked", False)))
        for f in page.get("files", [])
    ]


def _yanked(value: Any) -> str | None:
    """PEP 691's ``yanked`` (False, True or the reason) as :attr:`IndexFile.yanked`."""
    if value is False or value is None:
        return None
    return value if isinstance(value, str) else ""


class _AnchorParser(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        # (href, text, yanked: the data-yanked value, None without the attribute)
        self.anchors: list[tuple[str, str, str | None]] = []
        self._href: str | None = None
        self._yanked: str | None = None
        self._text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "a":
            found = dict(attrs)
            self._href = found.get("href")
            self._yanked = (found["data-yanked"] or "") if "data-yanked" in found else None
            self._text = []

    def handle_data(self, data: str) -> None:
        if self._href is not None:
            self._text.append(data)

    def handle_endtag(self, tag: str) -> None:
        if tag == "a" and self._href is not None:
            self.anchors.append((self._href, "".join(self._text).strip(), self._yanked))
            self._href = None


def _files_from_html(html: str, base: str) -> list[IndexFile]:
    parser = _AnchorParser()
    parser.feed(html)
    files = []
    for href, text, yanked in parser.anchors:
        url, _, fragment = urllib.parse.urljoin(base, href).partition("#")
        name = text or urllib.parse.unquote(url.rsplit("/", 1)[-1])
        digest = dict(urllib.parse.parse_qsl(fragment)).get("sha256")
        files.append(IndexFile(name, url, digest, yanked))
    return files


@contextlib.contextmanager
def _open(url: str, settings: PipSettings, accept: str = "*/*") -> Iterator[_Response]:
    """Open ``url``; a ``file://`` directory reads its ``index.html``, as pip does."""

    def unusable(exc: Exception) -> PackageIndexError:
        return PackageIndexError(
            f"{url} is not a usable index URL ({exc}); check PIP_INDEX_URL and pip's index-url"
        )

    try:
        parsed = urllib.parse.urlparse(url)
    except ValueError as exc:  # "Invalid IPv6 URL": a host with an unclosed "["
        raise unusable(exc) from None
    if parsed.scheme == "file" and Path(urllib.request.url2pathname(parsed.path)).is_dir():
        url = urllib.parse.urljoin(url.rstrip("/") + "/", "index.html")

    try:
        request = urllib.request.Request(
            url, headers={"Accept": accept, "User-Agent": f"hybridpd/{__version__}"}
        )
    except ValueError as exc:  # no scheme, or an unknown one
        raise unusable(exc) from None
    context = settings.ssl_context() if parsed.scheme == "https" else None
    try:
        with urllib.request.urlopen(request, timeout=settings.timeout, context=context) as r:
            yield r
    except http.client.InvalidURL as exc:  # a space or a bad port in the host
        raise unusable(exc) from None
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            raise _NotFound(url, "not found on the index (HTTP 404)") from exc
        raise PackageIndexError(f"HTTP {exc.code} for {url}") from exc
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        if isinstance(reason, FileNotFoundError):
            raise _NotFound(url, f"no such file: {reason.filename or parsed.path}") from exc
        raise PackageIndexError(f"cannot read {url}: {reason}") from exc


def download(url: str, dest: Path, sha256: str | None, settings: PipSettings,
             expected_by: str = "series.toml") -> str:
    """Download ``url`` to ``dest``, which appears only if its sha256 is ``sha256``
    (any, for None: an index that lists the file without a hash); returns the sha256.
    ``expected_by``: where ``sha256`` comes from, for the error when it differs.

    The file is streamed to a temporary file next to ``dest`` and moved into place
    after verification, so ``dest`` is never partial; on any failure the temporary
    file is removed.
    """
    try:
        with _download(url, dest, sha256, settings, expected_by) as digest:
            return digest
    except _NotFound as exc:  # listed on the index, but not there
        raise PackageIndexError(
            f"the index lists {dest.name} at {url}, but it is not there ({exc.what})"
        ) from None


def is_sha256(value: str) -> bool:
    """Whether ``value`` is a sha256 as indexes write it (64 hex digits)."""
    return re.fullmatch(r"[0-9a-fA-F]{64}", value) is not None


@contextlib.contextmanager
def _download(url: str, dest: Path, sha256: str | None, settings: PipSettings,
              expected_by: str) -> Iterator[str]:
    with _open(url, settings) as response:
        size = int(response.headers.get("Content-Length") or 0)
        # Local errors (no space, no permission) are LocalFileError, not OSError:
        # _open would report an OSError from this body as the index's failure.
        try:
            fd, tmp_name = tempfile.mkstemp(
                dir=dest.parent, prefix=f".{dest.name}.", suffix=".part"
            )
        except OSError as exc:
            raise LocalFileError.from_os_error(exc) from exc
        tmp = Path(tmp_name)
        try:
            digest = hashlib.sha256()
            with os.fdopen(fd, "wb") as out, _progress(dest.name, size) as advance:
                for chunk in iter(lambda: response.read(_CHUNK), b""):
                    try:
                        out.write(chunk)
                    except OSError as exc:
                        raise LocalFileError.from_os_error(
                            OSError(exc.errno, exc.strerror, str(tmp))
                        ) from exc
                    digest.update(chunk)
                    advance(len(chunk))
                try:
                    out.flush()  # the last short chunk: a full disk shows here
                except OSError as exc:
                    raise LocalFileError.from_os_error(
                        OSError(exc.errno, exc.strerror, str(tmp))
                    ) from exc
            if sha256 is not None and digest.hexdigest() != sha256:
                raise ChecksumError(
                    f"{dest.name} from {url} has sha256 {digest.hexdigest()}, "
                    f"{expected_by} expects {sha256}"
                )
            try:
                os.replace(tmp, dest)
            except OSError as exc:
                raise LocalFileError.from_os_error(exc) from exc
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    yield digest.hexdigest()


@contextlib.contextmanager
def _progress(name: str, size: int) -> Iterator[Callable[[int], None]]:
    """A progress bar on stderr when it is a terminal, else a one-line message."""
    with progress.bar(f"downloading {name}", size) as advance:
        yield advance
