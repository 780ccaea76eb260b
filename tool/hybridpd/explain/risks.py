"""Question 5 of ``explain``: the known correctness risks of a deployment, from the
series' records (``[[risks]]`` in ``series.toml`` and in the series hosted on it, such
as LMCache's), never from a table in code.

A risk applies when every fact its ``when`` table names holds for the deployment; the
facts come from the options and from what vLLM answered on each tree (prefix caching,
Mamba cache mode, ``max_num_batched_tokens`` and the block size vLLM resolved). Whether
it is fixed on a side is its ``fixed_by`` patch's state on the pin (for a hosted
series, on the release of its project the deployment runs): upstream (fixed on stock
too), carried (fixed with the series), dropped or absent (open).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridpd.series.model import Pin, Risk, Series, load

SIDES = ("stock", "patched")


def hosted_series(series: Series) -> list[Series]:
    """``series`` and the series whose patch tests it hosts (``[test] host``), e.g.
    LMCache's beside vLLM's: a deployment with the series runs both."""
    found = [series]
    for path in sorted(series.dir.glob("*/series.toml")):
        other = load(path)
        host = other.test.host_series if other.test else None
        if host is not None and Path(host).resolve() == series.path.resolve():
            found.append(other)
    return found


def connector_names(kv: dict | None) -> set[str]:
    """The connector class names a ``--kv-transfer-config`` configures, a
    MultiConnector's children (at any depth) included."""
    if not kv:
        return set()
    children = (kv.get("kv_connector_extra_config") or {}).get("connectors") or []
    return {kv.get("kv_connector", "")} | set().union(*map(connector_names, children))


#: The steps whose error is vLLM refusing the deployment (the decode-side step drives
#: a scheduler that started; its errors are explain's, not a refusal).
_STARTING_STEPS = ("start", "groups", "scheduler")


def refused(answer: dict) -> bool:
    """Whether vLLM refused the deployment on this tree (a step's error that is vLLM's
    verdict, not one explain cannot answer)."""
    steps = answer.get("steps", {})
    return any("error" in steps[name] and "unknown" not in steps[name]
               for name in _STARTING_STEPS if name in steps)


@dataclass(frozen=True)
class Facts:
    """What a risk's ``when`` is matched against on one tree; None: not known
    (vLLM did not answer that step)."""

    connectors: frozenset[str]
    speculative_decoding: bool
    prefix_caching: bool | None
    mamba_cache_mode: str | None
    max_num_batched_tokens: int | None
    block_size: int | None
    #: vLLM refused the deployment on this tree: nothing of it runs, no risk applies.
    refused: bool = False

    @classmethod
    def of(cls, kv: dict | None, num_speculative_tokens: int, answer: dict) -> Facts:
        steps = answer.get("steps", {})
        start = steps.get("start", {}) if "error" not in steps.get("start", {}) else {}
        groups = steps.get("groups", {}) if "error" not in steps.get("groups", {}) else {}
        return cls(frozenset(connector_names(kv)), num_speculative_tokens > 0,
                   start.get("enable_prefix_caching"), start.get("mamba_cache_mode"),
                   start.get("max_num_batched_tokens"), groups.get("block_size"),
                   refused(answer))

    def holds(self, key: str, value: Any) -> bool | None:
        if key == "connectors":
            return "*" in value and bool(self.connectors) or bool(self.connectors & set(value))
        if key == "speculative_decoding":
            return self.speculative_decoding == value
        if key == "prefix_caching":
            return None if self.prefix_caching is None else self.prefix_caching == value
        if key == "mamba_cache_mode":
            return None if self.mamba_cache_mode is None else self.mamba_cache_mode in value
        if key == "max_num_batched_tokens_at_least_blocks":
            if self.max_num_batched_tokens is None or self.block_size is None:
                return None
            return self.max_num_batched_tokens >= value * self.block_size
        raise KeyError(key)  # the series parser admits no other key

    def matches(self, risk: Risk) -> bool | None:
        """True when every condition holds, False when one does not, None when one
        cannot be told and none fails."""
        if self.refused:
            return False
        said = [self.holds(k, v) for k, v in risk.when.items()]
        return False if False in said else (None if None in said else True)


def _fixed(series: Series, risk: Risk, release: str, hosted: bool) -> dict[str, str | None]:
    """Per side, how the risk is fixed (None: open), from its fix's state on the
    deployment's ``release`` of ``series``'s project (a release the series does not pin
    has no fix of it: open)."""
    if risk.fixed_by is None:
        return {side: None for side in SIDES}
    patch = series.patch(risk.fixed_by)
    assert patch is not None  # the series parser checks fixed_by
    state = patch.pins.get(release)
    if state is None:
        return {side: None for side in SIDES}
    if state.state == "upstream":
        said = f"fixed upstream in {series.project} {state.release}"
        return {"stock": said, "patched": said}
    if state.state == "carried":
        on = f" (hybridpd's {series.project} series, on {series.project} {release})"
        return {"stock": None, "patched": f"fixed by {patch.id}" + (on if hosted else "")}
    return {side: None for side in SIDES}  # dropped: the record says why


def assess(vllm: Series, pin: Pin, kv: dict | None, num_speculative_tokens: int,
           answers: dict[str, dict], hosted_versions: dict[str, str] | None = None) -> list[dict]:
    """The records' risks that apply (or may: a fact vLLM did not answer) to the
    deployment on either tree, each with its links and its fix state per side: on
    vLLM ``pin``, and on the version of each hosted series' project the deployment
    runs (``hosted_versions``, by package; the series' default pin unless given)."""
    facts = {side: Facts.of(kv, num_speculative_tokens, answers.get(side, {}))
             for side in SIDES}
    out = []
    for series in hosted_series(vllm):
        on = pin.version if series is vllm else (hosted_versions or {}).get(
            series.package, series.default_pin)
        for risk in series.risks:
            applies = {side: facts[side].matches(risk) for side in SIDES}
            if all(a is False for a in applies.values()):
                continue
            dropped = None
            if risk.fixed_by:
                state = series.patch(risk.fixed_by).pins.get(on)
                if state is not None and state.state == "dropped":
                    dropped = series.patch(risk.fixed_by).why_dropped
            out.append({
                "id": risk.id, "project": series.project, "says": risk.says,
                "links": [{"ref": l, "url": Risk.url(l)} for l in risk.links],
                "unless": risk.unless, "fixed_by": risk.fixed_by,
                "applies": applies, "fixed": _fixed(series, risk, on, series is not vllm),
                **({"fix_dropped": dropped} if dropped else {}),
            })
    return out
