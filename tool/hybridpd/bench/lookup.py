"""``hybridpd bench lookup``: what the series costs in the hit computation.

Both builds of a pin run ``lookup_worker.py`` at once, each in its own process, idle
between samples; samples alternate (stock, patched, then patched, stock, ...), so
a slow moment of the machine lands on both. Each round gives one ratio
patched/stock per path; the report gives their median, quartiles and range.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridpd import proc
from hybridpd.bench.env import BUILDS, BenchEnv, BenchError, prepared
from hybridpd.bench.replay import CONNECTORS
from hybridpd.errors import UsageError
from hybridpd.progress import Log, quiet
from hybridpd.series.model import Pin, Series

WORKER = Path(__file__).with_name("lookup_worker.py")
PATHS = ("decode", "plain")
#: Seconds a worker may take to import vLLM and build its instance.
READY_TIMEOUT = 600.0


@dataclass
class LookupOptions:
    pin: Pin
    connector: str = "nixl"
    prompt_len: int = 17408
    block_size: int = 1152
    calls: int = 2000
    repeats: int = 15


class _Worker:
    """One build's worker: started, fed a line per sample, read from its log."""

    def __init__(self, env: BenchEnv, build: str, spec: dict[str, Any]) -> None:
        self.build = build
        self.log = env.root / f"{build}-lookup.log"
        self.log.unlink(missing_ok=True)
        spec_path = env.root / f"{build}-lookup.spec.json"
        spec_path.write_text(json.dumps(spec))
        self.child: proc.Child = proc.start(
            [env.python(), WORKER, spec_path], self.log, cwd=env.root, env=env.env(build), stdin=True
        )
        self.seen = 0

    def next_line(self, key: str, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            with self.log.open("rb") as fh:
                fh.seek(self.seen)
                data = fh.read()
            end = data.rfind(b"\n") + 1
            for line in data[:end].splitlines():
                self.seen += len(line) + 1
                try:
                    doc = json.loads(line) if line.startswith(b"{") else {}
                except ValueError:
                    continue
                if key in doc:
                    return doc
            if self.child.poll() is not None or time.monotonic() > deadline:
                raise BenchError(f"lookup worker ({self.build}) stopped answering; log {self.log}")
            time.sleep(0.01)

    def sample(self) -> dict[str, float]:
        assert self.child.stdin is not None
        self.child.stdin.write(b"\n")
        self.child.stdin.flush()
        return self.next_line("sample", READY_TIMEOUT)["sample"]

    def close(self, wait: float) -> None:
        """End the worker: close its stdin (it exits), give it ``wait`` s, then stop
        its process group."""
        try:
            if self.child.stdin:
                self.child.stdin.close()
        except OSError:
            pass
        if proc.wait(self.child, wait) is None:
            proc.stop(self.child)


def _spread(values: list[float]) -> dict[str, float]:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return {"median": round(statistics.median(values), 4), "q1": round(q[0], 4),
            "q3": round(q[2], 4), "min": round(min(values), 4), "max": round(max(values), 4)}


@dataclass(frozen=True)
class LookupReport:
    """``hybridpd bench lookup``: per build, the lookup's median ns per call and the hit
    it found on each path; per path, the patched/stock ratio's spread."""

    pin: str
    connector: str
    stock_build: str
    prompt_len: int
    block_size: int
    calls_per_sample: int
    repeats: int
    timed: dict[str, str]  # build -> the function timed
    hit_tokens: dict[str, dict[str, int]]  # build -> path -> tokens
    ns_per_call: dict[str, dict[str, float]]  # build -> path -> median
    ratio_patched_over_stock: dict[str, dict[str, float]]  # path -> median, q1, q3, min, max

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def run(series: Series, options: LookupOptions, log: Log = quiet) -> LookupReport:
    if options.connector not in CONNECTORS:
        raise UsageError(f"unknown connector set {options.connector}")
    if options.repeats < 1 or options.calls < 1:
        raise UsageError("--repeats and --calls must be at least 1")
    with prepared(series, options.pin, log) as env:
        stock_build = f"v{options.pin.version}" + "".join(f" + {p}" for p in env.baseline)
        spec = {"builders_dir": str(env.builders_dir), "connector": options.connector,
                "prompt_len": options.prompt_len, "block_size": options.block_size,
                "calls": options.calls}
        workers: dict[str, _Worker] = {}
        wait = 10.0  # a clean end: the workers exit when their stdin closes
        try:
            for build in BUILDS:
                workers[build] = _Worker(env, build, spec)
            log(f"lookup: starting both builds of {options.pin.version}")
            ready = {b: w.next_line("ready", READY_TIMEOUT) for b, w in workers.items()}
            samples: dict[str, list[dict[str, float]]] = {b: [] for b in BUILDS}
            for i in range(options.repeats):
                for build in BUILDS if i % 2 == 0 else BUILDS[::-1]:
                    samples[build].append(workers[build].sample())
                log(f"lookup: sample {i + 1}/{options.repeats}")
        except BaseException:
            wait = 0.0  # failed or interrupted: stop them now
            raise
        finally:
            for w in workers.values():
                try:
                    w.close(wait)
                except BaseException:  # a second interrupt still stops the others
                    proc.stop(w.child)
    ratios = {
        path: [p[path] / s[path] for s, p in zip(samples["stock"], samples["patched"])]
        for path in PATHS
    }
    return LookupReport(
        pin=options.pin.version,
        connector=options.connector,
        stock_build=stock_build,
        prompt_len=options.prompt_len,
        block_size=options.block_size,
        calls_per_sample=options.calls,
        repeats=options.repeats,
        timed={b: ready[b]["timed"] for b in BUILDS},
        hit_tokens={b: ready[b]["hits"] for b in BUILDS},
        ns_per_call={
            b: {path: round(statistics.median(s[path] for s in samples[b]), 1) for path in PATHS}
            for b in BUILDS
        },
        ratio_patched_over_stock={path: _spread(ratios[path]) for path in PATHS},
    )


def table(report: LookupReport) -> str:
    lines = [
        f"{report.pin}, {report.connector}: {report.timed['patched']} on a "
        f"{report.prompt_len}-token prompt, blocks of {report.block_size}, "
        f"{report.repeats} x {report.calls_per_sample} calls per build; "
        f"stock: {report.stock_build}",
        f"{'path':8} {'stock ns':>10} {'patched ns':>11} {'stock hit':>10} {'patched hit':>12} "
        f"{'ratio (median [q1, q3], range)':>34}",
    ]
    for path in PATHS:
        r = report.ratio_patched_over_stock[path]
        lines.append(
            f"{path:8} {report.ns_per_call['stock'][path]:>10,.0f} "
            f"{report.ns_per_call['patched'][path]:>11,.0f} "
            f"{report.hit_tokens['stock'][path]:>10,} {report.hit_tokens['patched'][path]:>12,} "
            f"{r['median']:>8.3f} [{r['q1']:.3f}, {r['q3']:.3f}], {r['min']:.3f}-{r['max']:.3f}"
        )
    return "\n".join(lines)
