"""vLLM's own unit tests as a regression gate for the patch series.

The claim we prove: on every pin, the patched tree passes every selected upstream test
that the stock tree passes. "Selected" means the test files of ``FULL_SELECTION`` that
exercise what the series touches (scheduler, KV cache manager and coordinator, the
LMCache / Multi / NIXL connectors); ``REDUCED_SELECTION`` is the quick subset for CI.

Two ways to get the stock side:

- run it (:func:`run_upstream` with a ``stock_tree``): one pytest process per tree, all
  files in it (the ~30 s vLLM import is paid once per tree);
- read a committed baseline, ``data/upstream/<version>-stock.json``, recorded once with
  :func:`write_baseline` (how it was produced is stored in it).

Comparison rule (:func:`compare`), by pytest node id:

- a **regression** is a test that passed on stock and did not pass on patched
  (failed, error, skipped, or missing), or a test id present on stock that is missing on
  patched whatever its stock outcome (a vanished test proves nothing);
- a **fix** is a test that did not pass on stock and passes on patched;
- **new** tests exist only on patched; they are listed, not judged.

When the patched run covers fewer files than the stock side, only the stock ids of the
files that ran are compared.
"""

from __future__ import annotations

import dataclasses
import json
import platform
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path

from hybridpd.progress import Log, quiet
from hybridpd.proof import hfsnap
from hybridpd.proof.pytestrun import SuiteResult, run_pytest
from hybridpd.series.model import Pin

BASELINE_DIR = Path(__file__).parents[1] / "data" / "upstream"
BASELINE_SCHEMA = 1

_CORE = (
    "tests/v1/core/test_prefix_caching.py",
    "tests/v1/core/test_kv_cache_utils.py",
    "tests/v1/core/test_single_type_kv_cache_manager.py",
    "tests/v1/core/test_scheduler.py",
)
_MAMBA_ALIGN = ("tests/v1/core/test_mamba_align_chunk_split.py",)  # first in 0.2x; absent in 0.20.2
_CONNECTORS = (
    "tests/v1/kv_connector/unit/test_lmcache_connector.py",
    "tests/v1/kv_connector/unit/test_multi_connector.py",
    "tests/v1/kv_connector/unit/test_nixl_connector.py",
    "tests/v1/kv_connector/unit/test_nixl_connector_hma.py",
)

#: Per pin, every upstream test file the gate runs. A file listed for a pin exists in
#: that pin's sdist (checked by tests/tool/test_upstream.py against the trees when present).
FULL_SELECTION: dict[str, tuple[str, ...]] = {
    "0.20.2": _CORE + _CONNECTORS,
    "0.32.0": _CORE + _MAMBA_ALIGN + _CONNECTORS,
    "0.33.0": _CORE + _MAMBA_ALIGN + _CONNECTORS,
}

#: Quick CI subset: the test files of the code the series patches, minus the big ones.
#: Kept: test_prefix_caching.py (KV cache manager + coordinator, find_longest_cache_hit),
#: test_single_type_kv_cache_manager.py (per-spec managers incl. Mamba), the
#: Mamba-align chunk split where the pin has it (scheduler patch (a)), and the LMCache
#: and Multi connector tests (patches (d), (e)), and test_scheduler.py: every pin carries
#: a patch that changes vllm/v1/core/sched/scheduler.py (the decode-side hit's
#: reconciliation; on v0.20.2 also the admission of external KV). Left out:
#: test_kv_cache_utils.py, test_nixl_connector.py, test_nixl_connector_hma.py (the full
#: gate and the committed baselines cover them). Measured cost on 2 cores: vLLM's
#: autouse cleanup fixture makes every test cost ~0.4 s idle, ~1 s loaded.
REDUCED_SELECTION: dict[str, tuple[str, ...]] = {
    version: tuple(f for f in files if f.endswith((
        "/test_prefix_caching.py",
        "/test_single_type_kv_cache_manager.py",
        "/test_scheduler.py",
        "/test_mamba_align_chunk_split.py",
        "/test_lmcache_connector.py",
        "/test_multi_connector.py",
    )))
    for version, files in FULL_SELECTION.items()
}

#: Models whose config-only snapshots the selected tests need (see hybridpd.proof.hfsnap).
MODELS = (
    "facebook/opt-125m",
    "facebook/opt-350m",
    "Qwen/Qwen3-0.6B",
    "Qwen/Qwen1.5-7B",
    "Qwen/Qwen3-Next-80B-A3B-Instruct",
    "google/gemma-3-1b-it",
    "llava-hf/llava-1.5-7b-hf",
    "meta-llama/Llama-3.2-1B-Instruct",
)


