"""``hybridpd install --wheelhouse DIR``: a bundle of ``hybridpd bundle`` installed with no
network at all.

1. ``bundle.json`` is read and every part checked (present, size, sha256): a missing or
   corrupt one is refused in one line before anything else happens;
2. the host interpreter is checked, before anything is installed, against what the
   bundle left to it (``--reuse-host``): its Python, each reused distribution at a
   version every bundled wheel (and the other reused ones) accepts, and torch's CUDA
   build with the CUDA major the release's compiled ops link; every problem in one line;
3. the parts are read back as one tar into ``DIR/payload`` and every file checked
   against its sha256;
4. a venv (seeing the host's site-packages when distributions were reused) gets the
   release and its dependencies with ``pip install --no-index --find-links``, and NIXL;
5. the patched files are written over the release, each verified by its sha256 first,
   with the overlay manifest ``hybridpd build`` writes;
6. the proof: the venv imports the patched files, ``nixl._api`` imports, and whether
   vLLM's compiled ops load (a warning, not a failure, on a host without the GPU they
   are for).

Nothing here needs git or a package index.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import tarfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import InvalidVersion, Version

from hybridpd import proc as proc_mod
from hybridpd.envs import build as build_mod
from hybridpd.envs import kernels
from hybridpd.envs import parts as parts_mod
from hybridpd.envs import wheel_overlay as wo
from hybridpd.errors import HybridpdError
from hybridpd.progress import Log, quiet

MANIFEST = "bundle.json"
FORMAT = 1


class WheelhouseError(HybridpdError):
    """The bundle or the host cannot give a patched vLLM; one line."""


def load(bundle: Path) -> dict:
    """The bundle's manifest; WheelhouseError when it is not one."""
    path = Path(bundle) / MANIFEST
    if not path.is_file():
        raise WheelhouseError(f"{bundle} is not a bundle: it has no {MANIFEST}")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise WheelhouseError(f"{path} is not JSON: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise WheelhouseError(f"{path} is not a bundle manifest of format {FORMAT}")
    return manifest


# --------------------------------------------------------------------------- the host

_HOST_SCRIPT = r"""
import json, re, sys
from importlib import metadata
out = {"python": "%d.%d" % sys.version_info[:2], "dists": {}}
for name in json.loads(sys.argv[1]):
    try:
        d = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        out["dists"][name] = None
        continue
    info = {"version": d.version, "requires": d.requires or []}
    for f in d.files or []:
        if str(f).replace("\\", "/") == name + "/version.py":
            m = re.search(r"^cuda\s*(?::[^=]*)?=\s*['\"]([^'\"]*)['\"]", f.read_text(), re.M)
            info["cuda"] = m.group(1) if m else None
    out["dists"][name] = info
print("HYBRIDPD-HOST " + json.dumps(out))
"""


def read_host(python: Path | str, names: list[str]) -> dict:
    """What ``python`` has of ``names``: its version, each distribution's version,
    requirements and (torch) the CUDA of its build."""
    done = proc_mod.run([python, "-c", _HOST_SCRIPT, json.dumps(names)], capture=True)
    line = next((l for l in (done.stdout or "").splitlines() if l.startswith("HYBRIDPD-HOST ")),
                None)
    if done.returncode != 0 or line is None:
        raise WheelhouseError(f"{python} does not run: {(done.stderr or '').strip()[-200:]}")
    return json.loads(line[len("HYBRIDPD-HOST "):])


def host_problems(manifest: dict, host: dict) -> list[str]:
    """Why the host cannot take the bundle (empty: it can)."""
    problems = []
    if host["python"] != manifest["python_version"]:
        problems.append(f"the bundle is for Python {manifest['python_version']}, "
                        f"the host's is {host['python']}")
    reuse = manifest.get("reuse") or {}
    dists = host["dists"]
    wants: dict[str, list[tuple[str, str]]] = {n: [(r["by"], r["specifier"])
                                                   for r in e["requires"]]
                                               for n, e in reuse.items()}
    for by, info in dists.items():  # what the reused distributions require of each other
        for line in (info or {}).get("requires", []):
            try:
                req = Requirement(line)
            except InvalidRequirement:
                continue
            name = canonicalize_name(req.name)
            if name in wants and (req.marker is None or req.marker.evaluate({"extra": ""})):
                wants[name].append((f"{by} {info['version']}", str(req.specifier)))
    for name, entry in reuse.items():
        info = dists.get(name)
        if info is None:
            problems.append(f"{name} is not installed")
            continue
        try:
            version = Version(info["version"])
        except InvalidVersion:
            problems.append(f"{name} has the unreadable version {info['version']!r}")
            continue
        for by, spec in wants[name]:
            try:
                ok = SpecifierSet(spec).contains(version, prereleases=True)
            except InvalidSpecifier:
                ok = False
            if not ok:
                problems.append(f"{name} {version} is not {spec} ({by} requires it)")
        cuda = entry.get("cuda")
        if cuda:
            have = info.get("cuda")
            if not have or have.split(".")[0] != cuda:
                problems.append(f"{name} {version} is built for CUDA {have or 'none (CPU)'}, "
                                f"the release's compiled ops for CUDA {cuda}")
            elif version.local and not re.fullmatch(rf"cu{cuda}\d", version.local):
                problems.append(f"{name} {version} is not a CUDA {cuda} build (+cu{cuda}x)")
    return problems


# --------------------------------------------------------------------------- payload


def extract(bundle: Path, manifest: dict, log: Log = quiet) -> Path:
    """The parts read back into ``bundle/payload`` (reused when there already), every
    file checked against its sha256."""
    bundle = Path(bundle)
    dest = bundle / "payload"
    files = {f["name"]: f for f in manifest["payload"]["files"]}
    if not dest.is_dir():
        tmp = bundle / f"payload.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        log(f"unpacking {len(manifest['parts'])} part(s) into {dest}")
        try:
            reader = parts_mod.PartReader(bundle / "parts", manifest["parts"])
            with tarfile.open(fileobj=reader, mode="r|") as tar:
                for member in tar:
                    if member.name not in files or not member.isfile():
                        raise WheelhouseError(f"the payload holds {member.name!r}, "
                                              "which the manifest does not list")
                    tar.extract(member, tmp, set_attrs=False)
            tmp.rename(dest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    for name, entry in files.items():
        path = dest / name
        if not path.is_file() or wo.sha256_file(path) != entry["sha256"]:
            raise WheelhouseError(f"{path} is missing or not the file the manifest names "
                                  f"(remove {dest} to unpack the parts again)")
    return dest


def overlay_changes(payload: Path, manifest: dict) -> list[wo.Change]:
    """The patched files of the bundle, each verified by its sha256."""
    changes = []
    for entry in manifest["overlay"]["files"]:
        if entry["status"] == "D":
            changes.append(wo.Change("D", entry["path"]))
            continue
        data = (payload / "overlay" / entry["path"]).read_bytes()
        if hashlib.sha256(data).hexdigest() != entry["sha256"]:
            raise WheelhouseError(f"the bundle's {entry['path']} is not the patched file")
        changes.append(wo.Change(entry["status"], entry["path"], data))
    return changes


# --------------------------------------------------------------------------- install


@dataclass
class WheelhouseResult:
    venv: Path
    python: Path
    manifest: dict
    overlaid: list[str] = field(default_factory=list)
    proof: dict = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"venv": str(self.venv), "pin": self.manifest["pin"],
                "variant": self.manifest["variant"], "overlaid": self.overlaid,
                "proof": self.proof, "warnings": self.warnings}


def _pip(py: Path, *args: str | Path) -> None:
    done = proc_mod.run([py, "-m", "pip", *args], capture=True)
    if done.returncode != 0:
        tail = [l for l in (done.stderr or "").splitlines() if l.startswith("ERROR")][-1:]
        raise WheelhouseError(
            f"pip {args[0]} failed offline: {(tail or (done.stderr or '').strip().splitlines()[-1:] or ['no output'])[0][:300]}"
        )


def install(
    bundle: Path, venv: Path, *, python: Path | str | None = None, stock: bool = False,
    log: Log = quiet,
) -> WheelhouseResult:
    """Install the bundle at ``bundle`` into ``venv`` with no network (see the module
    docstring); ``stock``: the release as published, without the patched files (the
    e2e's comparison), proven to import the release's own files. WheelhouseError (one
    line) when a check or step fails."""
    bundle, venv = Path(bundle).absolute(), Path(venv).absolute()
    manifest = load(bundle)
    log(f"checking {len(manifest['parts'])} part(s) of {bundle}")
    parts_mod.verify(bundle / "parts", manifest["parts"])
    python = python or sys.executable
    reuse = sorted(manifest.get("reuse") or {})
    problems = host_problems(manifest, read_host(python, reuse))
    if problems:
        raise WheelhouseError(f"{python} cannot take this bundle: {'; '.join(problems)}")
    if reuse:
        log(f"the host has what the bundle leaves to it: {', '.join(reuse)}")
    payload = extract(bundle, manifest, log)
    changes = overlay_changes(payload, manifest)

    py = venv / "bin" / "python"
    if not py.exists():
        log(f"creating {venv}" + (" (seeing the host's site-packages)" if reuse else ""))
        flags = ["--system-site-packages"] if reuse else []
        done = proc_mod.run([python, "-m", "venv", *flags, venv], capture=True)
        if done.returncode != 0 or not py.exists():
            raise WheelhouseError(f"could not create {venv}: {(done.stderr or '').strip()[-200:]}")
    wheels = payload / "wheels"
    log(f"installing {', '.join(manifest['install'])} from the bundle (no index)")
    if manifest.get("dropped"):
        # The release requires what the bundle left out (a CPU venv's CPU_DROPPED): pip
        # would look for it; the bundled wheels (no_deps ones too) are the resolved set
        # without it.
        log(f"leaving out {', '.join(manifest['dropped'])}, as a CPU install does")
        _pip(py, "install", "-q", "--no-index", "--no-deps", *sorted(wheels.glob("*.whl")))
    else:
        _pip(py, "install", "-q", "--no-index", "--find-links", wheels, *manifest["install"])
        if manifest.get("no_deps"):
            _pip(py, "install", "-q", "--no-index", "--no-deps", "--find-links", wheels,
                 *manifest["no_deps"])

    distribution = canonicalize_name(manifest["distribution"])
    release = next((w for w in wheels.glob("*.whl")
                    if canonicalize_name(parse_wheel_filename(w.name)[0]) == distribution), None)
    if release is None:
        raise WheelhouseError(f"the bundle holds no {distribution} wheel")
    if stock:
        with zipfile.ZipFile(release) as zf:  # what the release itself has at those paths
            names = set(zf.namelist())
            changes = [wo.Change("M", c.path, zf.read(c.path)) for c in changes
                       if c.path in names]
        result = WheelhouseResult(venv, py, manifest)
        result.proof = prove(py, changes, manifest["variant"], venv, result.warnings, log,
                             kind="release's")
        return result
    site = Path(build_mod.venv_paths(py)["platlib"])
    log(f"overlaying {len(changes)} patched files")
    with zipfile.ZipFile(release) as zf:
        dist_info = site / wo.find_dist_info(zf)
        wo.apply_overlay(site, dist_info, zf, changes, manifest["overlay"]["manifest"])
    bad = wo.check_record(site, dist_info, [c.path for c in changes if c.data is not None])
    if bad:
        raise WheelhouseError(f"RECORD disagrees with the overlaid files: {', '.join(bad)}")
    result = WheelhouseResult(venv, py, manifest, [c.path for c in changes])
    result.proof = prove(py, changes, manifest["variant"], venv, result.warnings, log)
    return result


def prove(
    py: Path, changes: list[wo.Change], variant: str, cwd: Path, warnings: list[str], log: Log,
    kind: str = "patched",
) -> dict:
    """The venv imports the ``kind`` (patched, or the release's) files and ``nixl._api``;
    whether the compiled ops load."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.setdefault("HF_HUB_OFFLINE", "1")
    if variant == "cpu":
        env.setdefault("VLLM_TARGET_DEVICE", "cpu")
    log(f"checking that the venv imports the {kind} files and nixl._api")
    proof = build_mod.prove_overlay(py, changes, env, cwd=cwd)
    wrong = [f["path"] for f in proof["files"] if not f["ok"]]
    if wrong:
        raise WheelhouseError(f"the venv does not import the {kind} {', '.join(wrong)}")
    nixl = proc_mod.run([py, "-c", "import nixl._api"], capture=True, env=env, cwd=cwd)
    if nixl.returncode != 0:
        tail = (nixl.stderr or "").strip().splitlines()[-1:] or ["no output"]
        raise WheelhouseError(f"nixl._api does not import in the venv: {tail[0][:300]}")
    proof["nixl"] = "ok"
    ops = kernels.probe(py, variant, env, cwd=cwd)
    proof["kernels"] = ops.to_json()
    proof["compiled_ops"] = ops.status
    if not ops.ok:
        warnings.append(f"vllm imports, but its compiled ops ({ops.module}) do not load: "
                        f"{ops.status}")
        log(f"warning: {warnings[-1]}")
    return proof
