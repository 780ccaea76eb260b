"""Killed, interrupted and concurrent operations: the checkout ends before or after, never between.

Each kill is deterministic: ``HYBRIDPD_FAULT=<point>[:TERM]`` makes the hybridpd
process kill itself when it reaches ``<point>`` (:func:`hybridpd.guard.fault`), and a
git hook kills git and hybridpd in the middle of a ``git am``. The CLI runs as a real
process (``python -m hybridpd.cli.entry``), so signals act as they do for a user.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import standins
from builders import Project, port_project, standard_project
from hybridpd import gitops, guard, scratch
from hybridpd.series.model import Series

pytestmark = pytest.mark.usefixtures("isolated")


def hybridpd(
    series: Series,
    *args: str,
    fault: str | None = None,
    tmp: Path | None = None,
    path: Path | None = None,
    code: str = "import sys; from hybridpd.cli.main import main; sys.exit(main())",
):
    env = dict(os.environ)
    env.pop(guard.FAULT_ENV, None)
    if fault:
        env[guard.FAULT_ENV] = fault
    # A killed run cannot remove its temporary trees: keep them in the test's project,
    # never in the machine's /tmp.
    if tmp is None:
        tmp = series.dir.parent / "tmp"
        tmp.mkdir(exist_ok=True)
    env["TMPDIR"] = str(tmp)
    if path:
        env["PATH"] = f"{path}{os.pathsep}{env['PATH']}"
    return subprocess.run(
        [sys.executable, "-c", code, "--series", str(series.path), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def snapshot(repo: Path) -> tuple[str, list[str], bool, bool]:
    gdir = guard.git_dir(repo)
    return (
        gitops.head(repo),
        gitops.status(repo),
        (gdir / "rebase-apply").exists(),
        (gdir / guard.JOURNAL).exists(),
    )


@pytest.fixture
def project(tmp_path: Path) -> tuple[Project, Series, str]:
    """A stock 1.0 checkout and the tree the full series gives it."""
    project, series = standard_project(tmp_path)
    reference = project.checkout("1.0", "reference")
    assert hybridpd(series, "apply", "--dir", str(reference)).returncode == 0
    return project, series, gitops.check(reference, "rev-parse", "HEAD^{tree}").strip()


def tree(repo: Path) -> str:
    return gitops.check(repo, "rev-parse", "HEAD^{tree}").strip()


@pytest.mark.parametrize("point", ["apply:patch-1", "apply:patch-2", "apply:done"])
def test_sigterm_mid_apply_restores_the_checkout(project, point: str) -> None:
    proj, series, _ = project
    repo = proj.checkout("1.0")
    before = snapshot(repo)
    result = hybridpd(series, "apply", "--dir", str(repo), fault=f"{point}:TERM")
    assert result.returncode == 130, result.stderr  # interrupted, not killed
    assert result.stderr.strip().splitlines()[-1] == "Error: interrupted"
    assert snapshot(repo) == before


def test_an_interrupt_of_an_apply_with_nothing_to_do_keeps_the_users_work(project) -> None:
    """With the series applied and the user's edit beside it, apply writes no journal
    and changes nothing: no interrupt can make it restore (reset) over that edit."""
    proj, series, _ = project
    repo = proj.checkout("1.0")
    assert hybridpd(series, "apply", "--dir", str(repo)).returncode == 0
    (repo / "README.txt").write_text("the user's edit\n")
    head = gitops.head(repo)
    result = hybridpd(series, "apply", "--dir", str(repo), fault="apply:done:TERM")
    assert result.returncode == 0, result.stderr  # nothing to do: no point to stop at
    assert (repo / "README.txt").read_text() == "the user's edit\n"
    assert gitops.head(repo) == head
    assert not (guard.git_dir(repo) / guard.JOURNAL).exists()


@pytest.mark.parametrize("point", ["apply:patch-1", "apply:patch-2", "apply:done"])
def test_sigkill_mid_apply_is_recovered_by_the_next_run(project, point: str) -> None:
    proj, series, full = project
    repo = proj.checkout("1.0")
    stock = gitops.head(repo)
    killed = hybridpd(series, "apply", "--dir", str(repo), fault=point)
    assert killed.returncode == -signal.SIGKILL
    assert snapshot(repo)[3]  # the journal says an apply was killed
    again = hybridpd(series, "apply", "--dir", str(repo))
    assert again.returncode == 0, again.stderr
    assert "recovered from an interrupted `hybridpd apply`" in again.stderr
    assert f"restored to {stock[:12]}" in again.stderr
    assert tree(repo) == full
    assert snapshot(repo)[1:] == ([], False, False)


def test_status_says_a_killed_apply_left_the_checkout(project) -> None:
    proj, series, _ = project
    repo = proj.checkout("1.0")
    killed = hybridpd(series, "apply", "--dir", str(repo), fault="apply:patch-2")
    assert killed.returncode == -signal.SIGKILL
    before = snapshot(repo)
    shown = hybridpd(series, "status", "--dir", str(repo))
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.splitlines()[1] == (
        f"  interrupted: a killed `hybridpd apply` (pid {killed_pid(repo)}) left this checkout "
        "mid-operation; the next apply, export or build on it recovers it first, or says in "
        "one line what to do"
    )
    doc = json.loads(hybridpd(series, "status", "--dir", str(repo), "--json").stdout)
    assert doc["interrupted"].startswith("a killed `hybridpd apply`")
    assert snapshot(repo) == before  # status reads only
    assert hybridpd(series, "apply", "--dir", str(repo)).returncode == 0
    doc = json.loads(hybridpd(series, "status", "--dir", str(repo), "--json").stdout)
    assert doc["interrupted"] is None


def test_status_is_silent_while_the_operation_runs(project, tmp_path: Path) -> None:
    """A journal whose operation still holds the lock is a running operation, not a
    killed one; status reads that without taking the lock (a starting operation would
    fail as busy)."""
    proj, series, _ = project
    repo = proj.checkout("1.0")
    code = (
        "import sys, time; from pathlib import Path; from hybridpd import guard\n"
        "repo = Path(sys.argv[1])\n"
        "with guard.operation(repo, 'apply'), guard.journal(repo, 'apply'):\n"
        "    print('in', flush=True); time.sleep(60)\n"
    )
    holder = subprocess.Popen([sys.executable, "-c", code, str(repo)], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline() == "in\n"
        doc = json.loads(hybridpd(series, "status", "--dir", str(repo), "--json").stdout)
        assert doc["interrupted"] is None
        busy = hybridpd(series, "apply", "--dir", str(repo))
        assert busy.returncode == 1 and "is busy" in busy.stderr
    finally:
        holder.kill()
        holder.wait()
    doc = json.loads(hybridpd(series, "status", "--dir", str(repo), "--json").stdout)
    assert doc["interrupted"].startswith(f"a killed `hybridpd apply` (pid {holder.pid})")


def killed_pid(repo: Path) -> int:
    return json.loads((guard.git_dir(repo) / guard.JOURNAL).read_text())["pid"]


def _git_that_dies_in_am(root: Path, only_in: Path | None = None) -> Path:
    """A ``git`` first on PATH whose ``git am`` (not ``--abort``) runs a pre-applypatch
    hook that kills git and hybridpd in the middle of the am, leaving what a SIGKILL
    there leaves: the am session and git's index.lock. (hybridpd runs git with hooks
    off; this wrapper turns them on for that one command.) ``only_in``: only an am run
    in that repository (a port also applies the source pin's series elsewhere)."""
    hooks, bin_dir = root / "hooks", root / "bin"
    hooks.mkdir()
    bin_dir.mkdir()
    (hooks / "pre-applypatch").write_text(
        "#!/bin/sh\n"
        "git_pid=$PPID\n"
        "hpd_pid=$(ps -o ppid= -p $git_pid | tr -d ' ')\n"
        ': > "$(git rev-parse --git-dir)/index.lock"\n'
        "kill -KILL $hpd_pid $git_pid\n"
    )
    (hooks / "pre-applypatch").chmod(0o755)
    real = shutil.which("git")
    (bin_dir / "git").write_text(
        f"#!{sys.executable}\n"
        "import os, sys\n"
        "args = sys.argv[1:]\n"
        f"here = {str(only_in) if only_in else ''!r}\n"
        "inside = not here or os.path.realpath(os.getcwd()) == os.path.realpath(here)\n"
        "if 'am' in args and '--abort' not in args and inside:\n"
        f"    args[args.index('am'):args.index('am')] = ['-c', 'core.hooksPath={hooks}']\n"
        f"os.execv({real!r}, [{real!r}, *args])\n"
    )
    (bin_dir / "git").chmod(0o755)
    return bin_dir


def test_sigkill_inside_git_am_is_recovered(project, tmp_path: Path) -> None:
    proj, series, full = project
    repo = proj.checkout("1.0")
    killed = hybridpd(series, "apply", "--dir", str(repo), path=_git_that_dies_in_am(tmp_path))
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    gdir = guard.git_dir(repo)
    assert (gdir / "rebase-apply").is_dir() and (gdir / "index.lock").exists()
    again = hybridpd(series, "apply", "--dir", str(repo))
    assert again.returncode == 0, again.stderr
    assert "recovered from an interrupted `hybridpd apply`" in again.stderr
    assert tree(repo) == full
    assert not (gdir / "index.lock").exists() and not (gdir / "rebase-apply").exists()


def test_a_git_am_that_is_not_ours_is_refused_and_kept(project, tmp_path: Path) -> None:
    proj, series, _ = project
    repo = proj.checkout("1.0")
    hook = guard.git_dir(repo) / "hooks" / "pre-applypatch"
    hook.parent.mkdir(exist_ok=True)
    hook.write_text("#!/bin/sh\nexit 1\n")  # the user's own am stops, waiting for them
    hook.chmod(0o755)
    patch = series.patch_path(series.pin("1.0"), "fix-add")
    ident = ["-c", "user.name=U", "-c", "user.email=u@example.com"]
    users_am = subprocess.run(["git", *ident, "am", str(patch)], cwd=repo, capture_output=True)
    assert users_am.returncode != 0 and gitops.am_in_progress(repo)
    result = hybridpd(series, "apply", "--dir", str(repo))
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"Error: {repo} is in the middle of a `git am` that hybridpd did not start: finish it "
        f"(git -C {repo} am --continue) or abort it (git -C {repo} am --abort), then run again"
    ]
    assert gitops.am_in_progress(repo)  # never aborted for the user