#: Why stock vLLM fails or skips some selected tests on a CPU-only machine without the
#: hub: (substring of the pytest message, cause). First match wins. Used to annotate
#: baselines; a cause is documentation, never a reason to ignore a regression.
KNOWN_CAUSES: tuple[tuple[str, str], ...] = (
    ("LlavaForConditionalGeneration'] failed to be inspected",
     "needs torchvision: llava imports transformers' pixtral image processor, which "
     "imports torchvision; the index serves only CUDA torchvision builds, which do not "
     "import beside CPU torch (operator torchvision::nms does not exist)"),
    ("Couldn't instantiate the backend tokenizer",
     "runs a real LLM: needs the model's weights and tokenizer from the hub"),
    ("WorkerProc initialization failed",
     "runs a real engine on the CPU platform: needs vLLM's compiled CPU extension "
     "(vllm._C: init_cpu_memory_env)"),
    ("does not support ray", "Ray executor is not supported on vLLM's CPU platform"),
    ("Cannot access accelerator device",
     "GPU-only test: calls torch.accelerator (device index / empty_cache) directly"),
    ("not compatible with FP8 KV cache",
     "CPU backend rejects an FP8 KV cache with chunked prefill and prefix caching"),
    ("no attribute 'init_cpu_memory_env'",
     "runs a real engine on the CPU platform: needs vLLM's compiled CPU extension "
     "(vllm._C: init_cpu_memory_env)"),
    ("No module named 'vllm._C'", "needs vLLM's compiled extension (vllm._C)"),
    ("Requires GPU to instantiate LLM", "GPU-only test (says so itself)"),
    ("Async scheduling is not supported by the V1 model runner",
     "assumes the V2 model runner (GPU); vLLM's CPU platform uses V1, which refuses "
     "async scheduling with pipeline parallelism"),
)


def explain(message: str) -> str | None:
    """The known cause of a stock failure message, or None."""
    for needle, cause in KNOWN_CAUSES:
        if needle in message:
            return cause
    return None


def selection(pin: Pin, reduced: bool = False) -> tuple[str, ...]:
    """The test files for ``pin``; KeyError for a pin with no selection."""
    return (REDUCED_SELECTION if reduced else FULL_SELECTION)[pin.version]


def _file_of(test_id: str) -> str:
    return test_id.split("::", 1)[0]


@dataclasses.dataclass
class Comparison:
    """Result of :func:`compare`. ``regressions`` maps id -> (stock, patched outcome)."""

    regressions: dict[str, tuple[str, str]]
    fixes: dict[str, tuple[str, str]]
    new: dict[str, str]
    compared: int

    @property
    def ok(self) -> bool:
        return not self.regressions


def compare(stock: Mapping[str, str], patched: Mapping[str, str],
            files: Iterable[str] | None = None) -> Comparison:
    """Compare outcomes by test id (rule in the module docstring).

    ``files`` restricts the stock ids to those test files (a collection error is
    recorded under the file path itself, so it belongs to its file too).
    """
    if files is not None:
        keep = set(files)
        stock = {k: v for k, v in stock.items() if _file_of(k) in keep}
    regressions: dict[str, tuple[str, str]] = {}
    fixes: dict[str, tuple[str, str]] = {}
    for test_id, before in sorted(stock.items()):
        after = patched.get(test_id, "missing")
        if after == "missing" or (before == "passed" and after != "passed"):
            regressions[test_id] = (before, after)
        elif before != "passed" and after == "passed":
            fixes[test_id] = (before, after)
    new = {k: v for k, v in sorted(patched.items()) if k not in stock}
    return Comparison(regressions, fixes, new, compared=len(stock))


# --- baselines ------------------------------------------------------------------------

def baseline_path(pin: Pin, base_dir: Path = BASELINE_DIR) -> Path:
    return Path(base_dir) / f"{pin.version}-stock.json"


def _portable_command(command: Sequence[str]) -> list[str]:
    """The pytest command without this machine's paths: the venv's ``bin/`` becomes
    ``<venv>/bin/`` and the output directory of ``--junitxml`` becomes ``<out>``."""
    portable = []
    for arg in command:
        if arg.endswith("/bin/pytest"):
            arg = "<venv>/bin/pytest"
        elif arg.startswith("--junitxml="):
            arg = "--junitxml=<out>/" + Path(arg.split("=", 1)[1]).name
        portable.append(arg)
    return portable


def baseline_dict(result: SuiteResult, pin: Pin, files: Sequence[str], *,
                  tree: str, env: Mapping | None = None) -> dict:
    """The JSON document recording a stock run (schema ``BASELINE_SCHEMA``)."""
    per_file = result.per_file_counts()
    return {
        "schema": BASELINE_SCHEMA,
        "vllm_version": pin.version,
        "tree": tree,
        "files": list(files),
        "produced": {
            "by": "hybridpd.proof.upstream.write_baseline",
            "command": _portable_command(result.command),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "wall_seconds": result.wall_seconds,
            "status": result.status,
            "exit_code": result.exit_code,
            "host": {"machine": platform.machine(), "python": platform.python_version()},
            "env": dict(env or {}),
        },
        "counts": result.counts(),
        "per_file": {
            f: {**per_file.get(f, {}), "seconds": result.file_seconds.get(f, 0.0)}
            for f in files
        },
        "outcomes": dict(sorted(result.outcomes.items())),
        # Why each non-passing stock test does not pass (KNOWN_CAUSES, else its message).
        "causes": {
            test_id: explain(result.messages.get(test_id, ""))
            or result.messages.get(test_id, "")
            for test_id, outcome in sorted(result.outcomes.items()) if outcome != "passed"
        },
    }


