"""No server outlives its run: the record of the process groups a run starts, the signals
that end a run, and the reaping of what a SIGKILLed run left (issue 28, item 5).

The stand-in server forks an "engine core" that forks a "worker" (a grandchild, in the
server's group, as vLLM's API server, engine core and workers are); the worker writes a
shared-memory file named by the server's pid (as LMCache's ``lmcache_kv_<pid>_*``) and
holds another one open.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest
from builders import Project
from click.testing import CliRunner
from hybridpd import proc
from hybridpd.cli.main import main
from hybridpd.e2e import reap
from hybridpd.e2e.servers import Processes, group_members

pytestmark = pytest.mark.usefixtures("isolated")

SERVER = textwrap.dedent(
    """
    import os, signal, sys, time
    tag, stubborn = sys.argv[1], sys.argv[2] == "stubborn"
    leader = os.getpid()
    if os.fork() == 0:  # the engine core
        if os.fork() == 0:  # its worker, the server's grandchild
            if stubborn:
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
            if tag:
                with open(f"/dev/shm/{tag}-{leader}-kv", "w") as f:
                    f.write("kv")
                held = open(f"/dev/shm/{tag}-held", "w")
        while True:
            time.sleep(1)
    while True:
        time.sleep(1)
    """
)

#: ``hybridpd e2e`` with everything but the start of the processes stood in: the pair
#: starts three stand-in servers through Processes.start, the scenario sleeps.
HYBRIDPD = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from hybridpd.cli.main import main
    from hybridpd.e2e import pair as pair_mod, router as router_mod, run as run_mod, smoke
    from hybridpd.e2e.envs import Env
    from hybridpd.e2e.servers import Processes

    server, tag, stubborn = sys.argv[1], sys.argv[2], sys.argv[3]
    Processes.__init__.__kwdefaults__["grace"] = 1.0  # a stubborn worker: SIGKILL soon

    def prepare(series, version, build, device, log, torch=None):
        return Env(build, Path(sys.executable), Path(sys.prefix), None, "0" * 40, True, {})

    def tiny_model(env, arch, seed, cache, process_env, variant="default", mtp=False):
        path = cache / "tiny"
        path.mkdir(parents=True, exist_ok=True)
        (path / "hybridpd-tiny.json").write_text(
            '{"architectures": ["X"], "parameters": 1, "vocab_size": 300}')
        return path

    def start_pair(procs, env, model, connector, role, opts, progress):
        for name in ("prefill", "decode", "router"):
            mine = tag if name == "decode" else ""
            procs.start(name, [sys.executable, server, mine, stubborn],
                        shm=[f"/dev/shm/{tag}-{{pid}}-*"] if mine else [])
        return pair_mod.Pair("p", "d", "x")

    run_mod.preflight = lambda *a, **k: None
    router_mod.install = lambda python, log: None
    run_mod.prepare = prepare
    run_mod.probe = lambda env, process_env, device: {
        "nixl": "ok", "qwen3_5": "ok", "kernels": {"module": "m", "status": "ok"}}
    run_mod.tiny_model = tiny_model
    pair_mod.start_pair = start_pair
    smoke.run_smoke = lambda *a, **k: time.sleep(600)
    main(sys.argv[4:])
    """
)


@pytest.fixture
def tag() -> str:
    """A prefix for this test's files in /dev/shm; whatever is left is removed."""
    name = f"hybridpd-test-{uuid.uuid4().hex[:12]}"
    yield name
    for left in Path("/dev/shm").glob(f"{name}-*"):
        left.unlink()