@pytest.mark.parametrize("name", ["index.lock", "HEAD.lock", "refs/heads/hybridpd.lock"])
def test_a_stale_git_lock_is_refused_up_front_with_one_line(project, name) -> None:
    """Refused before anything: no journal, no am session (a later recovery would blame
    a hybridpd run for it, and remove it); the line says a killed git left it."""
    proj, series, full = project
    repo = proj.checkout("1.0")
    lock = guard.git_dir(repo) / name
    lock.touch()
    before = snapshot(repo)
    result = hybridpd(series, "apply", "--dir", str(repo))
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"Error: {lock}: no git process is running on {repo}, so a git command that was "
        f"killed or crashed left it; nothing was done: remove it (rm {lock}) and run again"
    ]
    assert snapshot(repo) == before and lock.exists()  # not ours to remove
    shown = hybridpd(series, "status", "--dir", str(repo), "--json")
    assert json.loads(shown.stdout)["interrupted"] is None  # no killed apply to blame
    lock.unlink()  # as the line says
    assert hybridpd(series, "apply", "--dir", str(repo)).returncode == 0
    assert tree(repo) == full


def _holding(repo: Path, lock: Path) -> subprocess.Popen:
    """Another process that writes ``lock`` in ``repo`` as git does (open, not done)."""
    code = ("import os, sys, time; fd = os.open(sys.argv[1], os.O_CREAT | os.O_EXCL | os.O_WRONLY)\n"
            "print('held', flush=True); time.sleep(120)\n")
    holder = subprocess.Popen([sys.executable, "-c", code, str(lock)], cwd=repo,
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "held\n"
    return holder


def test_a_git_lock_a_live_process_writes_is_left_to_it(project) -> None:
    proj, series, full = project
    repo = proj.checkout("1.0")
    lock = guard.git_dir(repo) / "index.lock"
    holder = _holding(repo, lock)
    try:
        result = hybridpd(series, "apply", "--dir", str(repo))
    finally:
        holder.kill()
        holder.wait()
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"Error: {lock}: a git process (pid {holder.pid}) is running on {repo}; nothing was "
        "done: run again when it ends"
    ]
    assert lock.exists() and not (guard.git_dir(repo) / guard.JOURNAL).exists()


