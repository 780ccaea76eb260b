"""``hybridpd run-bundle DIR``: the prepared check a bundle runs on a host with no index.

What ``run.sh`` (:mod:`hybridpd.envs.runkit`) hands over to, in the unpacked bundle:

1. ``patched``: the bundle installed offline into ``venvs/patched`` and proven
   (:func:`hybridpd.envs.wheelhouse.install`); where the bundle left torchvision out (a
   CPU bundle), vLLM's Qwen3.5 module is made to import without it, as in the e2e's own
   CPU venvs (:mod:`hybridpd.e2e.qwen35`), so the bundle's Qwen3.5 models are served;
2. ``stock``: the same wheels without the patched files into ``venvs/stock``, proven to
   import the release's own files (the e2e's OFF column; skipped with ``--no-stock``);
3. ``models``: the bundle's tiny seeded models copied to where the e2e looks for them
   (``e2e/models`` under hybridpd's cache) and checked against their manifests;
4. one e2e per scenario (smoke, correctness), patched against stock, into
   ``OUT/<scenario>`` (:func:`hybridpd.e2e.run.run`, the front hybridpd's own proxy,
   which needs nothing beyond the standard library); with ``dry_run``, the server
   command lines it would start instead.

Each step's time, outcome and details go to ``OUT/report.json`` and ``OUT/report.md``,
written after every step, so a failure leaves the report of what ran; the failure is
then one line (:class:`OfflineRunError`).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from pathlib import Path
from typing import Callable

from hybridpd import cache
from hybridpd.e2e import qwen35
from hybridpd.e2e import run as run_mod
from hybridpd.e2e import tinymodel
from hybridpd.envs import wheelhouse
from hybridpd.errors import HybridpdError, Interrupted, UsageError
from hybridpd.progress import Log, quiet
from hybridpd.series.model import Series

SCENARIOS = ("smoke", "correctness")
DEVICES = ("cuda", "cpu")


class OfflineRunError(HybridpdError):
    """A step of the prepared check failed; one line (the report says the rest)."""


@dataclasses.dataclass(frozen=True)
class RunOptions:
    bundle: Path
    out: Path
    python: str | None = None  # the host interpreter; None: this one
    device: str | None = None  # None: cuda for a CUDA bundle, else cpu
    gpus: str = "0"
    scenarios: tuple[str, ...] = SCENARIOS
    stock: bool = True
    dry_run: bool = False
    ready_timeout: float | None = None


@dataclasses.dataclass
class Step:
    name: str
    status: str = "running"  # ok, failed
    seconds: float = 0.0
    detail: dict = dataclasses.field(default_factory=dict)
    error: str | None = None


def copy_models(payload: Path, models: list[str], root: Path) -> list[Path]:
    """The bundle's tiny models into ``root`` (the e2e's model cache), checked."""
    for name in models:
        src, dest = payload / "models" / name, root / name
        if not dest.is_dir():
            tmp = root / f".{name}.tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.copytree(src, tmp)
            tmp.rename(dest)
    return tinymodel.cached_models(root) if models else []


def e2e_options(o: RunOptions, series: Series, manifest: dict, scenario: str,
                venvs: Path) -> run_mod.E2EOptions:
    """The e2e of one scenario: the bundle's pin, its tiny model, patched against stock."""
    device = o.device or ("cuda" if manifest["variant"] == "cuda" else "cpu")
    kwargs = {} if o.ready_timeout is None else {"ready_timeout": o.ready_timeout}
    return run_mod.E2EOptions(
        pin=series.pin(manifest["pin"]), device=device, tiny=True, scenario=scenario,
        compare="stock" if o.stock else None, patched_venv=venvs / "patched",
        stock_venv=venvs / "stock" if o.stock else None, gpus=o.gpus, front="proxy",
        out_dir=o.out / scenario, expect_patched_hit=scenario == "smoke", **kwargs,
    )


def check_options(o: RunOptions) -> None:
    if o.device is not None and o.device not in DEVICES:
        raise UsageError(f"--device {o.device}: choose {' or '.join(DEVICES)}")
    bad = [s for s in o.scenarios if s not in SCENARIOS]
    if bad or not o.scenarios:
        raise UsageError(f"--scenario takes {' or '.join(SCENARIOS)}, not {', '.join(bad) or 'none'}")


