"""report.json, report.md and the plot of an e2e run.

``report.json`` is a contract (scripts and CI read it); add fields, never rename.
Its top level: ``pin, device, model, scenario, runs``; each run: ``build`` ("stock" |
"patched"), ``connector``, ``requests`` (per request: ``prompt_tokens,
decode_local_hit_tokens, kv_bytes_transferred, ttft_ms, output_token_ids``, ...),
``decode_prefix_cache_hits``, ``decode_prefix_cache_queries``,
``outputs_match_baseline``.

``report.md`` uses the seed's ON/OFF table layout with stock (upstream's behaviour)
as OFF and patched as ON. The plot is drawn by ``plot.py`` under the e2e venv's
Python, which has matplotlib; hybridpd itself does not need it.
"""

from __future__ import annotations

import json
from pathlib import Path

from hybridpd import proc

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


def _runs_by(report: dict, build: str) -> dict[str, dict]:
    return {r["connector"]: r for r in report["runs"] if r["build"] == build}


def smoke_table(report: dict) -> list[str]:
    """Per connector and request: stock (OFF) | patched (ON) | Δ, for hit, bytes, TTFT."""
    stock, patched = _runs_by(report, "stock"), _runs_by(report, "patched")
    lines = [
        "| connector | request | prompt tokens | OFF hit | ON hit | OFF KV bytes | ON KV bytes "
        "| ΔKV bytes | OFF TTFT (ms) | ON TTFT (ms) | ΔTTFT | outputs OK (OFF/ON) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for connector in dict.fromkeys([*patched, *stock]):
        off, on = stock.get(connector), patched.get(connector)
        n = max(len((off or {}).get("requests", [])), len((on or {}).get("requests", [])))
        for i in range(n):
            ro = off["requests"][i] if off and i < len(off["requests"]) else {}
            rn = on["requests"][i] if on and i < len(on["requests"]) else {}
            label = (rn or ro).get("label", f"r{i + 1}")
            ok = "/".join(
                "—" if r is None else ("yes" if r.get("outputs_match_baseline") else "NO")
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


def bench_table(report: dict) -> list[str]:
    """The seed's table: workload | OFF/ON TTFT | ΔTTFT | OFF/ON output TPS | ΔTPS."""
    stock, patched = _runs_by(report, "stock"), _runs_by(report, "patched")
    lines = [
        "| connector | prefix_len | suffix_len | num_prefix | num_prompts | concurrency "
        "| OFF TTFT (ms) | ON TTFT (ms) | ΔTTFT | OFF Output TPS | ON Output TPS | ΔTPS "
        "| OFF D hit/queries | ON D hit/queries |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for connector in dict.fromkeys([*patched, *stock]):
        off, on = stock.get(connector) or {}, patched.get(connector) or {}
        w = (on or off).get("workload", {})
        bo, bn = off.get("bench", {}), on.get("bench", {})

        def hits(r: dict) -> str:
            if not r:
                return "—"
            return f"{_num(r.get('decode_prefix_cache_hits'))}/{_num(r.get('decode_prefix_cache_queries'))}"

        lines.append(
            f"| {connector} | {w.get('prefix_len')} | {w.get('suffix_len')} | {w.get('num_prefixes')} "
            f"| {w.get('num_prompts')} | {w.get('concurrency')} "
            + _off_on(bo, bn, "mean_ttft_ms")
            + _off_on(bo, bn, "output_throughput", digits=1)
            + f"| {hits(off)} | {hits(on)} |"
        )
    return lines


def correctness_table(report: dict) -> list[str]:
    lines = [
        "| build | connector | request | decode hit | every token agrees (teacher-forced) "
        "| common prefix with the free-running reference |",
        "|---|---|---|---|---|---|",
    ]
    for run in report["runs"]:
        for r in run.get("requests", []):
            hit = r.get("decode_local_hit_tokens")
            lines.append(
                f"| {run['build']} | {run['connector']} | {r['label']} | "
                f"{'' if hit is None else hit} | {'yes' if r['equal'] else 'NO'} | "
                f"{r['common_prefix_tokens']}/{len(r['reference_token_ids'])} |"
            )
        if "decode_preemptions" in run:
            lines.append(f"| {run['build']} | {run['connector']} | preemptions on D | "
                         f"{run['decode_preemptions']} | | |")
    return lines


def table(report: dict) -> list[str]:
    if report["scenario"] == "correctness":
        return correctness_table(report)
    return bench_table(report) if report["scenario"] == "prefix-repetition" else smoke_table(report)


def markdown(report: dict) -> str:
    lines = [
        f"# hybridpd e2e: {report['scenario']} on vLLM {report['pin']} ({report['device']})",
        "",
        f"Model: `{report['model']}`. OFF = stock vLLM {report['pin']}, ON = patched. "
        "hit = tokens the decode instance took from its own prefix cache "
        "(Δ `vllm:prefix_cache_hits`); KV bytes = Δ `vllm:nixl_bytes_transferred_sum` "
        "on the decode instance; TTFT measured at the client through the proxy.",
        "",
        *table(report),
        "",
    ]
    for run in report["runs"]:
        checks = run.get("checks") or {}
        if checks:
            failed = [k for k, v in checks.items() if not v]
            lines.append(
                f"- {run['build']} / {run['connector']}: "
                + ("all checks pass" if not failed else "failed: " + ", ".join(failed))
            )
    ops = {
        b: c["kernels"] for b, c in (report.get("capabilities") or {}).items() if c.get("kernels")
    }
    if ops:
        lines += ["", "Compiled ops vLLM loaded: " + "; ".join(
            f"{b} `{k['module']}` ({k['status']})" for b, k in ops.items()
        ) + "."]
    if report.get("notes"):
        lines += ["", *[f"- {n}" for n in report["notes"]]]
    return "\n".join(lines) + "\n"


def write(report: dict, out: Path, plot_python: Path | None) -> dict[str, Path]:
    """Write report.json, report.md and (with a Python that has matplotlib) report.png."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "report.json", "md": out / "report.md"}
    paths["json"].write_text(json.dumps(report, indent=2) + "\n")
    paths["md"].write_text(markdown(report))
    if plot_python is not None:
        png = out / "report.png"
        done = proc.run([plot_python, Path(__file__).with_name("plot.py"), paths["json"], png])
        if done.ok and png.exists():
            paths["png"] = png
        else:
            (out / "plot.log").write_text(done.stdout + done.stderr)
    return paths