def test_recovery_never_removes_a_lock_another_git_process_made(project) -> None:
    """A killed apply's journal, then another git process takes index.lock: the lock is
    not the dead apply's, so the next run leaves it and says to wait."""
    repo, series, stock = _killed_apply(project)
    lock = guard.git_dir(repo) / "index.lock"
    holder = _holding(repo, lock)
    try:
        result = hybridpd(series, "apply", "--dir", str(repo))
        assert result.returncode == 1
        assert result.stderr.strip().splitlines() == [
            f"Error: {lock}: a git process (pid {holder.pid}) is running on {repo}; nothing "
            "was done: run again when it ends"
        ]
        assert lock.exists() and (guard.git_dir(repo) / guard.JOURNAL).exists()
    finally:
        holder.kill()
        holder.wait()
    lock.unlink()  # the other git is done
    again = hybridpd(series, "apply", "--dir", str(repo))
    assert again.returncode == 0, again.stderr
    assert f"restored to {stock[:12]}" in again.stderr


def test_a_group_kill_inside_git_before_the_journal_gets_the_right_advice(
    project, tmp_path: Path
) -> None:
    """The whole process group killed while a git child holds index.lock, before apply
    wrote its journal (its `git status`): the next run says a killed git left the lock
    (none is running), and once it is removed, apply runs."""
    proj, series, full = project
    repo = proj.checkout("1.0")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    real = shutil.which("git")
    (bin_dir / "git").write_text(
        f"#!{sys.executable}\n"
        "import os, signal, sys\n"
        "if 'status' in sys.argv:\n"
        "    open(os.path.join(sys.argv[sys.argv.index('-C') + 1] if '-C' in sys.argv\n"
        "         else os.getcwd(), '.git', 'index.lock'), 'w').close()\n"
        "    os.killpg(0, signal.SIGKILL)\n"
        f"os.execv({real!r}, [{real!r}, *sys.argv[1:]])\n"
    )
    (bin_dir / "git").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != guard.FAULT_ENV}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    code = "import sys; from hybridpd.cli.main import main; sys.exit(main())"
    killed = subprocess.run(
        [sys.executable, "-c", code, "--series", str(series.path), "apply", "--dir", str(repo)],
        env=env, capture_output=True, text=True, timeout=120, start_new_session=True,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    lock = guard.git_dir(repo) / "index.lock"
    assert lock.exists() and not (guard.git_dir(repo) / guard.JOURNAL).exists()
    result = hybridpd(series, "apply", "--dir", str(repo))
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"Error: {lock}: no git process is running on {repo}, so a git command that was "
        f"killed or crashed left it; nothing was done: remove it (rm {lock}) and run again"
    ]
    lock.unlink()
    assert hybridpd(series, "apply", "--dir", str(repo)).returncode == 0
    assert tree(repo) == full


