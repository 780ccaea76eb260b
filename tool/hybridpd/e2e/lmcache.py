"""LMCache in an e2e run: the patched lmcache in the venv, and one server per instance.

The decode instance of an LMCache connector set (``nixl+lmcache``, ``lmcache+nixl``)
runs ``MultiConnector`` over NIXL and ``LMCacheMPConnector`` and talks to its own
``lmcache server`` on loopback, as LMCache's disaggregated-prefill and hybrid-model
guides describe; the prefill instance stays on NIXL alone, so that the single-instance
reference it computes is cold.

- lmcache goes only into e2e venvs hybridpd builds, never into a user's environment: a
  wheel built here from the LMCache series' verified sdist (``patches/lmcache`` beside
  the vLLM series), patched (or with one patch left out, for the gate that must go
  red), with lmcache's no-GPU-extension build (``NO_GPU_EXT=1``): that wheel needs
  neither cupy nor cuda-python, whose CUDA 13 packages made NIXL look for its CUDA 13
  variant. The wheel is cached by the tree it was built from.
- the server is one more process of the run (:class:`.servers.Processes`): its own
  process group, its log beside the vLLM logs, ready when its HTTP ``/status``
  answers, reaped with the run. LMCache's shared-memory segments
  (``/dev/shm/lmcache_kv_<pid>_*``, made by the vLLM worker that registers its KV cache)
  are named in the decode instance's record, so they are removed with it, also after
  a SIGKILLed run.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Sequence
from pathlib import Path

from hybridpd import cache, connectors, gitops, proc
from hybridpd.e2e.servers import E2EError, Processes, new_lines
from hybridpd.errors import HybridpdError
from hybridpd.progress import Log
from hybridpd.series.apply import patch_commits
from hybridpd.series.model import Pin, Series
from hybridpd.series.model import load as load_series

#: LMCache's chunk: vLLM raises the tiny hybrid model's block size to 256 on CPU, and
#: LMCache's chunk must be a multiple of it.
CHUNK_SIZE = 256
#: What each ``lmcache server`` gets: LMCache's defaults otherwise (one object per
#: chunk for attention and Mamba together, no --separate-object-groups).
L1_SIZE_GB = 0.5
#: How long the check waits for the lmcache server's removal of the stopped decode
#: instance's segments (its watcher polls once a second).
SEGMENTS_TIMEOUT = 10.0
#: The shared-memory files a vLLM instance registered with LMCache may leave (a path:
#: the record's globs are matched as they are, and only files in /dev/shm are removed).
SHM_GLOBS = ("/dev/shm/lmcache_kv_{pid}_*",)
#: Seconds between the decode instance's LMCache heartbeat pings, and each ping's
#: timeout (see :func:`connector_config`).
HEARTBEAT_INTERVAL = 30.0
#: lmcache's ``[build-system] requires`` (its sdist's pyproject.toml) but torch, which
#: the venv already holds as the CPU build: a build without isolation uses them.
BUILD_REQUIREMENTS = (
    "ninja", "packaging>=24.2", "setuptools>=77.0.3,<81.0.0", "setuptools_scm>=8",
    "grpcio==1.78.0", "grpcio-tools==1.78.0", "wheel",
)


def uses_lmcache(connector: str) -> bool:
    """Whether the decode instance's set ``connector`` has an LMCacheMPConnector."""
    return connectors.uses(connector, "LMCacheMPConnector")


class RetrievedTokens:
    """The tokens an ``lmcache server`` loaded into vLLM, read from its log.

    vLLM counts one external hit per request, whichever MultiConnector child served it,
    and both NixlConnector and LMCacheMPConnector report it as an unspecified source; the
    server logs each load (``Retrieved N tokens in S seconds``), so LMCache's share is
    counted there. :meth:`take` returns the tokens of the loads logged since the last
    call (whole lines only).
    """

    LINE = re.compile(r"Retrieved (\d+) tokens in ")

    def __init__(self, log: Path):
        self.log = Path(log)
        self.offset = self.log.stat().st_size if self.log.exists() else 0

    def take(self) -> int:
        text, self.offset = new_lines(self.log, self.offset)
        return sum(int(n) for n in self.LINE.findall(text))


