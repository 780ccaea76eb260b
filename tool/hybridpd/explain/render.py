"""``explain``'s verdict lines: one per question, stock and with the series."""

from __future__ import annotations

import json
from collections import Counter

from .runner import SIDES, Explained

#: The questions, in the driver's step order, and how each is named.
QUESTIONS = (("start", "config accepted"), ("groups", "KV cache groups"),
             ("scheduler", "scheduler and connector"))
#: What the answers are not: said once, above them.
CAVEAT = ("  (a CPU engine of this pin answered: block sizes are rounded to its attention "
          "kernels, max_num_batched_tokens and async scheduling are its defaults unless "
          "given; tensor parallel 1, no speculative decoding; the connectors' worker side "
          "(KV cache registration) is not run)")
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
            f"max_num_batched_tokens {step['max_num_batched_tokens']}")


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
    return (f"{built}, scheduler-side connector {connector}" if connector
            else f"{built}, no KV connector")


_FORMAT = {"start": _start, "groups": _groups, "scheduler": _scheduler}


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
    return _FORMAT[key](step)


def lines(result: Explained) -> list[str]:
    kv = json.dumps(result.kv_transfer_config) if result.kv_transfer_config else "none"
    out = [f"explain: vLLM {result.version}, model {result.model}, "
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
        said = {side: verdict(result.answers[side], key) for side in answered}
        if len(set(said.values())) == 1:
            both = " (stock and with the series)" if len(said) == 2 else (
                f" ({SIDE_NAMES[answered[0]]})")
            out.append(f"{n}. {title}: {next(iter(said.values()))}{both}")
            continue
        out.append(f"{n}. {title}:")
        out += [f"   {SIDE_NAMES[side]}: {said[side]}" for side in answered]
    out.append(f"took {result.seconds:.1f} s")
    return out
