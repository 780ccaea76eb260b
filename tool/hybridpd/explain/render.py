"""``explain``'s verdict lines: one per question, stock and with the series."""

from __future__ import annotations

import json
from collections import Counter

from hybridpd.explain import risks as risks_mod
from hybridpd.explain.runner import SIDES, Explained

#: The questions, in the driver's step order, and how each is named.
QUESTIONS = (("start", "config accepted"), ("groups", "KV cache groups"),
             ("scheduler", "scheduler and connector"),
             ("decode_hit", "decode-side prefix hits"))
#: Question 3's followers, as the verdict lines name them.
FOLLOWER_NAMES = {"remote_prefill": "remote prefill",
                  "remote_prefill_prefix_plus_one": "remote prefill of the prefix + 1 token",
                  "plain": "plain request"}
#: What the answers are not: said once, above them.
CAVEAT = ("  (a CPU engine of this pin answered: block sizes are rounded to its attention "
          "kernels, max_num_batched_tokens and async scheduling are its defaults unless "
          "given; with tensor parallel, rank 0's layers, groups and pool (nothing "
          "communicates); --num-speculative-tokens only matched against the known "
          "risks, --speculative-config built in (the drafter's own layers are not in the "
          "groups); the connectors' worker side (KV cache registration) is not run)")
SIDE_NAMES = {"stock": "stock", "patched": "with the series"}


def _refused(step: dict) -> str:
    said = f"{step['error']} ({step['raised_at']})"
    if "unknown" in step:
        return f"unknown here: {step['unknown']}; vLLM raised {said}"
    return f"refused: {said}"


def _start(step: dict) -> str:
    manager = "kept" if step["hybrid_kv_cache_manager"] else "turned off"
    return (f"yes ({step['architecture']}); hybrid KV cache manager "
            f"{manager}, mamba_cache_mode {step['mamba_cache_mode']}, prefix caching "
            f"{'on' if step['enable_prefix_caching'] else 'off'}, "
            f"max_num_batched_tokens {step['max_num_batched_tokens']}"
            + (f", tensor parallel {step['tensor_parallel_size']} (one rank's KV cache below)"
               if step.get("tensor_parallel_size", 1) > 1 else ""))


def _groups(step: dict) -> str:
    kinds = Counter()
    for g in step["groups"]:
        detail = g["type"]
        if g.get("sliding_window"):
            detail += f" (window {g['sliding_window']})"
        if g["type"] == "MambaSpec":
            detail += f" ({g.get('mamba_cache_mode')})"
        kinds[(detail, g["layers"])] += 1
    parts = [f"{n} x {detail} of {layers} layers" for (detail, layers), n in kinds.items()]
    padded = step.get("mamba_page_size_padded")
    return (f"block size {step['block_size']} tokens; {', '.join(parts)}"
            + (f"; Mamba pages padded to {padded} bytes" if padded else "")
            + f"; {step['num_blocks']} blocks"
            + (f" in {step['kv_cache_bytes'] / (1 << 30):g} GiB" if "kv_cache_bytes" in step
               else ""))


def _scheduler(step: dict) -> str:
    connector = step.get("connector")
    if connector and step.get("children"):
        connector += f"[{', '.join(step['children'])}]"
    built = f"{step.get('class', 'scheduler')} built"
    stand_in = f" ({step['stand_in']})" if step.get("stand_in") else ""
    text = (f"{built}, scheduler-side connector {connector}{stand_in}" if connector
            else f"{built}, no KV connector")
    events = kv_events_line(step)
    if events:
        text += f"; {events}"
    spec = step.get("speculative")
    if spec:
        modules = {True: " (one draft module per token)",
                   False: " (one draft module, reused)"}.get(spec.get("multi_module_mtp"), "")
        text += (f"; speculative decoding {spec['method']}, {spec['num_speculative_tokens']} "
                 f"tokens{modules}: "
                 f"{spec['lookahead_slots']} lookahead slot(s) per request, prefill lookahead "
                 f"{spec['prefill_lookahead_tokens']}"
                 + (f", NIXL backs off {spec['nixl_prefill_backoff']} prompt token(s)"
                    if spec.get("nixl_prefill_backoff") is not None else "")
                 + (", a hit drops its last matched block" if spec["drops_last_matched_block"]
                    else ", a hit keeps its last matched block"))
    return text


