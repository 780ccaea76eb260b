"""``apply --installed``: patch an installed release in a real venv, all or nothing, and
undo it byte for byte.

The fixture environment is a real ``python -m venv`` whose site-packages holds the
fixture release ``proj`` as pip would install it (files, bytecode, a dist-info with a
true RECORD). The CLI runs as a real process, so a kill acts as it does for a user.
"""

from __future__ import annotations

import compileall
import csv
import io
import json
import os
import signal
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from builders import BASE_FILES, FEATURE, FIX_ADD, standard_project
from hybridpd import guard
from hybridpd.envs import installed
from hybridpd.envs import wheel_overlay as wo

pytestmark = pytest.mark.usefixtures("isolated")


def make_env(root: Path, version: str = "1.0", distribution: str = "proj") -> Path:
    """A venv with ``distribution`` ``version`` installed from the fixture release's
    files; returns its Python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    py = root / "bin" / "python"
    site = Path(subprocess.run(
        [py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip())
    files = {p: t for p, t in BASE_FILES.items() if p.startswith("proj/")}
    for rel, text in files.items():
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_text(text)
    compileall.compile_dir(site / "proj", quiet=1)
    dist_info = site / f"{distribution.replace('-', '_')}-{version}.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {distribution}\nVersion: {version}\n"
    )
    (dist_info / "INSTALLER").write_text("pip\n")
    rows = []
    for path in sorted(site.rglob("*")):
        if path.is_file():
            data = path.read_bytes()
            rows.append([path.relative_to(site).as_posix(), wo.record_hash(data), str(len(data))])
    rows.append([f"{dist_info.name}/RECORD", "", ""])
    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerows(rows)
    (dist_info / "RECORD").write_text(out.getvalue())
    return py


def snapshot(py: Path) -> dict[str, tuple]:
    """Every file of the venv with its bytes, mode and mtime; every folder and link."""
    root = py.parent.parent
    out: dict[str, tuple] = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if p.is_symlink():
            out[rel] = ("link", os.readlink(p))
        elif p.is_dir():
            out[rel] = ("dir",)
        else:
            out[rel] = (p.read_bytes(), p.stat().st_mode, p.stat().st_mtime_ns)
    return out


def run(py: Path, code: str) -> str:
    proc = subprocess.run([py, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def hybridpd(series, *args: str, fault: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != guard.FAULT_ENV}
    if fault:
        env[guard.FAULT_ENV] = fault
    code = "import sys; from hybridpd.cli.main import main; sys.exit(main())"
    return subprocess.run(
        [sys.executable, "-c", code, "--series", str(series.path), *args],
        capture_output=True, text=True, env=env, timeout=120,
    )


def site_of(py: Path) -> Path:
    return installed.locate(py, "proj").site


def test_apply_then_revert_is_byte_for_byte(tmp_path: Path) -> None:
    _, series = standard_project(tmp_path)
    py = make_env(tmp_path / "venv")
    before = snapshot(py)

    result = installed.apply(series, py)
    assert (result.action, result.patches) == ("applied", ("fix-add", "feature"))
    # The environment imports the patched files, and RECORD tells the truth about them.
    assert run(py, "import inspect, proj.core; print('total' in inspect.getsource(proj.core))") == "True"
    assert run(py, "from proj.feature import double; print(double(21))") == "42"
    target = installed.locate(py, "proj")
    assert wo.check_record(target.site, target.dist_info) == []
    state = installed.status("proj", py)
    assert (state.manifest["patches"], state.changed, state.interrupted) == (
        ["fix-add", "feature"], [], False
    )

    assert installed.revert("proj", py).action == "reverted"
    assert snapshot(py) == before
    assert installed.revert("proj", py).action == "nothing"


def test_second_apply_changes_nothing(tmp_path: Path) -> None:
    _, series = standard_project(tmp_path)
    py = make_env(tmp_path / "venv")
    installed.apply(series, py)
    after = snapshot(py)
    assert installed.apply(series, py).action == "already"
    assert snapshot(py) == after


def test_a_changed_series_replaces_the_earlier_overlay(tmp_path: Path) -> None:
    project, series = standard_project(tmp_path)
    py = make_env(tmp_path / "venv")
    before = snapshot(py)
    installed.apply(series, py)
    project.records[1]["states"]["1.0"] = "dropped"  # `feature` dropped since
    series = project.write()
    result = installed.apply(series, py)
    assert (result.action, result.patches) == ("applied", ("fix-add",))
    site = site_of(py)
    assert not (site / "proj" / "feature.py").exists()
    assert (site / "proj" / "core.py").read_text() == FIX_ADD["proj/core.py"]
    installed.revert("proj", py)
    assert snapshot(py) == before


def test_a_file_that_is_not_the_release_is_refused_and_nothing_changes(tmp_path: Path) -> None:
    _, series = standard_project(tmp_path)
    py = make_env(tmp_path / "venv")
    core = site_of(py) / "proj" / "core.py"
    core.write_text(core.read_text() + "# local hotfix\n")
    before = snapshot(py)
    result = hybridpd(series, "apply", "--installed", "--python", str(py))
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        f"Error: proj 1.0 in {site_of(py)} does not match the stock source: 1 differ "
        "(first: proj/core.py); reinstall the release "
        "(pip install --force-reinstall --no-deps proj==1.0)"
    )
    assert snapshot(py) == before


def test_a_file_changed_after_apply_is_named_and_revert_restores_the_release(
    tmp_path: Path,
) -> None:
    _, series = standard_project(tmp_path)
    py = make_env(tmp_path / "venv")
    before = snapshot(py)
    installed.apply(series, py)
    core = site_of(py) / "proj" / "core.py"
    core.write_text("edited by hand\n")
    assert installed.status("proj", py).changed == ["proj/core.py"]
    with pytest.raises(installed.InstalledError, match=r"proj/core.py was changed after"):
        installed.apply(series, py)
    result = hybridpd(series, "apply", "--installed", "--python", str(py), "--revert")
    assert result.returncode == 0, result.stderr
    # The release is back, and the edit is kept beside it, where the one line says.
    kept = core.with_name("core.py.hybridpd-kept")
    assert kept.read_text() == "edited by hand\n"
    assert (
        f"warning: proj/core.py was changed after the overlay; your version is kept "
        f"as {kept}" in result.stderr
    )
    kept.unlink()
    assert snapshot(py) == before


def test_a_failure_after_files_changed_puts_the_release_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, series = standard_project(tmp_path)
    py = make_env(tmp_path / "venv")
    before = snapshot(py)

    def fail(*_args) -> None:
        raise installed.InstalledError("the proof failed")

    monkeypatch.setattr(installed, "_prove", fail)
    with pytest.raises(installed.InstalledError, match="the proof failed"):
        installed.apply(series, py)
    assert snapshot(py) == before


@pytest.mark.parametrize(
    "point",
    ["installed:backed-up", "installed:file-1", "installed:file-2", "installed:manifest",
     "installed:proven"],
)
def test_a_killed_apply_is_undone_by_the_next_run(tmp_path: Path, point: str) -> None:
    _, series = standard_project(tmp_path)
    py = make_env(tmp_path / "venv")
    before = snapshot(py)
    killed = hybridpd(series, "apply", "--installed", "--python", str(py), fault=point)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    status = json.loads(hybridpd(series, "status", "--installed", "--python", str(py),
                                 "--json").stdout)
    assert (status["interrupted"], status["applied"]) == (True, False)

    # The next revert finishes what the killed run left: the release is back.
    reverted = hybridpd(series, "apply", "--installed", "--python", str(py), "--revert")
    assert reverted.returncode == 0, reverted.stderr
    assert "recovered from an interrupted `hybridpd apply --installed`" in reverted.stderr
    assert snapshot(py) == before

    # And a killed apply followed by an apply ends patched, as if it had not been killed.
    killed = hybridpd(series, "apply", "--installed", "--python", str(py), fault=point)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    again = hybridpd(series, "apply", "--installed", "--python", str(py), "--json")
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["action"] == "applied"
    assert (site_of(py) / "proj" / "feature.py").read_text() == FEATURE["proj/feature.py"]


@pytest.mark.parametrize("command", [["apply"], ["apply", "--revert"]])
def test_an_edit_after_a_killed_apply_is_kept_by_the_recovery(tmp_path: Path, command) -> None:
    _, series = standard_project(tmp_path)
    py = make_env(tmp_path / "venv")
    killed = hybridpd(series, "apply", "--installed", "--python", str(py),
                      fault="installed:manifest")
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    core = site_of(py) / "proj" / "core.py"
    core.write_text("edited by hand after the kill\n")
    result = hybridpd(series, *command, "--installed", "--python", str(py))
    assert result.returncode == 0, result.stderr
    kept = core.with_name("core.py.hybridpd-kept")
    assert kept.read_text() == "edited by hand after the kill\n"
    recovered = [line for line in result.stderr.splitlines() if "recovered from" in line]
    assert len(recovered) == 1 and f"proj/core.py had changed since; kept as {kept}" in recovered[0]


@pytest.mark.parametrize(
    "point", ["installed:undo", "installed:restored", "installed:cleaned"]
)
def test_a_killed_revert_is_finished_by_the_next_run(tmp_path: Path, point: str) -> None:
    _, series = standard_project(tmp_path)
    py = make_env(tmp_path / "venv")
    before = snapshot(py)
    installed.apply(series, py)
    killed = hybridpd(series, "apply", "--installed", "--python", str(py), "--revert",
                      fault=point)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert snapshot(py) != before
    again = hybridpd(series, "apply", "--installed", "--python", str(py), "--revert")
    assert again.returncode == 0, again.stderr
    assert snapshot(py) == before


@pytest.mark.parametrize("revert", [False, True], ids=["apply", "revert"])
def test_a_run_killed_writing_its_journal_leaves_no_temporary_file(
    tmp_path: Path, revert: bool
) -> None:
    """Killed inside the atomic write of its journal (temporary file written, not yet
    renamed): the next run removes that file, and --revert leaves the release's
    dist-info byte for byte."""
    _, series = standard_project(tmp_path)
    py = make_env(tmp_path / "venv")
    before = snapshot(py)
    if revert:
        installed.apply(series, py)
    flags = ["--revert"] if revert else []
    killed = hybridpd(series, "apply", "--installed", "--python", str(py), *flags,
                      fault=f"write:{installed.JOURNAL}")
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    dist_info = locate_dist_info(py)
    left = sorted(p.name for p in dist_info.glob("*.hybridpd-tmp"))
    assert left == [f".{installed.JOURNAL}.{killed_pid(dist_info)}.hybridpd-tmp"]
    again = hybridpd(series, "apply", "--installed", "--python", str(py), "--revert")
    assert again.returncode == 0, again.stderr
    assert snapshot(py) == before


def test_a_journal_temporary_file_a_dead_run_left_is_removed_by_the_next_run(
    tmp_path: Path,
) -> None:
    """The same leftover as above, as the issue found it (any hybridpd version's write
    killed before its rename): the pid in its name is gone; --revert removes it."""
    _, series = standard_project(tmp_path)
    py = make_env(tmp_path / "venv")
    before = snapshot(py)
    installed.apply(series, py)
    gone = subprocess.Popen([sys.executable, "-c", ""])
    gone.wait()
    tmp = locate_dist_info(py) / f".{installed.JOURNAL}.{gone.pid}.hybridpd-tmp"
    tmp.write_text('{"operation": "apply --installed --revert", "pid"')
    again = hybridpd(series, "apply", "--installed", "--python", str(py), "--revert")
    assert again.returncode == 0, again.stderr
    assert not tmp.exists() and snapshot(py) == before


def locate_dist_info(py: Path) -> Path:
    (found,) = site_of(py).glob("*.dist-info")
    return found


def killed_pid(dist_info: Path) -> int:
    (tmp,) = dist_info.glob("*.hybridpd-tmp")
    return int(tmp.name.split(".")[-2])


#: The points a killed ``apply --installed`` (and ``--revert``) stops at.
APPLY_POINTS = ["installed:backed-up", "installed:file-1", "installed:file-2",
                "installed:manifest", "installed:proven"]
REVERT_POINTS = ["installed:undo", "installed:restored", "installed:cleaned"]


@pytest.mark.parametrize(
    "revert,point,edited",
    [pytest.param(False, p, "proj/core.py", id=f"apply-{p}") for p in APPLY_POINTS]
    + [pytest.param(True, p, "proj/core.py", id=f"revert-{p}") for p in REVERT_POINTS]
    + [pytest.param(False, "installed:file-1", "proj/__init__.py", id="apply-untouched"),
       pytest.param(True, "installed:restored", "proj/__init__.py", id="revert-untouched")],
)
def test_sweep_a_killed_overlay_then_an_edit_then_any_command(
    tmp_path: Path, revert: bool, point: str, edited: str
) -> None:
    """Kill ``apply --installed`` (or ``--revert``) at a named point, edit an installed
    file as a user would, then run apply, revert, status and apply: the edit is never
    lost (in place, or kept beside it as the line that says so names), and each command
    finishes or says in one line what to do."""
    _, series = standard_project(tmp_path)
    py = make_env(tmp_path / "venv")
    if revert:
        installed.apply(series, py)
    flags = ["--revert"] if revert else []
    killed = hybridpd(series, "apply", "--installed", "--python", str(py), *flags, fault=point)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    path = site_of(py) / edited
    mine = b"# the user's edit after the kill\n"
    path.write_bytes(mine)
    kept: set[Path] = set()
    for then in (["apply"], ["apply", "--revert"], ["status"], ["apply"]):
        result = hybridpd(series, *then, "--installed", "--python", str(py))
        assert "Traceback" not in result.stderr
        errors = [line for line in result.stderr.splitlines() if line.startswith("Error: ")]
        assert result.returncode == 0 or (result.returncode == 1 and len(errors) == 1), (
            then, result.stderr)
        now = set(path.parent.glob(f"{path.name}.hybridpd-kept*"))
        for copy in now - kept:  # a copy made aside is named by the command that made it
            assert str(copy) in result.stderr, (then, copy, result.stderr)
        kept = now
        assert any(c.is_file() and c.read_bytes() == mine for c in [path, *now]), (
            then, result.stderr)


def test_environments_that_cannot_be_patched_get_one_line(tmp_path: Path) -> None:
    _, series = standard_project(tmp_path)
    cases = {
        "no-dist": (lambda root: subprocess.run(
            [sys.executable, "-m", "venv", "--without-pip", str(root)], check=True
        ) and root / "bin" / "python", "has none of proj, proj-cpu installed"),
        "not-a-pin": (lambda root: make_env(root, version="1.5"),
                      "proj 1.5 in {py} is not a pinned release (pins: 1.0, 2.0)"),
    }
    for name, (make, message) in cases.items():
        py = make(tmp_path / name)
        result = hybridpd(series, "apply", "--installed", "--python", str(py))
        assert result.returncode == 1, name
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and message.format(py=py) in lines[0], (name, lines)

    both = make_env(tmp_path / "both")
    site = site_of(both)
    cpu = site / "proj_cpu-1.0.dist-info"
    cpu.mkdir()
    (cpu / "METADATA").write_text("Metadata-Version: 2.1\nName: proj-cpu\nVersion: 1.0\n")
    (cpu / "RECORD").write_text("")
    result = hybridpd(series, "apply", "--installed", "--python", str(both))
    assert result.stderr.strip() == (
        f"Error: {both} has proj 1.0, proj-cpu 1.0 installed; they own the same proj/ files "
        "(uninstall one)"
    )


def test_cpu_distribution_is_found_and_patched(tmp_path: Path) -> None:
    _, series = standard_project(tmp_path)
    py = make_env(tmp_path / "venv", distribution="proj-cpu")
    result = installed.apply(series, py)
    assert (result.target.distribution, result.action) == ("proj-cpu", "applied")


def test_usage_errors(tmp_path: Path) -> None:
    _, series = standard_project(tmp_path)
    for args in (["apply", "--revert"], ["apply", "--python", "x"],
                 ["apply", "--installed", "--dir", "elsewhere"]):
        result = hybridpd(series, *args)
        assert result.returncode == 2, (args, result.stderr)


def test_pip_uninstall_after_apply_leaves_no_dist_info(tmp_path: Path) -> None:
    _, series = standard_project(tmp_path)
    py = make_env(tmp_path / "venv")
    installed.apply(series, py)
    site = site_of(py)
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(py), "uninstall", "-y", "proj"],
        capture_output=True, text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert not list(site.glob("proj*")), list(site.glob("proj*"))


def test_relative_python_is_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _, series = standard_project(tmp_path)
    make_env(tmp_path / "venv")
    monkeypatch.chdir(tmp_path)
    result = installed.apply(series, Path("venv/bin/python"))
    assert result.action == "applied"
    assert result.target.python == tmp_path / "venv" / "bin" / "python"


def test_unreadable_state_and_a_lost_backup_get_one_line(tmp_path: Path) -> None:
    _, series = standard_project(tmp_path)
    py = make_env(tmp_path / "venv")
    installed.apply(series, py)
    target = installed.locate(py, "proj")
    backup = target.dist_info / installed.BACKUP
    moved = tmp_path / "backup-moved"
    backup.rename(moved)
    lost = hybridpd(series, "apply", "--installed", "--python", str(py), "--revert")
    assert lost.returncode == 1
    assert lost.stderr.strip().startswith("Error: the backup of proj/core.py in ")
    assert lost.stderr.strip().endswith(
        "cannot be put back; reinstall the release "
        "(pip install --force-reinstall --no-deps proj==1.0)"
    )
    moved.rename(backup)

    manifest = target.dist_info / installed.MANIFEST
    manifest.write_text("{not json")
    for args in (["status"], ["apply"], ["apply", "--revert"]):
        result = hybridpd(series, *args, "--installed", "--python", str(py))
        assert result.returncode == 1, args
        lines = result.stderr.strip().splitlines()
        assert "Traceback" not in result.stderr, lines
        assert lines[-1].startswith("Error: ") and "hybridpd-installed.json is unreadable" in lines[-1]


def test_editable_install_is_refused_before_any_checkout(tmp_path: Path) -> None:
    _, series = standard_project(tmp_path)
    py = make_env(tmp_path / "venv")
    dist_info = installed.locate(py, "proj").dist_info
    (dist_info / "direct_url.json").write_text(
        json.dumps({"url": "file:///src/proj", "dir_info": {"editable": True}})
    )
    result = hybridpd(series, "apply", "--installed", "--python", str(py))
    assert result.returncode == 1
    assert "is an editable or development install" in result.stderr
    assert not (installed.checkout_dir("1.0")).exists()


def test_a_symlinked_file_is_refused_and_nothing_changes(tmp_path: Path) -> None:
    _, series = standard_project(tmp_path)
    py = make_env(tmp_path / "venv")
    core = site_of(py) / "proj" / "core.py"
    real = tmp_path / "core-real.py"
    real.write_bytes(core.read_bytes())
    core.unlink()
    core.symlink_to(real)
    before = snapshot(py)
    with pytest.raises(installed.InstalledError, match=r"core.py is a symbolic link"):
        installed.apply(series, py)
    assert snapshot(py) == before


def build_made_env(tmp_path: Path, project, series, patched: bool = True
                   ) -> tuple[Path, Path, str]:
    """A venv as `hybridpd build` (and so `hybridpd install`) leaves it: the release
    installed from its wheel, the checkout's patched files written over it by
    :func:`wheel_overlay.apply_overlay` with build's manifest (``hybridpd-overlay.json``;
    ``patched=False``: a stock checkout's build, an overlay of no files, as the e2e's
    stock venv). Returns its Python, the checkout and the checkout's head."""
    import zipfile

    from hybridpd.envs import build as build_mod
    from hybridpd import gitops
    from hybridpd.series.apply import apply

    py = make_env(tmp_path / "venv")
    target = installed.locate(py, "proj")
    repo = project.checkout("1.0", "built")
    if patched:
        apply(series, repo)
    head = gitops.head(repo)
    wheel = tmp_path / "proj-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for path in sorted(target.site.rglob("*")):
            rel = path.relative_to(target.site).as_posix()
            if path.is_file() and rel.startswith(("proj/", target.dist_info.name + "/")) \
                    and "__pycache__" not in rel:
                zf.writestr(rel, path.read_bytes())
    changes = build_mod.patch_changes(repo, "v1.0", head, "proj")
    with zipfile.ZipFile(wheel) as zf:
        manifest = build_mod.overlay_manifest(
            repo, "proj", series.pin("1.0"), "cpu", gitops.resolve(repo, "v1.0"), head, wheel,
            "0" * 64, "torch==2.0", [],
        )
        wo.apply_overlay(target.site, target.dist_info, zf, changes, manifest)
    return py, repo, head


