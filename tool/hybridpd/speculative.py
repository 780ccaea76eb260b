"""``--speculative-config JSON`` (vLLM's option) and ``--num-speculative-tokens N``, its
shorthand for single-module MTP, as ``bench replay`` and ``explain`` take them.

Both commands build the decode instance's scheduler with vLLM's own
``SpeculativeConfig``; what they model is MTP (``"method": "mtp"``), the drafter
Qwen3.5-style checkpoints ship. How many MTP modules the checkpoint has is the
model's, not the option's: vLLM reads it from the model config
(``mtp_num_hidden_layers``, ``num_nextn_predict_layers``), so a single module (Qwen3.5)
is reused ``num_speculative_tokens`` times and a checkpoint of several modules runs
one per token.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from hybridpd.errors import UsageError

#: The model config keys vLLM reads a checkpoint's MTP module count from.
MODULE_KEYS = ("mtp_num_hidden_layers", "num_nextn_predict_layers")
#: The methods the scheduler-side model covers.
METHODS = ("mtp",)


@dataclass(frozen=True)
class Speculative:
    method: str
    num_speculative_tokens: int

    def to_json(self) -> dict[str, Any]:
        return {"method": self.method, "num_speculative_tokens": self.num_speculative_tokens}


def load(config_json: str) -> dict[str, Any]:
    """vLLM's ``--speculative-config`` JSON object, as it is; bad input is one line."""
    try:
        data = json.loads(config_json)
    except ValueError as exc:
        raise UsageError(f"--speculative-config: not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise UsageError("--speculative-config: a JSON object, as vLLM's own option takes")
    return data


def parse(config_json: str | None, num_speculative_tokens: int | None) -> Speculative | None:
    """The speculative decoding the options ask for, or None; bad input is one line."""
    if config_json is not None and num_speculative_tokens is not None:
        raise UsageError("give --speculative-config or --num-speculative-tokens, not both")
    if num_speculative_tokens is not None:
        if num_speculative_tokens < 1:
            raise UsageError(f"--num-speculative-tokens {num_speculative_tokens}: at least 1")
        return Speculative("mtp", num_speculative_tokens)
    if config_json is None:
        return None
    data = load(config_json)
    method = data.get("method")
    if method not in METHODS:
        raise UsageError(f"--speculative-config: method {method!r} is not modelled "
                         f"(only {', '.join(repr(m) for m in METHODS)})")
    n = data.get("num_speculative_tokens")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise UsageError("--speculative-config: num_speculative_tokens must be a positive "
                         f"integer, not {n!r}")
    unknown = sorted(set(data) - {"method", "num_speculative_tokens"})
    if unknown:
        raise UsageError(f"--speculative-config: {', '.join(unknown)} not modelled "
                         "(method and num_speculative_tokens are)")
    return Speculative(method, n)


def mtp_modules(model_config: dict[str, Any]) -> int:
    """The checkpoint's MTP module count (1 where the config does not say: Qwen3.5)."""
    for key in MODULE_KEYS:
        value = model_config.get(key)
        if isinstance(value, int) and value >= 1:
            return value
    return 1
