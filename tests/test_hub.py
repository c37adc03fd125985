"""The call options recspec hands a Hugging Face model (recspec.hub): the KV cache under the keyword
the model's forward takes, whichever transformers 5 release is installed."""

from __future__ import annotations

import pytest
import torch

from recspec.errors import RecspecError
from recspec.hub import returned_cache, with_cache


class OldForward(torch.nn.Module):
    """The signature of a transformers 5.0-5.23 causal LM's forward (the cache as
    ``past_key_values``); the installed release may be newer, so it is written out here."""

    def forward(self, input_ids=None, past_key_values=None, use_cache=None, **kwargs):
        return input_ids


class NoCache(torch.nn.Module):
    def forward(self, input_ids=None, **kwargs):
        return input_ids


def test_the_cache_keyword_follows_the_forward_signature(smollm2_dir) -> None:
    """The installed release's own model takes the name chosen (``cache`` from 5.24, where the old
    name is deprecated); an older forward gets ``past_key_values``; a forward that takes no cache
    by name is refused rather than handed one through ``**kwargs``, where it would be ignored."""
    import inspect

    from recspec.models.hf import load_causal_lm

    model = load_causal_lm(smollm2_dir)
    (name, value), = with_cache(model, "c").items()
    assert value == "c" and name in inspect.signature(model.forward).parameters
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([[1, 2, 3]]), use_cache=True)
    assert returned_cache(out).get_seq_length() == 3
    assert with_cache(OldForward(), "c") == {"past_key_values": "c"}
    with pytest.raises(RecspecError, match="takes no KV cache"):
        with_cache(NoCache(), "c")