def kv_events_line(step: dict) -> str | None:
    """What a prefix-aware router reading this instance's KV events needs: the block
    size ``BlockStored`` events carry (``--kv-event-block-size``), that Mamba groups
    announce only their state blocks, and how this tree's events pair those hashes
    with tokens and parents (vllm#44451 on stock; measured, not read from the patch
    names)."""
    groups = step.get("kv_events")
    if not groups:
        return None
    sizes = sorted({g["block_size"] for g in groups})
    if len(sizes) == 1:
        text = (f"KV events carry block_size {sizes[0]}: a router needs "
                f"--kv-event-block-size {sizes[0]}")
    else:
        per_group = ", ".join(f"group {g['group_idx']} ({g['type']}) {g['block_size']}"
                              for g in groups)
        text = (f"KV events carry a block_size per group ({per_group}): a router that "
                "takes one --kv-event-block-size reads only the groups of that size")
    hash_block_size = step.get("hash_block_size")
    if hash_block_size and hash_block_size not in sizes:
        text += (f" (prefix entries at the hash block size, {hash_block_size}, are "
                 "announced with their own block_size)")
    align = [g["group_idx"] for g in groups if g.get("mamba_cache_mode") == "align"]
    if align:
        text += (f"; the Mamba groups ({len(align)}, align mode) announce only the blocks "
                 f"that hold a state, {_stored_events(step.get('block_stored'))}: a prefix "
                 "counts up to its last block announced by every group, not by the "
                 "full-attention group alone")
    return text


def _stored_events(measured: dict | None) -> str:
    """What this tree's block pool was seen to publish for a group that skips blocks
    (the driver's ``block_stored``): per run, or over the whole range (stock)."""
    if not measured or "per_run" not in measured:
        why = (measured or {}).get("error", "not measured")
        return f"their BlockStored token_ids and parents unknown here ({why})"
    if measured["per_run"]:
        return ("one BlockStored per run of cached blocks, each hash with its own "
                "token_ids and the run's parent the hash of the block before it")
    return "with token_ids over every block of the range (vllm#44451)"


def _follower(said: dict) -> str:
    """One follower's answer: its local hit, the load beside it, and the Mamba state
    it resumes from (the invariant: none may resume where no state exists)."""
    if "error" in said:
        return _refused(said)
    if "unknown" in said:
        return f"unknown here: {said['unknown']}"
    local, loaded = said["local_hit_tokens"], said["external_tokens"]
    hit = f"local hit {local}" if local else "no local hit"
    if loaded:
        hit += f", {loaded} loaded by {said['served_by']}"
    state = said["mamba_state"]
    if state == "missing":
        return f"{hit}; NO Mamba state at {said['resume_point']} ({said['problem']})"
    return hit + {"not needed": " (computes from 0)",
                  "loaded": f"; Mamba state at {said['resume_point']} from the load",
                  "unchecked": f"; the load's Mamba state at {said['resume_point']} is not "
                               "checked",
                  "cached": f"; Mamba state at {said['resume_point']} cached"}[state]


def _donor_mamba(left: list[dict] | None) -> str:
    """What the donor left of Mamba state inside the prefix, as the block pool held it."""
    if left is None:
        return "the Mamba state inside them not measured"
    held = [g for g in left if g["blocks"]]
    if not held:
        return (f"no Mamba state cached inside them (none in any of the {len(left)} Mamba "
                "groups)")
    at = ", ".join(f"group {g['group']} at block{'s' * (len(g['blocks']) > 1)} "
                   f"{', '.join(map(str, g['blocks']))}" for g in held)
    rest = f" (none in the other {len(left) - len(held)})" if len(held) < len(left) else ""
    return f"Mamba state cached inside them in {at}{rest}"


def _decode_hit(step: dict) -> str:
    """The whole answer on one line (where the two trees agree on every follower)."""
    return "; ".join(f"{FOLLOWER_NAMES.get(r['kind'], r['kind'])}: {_follower(r)}"
                     for r in step["requests"])


_FORMAT = {"start": _start, "groups": _groups, "scheduler": _scheduler,
           "decode_hit": _decode_hit}


def verdict(answer: dict, key: str) -> str:
    steps = answer.get("steps", {})
    if key not in steps:
        return "not reached"
    step = steps[key]
    if "timeout" in step:
        return f"no answer within {step['timeout']:.0f} s (stopped there; log {step['log']})"
    if "exited" in step:
        return f"the driver died here (exit {step['exited']}; log {step['log']})"
    if "error" in step:
        return _refused(step)
    if "unknown" in step:
        return f"unknown here: {step['unknown']}"
    if "not_applicable" in step:
        return f"does not apply: {step['not_applicable']}"
    return _FORMAT[key](step)


def lines(result: Explained) -> list[str]:
    kv = json.dumps(result.kv_transfer_config) if result.kv_transfer_config else "none"
    out = [f"explain: vLLM {result.pin.version}, model {result.model}, "
           f"kv_transfer_config {kv}"]
    if result.note:
        out.append(f"  note: {result.note}")
    answered = [side for side in SIDES if "failed" not in result.answers.get(side, {})]
    for side in SIDES:
        if side not in answered:
            failed = result.answers.get(side, {}).get("failed", "no answer")
            out.append(f"  {SIDE_NAMES[side]}: unknown here: {failed}")
    if answered:
        out.append(CAVEAT)
    for n, (key, title) in enumerate(QUESTIONS, 1):
        if not answered:
            break
        if key == "decode_hit" and _per_follower(result, answered):
            out += _decode_hit_lines(n, title, result, answered)
        else:
            said = {side: verdict(result.answers[side], key) for side in answered}
            out += _side_by_side(f"{n}. {title}", said, answered, "   ")
        if key == "decode_hit":
            out += _hang_lines(result, answered)
    if answered:
        refused = all(risks_mod.refused(result.answers[side]) for side in answered)
        out += _risk_lines(len(QUESTIONS) + 1, result.risks, refused)
    out.append(f"took {result.seconds:.1f} s")
    return out