def test_a_second_operation_on_a_busy_checkout_fails_with_one_line(project) -> None:
    proj, series, full = project
    repo = proj.checkout("1.0")
    with guard.operation(repo, "apply"):
        for args in (("apply",), ("export",)):
            result = hybridpd(series, *args, "--dir", str(repo))
            assert result.returncode == 1
            assert result.stderr.strip().splitlines() == [
                f"Error: {repo} is busy: hybridpd apply (pid {os.getpid()}) is running on it; "
                "run again when it ends"
            ]
    assert hybridpd(series, "apply", "--dir", str(repo)).returncode == 0
    assert tree(repo) == full


def test_concurrent_applies_end_with_the_series_applied_once(project) -> None:
    proj, series, full = project
    repo = proj.checkout("1.0")
    env = {k: v for k, v in os.environ.items() if k != guard.FAULT_ENV}
    code = "import sys; from hybridpd.cli.main import main; sys.exit(main())"
    cmd = [sys.executable, "-c", code, "--series", str(series.path), "apply", "--dir", str(repo)]
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(4)]
    outcomes = [(p.wait(timeout=120), p.stderr.read()) for p in procs]
    for code_, err in outcomes:
        # The holder's name may not be written yet when a loser reads it.
        assert code_ == 0 or (
            f"{repo} is busy: " in err and "run again when it ends" in err
        ), err
    assert any(code_ == 0 for code_, _ in outcomes)
    assert tree(repo) == full
    assert len(gitops.commits(repo, "v1.0..HEAD")) == 2


def test_sigterm_during_check_leaves_no_temporary_tree(project, tmp_path: Path) -> None:
    _, series, _ = project
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    result = hybridpd(series, "check", fault="check:round-trip:TERM", tmp=tmp)
    assert result.returncode == 130, result.stderr
    assert list(tmp.iterdir()) == []
    assert list(scratch.root().iterdir()) == []