def _wait(what: str, until, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if result := until():
            return result
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _recorded(run_dir: Path) -> dict[str, reap.Entry] | None:
    """The record once all three groups are in it with their grandchildren (read as
    it is: reap.read refuses a record whose writer still runs)."""
    try:
        doc = json.loads((run_dir / reap.RECORD).read_text())
    except (OSError, ValueError):
        return None
    entries = [reap.Entry.from_json(e) for e in doc["processes"]]
    by_name = {e.name: e for e in entries}
    if set(by_name) == {"prefill", "decode", "router"} and all(
        len(e.members) == 2 for e in entries
    ):
        return by_name
    return None


def _hybridpd(
    tmp_path: Path, tag: str, stubborn: str = "plain", out: str = "out", stdout=subprocess.PIPE
) -> tuple[subprocess.Popen, Path]:
    series = tmp_path / "series-path"
    if not series.is_file():
        project = Project(tmp_path / "project")
        project.release("1.0")
        project.record("fix", {"1.0": "carried"})
        series.write_text(str(project.write().path))
    (tmp_path / "server.py").write_text(SERVER)
    (tmp_path / "hybridpd_e2e.py").write_text(HYBRIDPD)
    child = subprocess.Popen(
        [sys.executable, tmp_path / "hybridpd_e2e.py", tmp_path / "server.py", tag, stubborn,
         "--series", series.read_text(), "e2e", "--pin",
         "1.0", "--tiny", "--out", str(tmp_path / out)],
        stdout=stdout, stderr=subprocess.STDOUT, text=True,
    )
    return child, tmp_path / out / "patched-nixl"


def _alive(entries) -> dict[str, list[int]]:
    return {e.name: m for e in entries.values() if (m := group_members(e.pgid))}


def test_a_sigkilled_run_leaves_its_groups_and_reap_ends_them(tmp_path: Path, tag: str) -> None:
    child, run_dir = _hybridpd(tmp_path, tag)
    try:
        entries = _wait("the record", lambda: _recorded(run_dir) or child.poll() is not None)
        assert child.poll() is None, child.stdout.read()
        _wait("the shm files", lambda: len(list(Path("/dev/shm").glob(f"{tag}-*"))) == 2)
        refused = CliRunner().invoke(main, ["e2e", "--reap", str(tmp_path / "out")])
        assert refused.exit_code == 1 and "is still running; stop it" in refused.output
        assert len(_alive(entries)) == 3
        child.kill()
        child.wait()
        # The servers live on in their own sessions: only a reap ends them.
        assert {n: len(m) for n, m in _alive(entries).items()} == {
            "prefill": 3, "decode": 3, "router": 3}
        result = CliRunner().invoke(main, ["e2e", "--reap", str(tmp_path / "out")])
        assert result.exit_code == 0, result.output
        assert _alive(entries) == {}
        assert "decode ended process group" in result.output
        assert "removed 2 shared-memory file(s)" in result.output
        assert list(Path("/dev/shm").glob(f"{tag}-*")) == []
        assert not (run_dir / reap.RECORD).exists()
        again = CliRunner().invoke(main, ["e2e", "--reap", str(tmp_path / "out")])
        assert again.exit_code == 0 and "nothing to reap" in again.output
        doc = CliRunner().invoke(main, ["e2e", "--reap", str(tmp_path / "out"), "--json"])
        assert json.loads(doc.stdout) == {"reaped": []}
    finally:
        if child.poll() is None:
            child.kill()
        for entry in (_recorded(run_dir) or {}).values():
            proc.signal_group(entry.pgid, signal.SIGKILL)


def test_the_next_run_into_another_out_reaps_what_a_killed_one_left(
    tmp_path: Path, tag: str
) -> None:
    """--out is new per run by default: the next run finds the killed one's record
    through <cache>/e2e/live/ and ends its groups before it starts its own."""
    first, run_dir = _hybridpd(tmp_path, tag)
    second = None
    try:
        entries = _wait("the record", lambda: _recorded(run_dir) or first.poll() is not None)
        assert first.poll() is None, first.stdout.read()
        first.kill()
        first.wait()
        assert len(_alive(entries)) == 3
        with open(tmp_path / "second.log", "w") as log:
            second, second_dir = _hybridpd(tmp_path, f"{tag}-2", out="out-2", stdout=log)
            own = _wait("the second run's groups", lambda: _recorded(second_dir), timeout=90)
        text = (tmp_path / "second.log").read_text()
        assert _alive(entries) == {}, text
        for name in ("prefill", "decode", "router"):
            assert f"left by an earlier run: {run_dir}: {name} ended process group" in text
        assert not (run_dir / reap.RECORD).exists()
        assert len(_alive(own)) == 3  # its own, live run: untouched by itself
        live = list((tmp_path / "cache" / "e2e" / "live").iterdir())
        assert [json.loads(f.read_text())["record"] for f in live] == [
            str(second_dir / reap.RECORD)]
    finally:
        for child in (first, second):
            if child is not None and child.poll() is None:
                child.kill()
                child.wait()
        for d in (run_dir, tmp_path / "out-2" / "patched-nixl"):
            for entry in (_recorded(d) or {}).values():
                proc.signal_group(entry.pgid, signal.SIGKILL)


@pytest.mark.parametrize("where", ["host", "pidns", "boot_id"])
def test_a_record_of_another_host_container_or_boot_is_left_alone(
    tmp_path: Path, tag: str, where: str
) -> None:
    """A cache shared with another host, container or boot: its registered records
    name processes and /dev/shm files that are not this machine's to judge."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    ident = proc.identity(gone.pid)
    gone.wait()
    left = Path(f"/dev/shm/{tag}-{gone.pid}-kv")
    left.write_text("")
    record = tmp_path / "out" / reap.RECORD
    reap.write(record, [reap.Entry("decode", gone.pid, ident.pgid, ident.start_time,
                                   shm=(f"/dev/shm/{tag}-{{pid}}-*",))])
    (named,) = (tmp_path / "cache" / "e2e" / "live").iterdir()
    data = json.loads(named.read_text())
    data[where] = "elsewhere"
    named.write_text(json.dumps(data))
    assert reap.reap_registered() == ([], [])
    assert record.exists() and named.exists() and left.exists()
    data[where] = reap._here()[where]  # the same place again: reaped
    named.write_text(json.dumps(data))
    done, _ = reap.reap_registered()
    assert [(r.outcome, r.shm_removed) for r in done] == [("gone", (str(left),))]
    assert not record.exists() and not named.exists()


def test_a_name_being_written_is_not_touched(tmp_path: Path) -> None:
    """A run writes its name through a temporary file (guard.write_atomic), after its
    record: the next run must not read that file, nor remove it under the writer."""
    live = tmp_path / "cache" / "e2e" / "live"
    live.mkdir(parents=True)
    writing = live / f".abc.{os.getpid()}.hybridpd-tmp"
    writing.write_text(json.dumps({"record": str(tmp_path / "x" / reap.RECORD), **reap._here()}))
    assert reap.reap_registered() == ([], [])
    assert writing.exists()


@pytest.mark.parametrize("signals", [(signal.SIGHUP,), (signal.SIGTERM, signal.SIGTERM)],
                         ids=["SIGHUP", "SIGTERM-twice"])
def test_a_signal_reaps_every_group_before_hybridpd_exits(tmp_path: Path, tag: str, signals) -> None:
    """SIGHUP ends the run as SIGTERM does; a second signal while the run reaps (here
    while a worker that ignores SIGTERM is waited for) does not cut the reaping short."""
    child, run_dir = _hybridpd(tmp_path, tag, stubborn="stubborn")
    entries = {}
    try:
        entries = _wait("the record", lambda: _recorded(run_dir) or child.poll() is not None)
        assert child.poll() is None, child.stdout.read()
        for sig in signals:
            child.send_signal(sig)
            time.sleep(0.5)
        assert child.wait(timeout=60) == 130
        assert _alive(entries) == {}
        assert list(Path("/dev/shm").glob(f"{tag}-*")) == []
        assert not (run_dir / reap.RECORD).exists()
    finally:
        if child.poll() is None:
            child.kill()
        for entry in entries.values() if isinstance(entries, dict) else ():
            proc.signal_group(entry.pgid, signal.SIGKILL)


@pytest.mark.parametrize("signals", [(signal.SIGHUP,), (signal.SIGTERM, signal.SIGTERM)],
                         ids=["SIGHUP", "SIGTERM-twice"])
def test_library_use_reaps_on_a_signal(tmp_path: Path, signals) -> None:
    """Without the command line (whose handler turns SIGHUP into an interrupt), a run
    still reaps its groups on SIGHUP; a second SIGTERM while it waits for a worker that
    ignores SIGTERM does not leave the groups after it running."""
    (tmp_path / "server.py").write_text(SERVER)
    script = tmp_path / "lib.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        from hybridpd.e2e.servers import Processes
        with Processes({str(tmp_path / 'logs')!r}, grace=1, poll=0.1) as procs:
            for name in ("decode", "proxy"):
                p = procs.start(name, [sys.executable, {str(tmp_path / 'server.py')!r}, "",
                                       "stubborn"])
                print(p.pid, flush=True)
            time.sleep(600)
    """))
    child = subprocess.Popen([sys.executable, script], stdout=subprocess.PIPE, text=True)
    pgids = [int(child.stdout.readline()), int(child.stdout.readline())]
    try:
        _wait("the grandchildren", lambda: all(len(group_members(g)) == 3 for g in pgids))
        for sig in signals:
            child.send_signal(sig)
            time.sleep(0.3)
        child.wait(timeout=30)
        _wait("the groups to end", lambda: all(group_members(g) == [] for g in pgids),
              timeout=10)
    finally:
        if child.poll() is None:
            child.kill()
        for pgid in pgids:
            proc.signal_group(pgid, signal.SIGKILL)


