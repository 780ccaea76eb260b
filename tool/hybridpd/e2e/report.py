"""report.json, report.md and the plot of an e2e run.

``report.json`` is a contract (scripts and CI read it); add fields, never rename.
Its top level: ``pin, device, model, scenario, runs``; each run: ``build`` ("stock" |
"patched"), ``connector``, ``requests`` (per request: ``prompt_tokens,
decode_local_hit_tokens, kv_bytes_transferred, ttft_ms, output_token_ids``, ...),
``decode_prefix_cache_hits``, ``decode_prefix_cache_queries``,
``outputs_match_baseline``.

In the library a report is an :class:`E2EReport` of :class:`RunResult` runs (a finished
run and a failed one have the same type); ``to_json``/``from_json`` are the file's
shape, and ``from_json`` reads reports older than a field.

``report.md`` uses vllm#42524's ON/OFF table layout with stock (upstream's behaviour)
as OFF and patched as ON. The plot is drawn by ``plot.py`` under the e2e venv's
Python, which has matplotlib; hybridpd itself does not need it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybridpd import proc

#: The fields every run has, finished or failed (the contract above), in their order.
RUN_FIELDS = ("requests", "decode_prefix_cache_hits", "decode_prefix_cache_queries",
              "outputs_match_baseline")


@dataclass
class RunResult:
    """One pair's run. A finished run has the scenario's figures; a failed one has its
    ``error``. Both have the contract's fields, so a reader need not tell them apart."""

    build: str  # "stock" | "patched"
    connector: str
    logs: str
    requests: list[dict] = field(default_factory=list)
    decode_prefix_cache_hits: int | None = None
    decode_prefix_cache_queries: int | None = None
    outputs_match_baseline: bool | None = None
    checks: dict[str, bool] | None = None  # smoke and correctness: name -> passed
    error: str | None = None
    #: The scenario's own figures (``workload``, ``bench``, ``cold_decode``,
    #: ``decode_preemptions``, ...) and the run's timings and server commands.
    figures: dict[str, Any] = field(default_factory=dict)
    #: The keys of the JSON this run was read from, in order: written back as read.
    keys: tuple[str, ...] = field(default=(), compare=False, repr=False)

    @classmethod
    def failed(cls, build: str, connector: str, error: str, logs: Path) -> RunResult:
        return cls(build, connector, str(logs), error=error, keys=(
            "build", "connector", "error", "logs", *RUN_FIELDS))

    @classmethod
    def from_json(cls, data: dict) -> RunResult:
        """A run of any report; a field it lacks reads as empty (``""`` for the names)."""
        rest = dict(data)
        known = {name: rest.pop(name) for name in (*RUN_FIELDS, "checks", "error")
                 if name in rest}
        return cls(str(rest.pop("build", "")), str(rest.pop("connector", "")),
                   str(rest.pop("logs", "")), **known, figures=rest, keys=tuple(data))

    @property
    def where(self) -> str:
        return f"{self.build} / {self.connector}"

    def to_json(self) -> dict:
        fields = {"build": self.build, "connector": self.connector, "error": self.error,
                  **{name: getattr(self, name) for name in RUN_FIELDS},
                  "checks": self.checks, "logs": self.logs}
        # A run made here has every contract field; optional ones only when set.
        order = self.keys or ("build", "connector", *(("error",) if self.error else ()),
                              *RUN_FIELDS, *(("checks",) if self.checks is not None else ()),
                              *self.figures, "logs")
        out = {k: fields[k] if k in fields else self.figures[k] for k in order}
        return {**out, **{k: v for k, v in self.figures.items() if k not in out}}


#: report.json's top level in the order hybridpd writes it.
_TOP = ("command", "options", "pin", "device", "model", "scenario", "role", "environments",
        "capabilities", "server_options", "runs", "notes", "timings_s")


