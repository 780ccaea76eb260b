"""The ``correctness`` scenario: outputs of the pair against a single instance's.

``correctness`` compares every output with a single-instance reference (the prefill
instance alone, its prefix cache reset before each reference request), greedy, in
fp32 so that near-ties do not decide tokens: a warm-up, a prompt that shares a
block-aligned prefix with it (the decode-side hit), that prefix plus one token (a hit
of prompt length - 1), a plain request sent straight to the decode instance, and
concurrent requests on a decode KV pool small enough to preempt (checked on D's
``vllm:num_preemptions``). A decode instance that resumes a request where it has no
Mamba state answers with wrong tokens here.
"""

from __future__ import annotations

import json
import random
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass

from hybridpd.e2e import lmcache as lmcache_mod
from hybridpd.e2e import metrics
from hybridpd.e2e.client import (
    Completion,
    common_prefix,
    complete,
    post,
    prefill_for_remote_decode,
    settled_scrape,
    warm_up,
)
from hybridpd.e2e.pair import Pair
from hybridpd.e2e.servers import E2EError, Processes
from hybridpd.progress import Log


@dataclass(frozen=True)
class CorrectnessOptions:
    block_size: int = 128
    prefix_blocks: int = 4  # the shared prefix: whole blocks, so a hit can end on it
    max_tokens: int = 16
    # Requests in flight at once on the small decode pool (16 blocks, shared by the
    # attention and the Mamba groups; vLLM raises the tiny model's block
    # size from 128 to 256 so that an attention page holds a Mamba state). D admits a
    # request only when its prompt's blocks fit, so only running requests that grow
    # exhaust the pool: each concurrent prompt is the shared prefix + 216..225 tokens,
    # 31..40 tokens short of 768 (a multiple of 128 and 256), so every one crosses a
    # block boundary within its 64 output tokens and then needs a new block in every
    # group at once (align mode keeps the Mamba state at the boundary). Suffixes of
    # 64..73 tokens never crossed a boundary of 256, and a CI run saw no preemption
    # (measured with 216: 8 preemptions in 10 requests).
    concurrent: int = 10
    concurrent_max_tokens: int = 64
    concurrent_suffix: int = 216
    seed: int = 0
    # LMCache sets: requests the decode instance's LMCache serves (see lmcache_cases).
    lmcache: bool = False
    # Both instances draft with MTP (--speculative-config): vLLM keeps Mamba
    # checkpoints a block back (see lmcache_cases).
    speculative: bool = False
    # The block size the decode instance serves (vLLM raises --block-size until an
    # attention page holds a Mamba state; run._served_block_size): where the Mamba
    # checkpoints of a prefill step lie. None: block_size. Checked against the
    # instance's vllm:cache_config_info when the run starts.
    served_block_size: int | None = None
    # Stop at the first request whose free-running output differs from the reference
    # (beyond a near-tie): a gate that must go red needs no concurrent phase and no
    # teacher-forced scoring, which are most of a run's time.
    fail_fast: bool = False


#: Nats. Two runs' logprobs of the same token must agree within this, and a different
#: greedy choice counts as a tie only when the reference ranks both tokens within it.
#: bf16 numerics differ between a PD pair and a single instance (measured on the
#: state-sensitive tiny model: up to 0.11 nats within 16 tokens, 0.18 within 160); a
#: resume without its Mamba state changes the distribution far beyond this.
LOGPROB_TOLERANCE = 0.3
#: Top logprobs asked for each generated token.
TOP_LOGPROBS = 5