def test_a_stock_build_is_the_release_for_status_and_apply_installed(tmp_path: Path) -> None:
    # The e2e's stock venv: `hybridpd build` of a stock checkout, an overlay of no file.
    # It holds the release's files, so apply --installed patches it like a release.
    project, series = standard_project(tmp_path)
    py, _, _ = build_made_env(tmp_path, project, series, patched=False)
    data = json.loads(hybridpd(series, "status", "--installed", "--python", str(py),
                               "--json").stdout)
    assert (data["applied"], data["patched_by"]) == (False, None)
    result = hybridpd(series, "apply", "--installed", "--python", str(py), "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["action"] == "applied"


def test_status_names_a_venv_that_hybridpd_build_patched(tmp_path: Path) -> None:
    project, series = standard_project(tmp_path)
    py, repo, head = build_made_env(tmp_path, project, series)
    data = json.loads(hybridpd(series, "status", "--installed", "--python", str(py),
                               "--json").stdout)
    assert (data["applied"], data["patched_by"], data["pin"], data["head"], data["patches"]) == (
        True, "build", "1.0", head, ["fix-add", "feature"]
    )
    assert (data["files"], data["changed_since"], data["interrupted"]) == (
        ["proj/core.py", "proj/feature.py"], [], False
    )
    text = hybridpd(series, "status", "--installed", "--python", str(py))
    assert text.returncode == 0, text.stderr
    assert "not patched by hybridpd" not in text.stdout
    assert (
        f"  patched by `hybridpd build` from {repo}: series of 1.0 at {head[:12]}: "
        f"{len(data['files'])} file(s)"
    ) in text.stdout.splitlines(), text.stdout
    assert "  applied   feature" in text.stdout.splitlines()


def test_apply_installed_on_a_venv_build_made_with_the_same_series_is_already_applied(
    tmp_path: Path,
) -> None:
    project, series = standard_project(tmp_path)
    py, _, head = build_made_env(tmp_path, project, series)
    before = snapshot(py)
    result = hybridpd(series, "apply", "--installed", "--python", str(py), "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert (data["action"], data["patches"]) == ("already", ["fix-add", "feature"])
    assert snapshot(py) == before


def test_apply_installed_on_a_venv_build_made_with_another_series_is_one_line(
    tmp_path: Path,
) -> None:
    project, series = standard_project(tmp_path)
    py, repo, head = build_made_env(tmp_path, project, series)
    before = snapshot(py)
    project.records[1]["states"]["1.0"] = "dropped"  # `feature` dropped since the build
    series = project.write()
    for args in (["apply"], ["apply", "--revert"]):
        result = hybridpd(series, *args, "--installed", "--python", str(py))
        assert result.returncode == 1, (args, result.stderr)
        (line,) = [x for x in result.stderr.splitlines() if x.startswith("Error: ")]
        assert result.stderr.strip().splitlines()[-1] == line
        assert line.startswith(
            f"Error: proj 1.0 in {site_of(py)} was patched by `hybridpd build` (or "
            f"`hybridpd install`) from {repo} at {head[:12]}"
        ), line
        assert f"hybridpd build --dir {repo} --venv {tmp_path / 'venv'}" in line, line
        assert snapshot(py) == before
