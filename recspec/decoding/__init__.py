"""recspec's decoders. The item decoders (top-K items by trie-constrained beam search, beam
sampling and speculative beam search) and the text decoders share one layer laid out by role:

* requests and batches: ``prompts``; beams and one step of search or sampling: ``beams``;
  free text as a candidate space: ``space``; what a node sees: ``tree``; the model calls:
  ``scorer``; KV-cache selection and compaction: ``cache``;
* the plain beam loop and the item decoders built on it: ``beam_search`` (and the Hugging Face
  peer, ``hf_reference``);
* speculative decoding: the round loop (``engine``) and its searches (over item beams:
  ``rounds``; over text, batched, trees and chains: ``text_rounds``, with its rows' cache
  ``text_cache``), the drafters (``drafters``,
  their log-probs ``drafting`` and ``draft_sources``; the chain decoders' ``chains``), the
  verifiers (``verifiers``, ``text_rounds``' ``TreeVerifier``, ``chains``' ``ChainVerifier``)
  and their acceptance rules (``acceptance``), the round's token tree (``draft_tree``) and
  frontier (``frontier``);
* each method's wiring: ``speculative_beam`` (AtSpeed), ``dsbd``, ``text`` (the text decoders).
"""

from recspec.decoding.beam_search import beam_search, tree_beam_search
from recspec.decoding.beams import TopK
from recspec.decoding.hf_reference import hf_beam_search

__all__ = ["TopK", "beam_search", "hf_beam_search", "tree_beam_search"]