def test_sigkill_during_check_changes_nothing_and_the_next_check_passes(
    project, tmp_path: Path
) -> None:
    # A killed check cannot remove its temporary tree, which is in the cache (not the
    # temporary directory), where the next run removes it; it never writes the series.
    _, series, _ = project
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    before = {p: p.read_bytes() for p in sorted(series.dir.rglob("*")) if p.is_file()}
    killed = hybridpd(series, "check", fault="check:round-trip", tmp=tmp)
    assert killed.returncode == -signal.SIGKILL
    assert list(tmp.iterdir()) == []
    assert [p.name.startswith("check-") for p in scratch.root().iterdir() if p.is_dir()] == [True]
    assert {p: p.read_bytes() for p in sorted(series.dir.rglob("*")) if p.is_file()} == before
    again = hybridpd(series, "check")
    assert again.returncode == 0, again.stdout + again.stderr
    assert list(scratch.root().iterdir()) == []


# --------------------------------------------------------------------------- port


@pytest.fixture
def port_series(tmp_path: Path) -> Series:
    return port_project(tmp_path)[1]


@pytest.mark.parametrize("point", ["port:replayed", "port:series-written"])
def test_sigkill_mid_port_is_recovered_by_continue(port_series, tmp_path: Path, point) -> None:
    from hybridpd.series.export import check
    from hybridpd.series.model import load

    dest = tmp_path / "port"
    killed = hybridpd(port_series, "port", "--from", "1.0", "--to", "2.0", "--dir", str(dest),
                      fault=point)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    resumed = hybridpd(port_series, "port", "--continue", "--dir", str(dest), "--json")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    ported = load(port_series.path)
    assert [p.id for p in ported.carried(ported.pin("2.0"))] == ["fix-add", "feature"]
    assert check(ported) == []
    # Each patch is one commit on top of the release, once.
    log = gitops.check(dest, "log", "--format=%s", "v2.0..HEAD").splitlines()
    assert log == ["Add doubling", "[Core] Keep the sum in a local"]


def test_sigkill_inside_a_ports_git_am_is_recovered_by_continue(
    port_series, tmp_path: Path
) -> None:
    from hybridpd.series.export import check
    from hybridpd.series.model import load

    dest = tmp_path / "port"
    killed = hybridpd(port_series, "port", "--from", "1.0", "--to", "2.0", "--dir", str(dest),
                      path=_git_that_dies_in_am(tmp_path, only_in=dest))
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    gdir = guard.git_dir(dest)
    assert (gdir / "rebase-apply").is_dir() and (gdir / "index.lock").exists()
    resumed = hybridpd(port_series, "port", "--continue", "--dir", str(dest))
    assert resumed.returncode == 0, resumed.stderr
    assert "recovered from an interrupted `hybridpd port`" in resumed.stderr
    ported = load(port_series.path)
    assert [p.id for p in ported.carried(ported.pin("2.0"))] == ["fix-add", "feature"]
    assert check(ported) == []
    assert not (gdir / "index.lock").exists() and not (gdir / "rebase-apply").exists()


def test_sigkill_as_a_port_stops_on_a_conflict_is_recovered_by_continue(tmp_path: Path) -> None:
    # Killed after the state names the conflicting patch but before it returns: the
    # next call ends the am session (journal), and --continue replays the patch, which
    # stops on the same conflict again, resolvable as usual.
    series = port_project(tmp_path, {"README.txt": "proj, rewritten\n"})[1]
    dest = tmp_path / "port"
    killed = hybridpd(series, "port", "--from", "1.0", "--to", "2.0", "--dir", str(dest),
                      fault="port:conflict")
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    resumed = hybridpd(series, "port", "--continue", "--dir", str(dest))
    assert resumed.returncode == 1
    assert "recovered from an interrupted `hybridpd port`" in resumed.stderr
    assert "stopped: patch feature conflicts with 2.0" in resumed.stdout + resumed.stderr
    assert "ended outside hybridpd port" not in resumed.stderr
    assert hybridpd(series, "port", "--abort", "--dir", str(dest)).returncode == 0