def _per_follower(result: Explained, answered: list[str]) -> bool:
    """Whether question 3 was measured on every answered tree (one line per follower
    then, the trees side by side)."""
    return all("requests" in result.answers[side].get("steps", {}).get("decode_hit", {})
               for side in answered)


def _decode_hit_lines(n: int, title: str, result: Explained, answered: list[str]) -> list[str]:
    steps = {side: result.answers[side]["steps"]["decode_hit"] for side in answered}
    first = steps[answered[0]]
    left = {side: _donor_mamba(steps[side].get("donor_prefix_mamba")) for side in answered}
    mamba = left[answered[0]] if len(set(left.values())) == 1 else "; ".join(
        f"{SIDE_NAMES[side]}: {left[side]}" for side in answered)
    out = [f"{n}. {title} (a donor remote prefill left {first['cached_prefix_tokens']} "
           f"prefix tokens of attention KV cached on the decode instance, {mamba}; then "
           "each follower on a fresh instance):"]
    kinds = [r["kind"] for r in first["requests"]]
    for kind in kinds:
        said = {side: _follower(next(r for r in steps[side]["requests"] if r["kind"] == kind))
                for side in answered}
        out += _side_by_side(f"   {FOLLOWER_NAMES.get(kind, kind)}", said, answered, "      ")
    return out


def _hang_lines(result: Explained, answered: list[str]) -> list[str]:
    """Under question 4, where the driver probed them (``hangs``): the remote
    prefills one token and more past a block boundary, up to the drafter's prefill
    lookahead, each served or where it waits, on each tree's own scheduler."""
    steps = {side: result.answers[side].get("steps", {}).get("hangs") for side in answered}
    if not any(steps.values()):
        return []

    def said(step: dict | None) -> str:
        if step is None:
            return "not reached"
        if "lookahead_chunk" not in step:
            return verdict({"steps": {"hangs": step}}, "hangs")
        probes = step["lookahead_chunk"]
        if isinstance(probes, dict):
            return _refused(probes) if "error" in probes else str(probes)
        return "; ".join(
            f"{p['prompt_tokens']} tokens: " + (
                "served" if p["served"] else
                f"NEVER SERVED ({p.get('waits') or p.get('problem')})")
            for p in probes)

    lookahead = next((s["prefill_lookahead_tokens"] for s in steps.values()
                      if s and "prefill_lookahead_tokens" in s), None)
    head = ("   remote prefills of 2 blocks + 1 token and more"
            + (f" (the drafter's prefill lookahead: {lookahead})" if lookahead else ""))
    return _side_by_side(head, {side: said(steps[side]) for side in answered}, answered,
                         "      ")


def _side_by_side(head: str, said: dict[str, str], answered: list[str],
                  indent: str) -> list[str]:
    """``head: answer (stock and with the series)`` when the trees agree, else ``head:``
    and a line per tree indented by ``indent``."""
    if len(set(said.values())) == 1:
        both = " (stock and with the series)" if len(said) == 2 else (
            f" ({SIDE_NAMES[answered[0]]})")
        return [f"{head}: {next(iter(said.values()))}{both}"]
    return [f"{head}:", *(f"{indent}{SIDE_NAMES[side]}: {said[side]}" for side in answered)]


def _risk_lines(n: int, risks: list[dict], refused: bool = False) -> list[str]:
    """Question 5, from the series' records: the risks open on a side first, then
    those both trees have fixed."""
    title = f"{n}. known correctness risks (the series' records)"
    open_ = [r for r in risks if None in r["fixed"].values()]
    fixed = [r for r in risks if None not in r["fixed"].values()]
    if not risks:
        return [f"{title}: " + ("none: vLLM refuses the deployment" if refused
                                else "none of them matches this deployment")]
    out = [f"{title}:"]
    for r in open_:
        links = f" [{', '.join(l['ref'] for l in r['links'])}]" if r["links"] else ""
        maybe = (" (may apply: vLLM did not answer a fact it depends on)"
                 if None in r["applies"].values() else "")
        unless = f"; unless {r['unless']}" if r.get("unless") else ""
        out.append(f"   - {r['project']}: {r['says']}{links}{maybe}{unless}")
        state = {side: "does not apply" if r["applies"].get(side) is False
                 else r["fixed"][side] or "open" for side in ("stock", "patched")}
        if r.get("fix_dropped"):
            state = {side: f"{s} ({r['fixed_by']} dropped: {r['fix_dropped']})"
                     for side, s in state.items()}
        if state["stock"] == state["patched"]:
            out.append(f"     {state['stock']} (stock and with the series)")
        else:
            out.append(f"     stock: {state['stock']}; with the series: {state['patched']}")
    if fixed:
        out.append("   fixed on stock too: " + "; ".join(
            f"{r['id']} ({r['fixed']['stock']})" for r in fixed))
    return out