@dataclass
class E2EReport:
    """``report.json`` as the library reads and writes it. Reports older than a field
    read it as empty (``command``: the report does not say what produced it)."""

    pin: str
    device: str
    model: str
    scenario: str
    role: str = "kv_both"
    command: list[str] = field(default_factory=list)
    options: dict[str, Any] = field(default_factory=dict)
    environments: dict[str, dict] = field(default_factory=dict)
    capabilities: dict[str, dict] = field(default_factory=dict)
    server_options: dict[str, Any] = field(default_factory=dict)
    runs: list[RunResult] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    timings_s: dict[str, float] = field(default_factory=dict)
    #: Top-level fields this version does not know, kept as read.
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: dict) -> E2EReport:
        """Raises KeyError, TypeError or ValueError where ``data`` is not a report; a
        report without one of the four headline fields reads it as ``?``."""
        known = {k: v for k, v in data.items() if k in _TOP and k != "runs" and v is not None}
        for name in ("pin", "device", "model", "scenario"):
            known[name] = str(known.get(name, "?"))
        return cls(**known, runs=[RunResult.from_json(r) for r in data["runs"]],
                   extra={k: v for k, v in data.items() if k not in _TOP})

    def to_json(self) -> dict:
        out = {k: getattr(self, k) for k in _TOP}
        out["runs"] = [run.to_json() for run in self.runs]
        if not self.command:  # a report older than the recorded command
            del out["command"], out["options"]
        return {**out, **self.extra}

    def runs_by(self, build: str) -> dict[str, RunResult]:
        return {r.connector: r for r in self.runs if r.build == build}


SMOKE_COLUMNS = ("decode local hit (tokens)", "KV bytes moved", "TTFT (ms)")


def _pct(off: float | None, on: float | None) -> str:
    if off in (None, 0) or on is None:
        return "n/a"
    return f"{(on - off) / off * 100:+.1f}%"


def _num(value, digits: int = 0) -> str:
    if value is None:
        return "—"
    if isinstance(value, float) and digits:
        return f"{value:,.{digits}f}"
    return f"{int(round(value)):,}".replace(",", " ")


def _off_on(off: dict, on: dict, key: str, digits: int = 0, delta: bool = True) -> str:
    """The cells ``| OFF | ON | Δ `` of one figure (without Δ: ``| OFF | ON ``)."""
    cells = f"| {_num(off.get(key), digits)} | {_num(on.get(key), digits)} "
    return cells + (f"| {_pct(off.get(key), on.get(key))} " if delta else "")