@pytest.mark.parametrize("then", [["--continue"], ["--abort"]], ids=" ".join)
def test_a_killed_port_skip_then_the_users_work_then_continue_or_abort(
    tmp_path: Path, then: list[str]
) -> None:
    """`port --skip` killed as it writes the series; the user edits series.toml and
    starts a patch file of the target; the next port call keeps both or says why in
    one line."""
    series = port_project(tmp_path, {"README.txt": "proj, rewritten\n"})[1]
    dest = tmp_path / "port"
    stopped = hybridpd(series, "port", "--from", "1.0", "--to", "2.0", "--dir", str(dest))
    assert stopped.returncode == 1 and "conflicts" in stopped.stdout + stopped.stderr
    killed = hybridpd(series, "port", "--skip", "--upstream", "2.0", "--dir", str(dest),
                      fault="port:series-written")
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    with open(series.path, "a") as fh:
        fh.write("# the user's note\n")
    wip = series.patch_dir(series.pin("2.0")) / "my-wip.patch"
    wip.parent.mkdir(parents=True, exist_ok=True)
    wip.write_bytes(b"the user's patch in progress\n")
    result = hybridpd(series, "port", *then, "--dir", str(dest))
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error: ")]
    assert result.returncode == 0 or (result.returncode == 1 and len(errors) == 1), result.stderr
    assert series.path.read_text().endswith("# the user's note\n")
    assert wip.read_bytes() == b"the user's patch in progress\n"


@pytest.mark.parametrize(
    "args", [["--abort"], ["--abort", "--json"], ["--continue", "--json"]], ids=" ".join
)
def test_every_port_call_that_recovers_a_killed_replay_says_so(
    port_series, tmp_path: Path, args
) -> None:
    import json

    dest = tmp_path / "port"
    killed = hybridpd(port_series, "port", "--from", "1.0", "--to", "2.0", "--dir", str(dest),
                      fault="port:replayed")
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    result = hybridpd(port_series, "port", *args, "--dir", str(dest))
    assert result.returncode == 0, result.stdout + result.stderr
    recovered = [line for line in result.stderr.splitlines() if "recovered from" in line]
    assert len(recovered) == 1, result.stderr
    assert "an interrupted `hybridpd port`" in recovered[0]
    if "--json" in args:
        assert json.loads(result.stdout)["recovered"] == recovered[0]
    assert not (guard.git_dir(dest) / guard.JOURNAL).exists()


# ----------------------------------------------------- recovery proves it may act

USER = ["-c", "user.name=U", "-c", "user.email=u@example.com"]


def _killed_apply(project, point: str = "apply:patch-2") -> tuple[Path, Series, str]:
    proj, series, _ = project
    repo = proj.checkout("1.0")
    stock = gitops.head(repo)
    killed = hybridpd(series, "apply", "--dir", str(repo), fault=point)
    assert killed.returncode == -signal.SIGKILL
    return repo, series, stock


def _one_refusal(result, repo: Path, stock: str) -> str:
    assert result.returncode == 1, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    line = lines[0]
    assert "interrupted `hybridpd apply`" in line
    assert f"rm {guard.git_dir(repo) / guard.JOURNAL}" in line  # the command to finish by hand
    assert stock[:12] in line and f"git -C {repo} reflog" in line  # named, not relied on
    return line


@pytest.mark.parametrize("path", ["proj/core.py", "proj/__init__.py"])  # touched, untouched
@pytest.mark.parametrize("command", ["apply", "export"])
def test_an_edit_after_a_killed_apply_is_never_overwritten(project, path, command) -> None:
    repo, series, stock = _killed_apply(project)
    with open(repo / path, "a") as fh:
        fh.write("x\n")
    edited = (repo / path).read_bytes()
    result = hybridpd(series, command, "--dir", str(repo))
    line = _one_refusal(result, repo, stock)
    assert path in line
    assert (repo / path).read_bytes() == edited
    # The commands the line names finish it: the user's edit is still there after.
    (guard.git_dir(repo) / guard.JOURNAL).unlink()
    assert (repo / path).read_bytes() == edited


@pytest.mark.parametrize("command", ["apply", "export"])
def test_a_commit_after_a_killed_apply_is_never_reset(project, command) -> None:
    repo, series, stock = _killed_apply(project)
    (repo / "mine.txt").write_text("my work\n")
    subprocess.run(["git", *USER, "add", "mine.txt"], cwd=repo, check=True)
    subprocess.run(["git", *USER, "commit", "-qm", "mine"], cwd=repo, check=True)
    mine = gitops.head(repo)
    result = hybridpd(series, command, "--dir", str(repo))
    line = _one_refusal(result, repo, stock)
    assert f"HEAD moved to {mine[:12]}" in line
    assert gitops.head(repo) == mine and (repo / "mine.txt").read_text() == "my work\n"