def test_a_pid_whose_start_time_differs_is_left_alone(tmp_path: Path, tag: str) -> None:
    """The recorded pid now names another process (pid reuse): neither it nor the files
    its pid names are touched."""
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                             start_new_session=True)
    try:
        ident = _wait("the process", lambda: proc.identity(other.pid))
        named = Path(f"/dev/shm/{tag}-{other.pid}-kv")
        named.write_text("theirs")
        entry = reap.Entry("decode", other.pid, ident.pgid, ident.start_time - 1,
                           shm=(f"/dev/shm/{tag}-{{pid}}-*",))
        run_dir = tmp_path / "out" / "patched-nixl"
        reap.write(run_dir / reap.RECORD, [entry])
        done = reap.reap(tmp_path / "out", grace=1)
        assert [(r.name, r.outcome) for r in done] == [("decode", "pid reused")]
        assert other.poll() is None and named.exists()
        assert not (run_dir / reap.RECORD).exists()
    finally:
        other.kill()
        other.wait()


def test_a_record_of_groups_already_gone_only_removes_their_files(tmp_path: Path, tag: str) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    ident = _wait("the process", lambda: proc.identity(gone.pid))
    gone.wait()
    left = Path(f"/dev/shm/{tag}-{gone.pid}-kv")
    left.write_text("")
    stray = tmp_path / f"{tag}-{gone.pid}-kv"  # outside /dev/shm: never removed
    stray.write_text("")
    reap.write(tmp_path / "out" / reap.RECORD, [reap.Entry(
        "proxy", gone.pid, ident.pgid, ident.start_time,
        shm=(f"/dev/shm/{tag}-{{pid}}-*", f"{tmp_path}/{tag}-*"))])
    done = reap.reap(tmp_path / "out")
    assert [(r.outcome, r.shm_removed) for r in done] == [("gone", (str(left),))]
    assert stray.exists() and not left.exists()