class Trouble:
    """The lines of the decode instance's and its server's logs that say LMCache could
    not serve: the vLLM-side adapter's degraded mode (a heartbeat ping or a lookup
    that timed out: it then skips every store and lookup until a ping succeeds), a
    registration the server reaped, errors. :meth:`take` returns those logged since
    the last call (whole lines, colour codes removed), so that a request LMCache did
    not serve is reported with the reason its logs give."""

    LINE = re.compile(r"unhealthy|healthy again|timed out|Reaped|ERROR|Traceback")
    COLOUR = re.compile(r"\x1b\[[0-9;]*m")

    def __init__(self, *logs: Path):
        self.offsets = {Path(log): (Path(log).stat().st_size if Path(log).exists() else 0)
                        for log in logs}

    def take(self) -> list[str]:
        found = []
        for log, offset in self.offsets.items():
            text, self.offsets[log] = new_lines(log, offset)
            for line in text.splitlines():
                line = self.COLOUR.sub("", line).strip()
                if self.LINE.search(line):
                    found.append(f"{log.name}: {line[:300]}")
        return found


def segments_after_stop(procs: Processes, log: Log) -> dict:
    """Stop the decode instance, then its ``lmcache server``, and say which of the
    decode worker's shared-memory segments the server left behind.

    vLLM stopped with SIGTERM cannot unlink the segments its worker shares its KV cache
    through (its API server kills the worker within the same second); the LMCache series'
    ``cpu-shm-exited-worker-segments`` makes the server remove those of an exited worker
    when it releases the registration, here when it stops. hybridpd removes whatever is
    left when the run closes (the decode instance's record names the segments), so this
    is the only place the patch's own work shows: the check runs before that removal.
    vLLM unregisters its KV cache as it stops, from its still-running worker, so the
    server removes the segments once that worker has exited (possibly before the
    decode instance's stop returns): the segments are counted while it serves, and the
    count of those left waits up to ``SEGMENTS_TIMEOUT`` seconds.
    """
    registered = sorted(p.name for p in procs.shm_files("decode"))
    procs.stop("decode", keep_shm=True)
    # The server maps the segments: a plain stop would remove them as its own.
    procs.stop("lmcache", keep_shm=True)
    deadline = time.monotonic() + SEGMENTS_TIMEOUT
    while (left := sorted(p.name for p in procs.shm_files("decode"))) and (
            time.monotonic() < deadline):
        time.sleep(0.2)
    log(f"  shared-memory segments of the decode instance: {len(registered)} while it "
        f"served, {len(left)} left once vLLM and its lmcache server stopped")
    return {"decode_shm_segments_while_serving": len(registered),
            "decode_shm_segments_left_by_lmcache": left,
            # None registered would prove nothing: the decode instance shares its KV
            # cache with the server through them.
            "check": bool(registered) and not left}


def lmcache_series(vllm_series: Series) -> Series:
    """The LMCache series beside the vLLM one (``patches/lmcache/series.toml``)."""
    path = vllm_series.dir / "lmcache" / "series.toml"
    if not path.is_file():
        raise E2EError(f"no LMCache series at {path}")
    return load_series(path)


def source(series: Series, src: Path, without: Sequence[str], log: Log) -> str:
    """Make ``src`` the patched LMCache tree (minus the patches ``without``); its tree
    hash."""
    from hybridpd.series import releasetree

    pin = series.default
    for patch_id in without:
        if series.patch(patch_id) is None:
            raise E2EError(f"--lmcache-without {patch_id}: no such patch in the LMCache series")
    try:
        releasetree.prepare(series, pin, src, patched=True, log=log)
    except HybridpdError as exc:
        raise E2EError(f"cannot make the patched LMCache {pin.version}: {exc.message}") from None
    commits = dict(patch_commits(src, pin))
    for patch_id in without:
        if patch_id not in commits:
            raise E2EError(f"--lmcache-without {patch_id}: the patch is not applied in {src}")
    # Latest first: a later patch may change the lines of an earlier one.
    for patch_id in reversed([p for p in commits if p in without]):
        log(f"leaving {patch_id} out of LMCache {pin.version}")
        done = gitops.run(src, "revert", "--no-edit", commits[patch_id].sha)
        if not done.ok:
            gitops.run(src, "revert", "--abort")
            raise E2EError(
                f"cannot leave {patch_id} out of LMCache: "
                f"{gitops.first_error_line(done.stderr)}"
            )
    return gitops.check(src, "rev-parse", "HEAD^{tree}").strip()