def compare_with_reference(
    out: Completion, ref: Completion, tolerance: float = LOGPROB_TOLERANCE
) -> tuple[bool, str]:
    """Whether ``out`` is ``ref`` up to numerics, and a note on where they part."""
    n = common_prefix(out.token_ids, ref.token_ids)
    for j in range(n):
        if abs(out.token_logprobs[j] - ref.token_logprobs[j]) > tolerance:
            return False, (f"token {j}: logprob {out.token_logprobs[j]:.3f} vs reference "
                           f"{ref.token_logprobs[j]:.3f}")
    if n == len(ref.token_ids):
        return True, ""
    alt = ref.top_logprobs[n].get(out.tokens[n]) if n < len(ref.top_logprobs) else None
    if alt is not None and ref.token_logprobs[n] - alt <= tolerance:
        return True, f"tie at token {n} ({ref.token_logprobs[n] - alt:.3f} nats apart)"
    return False, (f"token {n}: {out.token_ids[n]} where the reference has "
                   f"{ref.token_ids[n]} ({'not in its top' if alt is None else f'{ref.token_logprobs[n] - alt:.3f} nats below'})")


def score(base_url: str, tokens: list[int], top: int, procs: Processes | None = None,
          timeout: float = 600.0) -> list[dict[int, float]]:
    """Teacher-forced logprobs of ``tokens`` (vLLM's ``prompt_logprobs``): for each
    position ``i > 0``, the logprobs of the ``top`` likeliest tokens and of ``tokens[i]``
    given ``tokens[:i]``; position 0 is empty."""
    body = {"model": "e2e", "prompt": tokens, "max_tokens": 1, "temperature": 0,
            "prompt_logprobs": top}
    req = urllib.request.Request(
        f"{base_url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            data = json.load(resp)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        if procs is not None:
            procs.check_soon()
        raise E2EError(f"scoring request to {base_url} failed: {exc}") from None
    rows = data["choices"][0].get("prompt_logprobs") or []
    if len(rows) != len(tokens):
        raise E2EError(f"{base_url} scored {len(rows)} of {len(tokens)} prompt tokens")
    return [{int(k): float(v["logprob"]) for k, v in (row or {}).items()} for row in rows]


def compare_teacher_forced(
    out: Completion, prompt_len: int, scored: list[dict[int, float]],
    tolerance: float = LOGPROB_TOLERANCE,
) -> tuple[bool, str]:
    """Whether every token of ``out`` is the reference model's greedy choice given
    ``out``'s own earlier tokens (up to a near-tie), with the same logprob.

    A request that was preempted recomputes its tokens in a prefill, whose bf16
    numerics differ from the decode steps of a free-running reference; after a near-tie
    the two runs then go on from different tokens. Scored on its own output, such a
    request still agrees token by token. A request that resumed without its Mamba
    state does not: from the resume point on, its distribution is not the model's.
    """
    worst = 0.0
    for j, tok in enumerate(out.token_ids):
        row = scored[prompt_len + j]
        lp = row.get(tok)
        if lp is None:
            return False, f"token {j}: {tok} was not scored"
        below = max(row.values()) - lp
        if below > tolerance:
            return False, (f"token {j}: {tok} is {below:.3f} nats below the teacher-forced "
                           "reference's choice")
        gap = abs(out.token_logprobs[j] - lp)
        if gap > tolerance:
            return False, (f"token {j}: logprob {out.token_logprobs[j]:.3f} vs teacher-forced "
                           f"{lp:.3f}")
        worst = max(worst, below, gap)
    return True, f"every token agrees with the teacher-forced reference (within {worst:.3f} nats)"


def correctness_cases(vocab_size: int, opts: CorrectnessOptions) -> list[dict]:
    """The requests, in the order they are sent: ``via`` is ``pd`` (through the front)
    or ``decode`` (straight to the decode instance, no KV transfer); ``group`` 0 runs
    one at a time, group 1 all at once."""
    rng = random.Random(opts.seed)
    low = 2  # 0 and 1 are the tiny tokenizer's special tokens

    def tokens(n: int) -> list[int]:
        return [rng.randrange(low, vocab_size) for _ in range(n)]

    bs, n = opts.block_size, opts.max_tokens
    prefix = tokens(opts.prefix_blocks * bs)
    cases = [
        {"label": "A warm-up", "via": "pd", "prompt": prefix + tokens(bs // 2), "max_tokens": n},
        {"label": "B shares A's block-aligned prefix", "via": "pd",
         "prompt": prefix + tokens(bs // 2 + 7), "max_tokens": n},
        {"label": "C A's prefix + 1 token", "via": "pd", "prompt": prefix + tokens(1),
         "max_tokens": n},
        {"label": "D plain request to the decode instance", "via": "decode",
         "prompt": prefix + tokens(bs // 2 + 3), "max_tokens": n},
    ]
    if opts.lmcache:
        cases += lmcache_cases(tokens, n, l1_tokens(opts))
    cases = [{**c, "group": 0} for c in cases]
    cases += [
        {"label": f"E{i} concurrent", "via": "pd",
         "prompt": prefix + tokens(opts.concurrent_suffix + i),
         "max_tokens": opts.concurrent_max_tokens, "group": 1}
        for i in range(opts.concurrent)
    ]
    return cases


def concurrent_prompt_span(opts: CorrectnessOptions) -> tuple[int, int]:
    """The shared prefix of the concurrent requests and the longest of their prompts,
    in tokens (:func:`correctness_cases`' E requests): what a decode pool must hold for
    two of them at once."""
    prefix = opts.prefix_blocks * opts.block_size
    return prefix, prefix + opts.concurrent_suffix + opts.concurrent - 1


def longest_request(opts: CorrectnessOptions) -> int:
    """Tokens of the longest request :func:`correctness_cases` sends, prompt and
    output: what ``--max-model-len`` must hold (with the defaults a concurrent one:
    the 512-token prefix + 225 tokens, then 64 generated, 801 in all)."""
    # The lengths do not depend on the vocabulary: 3 is the smallest one cases take.
    return max(len(c["prompt"]) + c["max_tokens"] for c in correctness_cases(3, opts))


#: L pairs (see :func:`lmcache_cases`) tried before the correctness scenario gives up
#: on an LMCache hit.
LMCACHE_HIT_ATTEMPTS = 3


def l1_tokens(opts: CorrectnessOptions) -> int:
    """The length of the prompt L1 whose first chunk LMCache serves to L2: one prefill
    step whose Mamba checkpoint vLLM keeps at the chunk's end (see lmcache_cases).

    Without speculative decoding vLLM keeps the state at the last block boundary of
    the step, 256 for 300 tokens with blocks of 128 or 256. With MTP it keeps it a
    block further back (``use_eagle_block_drop``: ``floor(s / B) * B - B`` in column
    ``cdiv(s, B) - 2``), at a column's end only for a multiple of the block size: a
    prompt of a chunk and a block (384 at blocks of 128; 512 at the blocks of 256 vLLM
    serves the tiny model with, ``served_block_size``) puts it at 256. Any
    other length stores the chunk with no state (a checkpoint that is not at its
    column's end is not stored), and LMCache serves L2 nothing."""
    if opts.speculative:
        return lmcache_mod.CHUNK_SIZE + (opts.served_block_size or opts.block_size)
    return 300


def lmcache_cases(tokens, max_tokens: int, l1_len: int = 300) -> list[dict]:
    """Requests the decode instance's LMCache serves: plain requests to D, each second
    one after D's prefix cache was reset (``reset_decode``), so that its prefix comes
    from LMCache, not from D's own blocks. vLLM runs the tiny model with block 256 (=
    LMCache's chunk) and stores the Mamba state only at the last block of each prefill
    step and the one before it (align mode): a 300-token prompt, one step of two
    blocks, leaves a real state at block 0; a 600-token prompt, one step of three,
    leaves vLLM's null block in block 0's Mamba slot. With MTP the tiny model keeps
    the blocks vLLM serves and L1 is ``l1_len`` tokens (:func:`l1_tokens`).

    - L: the state LMCache stores and loads must be the one vLLM computes with
      (the registration must leave vLLM's views on the memory it registers): L2 takes a
      256-token LMCache hit of L1's prefix.
      LMCache may decline to serve (its vLLM adapter skips stores and lookups while a
      heartbeat ping is unanswered), and then nothing was checked: a new L pair
      (``attempt`` 2, 3: new tokens, run only while no L2 took a hit) tries again,
      each row in the report and held to the same output check;
    - N: a chunk with a null Mamba slot must not be served as a state
      (null-recurrent-slot-not-stored): N2 shares 300 tokens with N1 and takes no hit.
    """
    chunk = lmcache_mod.CHUNK_SIZE
    cases = []
    for attempt in range(1, LMCACHE_HIT_ATTEMPTS + 1):
        l1 = tokens(l1_len)
        again = "" if attempt == 1 else f" (attempt {attempt})"
        cases += [
            {"label": f"L1{again} plain request D computes and stores in LMCache",
             "via": "decode", "prompt": l1, "max_tokens": max_tokens, "lmcache": "store",
             "attempt": attempt},
            {"label": f"L2{again} L1's first chunk from LMCache (D's prefix cache reset)",
             "via": "decode", "prompt": l1[:chunk] + tokens(200), "max_tokens": max_tokens,
             "reset_decode": True, "lmcache": "hit", "attempt": attempt},
        ]
    n1 = tokens(600)
    return cases + [
        {"label": "N1 600 tokens in one prefill step (a null Mamba slot at chunk 0)",
         "via": "decode", "prompt": n1, "max_tokens": max_tokens, "lmcache": "store"},
        {"label": "N2 shares 300 tokens with N1 (D's prefix cache reset)", "via": "decode",
         "prompt": n1[:300] + tokens(60), "max_tokens": max_tokens, "reset_decode": True,
         "lmcache": "null-slot"},
    ]


def check_served_block_size(decode: str, expected: int) -> None:
    """Raise E2EError unless the decode instance serves blocks of ``expected`` tokens
    (``block_size`` of its ``vllm:cache_config_info``): the scenario's lengths (L1, the
    pool with speculative decoding) were derived from it."""
    served = metrics.info_label(metrics.scrape(decode), metrics.CACHE_CONFIG_INFO,
                                "block_size")
    if served != str(expected):
        raise E2EError(f"the decode instance serves blocks of {served} tokens; the scenario "
                       f"was derived for {expected} (pair.served_block_size)")


def run_correctness(
    pair: Pair, procs: Processes, vocab_size: int, opts: CorrectnessOptions, log: Log
) -> dict:
    from concurrent.futures import ThreadPoolExecutor

    if opts.served_block_size is not None:
        check_served_block_size(pair.decode, opts.served_block_size)
    cases = correctness_cases(vocab_size, opts)
    extra = {"logprobs": TOP_LOGPROBS}
    trouble = (lmcache_mod.Trouble(procs.log_dir / "decode.log", procs.log_dir / "lmcache.log")
               if opts.lmcache else None)
    warm_up(pair, procs, vocab_size, opts.block_size // 2, log)

    def run(url: str, case: dict) -> Completion:
        return complete(url, case["prompt"], case["max_tokens"], procs, extra=extra)

    def reference(case: dict) -> None:
        # The reference: the prefill instance alone, cold for every prompt.
        post(f"{pair.prefill}/reset_prefix_cache")
        case["reference"] = run(pair.prefill, case)
        post(f"{pair.prefill}/reset_prefix_cache")

    first = [c for c in cases if c.get("attempt", 1) == 1  # retries: when they run
             and not (opts.fail_fast and c["group"] == 1)]  # fail_fast: when they run
    for case in first:
        reference(case)
    log(f"  reference outputs of {len(first)} prompts from the prefill instance alone")

    def url(case: dict) -> str:
        return pair.front if case["via"] == "pd" else pair.decode

    rows = []
    first: dict[int, Completion] = {}
    lmcache_loads = (
        lmcache_mod.RetrievedTokens(procs.log_dir / "lmcache.log") if opts.lmcache else None
    )
    figures: dict = {}
    said: list[str] = []
    lmcache_hit = False
    before = settled_scrape(pair.decode, wait=0.5)
    for case in (c for c in cases if c["group"] == 0):
        if case.get("attempt", 1) > 1:
            if lmcache_hit:
                continue
            reference(case)
        if case.get("reset_decode"):
            post(f"{pair.decode}/reset_prefix_cache")
            before = settled_scrape(pair.decode, wait=0.5)
        out = first[id(case)] = run(url(case), case)
        after = settled_scrape(pair.decode)
        rows.append({**_correctness_row(case, out),
                     "decode_local_hit_tokens": int(after.delta(before, metrics.PREFIX_CACHE_HITS)),
                     # vLLM counts one external hit per request, whichever child served it:
                     # NIXL for a remote prefill, LMCache for a plain request to D.
                     "decode_external_hit_tokens": int(
                         after.delta(before, metrics.EXTERNAL_PREFIX_CACHE_HITS)),
                     "kv_bytes_transferred": int(after.delta(before, metrics.NIXL_BYTES))})
        drafts = metrics.acceptance(after, before)
        if drafts is not None:  # speculative decoding: D's drafts for this request
            rows[-1]["decode_draft_tokens"] = drafts["draft_tokens"]
            rows[-1]["decode_accepted_tokens"] = drafts["accepted_tokens"]
        before = after
        by_child = ""
        if lmcache_loads is not None:
            # LMCache's share from its server's log, NIXL's the rest of vLLM's count.
            lm = rows[-1]["decode_external_hit_tokens_lmcache"] = lmcache_loads.take()
            rows[-1]["decode_external_hit_tokens_nixl"] = (
                rows[-1]["decode_external_hit_tokens"] - lm)
            by_child = f" (NIXL {rows[-1]['decode_external_hit_tokens_nixl']}, LMCache {lm})"
            said += trouble.take()
            if case.get("lmcache") == "hit":
                lmcache_hit = lmcache_hit or lm > 0
                if lm == 0:
                    # What the logs said since the last hit case (or the run's start).
                    figures.setdefault("lmcache_not_served", []).append(
                        {"label": case["label"], "log_lines": said[-5:]})
                    log(f"  {case['label']}: LMCache served no hit; its logs say: "
                        + ("; ".join(said[-5:]) or "nothing of a fault"))
                said = []
        log(f"  {case['label']}: decode local hit {rows[-1]['decode_local_hit_tokens']} tokens, "
            f"external {rows[-1]['decode_external_hit_tokens']}{by_child}, "
            f"KV bytes {rows[-1]['kv_bytes_transferred']}, "
            f"{out.latency_ms / 1e3:.2f} s, "
            f"{'equal to' if rows[-1]['equal'] else 'parts from'} the free-running reference "
            f"{rows[-1]['note']}".rstrip())
        if opts.fail_fast and not rows[-1]["equal"]:
            log(f"  stopping at {case['label']} (--fail-fast): no concurrent requests, "
                "no teacher-forced scoring")
            return {
                "requests": rows,
                **figures,
                "outputs_match_baseline": False,
                "checks": {
                    "outputs_equal_reference": False,
                    "decode_local_hit": len(rows) > 1 and rows[1]["decode_local_hit_tokens"] > 0,
                },
                "stopped_early": case["label"],
            }
    group = [c for c in cases if c["group"] == 1]
    if opts.fail_fast:
        for case in group:
            reference(case)
    # The concurrent requests reach D together, so that they exhaust its pool whatever
    # the two instances' speeds: the proxy's two steps run here, every prefill first (P
    # keeps each prompt's KV until D pulls it), then every decode at once. Through the
    # proxy each decode left when its own prefill ended, and a D that decoded faster
    # than P prefilled held one request at a time: a CI run saw 0 preemptions.
    with ThreadPoolExecutor(len(group)) as pool:
        ids = [f"hybridpd-concurrent-{i}-{uuid.uuid4().hex}" for i in range(len(group))]
        params = list(pool.map(
            lambda c, rid: prefill_for_remote_decode(pair.prefill, c["prompt"], rid, procs)
            if c["via"] == "pd" else None, group, ids))

        def decode(c: dict, rid: str, kv: dict | None) -> Completion:
            if kv is None:
                return run(url(c), c)
            return complete(pair.decode, c["prompt"], c["max_tokens"], procs,
                            extra={**extra, "kv_transfer_params": kv},
                            headers={"X-Request-Id": rid})

        outs = list(pool.map(decode, group, ids, params))
    after = settled_scrape(pair.decode)
    preemptions = int(after.delta(before, metrics.NUM_PREEMPTIONS))
    figures["decode_preemptions"] = preemptions
    drafts = metrics.acceptance(after, before)
    if drafts is not None:
        figures["decode_speculative_concurrent"] = drafts
    if lmcache_loads is not None:
        # Resumed requests may load from LMCache what D stored of them before.
        figures["decode_lmcache_tokens_concurrent"] = lmcache_loads.take()
    rows += [_correctness_row(c, o) for c, o in zip(group, outs)]
    # Every output is then scored on its own tokens by the prefill instance alone, cold
    # (compare_teacher_forced): the free-running comparison stops checking at the first
    # near-tie, this one checks every token.
    done = {**first, **{id(c): o for c, o in zip(group, outs)}}
    by_label = {case["label"]: case for case in cases}
    for row in rows:
        case = by_label[row["label"]]
        out = done[id(case)]
        post(f"{pair.prefill}/reset_prefix_cache")
        scored = score(pair.prefill, case["prompt"] + out.token_ids, TOP_LOGPROBS, procs)
        ok, note = compare_teacher_forced(out, len(case["prompt"]), scored)
        row["free_running"] = {"equal": row["equal"], "note": row["note"]}
        row["equal"], row["note"] = ok, note
        if not ok or not row["free_running"]["equal"]:
            log(f"  {case['label']}: free-running: {row['free_running']['note'] or 'equal'}; "
                f"teacher-forced: {note}")
    log(f"  {len(group)} concurrent requests: {preemptions} preemptions on the decode instance, "
        + (f"{figures['decode_lmcache_tokens_concurrent']} tokens loaded from LMCache, "
           if lmcache_loads is not None else "")
        + f"{sum(r['equal'] for r in rows[-len(group):])} agree with the model teacher-forced")
    checks = {
        "outputs_equal_reference": all(r["equal"] for r in rows),
        "decode_local_hit": rows[1]["decode_local_hit_tokens"] > 0,
        "preemption_forced": preemptions > 0,
    }
    if opts.lmcache:
        lm = {c["label"]: c["lmcache"] for c in cases if c.get("lmcache")}
        # An L2 must take its prefix from LMCache (else the state binding is not
        # exercised); each attempt before it is a row of its own.
        checks["lmcache_served_a_hit"] = any(
            r["decode_external_hit_tokens_lmcache"] > 0
            for r in rows if lm.get(r["label"]) == "hit"
        )
    return {
        "requests": rows,
        **figures,
        "outputs_match_baseline": checks["outputs_equal_reference"],
        "checks": checks,
    }


def _correctness_row(case: dict, out: Completion) -> dict:
    ref = case["reference"]
    equal, note = compare_with_reference(out, ref)
    return {
        "label": case["label"],
        "via": case["via"],
        "prompt_tokens": len(case["prompt"]),
        "output_token_ids": out.token_ids,
        "reference_token_ids": ref.token_ids,
        "output_token_logprobs": out.token_logprobs,
        "reference_token_logprobs": ref.token_logprobs,
        "equal": equal,
        "note": note,
        "common_prefix_tokens": common_prefix(out.token_ids, ref.token_ids),
        "ttft_ms": out.ttft_ms,
        "latency_ms": out.latency_ms,
    }
