"""recspec: fast, exact inference for LLM-based recommendation through speculative decoding.

``recspec.load(target, draft=None)`` returns a model whose ``.recommend(histories, k=10)`` gives
each history's top-K items (:mod:`recspec.api`); the rest is the ``recspec`` command and the
modules it is made of. The API is imported on first use, so ``import recspec`` stays light.
"""

from typing import Any

__version__ = "0.1.0"
__all__ = ["RecspecModel", "load"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from recspec import api

        return getattr(api, name)
    raise AttributeError(f"module 'recspec' has no attribute {name!r}")
