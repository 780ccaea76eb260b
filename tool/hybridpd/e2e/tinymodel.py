"""A small random-weight Qwen3.5-architecture model, written locally and reproducibly.

The e2e runs need a hybrid model that vLLM loads through its real code paths (config,
tokenizer, safetensors weight loading) without a model hub. ``load_format="dummy"`` is
not enough: dummy weights make every position predict the same token, so "outputs
equal" would compare constant sequences and prove nothing. This module writes:

- ``config.json``: ``Qwen3_5ForCausalLM`` / ``model_type "qwen3_5_text"``, 4 layers
  (3 ``linear_attention`` Gated-DeltaNet + 1 ``full_attention``), hidden 256;
- a byte-level BPE tokenizer trained with ``tokenizers`` on generated text and saved as
  a ``PreTrainedTokenizerFast`` (loads offline through ``AutoTokenizer``);
- ``model.safetensors`` in bf16 from transformers' own ``Qwen3_5ForCausalLM`` init,
  seeded, with the embedding and LM head scaled up so that greedy decoding moves
  between many tokens and is not decided by bf16 rounding at every step.

Same seed, same bytes: everything is seeded and written in a fixed order, and
``hybridpd-tiny.json`` records the sha256 of every file.

This file runs as a script inside the e2e virtualenv (it needs torch, transformers and
tokenizers, which that venv has for vLLM); the hybridpd side only imports the
constants and :func:`spec_id`, so the module imports nothing heavy at the top.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import sys
from pathlib import Path

GENERATOR_VERSION = 1

#: Architectures the tiny model can take. ``qwen3_5`` is the target. ``qwen3_next``
#: is its stand-in where vLLM cannot import its Qwen3.5 module: vLLM's qwen3_5.py
#: imports qwen3_vl.py, which imports transformers' Qwen2-VL image processor, which
#: imports torchvision at module level; the index serves torchvision only linked
#: against CUDA torch, and beside a CPU torch its import fails ("operator
#: torchvision::nms does not exist"). Qwen3.5's text decoder *is* Qwen3-Next's
#: (``Qwen3_5DecoderLayer`` subclasses ``Qwen3NextDecoderLayer``: the same
#: Gated-DeltaNet and gated full-attention layers, the same MambaSpec +
#: FullAttentionSpec KV cache groups). Layers 0-2 get dense MLPs like Qwen3.5's; vLLM's
#: Qwen3-Next refuses a model without any MoE layer, so the last one has 4 small
#: experts (the KV cache does not depend on the MLP).
ARCHITECTURES = {
    "qwen3_5": {"architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text"},
    "qwen3_next": {
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "mlp_only_layers": [0, 1, 2],
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 256,
        "shared_expert_intermediate_size": 256,
        "decoder_sparse_step": 1,
    },
}

#: What the e2e model is made of; part of the cache key.
SPEC = {
    "vocab_size": 4096,  # the BPE trainer's target; the model gets the trained size
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    "full_attention_interval": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    "linear_conv_kernel_dim": 4,
    "partial_rotary_factor": 0.25,
    "attn_output_gate": True,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "initializer_range": 0.02,
    # Applied after init: large enough that top-1 logits are separated by more than
    # bf16 rounding most of the time, small enough that the RMS norms keep it finite.
    "embedding_scale": 8.0,
    "lm_head_scale": 8.0,
}

#: The ``state-sensitive`` variant (the correctness scenario): with the default init the
#: embedding dominates the residual stream and the Gated-DeltaNet state barely moves the
#: greedy tokens (removing the linear-attention layers altogether changes ~8 % of them),
#: so a request resumed without its Mamba state still "matches". Scaling their output
#: projections up and making their state decay slowly (A_log, so g = -exp(A_log) *
#: softplus(.) is near 0) makes the tokens depend on the state built over the whole
#: prompt (measured in fp32: the last 32 top-1 tokens of a 600-token prompt and of its
#: last 88 tokens alone agree 0 % of the time, against 97 % with the default init).
#:
#: ``state-sensitive-mtp`` is the model an MTP run serves (with the :data:`MTP`
#: module): its greedy tokens must be predictable enough from the token before them that
#: the module's drafts are accepted, and still depend on the state. Measured in fp32
#: (teacher-forced on random 600-token prompts; "embedding-only" is the token the LM
#: head picks from the next token's normed embedding alone, the module's draft): with
#: ``state-sensitive`` it agrees with the model's next token 1 % of the time, with the
#: slow decay alone 42 %, and with the projections halved 48 %, where the last 32 top-1
#: tokens of a 600-token prompt and of its last 88 tokens still disagree 17 % of the time.
VARIANTS = {
    "default": {},
    "state-sensitive": {"linear_out_proj_scale": 16.0, "linear_a_log": -8.0},
    "state-sensitive-mtp": {"linear_out_proj_scale": 0.5, "linear_a_log": -8.0},
}
#: The MTP module ``--mtp`` adds (Qwen3.5's: ``mtp.fc`` over [norm(embedding of the next
#: token), norm(the target's last hidden state)], one full-attention decoder layer,
#: ``mtp.norm``; the embedding and LM head are the target's). Random MTP weights draft
#: tokens the target almost never takes, which would leave the accepted-token paths
#: untested. In a random-weight model the embedding carries much of the residual
#: stream, so the module drafts the token the model's LM head picks from the next
#: token's embedding alone: ``fc`` passes the embedding half through and drops the
#: hidden half, the decoder layer's output projections are ``layer_out_scale`` of a
#: random init so that it adds little, and ``mtp.norm`` is the target's final norm.
#: How often the target then agrees depends on the base weights (see VARIANTS:
#: ``state-sensitive-mtp``); the e2e holds vLLM's acceptance rate to ``ACCEPTANCE`` in
#: hybridpd.e2e.run. Seeded apart from the base weights, which stay byte for byte
#: those of the same variant without MTP.
MTP = {"layer_out_scale": 0.05, "seed_offset": 1000}
SPECIAL_TOKENS = ["<|endoftext|>", "<|pad|>"]
MANIFEST = "hybridpd-tiny.json"


def spec_id(seed: int, arch: str = "qwen3_5", variant: str = "default",
            mtp: bool = False) -> str:
    """Stable short id of (generator version, spec, arch, seed, variant, MTP): the
    model's cache key (the default variant without MTP keeps the ids it always had)."""
    key = {"v": GENERATOR_VERSION, "spec": SPEC, "arch": ARCHITECTURES[arch], "seed": seed}
    if VARIANTS[variant]:
        key["variant"] = VARIANTS[variant]
    if mtp:
        key["mtp"] = MTP
    blob = json.dumps(key, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


# --------------------------------------------------------------------------- text

_WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at "
    "which but have an they you were her she there one all we their been has more if "
    "will would so no what up out about into than them can only other new some could "
    "time these two may then do first any my now such like our over man me even most "
    "made after also did many before must through back years where much your way well "
    "down should because each just those people how too little state good very make "
    "world still own see men work long get here between both life being under never "
    "day same another know while last might us great old year off come since against "
    "go came right used take three system cache prefix decode prefill block state "
    "layer model token request attention memory transfer node server proxy metric "
    "queue batch kernel tensor hybrid mamba linear stream value key head group"
).split()


