"""Where a vllm-router decode policy sends a prefix-repetition workload, without vLLM.

The real router runs in PD mode over stand-in instances (:data:`WORKER`, standard
library only: ``/v1/models``, ``/health``, ``/v1/completions/render`` answering token
ids, ``/v1/completions`` answering a completion with ``kv_transfer_params`` and logging
the prompt it got), the requests go through it one at a time, and the decode instances'
logs say which one took each. From that order alone (:func:`spread`): how many times a
prefix is new to the instance it lands on (each such request misses on the decode side,
whatever the pool), and how many prefixes each instance must hold (more than its pool's
share evicts). What the fleet scenario's hits come to on real instances is
:mod:`.fleet`'s measurement; this says why.

    python -m hybridpd.e2e.routing --router VENV/bin/vllm-router --policy cache_aware
"""

from __future__ import annotations

import argparse
import json
import random
import string
import sys
import time
import urllib.request
from pathlib import Path

from hybridpd.e2e import router as router_mod
from hybridpd.e2e.servers import E2EError, Processes, free_port

#: A stand-in vLLM instance: ``python -c WORKER PORT LOG``.
WORKER = """\
import json, sys, time, zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
port, log = int(sys.argv[1]), open(sys.argv[2], "a")

class H(BaseHTTPRequestHandler):
    def _send(self, obj):
        body = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self._send({"object": "list", "data": [{"id": "e2e", "object": "model"}]})

    def do_POST(self):
        data = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))) or b"{}")
        prompt = str(data.get("prompt"))
        if self.path.endswith("/render"):  # the router tokenizes through it
            ids = [zlib.crc32(w.encode()) % 50000 for w in prompt.split()]
            return self._send([{"request_id": "r", "token_ids": ids}])
        log.write(json.dumps({"t": time.time(), "prompt": prompt}) + "\\n")
        log.flush()
        self._send({"id": "c", "object": "text_completion", "model": "e2e",
                    "choices": [{"index": 0, "text": "a", "finish_reason": "length"}],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
                    "kv_transfer_params": {"do_remote_prefill": True, "remote_engine_id": "p",
                                           "remote_block_ids": [], "remote_host": "127.0.0.1",
                                           "remote_port": 1}})

    def log_message(self, *args):
        pass

ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def prompts(num_prefixes: int, per_prefix: int, prefix_words: int, suffix_words: int,
            seed: int = 0) -> list[tuple[int, str]]:
    """(prefix index, text) for each request: ``num_prefixes`` random prefixes of
    ``prefix_words`` words, each with ``per_prefix`` random suffixes, shuffled (as vllm
    bench's prefix_repetition dataset does)."""
    rng = random.Random(seed)
    word = lambda: "".join(rng.choice(string.ascii_lowercase)  # noqa: E731
                           for _ in range(rng.randint(2, 9)))
    out = []
    for i in range(num_prefixes):
        prefix = " ".join(word() for _ in range(prefix_words))
        out += [(i, prefix + " " + " ".join(word() for _ in range(suffix_words)))
                for _ in range(per_prefix)]
    rng.shuffle(out)
    return out


def probe(router: Path, policy: str, decode_instances: int, work: list[tuple[int, str]],
          log_dir: Path, timeout: float = 60) -> list[int]:
    """The decode instance (0-based) the router at ``router`` (a ``vllm-router``
    script) with ``--decode-policy policy`` sends each request of ``work`` to, in
    order; every process it starts is reaped."""
    log_dir.mkdir(parents=True, exist_ok=True)
    names = ["prefill", *(f"decode-{i + 1}" for i in range(decode_instances))]
    ports = {n: free_port() for n in names}
    logs = {n: log_dir / f"{n}.jsonl" for n in names}
    with Processes(log_dir, grace=5) as procs:
        for n in names:
            logs[n].write_text("")
            procs.start(n, [sys.executable, "-c", WORKER, str(ports[n]), str(logs[n])])
        url = lambda n: f"http://127.0.0.1:{ports[n]}"  # noqa: E731
        procs.wait_ready({n: url(n) + "/v1/models" for n in names}, timeout)
        port = free_port()
        cmd = router_mod.command(router.parent / "python", port, free_port(), url("prefill"),
                                 [url(n) for n in names[1:]], timeout, decode_policy=policy)
        cmd[0] = str(router)
        procs.start("router", cmd)
        front = f"http://127.0.0.1:{port}"
        procs.wait_ready({"router": front + router_mod.HEALTH}, timeout)
        for _, text in work:
            body = json.dumps({"model": "e2e", "prompt": text, "max_tokens": 1}).encode()
            req = urllib.request.Request(front + "/v1/completions", body,
                                         {"content-type": "application/json"})
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                resp.read()
    seen = sorted((json.loads(line)["t"], i, json.loads(line)["prompt"])
                  for i, n in enumerate(names[1:])
                  for line in logs[n].read_text().splitlines())
    if [p for _, _, p in seen] != [text for _, text in work]:
        raise E2EError(f"the decode instances got {len(seen)} requests, not the "
                       f"{len(work)} sent, in order (logs: {log_dir})")
    return [i for _, i, _ in seen]


def spread(work: list[tuple[int, str]], chosen: list[int], decode_instances: int) -> dict:
    """From the order alone: requests per instance, the prefixes each instance saw, and
    the requests that are a prefix's first on their instance (a decode-side miss
    whatever the pool; an ideal router has one per prefix)."""
    held: list[set[int]] = [set() for _ in range(decode_instances)]
    first = 0
    for (prefix, _), d in zip(work, chosen):
        first += prefix not in held[d]
        held[d].add(prefix)
    return {"requests": [chosen.count(d) for d in range(decode_instances)],
            "prefixes": [len(h) for h in held], "first_on_instance": first,
            "ideal_first": len({p for p, _ in work})}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hybridpd.e2e.routing", description=__doc__
                                 .split("\n\n")[0])
    ap.add_argument("--router", type=Path, required=True, help="a vllm-router script")
    ap.add_argument("--policy", action="append", choices=router_mod.DECODE_POLICIES)
    ap.add_argument("--decode-instances", type=int, default=2)
    ap.add_argument("--num-prefixes", type=int, default=4)
    ap.add_argument("--per-prefix", type=int, default=4)
    ap.add_argument("--prefix-words", type=int, default=300)
    ap.add_argument("--suffix-words", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--logs", type=Path, default=Path("routing-probe"))
    a = ap.parse_args(argv)
    work = prompts(a.num_prefixes, a.per_prefix, a.prefix_words, a.suffix_words, a.seed)
    print("| decode policy | requests per instance | prefixes per instance "
          "| first on its instance (ideal) | order (prefix>instance) |")
    print("|---|---|---|---:|---|")
    for policy in a.policy or ["round_robin", "cache_aware", "kv_aware"]:
        try:
            chosen = probe(a.router, policy, a.decode_instances, work, a.logs / policy)
        except E2EError as exc:
            print(f"{policy}: {exc}", file=sys.stderr)
            return 1
        s = spread(work, chosen, a.decode_instances)
        order = " ".join(f"{p}>{d + 1}" for (p, _), d in zip(work, chosen))
        print(f"| {policy} | {' / '.join(map(str, s['requests']))} "
              f"| {' / '.join(map(str, s['prefixes']))} "
              f"| {s['first_on_instance']} ({s['ideal_first']}) | {order} |")
        time.sleep(0.1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
