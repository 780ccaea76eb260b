"""Text and PNG renderings of bench reports (the JSON is the report's ``to_json``)."""

from __future__ import annotations

from pathlib import Path

from hybridpd.bench.replay import ReplayReport
from hybridpd.errors import HybridpdError

#: (key, label, exact?) rows of the replay table.
ROWS = (
    ("hit_tokens", "decode-side local hit (tokens)", True),
    ("limit_tokens", "block-rounded limit (tokens)", True),
    ("pulled_tokens", "pulled from prefill (tokens)", True),
    ("recomputed_below_target_tokens", "recomputed below load target", True),
    ("corner_admissions", "len-1 corner admissions", True),
    ("corner_recomputed_tokens", "  recomputed in the corner", True),
    ("blocks_allocated", "KV blocks allocated", True),
    ("peak_block_usage", "peak KV pool usage", True),
    ("peak_running", "peak running", True),
    ("mean_running", "mean running", True),
    ("peak_waiting", "peak waiting", True),
    ("mean_waiting", "mean waiting", True),
    ("preemptions", "preemptions", True),
    ("steps", "scheduler steps", True),
    ("ttft_ms_est", "mean TTFT (ms, modelled)", False),
    ("ttft_p50_ms_est", "median TTFT (ms, modelled)", False),
    ("output_tps_est", "output tok/s (modelled)", False),
    ("wall_s", "replay wall time (s)", True),
)


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:,.2f}" if abs(value) < 100 else f"{value:,.0f}"
    return f"{value:,}"


def replay_table(report: ReplayReport) -> str:
    stock, patched = report.results["stock"], report.results["patched"]
    w = report.workload
    head = (
        f"{report.pin}, {report.connector}: prefix {w['prefix_len']}, suffix {w['suffix_len']}, "
        f"{w['num_prefixes']} prefixes, {w['num_prompts']} prompts, output {w['output_len']}, "
        f"concurrency {w['concurrency']}"
        + (f", exact repeats {w['exact_repeat_fraction']:g}" if w.get("exact_repeat_fraction") else "")
        + f"; {report.cost_model['kv_blocks']} blocks of "
        f"{report.cost_model['block_size']} tokens"
    )
    lines = [head, f"stock: {report.stock_build}; patched: the {report.pin} series",
             f"{'':34} {'stock':>14} {'patched':>14} {'patched/stock':>14}"]
    rows = [(stock[key], patched[key], label) for key, label, _exact in ROWS]
    if patched.get("store_blocks") is not None:  # a store child loads too
        rows[2] = (*rows[2][:2], "loaded by the connectors (tokens)")
    # Tokens each connector loaded, after the pull row (a set's every child, 0 included).
    served = (stock.get("served_by") or {}), (patched.get("served_by") or {})
    children = sorted(set(served[0]) | set(served[1]))
    at = 3
    for child in children:
        rows.insert(at, (served[0].get(child, 0), served[1].get(child, 0),
                         f"  loaded by {child}"))
        at += 1
    if patched.get("store_blocks") is not None:
        rows.insert(at, (stock["store_blocks"], patched["store_blocks"], "  store capacity (blocks)"))
    if patched.get("store_evicted_chunks") is not None:
        rows.insert(at + 1, (stock["store_evicted_chunks"], patched["store_evicted_chunks"],
                             "  LMCache store evictions (chunks)"))
    for a, b, label in rows:
        ratio = f"{b / a:.2f}x" if a else "-"
        lines.append(f"{label:34} {_fmt(a):>14} {_fmt(b):>14} {ratio:>14}")
    fraction = report.hit_fraction()
    share = f"{fraction * 100:.2f}% of the limit" if fraction is not None else "no limit (0)"
    lines.append(
        f"patched hit: {share}; exact: counts read from vLLM's scheduler; "
        "modelled: TTFT and tok/s"
    )
    lines += speculative_lines(report)
    return "\n".join(lines)


def speculative_lines(report: ReplayReport) -> list[str]:
    """What speculative decoding set on the decode instance, and the hit each build
    gave up against the block-rounded limit."""
    spec = report.results["patched"].get("speculative")
    if not spec:
        return []
    block = report.cost_model["block_size"]
    lines = [
        f"speculative decoding: {spec['method']}, {spec['num_speculative_tokens']} tokens, "
        f"{spec['mtp_modules']} MTP module(s); vLLM sets {spec['lookahead_slots']} lookahead "
        f"slot(s) per request, prefill lookahead {spec['prefill_lookahead_tokens']}, NIXL "
        f"back-off {spec['nixl_prefill_backoff']} token(s), "
        + ("drops the last matched block" if spec["drops_last_matched_block"]
           else "keeps the last matched block")
    ]
    for build in ("stock", "patched"):
        r = report.results[build]
        given = r["limit_tokens"] - r["hit_tokens"]
        n = r.get("limited_requests") or 0
        per = f", {given / n / block:.2f} blocks per request" if n else ""
        lines.append(f"  {build}: hit below the limit: {given:,} tokens over {n} "
                     f"requests{per}")
    if spec["drops_last_matched_block"]:
        lines.append("  under MTP vLLM drops the last matched block of a hit (drop_eagle_block: "
                     "the drafter's KV at a block's last slot was written with the next prompt "
                     "token, which another prompt may not share): 1 block per request is what "
                     "speculative decoding gives up")
    return lines


def gate_problems(report: ReplayReport, expect_hit: float | None, expect_gap: bool) -> list[str]:
    """What fails ``--expect-hit FRACTION`` and ``--expect-gap`` (empty: both pass)."""
    problems = []
    fraction = report.hit_fraction()
    if expect_hit is not None:
        if fraction is None:
            problems.append("the workload allows no decode-side hit (the limit is 0): "
                            "--expect-hit cannot pass")
        elif fraction < expect_hit:
            problems.append(f"patched hit {fraction * 100:.2f}% of the limit, below "
                            f"{expect_hit * 100:g}%")
    stock, patched = (report.results[b]["hit_tokens"] for b in ("stock", "patched"))
    if expect_gap and not stock < patched:
        problems.append(f"stock's hit ({stock:,} tokens) is not below patched's ({patched:,})")
    return problems


def require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise HybridpdError(
            "--png needs matplotlib in hybridpd's environment: pip install 'hybridpd[bench]'"
        ) from None


def replay_png(report: ReplayReport, dest: Path) -> None:
    """Running and waiting requests over modelled time, stock against patched."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"stock": "#9e9e9e", "patched": "#1f77b4"}
    fig, axes = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for build, trace in report.traces.items():
        seconds = [t / 1000 for _, t, _, _ in trace]
        axes[0].plot(seconds, [r for _, _, r, _ in trace], color=colors[build], label=build)
        axes[1].plot(seconds, [q for _, _, _, q in trace], color=colors[build], label=build)
    axes[0].set_ylabel("running requests")
    axes[1].set_ylabel("waiting requests")
    axes[1].set_xlabel("modelled time (s)")
    axes[0].legend()
    axes[0].set_title(f"decode instance, {report.pin} {report.connector}")
    fig.tight_layout()
    fig.savefig(dest, dpi=100)
    plt.close(fig)