def run_bundle(
    series: Series, o: RunOptions, log: Log = quiet,
    e2e: Callable[..., run_mod.E2EResult] = run_mod.run,
    dry_run: Callable[..., list[str]] = run_mod.dry_run,
) -> dict:
    """Run the prepared check (module docstring); the report. OfflineRunError after the
    report is written when a step fails."""
    check_options(o)
    bundle = Path(o.bundle).absolute()
    manifest = wheelhouse.load(bundle)
    out = Path(o.out).absolute()
    o = dataclasses.replace(o, bundle=bundle, out=out)
    out.mkdir(parents=True, exist_ok=True)
    venvs = bundle / "venvs"
    report = {"bundle": str(bundle), "out": str(out), "pin": manifest["pin"], "variant": manifest["variant"],
              "distribution": manifest["distribution"], "dry_run": o.dry_run,
              "device": o.device or ("cuda" if manifest["variant"] == "cuda" else "cpu"),
              "gpus": o.gpus, "steps": [], "ok": False}
    started = time.monotonic()

    def step(name: str, body: Callable[[Step], None]) -> None:
        s = Step(name)
        report["steps"].append(s)
        log(f"== {name}")
        t0 = time.monotonic()
        try:
            body(s)
            s.status = "ok"
        except Interrupted:
            s.status = "interrupted"
            raise
        except HybridpdError as exc:
            s.status, s.error = "failed", str(exc)
            raise OfflineRunError(f"{name}: {exc} (report: {out / 'report.md'})") from None
        finally:
            s.seconds = round(time.monotonic() - t0, 1)
            report["seconds"] = round(time.monotonic() - started, 1)
            write_report(out, report)

    def install(stock: bool) -> Callable[[Step], None]:
        def body(s: Step) -> None:
            result = wheelhouse.install(bundle, venvs / ("stock" if stock else "patched"),
                                        python=o.python, stock=stock, log=log)
            s.detail = result.to_json()
            if "torchvision" in (manifest.get("dropped") or ()):
                s.detail["qwen35_alias"] = str(qwen35.install(result.python))
        return body

    def models(s: Step) -> None:
        found = copy_models(bundle / "payload", manifest.get("models") or [],
                            cache.cache_dir() / "e2e" / "models")
        s.detail = {"models": [p.name for p in found], "root": str(cache.cache_dir() / "e2e" / "models")}

    def scenario(name: str) -> Callable[[Step], None]:
        def body(s: Step) -> None:
            options = e2e_options(o, series, manifest, name, venvs)
            (out / name).mkdir(parents=True, exist_ok=True)
            if o.dry_run:
                lines = dry_run(series, options, log)
                (out / name / "dry-run.txt").write_text("\n".join(lines) + "\n")
                s.detail = {"out": str(out / name), "commands": lines}
                return
            result = e2e(series, options, _command(options), log)
            s.detail = {"out": str(out / name), "report": str(result.paths.get("json", "")),
                        "failures": result.failures}
            if result.failures:
                raise OfflineRunError(f"{len(result.failures)} check(s) failed: "
                                      f"{result.failures[0]}")
        return body

    step("patched", install(stock=False))
    if o.stock:
        step("stock", install(stock=True))
    step("models", models)
    for name in o.scenarios:
        step(f"e2e {name}" + (" (dry run)" if o.dry_run else ""), scenario(name))
    report["ok"] = True
    write_report(out, report)
    return report


def _command(o: run_mod.E2EOptions) -> list[str]:
    """The e2e's command line, as the report records it."""
    argv = ["hybridpd", "e2e", "--pin", o.pin.version, "--device", o.device, "--tiny",
            "--scenario", o.scenario, "--front", o.front, "--gpus", o.gpus,
            "--patched-venv", str(o.patched_venv)]
    if o.compare:
        argv += ["--compare", o.compare, "--stock-venv", str(o.stock_venv)]
    if o.expect_patched_hit:
        argv.append("--expect-patched-hit")
    return argv


def _json(report: dict) -> dict:
    return {**report, "steps": [dataclasses.asdict(s) for s in report["steps"]]}


def write_report(out: Path, report: dict) -> None:
    data = _json(report)
    (out / "report.json").write_text(json.dumps(data, indent=2) + "\n")
    lines = [f"# Offline run of {data['distribution']} {data['pin']} ({data['variant']} bundle)",
             "", f"Device {data['device']}" + (f", GPUs {data['gpus']}" if data["device"] == "cuda"
                                                else "")
             + (", dry run (server command lines only)" if data["dry_run"] else "")
             + f"; {'ok' if data['ok'] else 'not ok'} in {data.get('seconds', 0)} s.", "",
             "| step | status | seconds | |", "|---|---|---|---|"]
    for s in data["steps"]:
        detail = s["error"] or ""
        if not detail and "proof" in s["detail"]:
            proof = s["detail"]["proof"]
            detail = (f"{len(proof.get('files', []))} file(s) proven, nixl {proof.get('nixl')}, "
                      f"compiled ops {proof.get('compiled_ops')}")
        elif not detail and "report" in s["detail"]:
            detail = f"{s['detail']['report']}"
        elif not detail and "commands" in s["detail"]:
            detail = f"{s['detail']['out']}/dry-run.txt"
        elif not detail and "models" in s["detail"]:
            detail = ", ".join(s["detail"]["models"]) or "none in the bundle"
        lines.append(f"| {s['name']} | {s['status']} | {s['seconds']} | {detail} |")
    (out / "report.md").write_text("\n".join(lines) + "\n")
