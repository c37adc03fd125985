"""Optional parts of recspec and the packages each needs.

The core install is what inference needs (the transformers drop-in, ``recspec.load(...)``,
``recspec recommend``); serving, Ray, training, plots and asset conversion are extras
(``pip install 'recspec[serve]'``). A feature whose extra is missing is refused in one line
naming the extra to install, before any work, never with an ``ImportError`` traceback.
"""

from __future__ import annotations

import importlib.util

from recspec.errors import RecspecError

#: extra -> the modules it provides, as imported.
EXTRAS: dict[str, tuple[str, ...]] = {
    "serve": ("fastapi", "uvicorn", "prometheus_client", "httpx"),
    "ray": ("ray",),
    "train": ("sklearn", "scipy"),
    "plot": ("matplotlib",),
    "assets": ("gguf",),
}


def missing_extra_error(extra: str, feature: str) -> RecspecError:
    """The one-line error for ``feature`` when ``extra`` is not installed."""
    return RecspecError(f"{feature} needs recspec's {extra!r} extra: pip install 'recspec[{extra}]'")


def require_extra(extra: str, feature: str) -> None:
    """Refuse ``feature`` (words for the user, e.g. ``"recspec serve"``) unless every module of
    ``extra`` is installed."""
    if any(importlib.util.find_spec(module) is None for module in EXTRAS[extra]):
        raise missing_extra_error(extra, feature)


def extra_of(err: ModuleNotFoundError) -> str | None:
    """The extra that provides the module ``err`` found missing, if an extra does."""
    top = (err.name or "").split(".")[0]
    return next((extra for extra, modules in EXTRAS.items() if top in modules), None)