def corpus(seed: int, n_lines: int = 4000) -> list[str]:
    """Deterministic English-like training text, with digits and punctuation."""
    rng = random.Random(seed)
    lines = []
    for i in range(n_lines):
        n = rng.randint(6, 24)
        words = [rng.choice(_WORDS) for _ in range(n)]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 99999)))
        sentence = " ".join(words)
        lines.append(sentence[0].upper() + sentence[1:] + rng.choice(".,;:!?") + " ")
    return lines


# --------------------------------------------------------------------------- writing


#: The models the e2e scenarios use: the smoke scenario's and the correctness scenario's.
E2E_MODELS = (("qwen3_5", 0, "default"), ("qwen3_5", 0, "state-sensitive"))


def cached_models(root: Path) -> list[Path]:
    """The :data:`E2E_MODELS` directories under ``root`` (the e2e's model cache), each
    checked against its manifest; HybridpdError (one line) when one is missing or
    differs. (Imported by hybridpd ``bundle``; never run in the e2e venv.)"""
    from hybridpd.errors import HybridpdError

    found = []
    for arch, seed, variant in E2E_MODELS:
        path = Path(root) / f"tiny-{arch}-{spec_id(seed, arch, variant)}"
        if not (path / MANIFEST).is_file():
            raise HybridpdError(
                f"the tiny model ({variant}) is not in the cache ({path.name}): "
                "`hybridpd e2e --device cpu --tiny` writes it"
            )
        for name, sha in json.loads((path / MANIFEST).read_text())["files"].items():
            if _sha256(path / name) != sha:
                raise HybridpdError(f"{path / name} is not the file its {MANIFEST} names")
        found.append(path)
    return found


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def train_tokenizer(dest: Path, seed: int) -> int:
    """Train and save the tokenizer; returns its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=SPEC["vocab_size"],
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=SPECIAL_TOKENS[0],
        bos_token=SPECIAL_TOKENS[0],
        pad_token=SPECIAL_TOKENS[1],
        model_max_length=SPEC["max_position_embeddings"],
    )
    fast.save_pretrained(str(dest))
    return tok.get_vocab_size()


def mtp_tensors(state: dict, seed: int) -> dict:
    """The MTP module's tensors (checkpoint names, fp32) for a model whose weights are
    ``state`` (:data:`MTP`); its decoder layer has the shapes of the target's
    full-attention layer."""
    import torch

    gen = torch.Generator().manual_seed(seed + MTP["seed_offset"])
    std = SPEC["initializer_range"]
    hidden = SPEC["hidden_size"]
    full = SPEC["layer_types"].index("full_attention")
    src = f"model.layers.{full}."
    out = {}
    for name in sorted(state):
        if not name.startswith(src):
            continue
        sub, shape = name[len(src):], state[name].shape
        if len(shape) == 1:
            # Qwen3.5's RMS norms scale by (1 + weight): zero is the unit scale.
            out[f"mtp.layers.0.{sub}"] = torch.zeros(shape)
            continue
        weight = torch.randn(shape, generator=gen) * std
        if sub.endswith(("o_proj.weight", "down_proj.weight")):
            weight *= MTP["layer_out_scale"]
        out[f"mtp.layers.0.{sub}"] = weight
    # The fc's input is [embedding, hidden], each RMS-normed: the embedding half
    # passes through.
    out["mtp.fc.weight"] = torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1)
    out["mtp.pre_fc_norm_embedding.weight"] = torch.zeros(hidden)
    out["mtp.pre_fc_norm_hidden.weight"] = torch.zeros(hidden)
    out["mtp.norm.weight"] = state["model.norm.weight"].float().clone()
    return out


def write(dest: Path, seed: int = 0, arch: str = "qwen3_5", variant: str = "default",
          mtp: bool = False) -> dict:
    """Write the model into ``dest`` (created; must be empty or missing); ``mtp``: with
    its MTP module (:data:`MTP`, Qwen3.5 only), the base weights unchanged."""
    if mtp and arch != "qwen3_5":
        raise SystemExit(f"an MTP module is written for qwen3_5 only, not {arch}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    if any(dest.iterdir()):
        raise SystemExit(f"{dest} is not empty")
    vocab = train_tokenizer(dest, seed)
    if vocab > SPEC["vocab_size"]:
        raise SystemExit(f"tokenizer has {vocab} tokens, more than vocab_size")

    fields = {k: v for k, v in SPEC.items() if k not in ("embedding_scale", "lm_head_scale")}
    fields.update(ARCHITECTURES[arch])
    architectures = fields.pop("architectures")
    model_type = fields.pop("model_type")
    # The model's vocabulary is exactly the tokenizer's: an id the tokenizer cannot
    # decode would make the detokenizer, not the engine, the thing under test.
    fields["vocab_size"] = vocab
    config = AutoConfig.for_model(
        model_type,
        **fields,
        eos_token_id=0,
        bos_token_id=0,
        pad_token_id=1,
        dtype="bfloat16",
    )
    config.architectures = list(architectures)

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(SPEC["embedding_scale"])
        model.get_output_embeddings().weight.mul_(SPEC["lm_head_scale"])
        extra = VARIANTS[variant]
        for name, param in model.named_parameters():
            if "linear_out_proj_scale" in extra and name.endswith("linear_attn.out_proj.weight"):
                param.mul_(extra["linear_out_proj_scale"])
            if "linear_a_log" in extra and name.endswith("linear_attn.A_log"):
                param.fill_(extra["linear_a_log"])
    model = model.to(torch.bfloat16)
    if mtp:
        # vLLM reads the module count from the config; transformers ignores the key
        # and the mtp.* weights (Qwen3_5ForCausalLM's _keys_to_ignore_on_load_unexpected).
        model.config.mtp_num_hidden_layers = 1
    model.save_pretrained(str(dest), safe_serialization=True)
    if mtp:
        from safetensors.torch import load_file, save_file

        weights = dest / "model.safetensors"
        state = load_file(str(weights))
        mtp_weights = {k: v.to(torch.bfloat16).contiguous()
                       for k, v in mtp_tensors(state, seed).items()}
        save_file({**state, **mtp_weights}, str(weights), metadata={"format": "pt"})
    # transformers may write a generation_config with sampling defaults; the e2e runs
    # send temperature 0 explicitly, and the file must not vary between versions.
    gen = dest / "generation_config.json"
    if gen.exists():
        gen.unlink()

    files = sorted(p for p in dest.iterdir() if p.is_file() and p.name != MANIFEST)
    manifest = {
        "generator": "hybridpd.e2e.tinymodel",
        "generator_version": GENERATOR_VERSION,
        "seed": seed,
        "arch": arch,
        "architectures": list(architectures),
        "spec_id": spec_id(seed, arch, variant, mtp),
        "variant": variant,
        "vocab_size": vocab,
        "parameters": sum(p.numel() for p in model.parameters())
        + (sum(v.numel() for v in mtp_weights.values()) if mtp else 0),
        "files": {p.name: _sha256(p) for p in files},
    }
    if mtp:
        manifest["mtp_num_hidden_layers"] = 1
    (dest / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dest", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--arch", choices=sorted(ARCHITECTURES), default="qwen3_5")
    ap.add_argument("--variant", choices=sorted(VARIANTS), default="default")
    ap.add_argument("--mtp", action="store_true", help="with an MTP module (see MTP)")
    args = ap.parse_args(argv)
    manifest = write(args.dest, args.seed, args.arch, args.variant, args.mtp)
    print(json.dumps(manifest))
    return 0


if __name__ == "__main__":
    sys.exit(main())
