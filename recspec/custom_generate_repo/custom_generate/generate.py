"""recspec's exact trie-constrained beam search as a transformers ``custom_generate`` recipe.

``model.generate(**inputs, custom_generate=<this repository>, trust_remote_code=True,
item_index="item_index.json", tokenizer=tokenizer, num_beams=10, num_return_sequences=10,
max_new_tokens=L)`` returns what transformers' own beam search constrained to the items of
``item_index`` returns (``prefix_allowed_tokens_fn`` over their trie), decoded by
:func:`recspec.hf.trie_beam_search`: the same sequences in the same order, the same
``sequences_scores``, every ``generate`` argument honoured or refused in one line
(:mod:`recspec.dropin_contract`). ``item_index`` (a path to an ``item_index.json`` or an
``ItemIndex``) and ``tokenizer`` are required; ``draft``, ``decoder``, ``end_with_eos``,
``draft_beams``, ``batch_size``, ``draft_tokenizer`` and ``expand_root`` are
:func:`~recspec.hf.trie_beam_search`'s. The drop-in is built for each call (``decoder="auto"``
with a draft times its candidates each call; keep ``trie_beam_search(...)`` as a callable for
repeated calls).
"""

from recspec.hf import DROP_IN_OPTIONS, refuse_streamer, trie_beam_search


def generate(model, *args, item_index=None, tokenizer=None, streamer=None, **kwargs):
    """transformers' ``generate`` with recspec's decoder (module doc)."""
    refuse_streamer(streamer)
    if item_index is None or tokenizer is None:
        raise ValueError("recspec's custom_generate needs item_index= (an item_index.json path) and tokenizer=")
    options = {name: kwargs.pop(name) for name in DROP_IN_OPTIONS if name in kwargs}
    drop_in = trie_beam_search(item_index, tokenizer, **options)
    return type(model).generate(model, *args, custom_generate=drop_in, tokenizer=tokenizer, **kwargs)