def wheel(python: Path, src: Path, tree: str, pin: Pin, log: Log) -> Path:
    """lmcache's CPU wheel of ``src`` (the tree of ``pin``, cached by ``tree``), built
    with ``python``."""
    out = cache.cache_dir() / "wheels" / "lmcache" / tree[:16]
    found = sorted(out.glob("lmcache-*.whl")) if out.is_dir() else []
    if found:
        return found[0]
    log(f"building lmcache's CPU wheel (NO_GPU_EXT=1) from {src}")
    pip = [str(python), "-m", "pip"]
    done = proc.run([*pip, "install", "-q", *BUILD_REQUIREMENTS])
    if not done.ok:
        raise E2EError(f"pip could not install lmcache's build requirements: {done.tail()}")
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    env = {
        **os.environ,
        "NO_GPU_EXT": "1",
        # The version of the release, not one setuptools_scm derives from our commits.
        "SETUPTOOLS_SCM_PRETEND_VERSION": f"{pin.version}+hybridpd",
    }
    built = proc.run(
        [*pip, "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp), str(src)],
        env=env,
    )
    if not built.ok or not list(tmp.glob("lmcache-*.whl")):
        raise E2EError(f"building lmcache's wheel from {src} failed: {built.tail()}")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return sorted(out.glob("lmcache-*.whl"))[0]


def install(python: Path, wheel_path: Path, log: Log) -> None:
    """Install the wheel and its dependencies into the venv of ``python``."""
    log(f"installing {wheel_path.name}")
    pip = [str(python), "-m", "pip", "install", "-q"]
    for done in (
        proc.run([*pip, "--force-reinstall", "--no-deps", str(wheel_path)]),
        proc.run([*pip, str(wheel_path)]),  # its dependencies (some pinned below vLLM's)
    ):
        if not done.ok:
            raise E2EError(f"pip could not install {wheel_path.name} into {python}: {done.tail()}")


def server_command(python: Path, port: int, http_port: int, host: str = "127.0.0.1") -> list[str]:
    """``lmcache server`` on ``host`` (loopback, or the decode instance's simulated
    host's address; it exits without --eviction-policy when given --l1-size-gb). Its
    HTTP server binds loopback unless told (--http-host): the readiness check reaches
    it at ``host`` from outside a simulated host."""
    return [
        str(Path(python).parent / "lmcache"), "server",
        "--host", host, "--port", str(port),
        "--http-host", host, "--http-port", str(http_port),
        "--chunk-size", str(CHUNK_SIZE), "--l1-size-gb", str(L1_SIZE_GB),
        "--eviction-policy", "LRU",
    ]


def connector_config(port: int, role: str, host: str = "127.0.0.1") -> dict:
    """``LMCacheMPConnector``'s child entry of the decode instance's MultiConnector,
    for the server at ``host``:``port``."""
    return {
        "kv_connector": "LMCacheMPConnector",
        "kv_role": role,
        "kv_connector_extra_config": {
            "lmcache.mp.host": f"tcp://{host}",
            "lmcache.mp.port": port,
            # The adapter pings its server every interval and takes a ping unanswered
            # within it for a dead server: degraded, it skips stores and lookups until
            # a ping succeeds. LMCache's 10 s went unanswered on this 2-core machine
            # (3 of 23 local runs, while the prefill instance held both cores); 30 s
            # stays within the server's reap rule (reap timeout, 120 s, >= 3 x it).
            "lmcache.mp.heartbeat_interval": HEARTBEAT_INTERVAL,
        },
    }
