"""recspec's CPU acceleration under one policy (:mod:`recspec.accel`): which model gets what, the one
switch (``RECSPEC_ACCEL=0``, :func:`set_enabled`, ``enabled=False``) giving transformers' own forward
and products with nothing built, nothing for a model off the CPU or not float32, the same bits as
the unaccelerated model where the lean forward serves, the cost interface, and an import that needs
no POSIX file locks."""

from __future__ import annotations

import copy
import functools
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from recspec.accel import CallShape, accelerate, call_shape, is_enabled, policy, set_enabled, timing_key
from recspec.accel.fused import FusedProjections
from recspec.accel.int8 import Int8Forward, int8_engine, int8_serves
from recspec.accel.kernel import available
from recspec.accel.lean_forward import forward_of
from recspec.accel.packed_attention import PACKED_SDPA
from recspec.accel.small_rows import SmallRowForward
from recspec.hub import with_cache

pytestmark = pytest.mark.usefixtures("one_thread")


def llama(seed: int = 0, kv_heads: int = 4) -> LlamaForCausalLM:
    """A tiny random float32 Llama on SDPA attention (multi-head with ``kv_heads=4``: the lean
    forward's kind)."""
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=60, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=kv_heads, initializer_range=0.3,
                                        max_position_embeddings=64, attn_implementation="sdpa")).eval()


def untouched(model: nn.Module) -> bool:
    """Whether ``model`` has transformers' own forward and products: no linear layer's forward
    replaced, SDPA attention as configured, no lean forward."""
    return (all("forward" not in vars(module) for module in model.modules() if isinstance(module, nn.Linear))
            and model.config._attn_implementation == "sdpa" and forward_of(model) is model)


def logits(model: nn.Module) -> list[torch.Tensor]:
    """Logits of two left-padded prompts and of one token after them over the cache, through
    what recspec's decoders call (:func:`forward_of`)."""
    tokens = torch.randint(1, 60, (2, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, :3] = 0
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        first = forward_of(model)(input_ids=tokens, attention_mask=mask, position_ids=positions,
                                  **with_cache(model, cache), use_cache=True)
        grown = torch.cat((mask, torch.ones(2, 1, dtype=torch.long)), dim=1)
        second = forward_of(model)(input_ids=tokens[:, :1], attention_mask=grown, position_ids=positions[:, -1:] + 1,
                                   **with_cache(model, cache), use_cache=True)
    return [first.logits[mask.bool()], second.logits]


@pytest.fixture
def streaming(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every model counts as LLM-sized (:func:`~recspec.accel.policy.streams_weights`)."""
    monkeypatch.setattr(policy, "STREAMED_BYTES", 0)


def test_a_small_float32_llama_gets_the_lean_forward_and_keeps_its_bits() -> None:
    """A small multi-head Llama: the lean forward and packed attention (a no-op for multi-head
    attention), transformers' products; recspec's calls give the unaccelerated model's logits bit
    for bit, and so does the model with the switch off."""
    plain = llama()
    expected = logits(plain)
    model = accelerate(copy.deepcopy(plain))
    assert forward_of(model) is not model and model.config._attn_implementation == PACKED_SDPA
    assert not any(isinstance(module.forward, SmallRowForward) for module in model.modules()
                   if isinstance(module, nn.Linear))
    assert all(torch.equal(a, b) for a, b in zip(logits(model), expected, strict=True))
    off = accelerate(copy.deepcopy(plain), enabled=False)
    assert untouched(off) and all(torch.equal(a, b) for a, b in zip(logits(off), expected, strict=True))


def test_the_switch_gives_transformers_own_forward_and_products(monkeypatch: pytest.MonkeyPatch, streaming) -> None:
    """``RECSPEC_ACCEL=0``, :func:`set_enabled` and ``enabled=False`` each leave an LLM-sized and a
    small model as transformers made them; ``enabled=True`` accelerates whatever the switch."""
    available()  # the kernel as this process loads it, before the switch goes off (a process keeps it)
    monkeypatch.setenv(policy.SWITCH, "0")
    assert not is_enabled()
    assert untouched(accelerate(llama(kv_heads=2))) and untouched(accelerate(llama()))
    assert timing_key("cpu") == {"products": 0, "attention": 0, "lean_forward": 0, "row_kernel": False}
    assert not int8_serves("cpu")
    assert isinstance(accelerate(llama(), enabled=True).lm_head.forward, SmallRowForward)
    monkeypatch.delenv(policy.SWITCH)
    assert is_enabled()
    try:
        set_enabled(False)
        assert not is_enabled() and untouched(accelerate(llama()))
    finally:
        set_enabled(None)
    assert untouched(accelerate(llama(), enabled=False))


def test_the_old_kernel_switch_is_read_as_the_new_one_and_warns_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(policy.SWITCH, raising=False)
    monkeypatch.setenv(policy.OLD_SWITCH, "0")
    policy.warn_old_switch.cache_clear()
    with pytest.warns(FutureWarning, match="RECSPEC_ACCEL=0"):
        assert not is_enabled()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not is_enabled()  # said once
    monkeypatch.setenv(policy.SWITCH, "1")  # the new switch decides where both are set
    assert is_enabled()


@pytest.mark.parametrize("move", ["meta", "bf16", "cuda"])
def test_a_model_off_the_cpu_or_not_float32_gets_nothing(move: str, streaming) -> None:
    """A model moved to ``meta`` or to bfloat16, or one said to run on CUDA, gets no speed-up: no
    product, no fused siblings, no packed attention, no lean forward."""
    for kv_heads in (2, 4):  # LLM-sized (products) and lean-forward kinds
        model = llama(kv_heads=kv_heads)
        if move == "meta":
            accelerate(model.to("meta"))
        elif move == "bf16":
            accelerate(model.to(torch.bfloat16))
        else:
            accelerate(model, device="cuda")
        assert untouched(model)
    assert timing_key("cuda") == {"products": 0, "attention": 0, "lean_forward": 0, "row_kernel": False}
    assert not int8_serves("cuda") and call_shape(llama().to("meta")) == CallShape()


def test_an_llm_sized_model_gets_the_small_row_products_and_fused_siblings(streaming) -> None:
    """An LLM-sized model: small-row products on every linear layer, q / k / v and gate / up fused,
    grouped-query attention packed, no lean forward (it would bypass the products); its logits
    are transformers' within float noise, and its calls compute the rows they are fed."""
    plain = llama(kv_heads=2)
    model = accelerate(copy.deepcopy(plain))
    assert isinstance(model.lm_head.forward, SmallRowForward) and forward_of(model) is model
    attention = model.model.layers[0].self_attn
    assert isinstance(attention.q_proj.forward, functools.partial)
    assert isinstance(attention.q_proj.forward.func, FusedProjections)
    assert model.config._attn_implementation == PACKED_SDPA
    for mine, theirs in zip(logits(model), logits(plain), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)
    assert call_shape(model) == CallShape() and CallShape().rows(10) == 10


def test_a_borrowed_model_keeps_its_modules_and_gets_the_lean_forward_alone(streaming) -> None:
    """A caller's model (the drop-in's): only the lean forward, which ``generate`` never calls; its
    linear layers and attention stay transformers', whatever its size."""
    model = accelerate(llama(), borrowed=True)
    assert forward_of(model) is not model
    assert all("forward" not in vars(module) for module in model.modules() if isinstance(module, nn.Linear))
    assert model.config._attn_implementation == "sdpa"
    grouped = accelerate(llama(kv_heads=2), borrowed=True)
    assert untouched(grouped)  # the lean forward serves multi-head attention only


class Draft(nn.Module):
    """A draft module of recspec's own: siblings q, k, v of one input and an output layer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.q, self.k, self.v, self.out = nn.Linear(16, 16), nn.Linear(16, 8), nn.Linear(16, 8), nn.Linear(32, 12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.cat((self.q(x), self.k(x), self.v(x)), dim=-1))


def test_a_draft_module_gets_small_row_products_and_its_int8_groups() -> None:
    """recspec's own draft modules: the small-row products on every linear layer whatever their
    size; the ``int8`` groups in int8 where the CPU computes int8 right, a group of siblings as
    one product."""
    draft = accelerate(Draft())
    assert all(isinstance(layer.forward, SmallRowForward) for layer in (draft.q, draft.k, draft.v, draft.out))
    if not int8_engine():
        pytest.skip("no int8 engine, or its 8-bit products are wrong on this CPU")
    int8 = Draft()
    accelerate(int8, int8=((int8.q, int8.k, int8.v), (int8.out,)))
    assert isinstance(int8.out.forward, Int8Forward)
    assert all(isinstance(layer.forward.func, FusedProjections) and layer.forward.func.int8
               for layer in (int8.q, int8.k, int8.v))


def test_padded_calls_cost_the_rows_they_compute() -> None:
    """:class:`CallShape`: a padded model's call costs the padded row count, another's the rows."""
    padded = CallShape(padded=True)
    assert [padded.rows(n) for n in (1, 9, 10, 15, 16, 21, 32)] == [1, 9, 16, 16, 16, 24, 32]
    assert [CallShape().rows(n) for n in (1, 10, 21)] == [1, 10, 21]


def run_python(code: str, cache: Path, **env: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter with ``$RECSPEC_CACHE`` at ``cache`` (empty)."""
    environment = {name: value for name, value in os.environ.items()
                   if name not in (policy.SWITCH, policy.OLD_SWITCH)}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**environment, "RECSPEC_CACHE": str(cache), **env})


