"""Decoders that return each user's top-K items by trie-constrained beam search (the Hugging Face
peer, a per-beam cache, tree attention), and the tree-mask and KV-cache utilities they share with
speculative decoding."""

from recspec.decoding.beam import beam_search, hf_beam_search, tree_beam_search
from recspec.decoding.topk import TopK

__all__ = ["TopK", "beam_search", "hf_beam_search", "tree_beam_search"]