def write_baseline(result: SuiteResult, pin: Pin, files: Sequence[str], *,
                   tree: str, env: Mapping | None = None,
                   path: Path | None = None) -> Path:
    """Write the stock baseline for ``pin``; returns its path.

    Refuses a run that crashed or timed out: a baseline must list every test.
    """
    if not result.finished:
        raise ValueError(f"refusing to record a {result.status} run: {result.reason}")
    path = Path(path) if path else baseline_path(pin)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = baseline_dict(result, pin, files, tree=tree, env=env)
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path


def load_baseline(pin: Pin, path: Path | None = None) -> dict:
    """Read a baseline; FileNotFoundError when none is committed for ``pin``."""
    return read_baseline(Path(path or baseline_path(pin)))


def read_baseline(path: Path) -> dict:
    """Read the baseline at ``path`` (a stock run's, of the pin its name says)."""
    doc = json.loads(path.read_text())
    if doc.get("schema") != BASELINE_SCHEMA:
        raise ValueError(f"baseline schema {doc.get('schema')} != {BASELINE_SCHEMA}")
    return doc


def compare_to_baseline(patched: SuiteResult, baseline: Mapping,
                        files: Iterable[str] | None = None) -> Comparison:
    """Compare a patched run with a stock baseline (restricted to ``files`` if given)."""
    return compare(baseline["outcomes"], patched.outcomes, files)


# --- running --------------------------------------------------------------------------

@dataclasses.dataclass
class UpstreamReport:
    """Stock vs patched on one pin. ``stock`` is None when a baseline stood in for it."""

    version: str
    files: list[str]
    patched: SuiteResult
    comparison: Comparison
    stock: SuiteResult | None = None
    baseline: Path | None = None

    @property
    def ok(self) -> bool:
        """No regression, and the patched pytest process finished normally."""
        return self.comparison.ok and self.patched.finished


def run_upstream(
    venv: Path,
    stock_tree: Path | None,
    patched_tree: Path,
    files: Sequence[str],
    out_dir: Path,
    *,
    pin: Pin,
    hf_home: Path | None = None,
    baseline: Path | None = None,
    test_timeout: int | None = 600,
    session_timeout: float | None = None,
    log: Log = quiet,
) -> UpstreamReport:
    """Run ``files`` on the patched tree and compare with stock.

    With ``stock_tree`` the stock tree runs first (sequentially: never two pytest
    processes at once); otherwise the baseline (``baseline`` or the committed one for
    ``pin``) stands in. ``hf_home`` defaults to ``<out_dir>/hf`` and receives the
    config snapshots of ``MODELS``. Logs and JUnit files land in ``out_dir``.
    """
    out_dir = Path(out_dir)
    hf_home = Path(hf_home) if hf_home else out_dir / "hf"
    hfsnap.write_snapshots(hf_home, MODELS)
    common = dict(hf_home=hf_home, test_timeout=test_timeout,
                  session_timeout=session_timeout, log=log)
    stock_result = None
    baseline_file = None
    if stock_tree is not None:
        stock_result = run_pytest(venv, stock_tree, files, out_dir, label="stock", **common)
        stock_outcomes = stock_result.outcomes
    else:
        baseline_file = Path(baseline) if baseline else baseline_path(pin)
        stock_outcomes = load_baseline(pin, baseline_file)["outcomes"]
    patched = run_pytest(venv, patched_tree, files, out_dir, label="patched", **common)
    comparison = compare(stock_outcomes, patched.outcomes, files)
    return UpstreamReport(pin.version, list(files), patched, comparison, stock_result,
                          baseline_file)


def format_report(report: UpstreamReport, limit: int = 20) -> str:
    """Human summary: counts per side, then regressions (at most ``limit`` listed)."""
    lines = [f"vLLM {report.version}: {len(report.files)} upstream test file(s)"]
    if report.stock is not None:
        s = report.stock
        lines.append(f"  stock:   {s.status:9} {s.counts()} in {s.wall_seconds} s")
    else:
        lines.append(f"  stock:   baseline {report.baseline}")
    p = report.patched
    lines.append(f"  patched: {p.status:9} {p.counts()} in {p.wall_seconds} s")
    if p.reason:
        lines.append(f"           {p.reason}")
    c = report.comparison
    lines.append(f"  compared {c.compared} test(s): {len(c.regressions)} regression(s), "
                 f"{len(c.fixes)} fix(es), {len(c.new)} new")
    for test_id, (before, after) in list(c.regressions.items())[:limit]:
        lines.append(f"  REGRESSION {test_id}: {before} -> {after}")
    if len(c.regressions) > limit:
        lines.append(f"  ... and {len(c.regressions) - limit} more")
    return "\n".join(lines)


def timed(fn: Callable[[], object]) -> tuple[object, float]:
    """Call ``fn`` and return its result with the wall time in seconds."""
    start = time.monotonic()
    value = fn()
    return value, round(time.monotonic() - start, 1)