def test_export_says_it_recovered_a_killed_apply(project) -> None:
    repo, series, stock = _killed_apply(project)
    result = hybridpd(series, "export", "--dir", str(repo))
    # Back at the release, nothing to export: refused, but the recovery is said first.
    assert result.returncode == 1, result.stderr
    recovered, error = result.stderr.strip().splitlines()
    assert "recovered from an interrupted `hybridpd apply`" in recovered
    assert error.startswith("Error: 2 patch(es) carried on 1.0 have no commit")
    assert gitops.head(repo) == stock


def test_a_corrupt_journal_gets_one_line(project) -> None:
    proj, series, _ = project
    repo = proj.checkout("1.0")
    journal = guard.git_dir(repo) / guard.JOURNAL
    journal.write_text('{"operation": "apply", "he')
    result = hybridpd(series, "apply", "--dir", str(repo))
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"Error: {journal} is not a hybridpd journal (corrupt); nothing was done. If no "
        f"hybridpd is running on {repo}, inspect `git -C {repo} status`, then "
        f"`rm {journal}` and run again"
    ]
    assert journal.exists()


def test_an_edit_after_a_kill_inside_git_am_is_never_overwritten(project, tmp_path: Path) -> None:
    # The am in flight left fix-add's change in proj/core.py; the user then edits it.
    proj, series, _ = project
    repo = proj.checkout("1.0")
    stock = gitops.head(repo)
    killed = hybridpd(series, "apply", "--dir", str(repo), path=_git_that_dies_in_am(tmp_path))
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    with open(repo / "proj" / "core.py", "a") as fh:
        fh.write("# mine\n")
    edited = (repo / "proj" / "core.py").read_bytes()
    line = _one_refusal(hybridpd(series, "apply", "--dir", str(repo)), repo, stock)
    gdir = guard.git_dir(repo)
    assert "proj/core.py changed" in line
    assert f"rm {gdir / 'index.lock'}; git -C {repo} am --quit; rm {gdir / guard.JOURNAL}" in line
    assert (repo / "proj" / "core.py").read_bytes() == edited
    # The commands it names finish it, and the edit is still there.
    (gdir / "index.lock").unlink()
    quit_ = subprocess.run(["git", *USER, "-C", str(repo), "am", "--quit"], capture_output=True, text=True)
    assert quit_.returncode == 0, quit_.stderr
    (gdir / guard.JOURNAL).unlink()
    assert not gitops.am_in_progress(repo)
    assert (repo / "proj" / "core.py").read_bytes() == edited


@pytest.mark.parametrize("point", ["checkout:extracted", "checkout:committed"])
def test_a_killed_checkout_is_named_and_never_removed(project, tmp_path: Path, point) -> None:
    _, series, _ = project
    dest = tmp_path / "half"
    killed = hybridpd(series, "checkout", "1.0", "--dir", str(dest), "--source", "sdist",
                      fault=point)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    (dest / "proj" / "mine.py").write_text("my work\n")  # the user works in it anyway
    again = hybridpd(series, "checkout", "1.0", "--dir", str(dest), "--source", "sdist")
    assert again.returncode == 1
    assert again.stderr.strip().splitlines() == [
        f"Error: {dest} holds a checkout of 1.0 that did not finish (a killed `hybridpd "
        f"checkout`?); nothing was changed: if nothing in it is yours, remove it "
        f"(rm -rf {dest}) and run again"
    ]
    applied = hybridpd(series, "apply", "--dir", str(dest))
    assert applied.returncode == 1 and len(applied.stderr.strip().splitlines()) == 1
    assert (dest / "proj" / "mine.py").read_text() == "my work\n"


# -------------------------------------------------------------- the fault sweep


def _edit(repo: Path, path: str) -> dict[str, bytes]:
    with open(repo / path, "a") as fh:
        fh.write("# the user's line\n")
    return {path: (repo / path).read_bytes()}


def _add(repo: Path) -> dict[str, bytes]:
    (repo / "notes.txt").write_text("the user's notes\n")
    return {"notes.txt": b"the user's notes\n"}


def _commit(repo: Path) -> dict[str, bytes]:
    (repo / "mine.txt").write_text("the user's commit\n")
    subprocess.run(["git", *USER, "add", "mine.txt"], cwd=repo, check=True)
    subprocess.run(["git", *USER, "commit", "-qm", "mine"], cwd=repo, check=True)
    return {"mine.txt": b"the user's commit\n"}


