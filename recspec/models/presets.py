"""Model presets: small ``LlamaForCausalLM`` configurations for the target and the draft.

Both presets use untied input and output embeddings (as Llama / LC-Rec do; with ~1k identifier
tokens the output head costs only 0.5M parameters in ``target-small``), no biases, RoPE, and
``max_position_embeddings`` 512 (a 20-item history with L = 4 is 84 prompt tokens).

Parameter counts with the Amazon Beauty vocabulary (4 control + 859 identifier tokens):
``target-small`` 26,189,312 (25,305,088 in the 8 blocks, 883,712 in the two embeddings),
``draft-tiny`` 418,944 (197,888 in its block, 220,928 in the embeddings). With a full 4 x 256
vocabulary: 26.36M and 0.46M.

Cost of one forward call, fp32, 2 threads on the 2-core development CPU (median of repeated
runs on an idle machine, Beauty vocabulary), and the draft / target ratio c:
1 x 84 tokens 32-36 ms vs 0.71-0.75 ms (c = 0.021-0.022); 16 x 84 tokens 450-478 ms vs 6.8-9.2 ms
(c = 0.015-0.019); 1 x 40 new tokens over an 84-token cache 22.7 ms vs 0.66 ms (c = 0.029);
one decoding step 16 x 1 over 84 cached 17.1 vs 0.46 ms (c = 0.027), 1 x 1: 9.0 vs 0.30 ms
(c = 0.034). The draft's small calls are mostly framework overhead, so c grows as calls shrink.

:func:`measure_call_cost` times one forward call, the unit in which speculative decoding pays:
a draft call must cost a small fraction c of a target call for drafting to pay off.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from recspec.errors import RecspecError

MAX_POSITIONS = 512

PRESETS: dict[str, dict[str, Any]] = {
    "target-small": {
        "hidden_size": 512,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "intermediate_size": 1376,
    },
    "draft-tiny": {
        "hidden_size": 128,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "intermediate_size": 344,
    },
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


def preset_config(preset: str, tokenizer, **overrides: Any):
    """The ``LlamaConfig`` of a preset for ``tokenizer``'s vocabulary (``overrides`` win)."""
    from transformers import LlamaConfig

    if preset not in PRESETS:
        raise RecspecError(f"unknown model preset {preset!r}; choose one of {', '.join(PRESETS)}")
    ids = {name: getattr(tokenizer, f"{name}_token_id", None) for name in ("pad", "bos", "eos")}
    missing = [name for name, value in ids.items() if value is None]
    if missing:
        raise RecspecError(f"the tokenizer has no {', '.join(missing)} token(s); build it with build_tokenizer")
    values = {**_COMMON, **PRESETS[preset], "vocab_size": len(tokenizer), "pad_token_id": ids["pad"],
              "bos_token_id": ids["bos"], "eos_token_id": ids["eos"], **overrides}
    return LlamaConfig(**values)


def build_model(preset: str, tokenizer, seed: int = 0, **overrides: Any):
    """A freshly initialised ``LlamaForCausalLM`` of ``preset`` (float32, CPU); same seed, same weights."""
    from transformers import LlamaForCausalLM

    config = preset_config(preset, tokenizer, **overrides)
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = config.pad_token_id
    model.generation_config.bos_token_id = config.bos_token_id
    model.generation_config.eos_token_id = config.eos_token_id
    return model


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


@torch.inference_mode()
def measure_call_cost(model, batch: int, seq_len: int, repeats: int = 20, past_len: int = 0,
                      warmup: int = 3) -> float:
    """Median wall time (seconds) of one forward call on ``batch`` x ``seq_len`` new tokens.

    With ``past_len`` > 0 the call runs over a KV cache of ``past_len`` tokens (built once, not
    timed, cropped back after each call), as a verification or draft step does. Runs on the
    model's device with its dtype, in eval mode; random token ids (the cost does not depend on them).
    """
    if batch < 1 or seq_len < 1 or repeats < 1 or past_len < 0:
        raise ValueError("batch, seq_len and repeats must be positive and past_len non-negative")
    from transformers import DynamicCache

    from recspec.decoding.cache import gather_positions

    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    new = torch.randint(0, vocab, (batch, seq_len), generator=generator).to(device)
    cache = None
    if past_len:
        past = torch.randint(0, vocab, (batch, past_len), generator=generator).to(device)
        cache = DynamicCache(config=model.config)
        model(input_ids=past, past_key_values=cache, use_cache=True)
    keep = torch.arange(past_len, device=device)[None, :].expand(batch, past_len)
    positions = torch.arange(past_len, past_len + seq_len, device=device)[None, :].expand(batch, seq_len)
    mask = torch.ones(batch, past_len + seq_len, dtype=torch.long, device=device)

    def call() -> None:
        model(input_ids=new, attention_mask=mask, position_ids=positions, past_key_values=cache,
              use_cache=cache is not None)
        if cache is not None:  # drop the new tokens again, through the layers' keys / values
            gather_positions(cache, keep)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    times = []
    for i in range(warmup + repeats):
        sync()
        start = time.perf_counter()
        call()
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    model.train(was_training)
    return statistics.median(times)
