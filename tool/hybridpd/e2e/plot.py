"""Draw report.png from report.json: stock (OFF) beside patched (ON).

Runs as a script under the e2e venv's Python (which has matplotlib):
``python plot.py report.json report.png``. Standard library + matplotlib only.

smoke: for each connector set, per request, the decode instance's local hit tokens,
the KV bytes NIXL moved and the TTFT. prefix-repetition: mean TTFT and output
throughput per connector set.
"""

from __future__ import annotations

import json
import sys


def main(argv: list[str]) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    src, dest = argv
    report = json.load(open(src))
    runs = report["runs"]
    connectors = list(dict.fromkeys(r["connector"] for r in runs))
    colors = {"stock": "#9e9e9e", "patched": "#1f77b4"}

    if report["scenario"] == "prefix-repetition":
        metrics = [("mean_ttft_ms", "mean TTFT (ms)"), ("output_throughput", "output tok/s")]
        fig, axes = plt.subplots(1, len(metrics), figsize=(5 * len(metrics), 4))
        for ax, (key, title) in zip(axes, metrics):
            for j, build in enumerate(("stock", "patched")):
                vals = [
                    next((r["bench"].get(key) or 0 for r in runs
                          if r["connector"] == c and r["build"] == build), 0)
                    for c in connectors
                ]
                xs = [i + (j - 0.5) * 0.38 for i in range(len(connectors))]
                ax.bar(xs, vals, 0.38, label=f"{build} ({'OFF' if build == 'stock' else 'ON'})",
                       color=colors[build])
            ax.set_xticks(range(len(connectors)), connectors)
            ax.set_title(title)
            ax.legend()
    else:
        metrics = [
            ("decode_local_hit_tokens", "decode local hit (tokens)"),
            ("kv_bytes_transferred", "KV bytes moved"),
            ("ttft_ms", "TTFT (ms)"),
        ]
        fig, axes = plt.subplots(
            len(connectors), len(metrics), figsize=(5 * len(metrics), 3.4 * len(connectors)),
            squeeze=False,
        )
        for row, connector in enumerate(connectors):
            for col, (key, title) in enumerate(metrics):
                ax = axes[row][col]
                labels = []
                for j, build in enumerate(("stock", "patched")):
                    run = next((r for r in runs if r["connector"] == connector
                                and r["build"] == build), None)
                    if run is None:
                        continue
                    reqs = run["requests"]
                    labels = [q.get("label", f"r{i + 1}").split(" ")[0] for i, q in enumerate(reqs)]
                    xs = [i + (j - 0.5) * 0.38 for i in range(len(reqs))]
                    ax.bar(xs, [q.get(key) or 0 for q in reqs], 0.38, color=colors[build],
                           label=f"{build} ({'OFF' if build == 'stock' else 'ON'})")
                ax.set_xticks(range(len(labels)), labels)
                ax.set_title(f"{connector}: {title}", fontsize=9)
                if row == 0 and col == 0:
                    ax.legend(fontsize=8)
    fig.suptitle(f"hybridpd e2e {report['scenario']}, vLLM {report['pin']} ({report['device']})")
    fig.tight_layout()
    fig.savefig(dest, dpi=100)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
