from __future__ import annotations

import hashlib
import http.server
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from builders import make_index, pack_release
from hybridpd import pkgindex
from hybridpd.errors import ChecksumError, PackageIndexError
from hybridpd.pkgindex import PipSettings

pytestmark = pytest.mark.usefixtures("isolated")


def test_env_index_urls_come_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIP_INDEX_URL", "https://mirror.example/simple")
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "file:///a file:///b")
    monkeypatch.setenv("PIP_CERT", "/etc/ca.pem")
    settings = pkgindex.pip_settings()
    assert settings.index_urls == ("https://mirror.example/simple", "file:///a", "file:///b")
    assert settings.cert == "/etc/ca.pem"


def test_pip_config_file_is_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "pip.conf"
    config.write_text(
        "[global]\nindex-url = https://global.example/simple\ncert = /ca.pem\ntimeout = 7\n"
        "[install]\nextra-index-url = file:///x file:///y\n"
    )
    monkeypatch.setenv("PIP_CONFIG_FILE", str(config))
    monkeypatch.delenv("PIP_INDEX_URL")
    settings = pkgindex.pip_settings()
    assert settings.index_urls == ("https://global.example/simple", "file:///x", "file:///y")
    assert (settings.cert, settings.timeout) == ("/ca.pem", 7.0)


def test_config_list_sections_override_in_pip_order(monkeypatch: pytest.MonkeyPatch) -> None:
    listing = (
        "global.index-url='https://global.example/simple'\n"
        "download.index_url='https://download.example/simple'\n"
        "global.extra-index-url='file:///e'\n"
    )
    monkeypatch.setattr(pkgindex, "_pip_config_list", lambda: listing)
    monkeypatch.delenv("PIP_INDEX_URL")
    assert pkgindex.pip_settings().index_urls == ("https://download.example/simple", "file:///e")


def test_find_links_come_from_pip_and_offer_their_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(b"")
    page = tmp_path / "page"  # a directory, given as a file:// URL: only its archives
    page.mkdir()
    (page / "index.html").write_text("<a href='x-1.0.tar.gz'>x-1.0.tar.gz</a>")
    monkeypatch.setattr(pkgindex, "_pip_config_list", lambda: f"global.find-links='{wheels}'\n")
    monkeypatch.delenv("PIP_INDEX_URL")
    assert pkgindex.pip_settings().find_links == (str(wheels),)
    monkeypatch.setenv("PIP_FIND_LINKS", f"{wheels} {page.as_uri()} {tmp_path / 'missing'}")
    settings = pkgindex.pip_settings()
    assert settings.find_links == (str(wheels), page.as_uri(), str(tmp_path / "missing"))
    names = [f.filename for f in pkgindex.find_links_files(settings)]
    assert names == ["torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl"]
    # A file:// URL of a directory lists the directory, as pip does.
    web = pkgindex.PipSettings((), find_links=("http://127.0.0.1:9/links/", wheels.as_uri()))
    assert [f.filename for f in pkgindex.find_links_files(web)] == names


def test_default_index_comes_from_pip(monkeypatch: pytest.MonkeyPatch) -> None:
    from pip._internal.models.index import PyPI

    monkeypatch.setattr(pkgindex, "_pip_config_list", lambda: "")
    monkeypatch.delenv("PIP_INDEX_URL")
    assert pkgindex.pip_settings().index_urls == (PyPI.simple_url,)


def test_find_file_skips_indexes_without_the_project(tmp_path: Path) -> None:
    release = pack_release(tmp_path / "dist", "1.0", {"a.py": ""})
    good = make_index(tmp_path / "good", [release])
    settings = PipSettings(((tmp_path / "empty").as_uri(), good))
    found = pkgindex.find_file("Proj", release.filename, settings)
    assert found.sha256 == release.sha256
    assert found.url == (tmp_path / "good" / "files" / release.filename).as_uri()


def test_find_file_reports_every_index_tried(tmp_path: Path) -> None:
    release = pack_release(tmp_path / "dist", "1.0", {"a.py": ""})
    settings = PipSettings((make_index(tmp_path / "i", [release]),))
    with pytest.raises(PackageIndexError, match=r"proj-9\.0\.tar\.gz not found .*no proj-9"):
        pkgindex.find_file("proj", "proj-9.0.tar.gz", settings)


def test_download_verifies_and_leaves_no_partial_file(tmp_path: Path) -> None:
    release = pack_release(tmp_path / "dist", "1.0", {"a.py": ""})
    dest = tmp_path / "cache" / release.filename
    dest.parent.mkdir()
    settings = PipSettings(())
    with pytest.raises(ChecksumError, match=f"has sha256 {release.sha256}, series.toml expects"):
        pkgindex.download(release.path.as_uri(), dest, "0" * 64, settings)
    assert list(dest.parent.iterdir()) == []
    pkgindex.download(release.path.as_uri(), dest, release.sha256, settings)
    assert dest.read_bytes() == release.path.read_bytes()


class _JsonIndex(http.server.BaseHTTPRequestHandler):
    """Serves one PEP 691 project page (only to JSON-accepting clients) and a file."""

    body = b"release bytes"

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        if self.path == "/simple/proj/":
            assert "application/vnd.pypi.simple.v1+json" in self.headers["Accept"]
            digest = hashlib.sha256(self.body).hexdigest()
            files = [
                {
                    "filename": "proj-1.0.tar.gz",
                    "url": "../../f/p.tgz",
                    "hashes": {"sha256": digest},
                }
            ]
            self._send("application/vnd.pypi.simple.v1+json", json.dumps({"files": files}).encode())
        elif self.path == "/f/p.tgz":
            self._send("application/octet-stream", self.body)
        else:
            self.send_error(404)

    def _send(self, content_type: str, body: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def json_index() -> Iterator[str]:
    server = http.server.HTTPServer(("127.0.0.1", 0), _JsonIndex)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}/simple"
    server.shutdown()


def test_pep691_json_index_over_http(tmp_path: Path, json_index: str) -> None:
    settings = PipSettings((json_index,))
    found = pkgindex.find_file("proj", "proj-1.0.tar.gz", settings)
    assert found.url.endswith("/f/p.tgz")
    dest = tmp_path / "proj-1.0.tar.gz"
    pkgindex.download(found.url, dest, found.sha256 or "", settings)
    assert dest.read_bytes() == _JsonIndex.body


def test_yanked_files_are_marked_in_both_index_formats() -> None:
    page = {"files": [
        {"filename": "a-1.tar.gz", "url": "a-1.tar.gz", "hashes": {}, "yanked": "bad"},
        {"filename": "a-2.tar.gz", "url": "a-2.tar.gz", "hashes": {}, "yanked": True},
        {"filename": "a-3.tar.gz", "url": "a-3.tar.gz", "hashes": {}, "yanked": False},
        {"filename": "a-4.tar.gz", "url": "a-4.tar.gz", "hashes": {}},
    ]}
    assert [f.yanked for f in pkgindex._files_from_json(page, "https://x/simple/a/")] == [
        "bad", "", None, None]
    html = ('<a href="a-1.tar.gz" data-yanked="bad">a-1.tar.gz</a>'
            '<a href="a-2.tar.gz" data-yanked>a-2.tar.gz</a><a href="a-3.tar.gz">a-3.tar.gz</a>')
    assert [f.yanked for f in pkgindex._files_from_html(html, "https://x/simple/a/")] == [
        "bad", "", None]