USER_CHANGES = {
    "edit-touched": lambda repo: _edit(repo, "proj/core.py"),
    "edit-other": lambda repo: _edit(repo, "proj/__init__.py"),
    "add-file": _add,
    "commit": _commit,
}


#: Per state-writing command: the named points it is killed at, and the commands
#: run after the kill and the user's change ("any command": the same one, others).
SWEEP = {
    # build right after the kill: it undoes the apply and builds nothing, in one line.
    "apply": (["apply:patch-1", "apply:done"], ["status", "build", "export", "apply", "apply"]),
    "export": (["export:before-writes", "export:after-writes"], ["export", "apply", "status"]),
    "build": (["build:downloaded", "build:installed", "build:overlaid"], ["build", "status"]),
    "install": (["install:checked-out", "install:applied"], ["install", "status"]),
}


def _args(command: str, repo: Path, venv: Path) -> list[str]:
    if command == "build":
        return ["build", "--dir", str(repo), "--venv", str(venv), "--variant", "cpu"]
    if command == "install":
        return ["install", "--pin", "1.0", "--dir", str(repo), "--venv", str(venv),
                "--variant", "cpu", "--source", "sdist"]
    return [command, "--dir", str(repo)]


def _before(command: str, proj: Project, series: Series, tmp_path: Path) -> tuple[Path, Path]:
    """The checkout and venv ``command`` is killed on, as a user has them then."""
    from hybridpd.series.apply import apply

    venv = tmp_path / "venv"
    if command in ("build", "install"):
        standins.release_wheel("1.0")
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    if command == "install":
        return proj.root / "work" / "installed", venv  # install checks it out
    repo = proj.checkout("1.0")
    if command in ("export", "build"):
        apply(series, repo)
    return repo, venv


@pytest.mark.parametrize(
    "command,point",
    [pytest.param(c, p, id=p) for c, (points, _) in SWEEP.items() for p in points],
)
@pytest.mark.parametrize("change", list(USER_CHANGES))
def test_sweep_a_killed_command_then_user_work_then_any_command(
    tmp_path: Path, command, point, change
) -> None:
    """Kill a state-writing command at a named point, change something as a user would,
    run the commands: no user byte is lost, and each command finishes or says in one
    line what to do. build and install run with :mod:`standins` for pip and the vLLM
    wheel (a real build is not killed here)."""
    proj, series = standard_project(tmp_path)
    repo, venv = _before(command, proj, series, tmp_path)
    wip = series.patch_dir(series.pin("1.0")) / "my-wip.patch"
    wip.write_bytes(b"the user's patch in progress\n")
    def code(name: str) -> dict:
        return {"code": standins.command()} if name in ("build", "install") else {}

    killed = hybridpd(series, *_args(command, repo, venv), fault=point, **code(command))
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    kept = {**USER_CHANGES[change](repo), wip: wip.read_bytes()}
    commit = gitops.head(repo) if change == "commit" else None
    for then in SWEEP[command][1]:
        result = hybridpd(series, *_args(then, repo, venv), **code(then))
        assert "Traceback" not in result.stderr
        errors = [line for line in result.stderr.splitlines() if line.startswith("Error: ")]
        assert result.returncode == 0 or (result.returncode == 1 and len(errors) == 1), (
            then, result.stderr)
        for path, data in kept.items():
            assert (repo / path).read_bytes() == data, (then, path)
        if commit:
            assert gitops.run(repo, "merge-base", "--is-ancestor", commit, "HEAD").ok


def test_an_edit_after_a_killed_port_is_never_overwritten(port_series, tmp_path: Path) -> None:
    dest = tmp_path / "port"
    killed = hybridpd(port_series, "port", "--from", "1.0", "--to", "2.0", "--dir", str(dest),
                      fault="port:replayed")
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    edited = _edit(dest, "proj/core.py")
    resumed = hybridpd(port_series, "port", "--continue", "--dir", str(dest))
    assert resumed.returncode == 1
    (line,) = resumed.stderr.strip().splitlines()
    assert "interrupted `hybridpd port`" in line and "proj/core.py changed" in line
    assert f"rm {guard.git_dir(dest) / guard.JOURNAL}" in line
    assert (dest / "proj" / "core.py").read_bytes() == edited["proj/core.py"]
