"""recspec: fast, exact inference for LLM-based recommendation through speculative decoding.

``recspec.load(target, draft=None)`` returns a model whose ``.recommend(histories, k=10)`` gives
each history's top-K items; ``recspec.recommend_users(...)`` and ``recspec.generate_knowledge(...)`` run
the batch jobs of ``recspec recommend`` and ``recspec knowledge generate`` (:mod:`recspec.api`,
with ``Engine``, ``DecodeOptions`` and ``KnowledgeConfig``); ``recspec.hf.trie_beam_search`` is
the transformers drop-in. The API is imported on first use, so ``import recspec`` stays light.
"""

from typing import Any

__version__ = "0.2.0"
__all__ = ["DecodeOptions", "Engine", "KnowledgeConfig", "RecspecModel", "generate_knowledge", "load", "recommend_users"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from recspec import api

        return getattr(api, name)
    raise AttributeError(f"module 'recspec' has no attribute {name!r}")