def test_an_unreadable_record_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / reap.RECORD).write_text("{not json")
    result = CliRunner().invoke(main, ["e2e", "--reap", str(tmp_path / "out")])
    assert result.exit_code == 1
    assert result.output.strip().splitlines() == [
        f"Error: {tmp_path / 'out' / reap.RECORD}: not a record of processes "
        "(Expecting property name enclosed in double quotes: line 1 column 2 (char 1)); "
        "end them by hand and delete it"
    ]


@pytest.mark.parametrize("text", [
    "[]", "null", '"x"', '{"processes": 5}', '{"processes": ["x"]}',
    '{"processes": [{"name": "a", "pid": 1, "pgid": 1, "start_time": 1, "members": 5}]}',
    '{"processes": [], "writer": 5}',
])
def test_valid_json_of_the_wrong_shape_is_one_line(tmp_path: Path, text: str) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / reap.RECORD).write_text(text)
    result = CliRunner().invoke(main, ["e2e", "--reap", str(tmp_path / "out")])
    assert result.exit_code == 1
    (line,) = result.output.strip().splitlines()
    assert line.startswith(f"Error: {tmp_path / 'out' / reap.RECORD}: not a record of processes")
    assert line.endswith("end them by hand and delete it")


def test_a_closed_run_leaves_no_record(tmp_path: Path) -> None:
    (tmp_path / "server.py").write_text(SERVER)
    with Processes(tmp_path / "logs", grace=1, poll=0.1) as procs:
        p = procs.start("decode", [sys.executable, tmp_path / "server.py", "", "x"])
        _wait("the members", lambda: len(json.loads(
            (tmp_path / "logs" / reap.RECORD).read_text())["processes"][0]["members"]) == 2)
        doc = json.loads((tmp_path / "logs" / reap.RECORD).read_text())
        assert doc["boot_id"] == proc.boot_id()
        assert doc["processes"][0]["pgid"] == p.pid
        assert doc["processes"][0]["start_time"] == proc.identity(p.pid).start_time
    assert not (tmp_path / "logs" / reap.RECORD).exists()
    assert os.listdir(tmp_path / "logs") == ["decode.log"]


def test_e2e_needs_pin_unless_it_reaps(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["e2e", "--tiny"])
    assert result.exit_code == 2 and "Missing option '--pin'" in result.output