def smoke_table(report: E2EReport) -> list[str]:
    """Per connector and request: stock (OFF) | patched (ON) | Δ, for hit, bytes, TTFT."""
    stock, patched = report.runs_by("stock"), report.runs_by("patched")
    lines = [
        "| connector | request | prompt tokens | OFF hit | ON hit | OFF KV bytes | ON KV bytes "
        "| ΔKV bytes | OFF TTFT (ms) | ON TTFT (ms) | ΔTTFT | outputs OK (OFF/ON) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for connector in dict.fromkeys([*patched, *stock]):
        off, on = stock.get(connector), patched.get(connector)
        n = max(len(off.requests if off else []), len(on.requests if on else []))
        for i in range(n):
            ro = off.requests[i] if off and i < len(off.requests) else {}
            rn = on.requests[i] if on and i < len(on.requests) else {}
            label = (rn or ro).get("label", f"r{i + 1}")
            ok = "/".join(
                "—" if r is None else ("yes" if r.outputs_match_baseline else "NO")
                for r in (off, on)
            )
            lines.append(
                f"| {connector} | {label} | {_num((rn or ro).get('prompt_tokens'))} "
                + _off_on(ro, rn, "decode_local_hit_tokens", delta=False)
                + _off_on(ro, rn, "kv_bytes_transferred")
                + _off_on(ro, rn, "ttft_ms")
                + f"| {ok if i == n - 1 else ''} |"
            )
    return lines


def bench_table(report: E2EReport) -> list[str]:
    """vllm#42524's table: workload | OFF/ON TTFT | ΔTTFT | OFF/ON output TPS | ΔTPS."""
    stock, patched = report.runs_by("stock"), report.runs_by("patched")
    lines = [
        "| connector | prefix_len | suffix_len | num_prefix | num_prompts | concurrency "
        "| OFF TTFT (ms) | ON TTFT (ms) | ΔTTFT | OFF Output TPS | ON Output TPS | ΔTPS "
        "| OFF D hit/queries | ON D hit/queries |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for connector in dict.fromkeys([*patched, *stock]):
        off, on = stock.get(connector), patched.get(connector)
        w = (on or off).figures.get("workload", {})
        bo = off.figures.get("bench", {}) if off else {}
        bn = on.figures.get("bench", {}) if on else {}

        def hits(r: RunResult | None) -> str:
            if r is None:
                return "—"
            return f"{_num(r.decode_prefix_cache_hits)}/{_num(r.decode_prefix_cache_queries)}"

        lines.append(
            f"| {connector} | {w.get('prefix_len')} | {w.get('suffix_len')} | {w.get('num_prefixes')} "
            f"| {w.get('num_prompts')} | {w.get('concurrency')} "
            + _off_on(bo, bn, "mean_ttft_ms")
            + _off_on(bo, bn, "output_throughput", digits=1)
            + f"| {hits(off)} | {hits(on)} |"
        )
    return lines


def _external_hit(r: dict) -> str:
    """D's external hit tokens, split per MultiConnector child where the run measured it."""
    total = r.get("decode_external_hit_tokens")
    if total is None:
        return ""
    if "decode_external_hit_tokens_lmcache" not in r:
        return str(total)
    return (f"{total} (NIXL {r['decode_external_hit_tokens_nixl']}, "
            f"LMCache {r['decode_external_hit_tokens_lmcache']})")


def _drafts(r: dict) -> str:
    """D's accepted/drafted tokens for one request (speculative decoding), else ""."""
    if "decode_draft_tokens" not in r:
        return ""
    return f" (drafts {r['decode_accepted_tokens']}/{r['decode_draft_tokens']})"


def correctness_table(report: E2EReport) -> list[str]:
    lines = [
        "| build | connector | request | decode hit | external hit | KV bytes "
        "| every token agrees (teacher-forced) "
        "| common prefix with the free-running reference | time (s) |",
        "|---|---|---|---|---|---|---|---|---:|",
    ]
    for run in report.runs:
        for r in run.requests:
            hit = r.get("decode_local_hit_tokens")
            moved = r.get("kv_bytes_transferred")
            took = r.get("latency_ms")
            lines.append(
                f"| {run.build} | {run.connector} | {r['label']} | "
                f"{'' if hit is None else hit} | {_external_hit(r)} | "
                f"{'' if moved is None else moved} | {'yes' if r['equal'] else 'NO'} | "
                f"{r['common_prefix_tokens']}/{len(r['reference_token_ids'])} | "
                f"{'' if took is None else f'{took / 1e3:.2f}'}{_drafts(r)} |"
            )
        if "decode_preemptions" in run.figures:
            lines.append(f"| {run.build} | {run.connector} | preemptions on D | "
                         f"{run.figures['decode_preemptions']} | | | | | |")
        if "decode_lmcache_tokens_concurrent" in run.figures:
            lines.append(f"| {run.build} | {run.connector} | LMCache loads on D while "
                         f"concurrent | | {run.figures['decode_lmcache_tokens_concurrent']} "
                         "| | | | |")
        if "decode_shm_segments_while_serving" in run.figures:
            left = run.figures.get("decode_shm_segments_left_by_lmcache") or []
            lines.append(f"| {run.build} | {run.connector} | D's LMCache segments while "
                         f"serving / left once vLLM and its lmcache server stopped | | "
                         f"{run.figures['decode_shm_segments_while_serving']} / {len(left)} "
                         "| | | | |")
    return lines


def _share(hits: int | None, limit: int | None) -> str:
    return "—" if hits is None or not limit else f"{hits / limit * 100:.1f}%"


def fleet_table(report: E2EReport) -> list[str]:
    """Per connector and decode policy: the decode instances' summed hit, stock (OFF)
    and patched (ON), against the block-rounded limit, and each instance's share."""
    runs: dict[tuple[str, str], dict[str, RunResult]] = {}
    for r in report.runs:
        if "policy" in r.figures:
            runs.setdefault((r.connector, r.figures["policy"]), {})[r.build] = r
    lines = [
        "| connector | decode policy | limit (tokens) | OFF fleet hit | ON fleet hit "
        "| OFF of limit | ON of limit | OFF per instance: hit (requests) "
        "| ON per instance: hit (requests) | OFF TTFT (ms) | ON TTFT (ms) |",
        "|---|---|---:|---:|---:|---:|---:|---|---|---:|---:|",
    ]
    for (connector, policy), by in runs.items():
        off, on = by.get("stock"), by.get("patched")
        limit = (on or off).figures.get("hit_limit_tokens")

        def each(r: RunResult | None) -> str:
            if r is None:
                return "—"
            return " / ".join(f"{i['prefix_cache_hits']} ({i['requests']})"
                              for i in r.figures.get("instances", []))

        def hit(r: RunResult | None) -> int | None:
            return None if r is None else r.decode_prefix_cache_hits

        def ttft(r: RunResult | None) -> str:
            return _num(None if r is None else r.figures.get("bench", {}).get("mean_ttft_ms"))

        lines.append(
            f"| {connector} | {policy} | {_num(limit)} | {_num(hit(off))} | {_num(hit(on))} "
            f"| {_share(hit(off), limit)} | {_share(hit(on), limit)} | {each(off)} "
            f"| {each(on)} | {ttft(off)} | {ttft(on)} |"
        )
    return lines


def table(report: E2EReport) -> list[str]:
    if report.scenario == "fleet":
        return fleet_table(report)
    if report.scenario == "correctness":
        return correctness_table(report)
    return bench_table(report) if report.scenario == "prefix-repetition" else smoke_table(report)


def _front(report: E2EReport) -> str:
    """The front PD requests went through, in words (reports before it was recorded:
    the proxy)."""
    front = report.server_options.get("front") or "hybridpd proxy"
    return f"`{front}`" if front.startswith("vllm-router") else "hybridpd's proxy"


def markdown(report: E2EReport) -> str:
    lines = [
        f"# hybridpd e2e: {report.scenario} on vLLM {report.pin} ({report.device})",
        "",
        f"Model: `{report.model}`. OFF = stock vLLM {report.pin}, ON = patched. "
        "hit = tokens the decode instance took from its own prefix cache "
        "(Δ `vllm:prefix_cache_hits`); external hit = Δ `vllm:external_prefix_cache_hits` "
        "(LMCache's share from its server's log, NIXL's the rest); KV bytes = "
        "Δ `vllm:nixl_bytes_transferred_sum` "
        f"on the decode instance; TTFT measured at the client through {_front(report)}.",
        "",
        *table(report),
        "",
    ]
    if report.scenario == "fleet":
        lines += ["Fleet: 1 prefill and N decode instances behind `vllm-router`, one router "
                  "per decode policy over the same instances, every prefix cache reset before "
                  "each policy, the same prompts in the same order. fleet hit = Δ "
                  "`vllm:prefix_cache_hits` summed over the decode instances; limit = every "
                  "request but the first of each prefix taking the prefix's whole blocks.", ""]
    if report.scenario == "correctness":
        lines += [f"The sequential PD requests go through {_front(report)}; the concurrent ones "
                  "(the preemption phase) do not: every prefill is sent first, then every "
                  "decode at once, with hybridpd's proxy's two steps, an order no router "
                  "offers (each forwards a decode as soon as its own prefill ends).", ""]
    baseline = (report.environments.get("stock") or {}).get("baseline")
    if baseline:
        lines += [f"OFF carries {', '.join(f'`{p}`' for p in baseline)}: stock vLLM "
                  f"{report.pin} cannot serve on {report.device} without it.", ""]
    for run in report.runs:
        spec = run.figures.get("speculative")
        if spec:
            lines.append(f"- {run.where}: speculative decoding "
                         + "; ".join(f"{side} accepted {s['accepted_tokens']} of "
                                     f"{s['draft_tokens']} drafted tokens "
                                     f"(acceptance rate {s['acceptance_rate']})"
                                     for side, s in spec.items() if s))
        times = [r["latency_ms"] for r in run.requests if r.get("latency_ms") is not None]
        if report.scenario == "correctness" and times:
            lines.append(f"- {run.where}: {len(times)} requests, {sum(times) / len(times) / 1e3:.2f} s "
                         f"per request on average (max {max(times) / 1e3:.2f} s)")
    for run in report.runs:
        if run.checks:
            failed = [k for k, v in run.checks.items() if not v]
            lines.append(
                f"- {run.where}: "
                + ("all checks pass" if not failed else "failed: " + ", ".join(failed))
            )
    ops = {b: c["kernels"] for b, c in report.capabilities.items() if c.get("kernels")}
    if ops:
        lines += ["", "Compiled ops vLLM loaded: " + "; ".join(
            f"{b} `{k['module']}` ({k['status']})" for b, k in ops.items()
        ) + "."]
    if report.notes:
        lines += ["", *[f"- {n}" for n in report.notes]]
    return "\n".join(lines) + "\n"


def write(report: E2EReport, out: Path, plot_python: Path | None) -> dict[str, Path]:
    """Write report.json, report.md and (with a Python that has matplotlib) report.png."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "report.json", "md": out / "report.md"}
    paths["json"].write_text(json.dumps(report.to_json(), indent=2) + "\n")
    paths["md"].write_text(markdown(report))
    if plot_python is not None:
        png = out / "report.png"
        done = proc.run([plot_python, Path(__file__).with_name("plot.py"), paths["json"], png])
        if done.ok and png.exists():
            paths["png"] = png
        else:
            (out / "plot.log").write_text(done.stdout + done.stderr)
    return paths