BUILD_NOTHING = """
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM
from recspec.accel import accelerate, policy, timing_key
from recspec.accel.lean_forward import forward_of
policy.STREAMED_BYTES = 0
config = LlamaConfig(vocab_size=60, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, attn_implementation="sdpa")
models = [accelerate(LlamaForCausalLM(config).eval(){move}) for _ in range(2)]
print(all("forward" not in vars(m) for model in models for m in model.modules() if isinstance(m, nn.Linear)),
      all(forward_of(model) is model for model in models), timing_key("{device}")["row_kernel"])
"""


@pytest.mark.parametrize("switch,move,device", [("0", "", "cpu"), ("1", ".to('meta')", "cuda")],
                         ids=["switched-off", "off-the-cpu"])
def test_nothing_is_built_where_accel_is_off_or_cannot_run(tmp_path: Path, switch: str, move: str,
                                                          device: str) -> None:
    """In a fresh process over an empty cache, with ``RECSPEC_ACCEL=0`` or for models off the CPU
    (and timings on CUDA): LLM-sized models keep transformers' products and no kernels/ folder
    appears (the kernel is never compiled)."""
    done = run_python(BUILD_NOTHING.format(move=move, device=device), tmp_path, **{policy.SWITCH: switch})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "True", "False"]
    assert not (tmp_path / "kernels").exists() and "building" not in done.stderr


def test_the_package_imports_without_posix_file_locks(tmp_path: Path) -> None:
    """``import recspec.accel`` (and its kernel's module) where ``fcntl`` cannot be imported, as on
    Windows: nothing at import time needs it."""
    code = ("import sys; sys.modules['fcntl'] = None\n"
            "import recspec.accel, recspec.accel.kernel, recspec.accel.small_rows\n"
            "from recspec.accel import accelerate\nprint('imported')")
    done = run_python(code, tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["imported"] and not (tmp_path / "kernels").exists()
