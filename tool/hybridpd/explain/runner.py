"""Run ``explain``'s driver on a pin's stock tree and its patched tree, side by side,
in the pin's test environment."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from hybridpd import cache, proc
from hybridpd.e2e import qwen35
from hybridpd.errors import HybridpdError
from hybridpd.explain import driver as driver_mod
from hybridpd.explain import model as model_mod
from hybridpd.explain import risks as risks_mod
from hybridpd.progress import Log, quiet
from hybridpd.proof import testrun
from hybridpd.proof.pytestrun import cpu_metadata_overlay, pytest_env
from hybridpd.series import releasetree
from hybridpd.series.model import Pin, Series

#: The trees the driver runs on, in the order they are reported.
SIDES = ("stock", "patched")
#: The script run in the pin's environment.
DRIVER = Path(driver_mod.__file__)


class ExplainError(HybridpdError):
    """explain could not run (the answers themselves are never errors)."""


@dataclass(frozen=True)
class ExplainOptions:
    """The deployment asked about: the model, its KV connector set, and the serve
    flags that change the hybrid KV cache."""

    model: str
    kv_transfer_config: dict | None = None
    block_size: int | None = None
    mamba_cache_mode: str | None = None
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True
    disable_hybrid_kv_cache_manager: bool = False
    max_model_len: int = 8192
    #: vLLM's --tensor-parallel-size: the groups and the pool are one rank's (rank 0).
    tensor_parallel_size: int = 1
    #: Matched against the known risks only (question 5) where no
    #: ``speculative_config`` is given.
    num_speculative_tokens: int = 0
    #: vLLM's --speculative-config: the engine, its KV cache and its scheduler are built
    #: with it (and its ``num_speculative_tokens`` is matched against the risks).
    speculative_config: dict | None = None
    #: The LMCache release the deployment runs: the LMCache series' fixes are that
    #: release's records (None: the series' default pin, the test environment's).
    lmcache_version: str | None = None
    #: The KV cache memory the engine core sizes the pool for (it sets num_blocks only).
    kv_cache_gib: float = 16.0
    #: Seconds each driver may take (one vLLM import is 25-40 s on 2 busy cores).
    timeout: float = 300.0

    def engine_args(self) -> dict:
        args = {"enable_prefix_caching": self.enable_prefix_caching,
                "max_model_len": self.max_model_len}
        optional = {"block_size": self.block_size,
                    "mamba_cache_mode": self.mamba_cache_mode,
                    "max_num_batched_tokens": self.max_num_batched_tokens}
        args.update({k: v for k, v in optional.items() if v is not None})
        if self.disable_hybrid_kv_cache_manager:
            args["disable_hybrid_kv_cache_manager"] = True
        if self.tensor_parallel_size != 1:
            args["tensor_parallel_size"] = self.tensor_parallel_size
        if self.speculative_config is not None:
            args["speculative_config"] = dict(self.speculative_config)
        return args

    def speculative_tokens(self) -> int:
        """The speculative tokens the deployment runs (for the risks)."""
        if self.speculative_config is not None:
            n = self.speculative_config.get("num_speculative_tokens")
            return n if isinstance(n, int) and not isinstance(n, bool) else 0
        return self.num_speculative_tokens


@dataclass
class Explained:
    pin: Pin
    model: str
    kv_transfer_config: dict | None
    note: str | None
    answers: dict[str, dict] = field(default_factory=dict)
    seconds: float = 0.0
    logs: dict[str, str] = field(default_factory=dict)
    #: Question 5: the records' risks that apply (:func:`.risks.assess`).
    risks: list[dict] = field(default_factory=list)

    def unanswered(self) -> list[str]:
        """The sides whose driver did not answer every step it reached: it died, or
        stopped at the time limit (a refusal by vLLM is an answer)."""
        return [side for side in SIDES if _incomplete(self.answers.get(side, {}))]

    def require_answers(self) -> None:
        """Raise :class:`Unanswered` where a side did not answer (once shown: what
        was answered stands, but the run failed)."""
        if missing := self.unanswered():
            names = {"stock": "the stock release", "patched": "the release with the series"}
            raise Unanswered(f"no complete answer from {' or '.join(names[s] for s in missing)}"
                             f" (stopped at --timeout or died; logs: "
                             f"{', '.join(self.logs.get(s, '?') for s in missing)})")

    def to_json(self) -> dict:
        return {"version": self.pin.version, "model": self.model,
                "kv_transfer_config": self.kv_transfer_config, "note": self.note,
                "answers": self.answers, "risks": self.risks,
                "seconds": round(self.seconds, 1), "logs": self.logs}


def _incomplete(answer: dict) -> bool:
    return "failed" in answer or not answer or any(
        "timeout" in step or "exited" in step for step in answer.get("steps", {}).values())


class Unanswered(ExplainError):
    """A side of ``explain`` gave no complete answer (after the answers were shown)."""


def explain(series: Series, pin: Pin, opts: ExplainOptions, log: Log = quiet) -> Explained:
    """One deployment on ``pin``, stock and with the series."""
    return explain_cases(series, pin, [opts], log)[0]


def explain_cases(series: Series, pin: Pin, cases: list[ExplainOptions],
                  log: Log = quiet) -> list[Explained]:
    """Several deployments on ``pin``, answered in one driver per tree (one vLLM
    import each), the two trees side by side; ``cases[0].timeout`` bounds each driver."""
    if not pin.ported:
        raise ExplainError(f"{pin.version} is pinned but not ported yet: nothing to compare "
                           f"stock with (hybridpd port --to {pin.version} first)")
    started = time.monotonic()
    root = cache.cache_dir() / "explain" / series.slug(pin)
    requests, notes = [], []
    for opts in cases:
        config_dir = model_mod.resolve(opts.model)
        notes.append(model_mod.text_only(config_dir))
        requests.append({"model": str(config_dir), "kv_transfer_config": opts.kv_transfer_config,
                         "engine_args": opts.engine_args(), "text_only": notes[-1] is not None,
                         "kv_cache_bytes": int(opts.kv_cache_gib * (1 << 30)),
                         "patch_tests": str(testrun.patch_tests_dir(series))})
    trees = {side: root / side for side in SIDES}
    for side, tree in trees.items():
        releasetree.prepare(series, pin, tree, patched=side == "patched", log=log)
    venv, layers = testrun.pin_environment(series, pin, trees["stock"], root, log)
    log(f"explain: vLLM {pin.version}, stock and with the series, side by side")
    answers, logs = _run_side_by_side(venv, trees, _site(root), layers, root,
                                      {"cases": requests}, cases[0].timeout)
    seconds = time.monotonic() - started
    out = []
    for n, (opts, note) in enumerate(zip(cases, notes)):
        said = {side: answers[side][n] for side in SIDES}
        out.append(Explained(
            pin, opts.model, opts.kv_transfer_config, note, said, seconds, logs,
            risks_mod.assess(series, pin, opts.kv_transfer_config,
                             opts.speculative_tokens(), said,
                             {"lmcache": opts.lmcache_version} if opts.lmcache_version
                             else None)))
    return out


def _site(root: Path) -> Path:
    """A directory whose ``sitecustomize`` makes vLLM's Qwen3.5 module import without
    torchvision in every process the driver starts (:mod:`hybridpd.e2e.qwen35`)."""
    site = root / "site"
    site.mkdir(parents=True, exist_ok=True)
    hook = site / "sitecustomize.py"
    if not hook.is_file() or hook.read_text() != qwen35._HOOK:
        hook.write_text(qwen35._HOOK)
    return site


def _run_side_by_side(venv: Path, trees: dict[str, Path], site: Path, layers, root: Path,
                      request: dict, timeout: float) -> tuple[dict, dict]:
    logs_dir = root / "logs"
    logs_dir.mkdir(parents=True, exist_ok=True)
    children, logs = {}, {}
    for side, tree in trees.items():
        overlay = cpu_metadata_overlay(tree, root / f"{side}.vllm-meta")
        env = pytest_env(venv, tree, root / "hf", overlay=overlay, layers=layers)
        env["PYTHONPATH"] = f"{site}:{env['PYTHONPATH']}"
        env["PYTHONPYCACHEPREFIX"] = str(root / "pycache")
        logs[side] = str(logs_dir / f"{side}.log")
        Path(logs[side]).unlink(missing_ok=True)
        children[side] = proc.start(
            [venv / "bin" / "python", DRIVER, json.dumps(request)],
            Path(logs[side]), cwd=tree, env=env)
    deadline = time.monotonic() + timeout
    answers = {}
    try:
        for side, child in children.items():
            code = proc.wait(child, max(0.0, deadline - time.monotonic()))
            answers[side] = _answers(Path(logs[side]), code, timeout,
                                     len(request["cases"]))
    finally:
        for child in children.values():
            proc.stop(child)  # also what a finished driver left in its group
    return answers, logs


def _answers(log_file: Path, code: int | None, timeout: float, cases: int) -> list[dict]:
    """Each case's answer from a driver's log: its final line, or, for a driver stopped
    at its time limit or dead before it answered, the steps each case had answered and
    what ended the one it was in."""
    text = log_file.read_text(errors="replace") if log_file.is_file() else ""
    final, steps, running = None, [{} for _ in range(cases)], None
    for line in text.splitlines():
        try:
            if line.startswith(driver_mod.STEP + " "):
                said = json.loads(line[len(driver_mod.STEP) + 1:])
                if "running" in said:
                    running = (said["case"], said["running"])
                else:
                    steps[said["case"]][said["done"]] = said["answer"]
                    running = None
            elif line.startswith(driver_mod.MARKER + " "):
                final = json.loads(line[len(driver_mod.MARKER) + 1:])
        except (ValueError, KeyError, IndexError, TypeError):
            continue  # a line cut short by a kill: what came before it stands
    if final is not None:
        return final
    if running is not None:
        case, step = running
        steps[case][step] = ({"timeout": timeout, "log": str(log_file)} if code is None
                             else {"exited": code, "log": str(log_file)})
    return [{"steps": s} if s else {"failed": _why(text, code, timeout, log_file)}
            for s in steps]


def _why(text: str, code: int | None, timeout: float, log_file: Path) -> str:
    if code is None:
        reason = f"no answer within {timeout:.0f} s"
    else:
        tail = [l for l in text.splitlines() if l.strip()][-1:] or ["(no output)"]
        reason = f"the driver exited with {code} without an answer: {tail[0][:300]}"
    return f"{reason}; log {log_file}"
