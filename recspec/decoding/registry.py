"""The decoders by name: each registered once, where it is wired (the item decoders in
:mod:`recspec.recommend`, the text decoders in :mod:`recspec.decoding.text`, the knowledge
decoders in :mod:`recspec.knowledge.job`), with its kind (:data:`ITEMS`: top-K item identifiers
under the trie; :data:`TEXT`: free text; :data:`KNOWLEDGE`: knowledge jobs), the options
dataclass it takes, whether it needs a draft, whether it is exact and the function that runs it.
Everything that takes a decoder by name (``recommend``, ``generate``, the API, the server, the
drop-in, ``auto``, Ray) looks it up here: :func:`decoder` (an unknown name is one line listing
the known ones), :func:`names`. Adding a decoder is one :func:`register` call and its options.

An options dataclass validates itself against the decoder it is given to
(``options.check(decoder)``), and names in ``OWNED`` the fields only some decoders take
(a set value of one of them with another decoder is an error naming the decoders that take it,
:func:`check_owned`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from recspec.errors import RecspecError

#: The kinds of decoder: top-K items by trie-constrained search, free text, and knowledge jobs
#: (:mod:`recspec.knowledge.job`: greedy or LASER's relaxed text, drafted by retrieval and / or a head).
ITEMS, TEXT, KNOWLEDGE = "items", "text", "knowledge"
#: What a missing draft's error says to pass, per kind.
DRAFT_HINT = {ITEMS: "pass --draft (a folder written by `recspec train` with the target's item index and tokenizer)",
              TEXT: "pass --draft or --draft-layers", KNOWLEDGE: "pass --pool (earlier knowledge of this side)"}


@dataclass(frozen=True)
class Decoder:
    """A registered decoder: ``name``, ``kind`` (:data:`ITEMS` or :data:`TEXT`), ``run`` (the
    function that runs it; its signature is the kind's), ``options`` (its options dataclass),
    ``drafted`` (needs a draft), ``exact`` (items: the items of exact beam search; text: the
    target's own output distribution), ``takes``: the options of the ``OWNED`` fields it uses;
    ``validate``: its own checks of its options, after theirs."""

    name: str
    kind: str
    run: Callable[..., Any]
    options: type
    drafted: bool = False
    exact: bool = False
    takes: frozenset[str] = frozenset()
    validate: Callable[[Any], None] | None = None

    def check(self, options: Any, has_draft: bool | None = None) -> None:
        """Raise :class:`RecspecError` when this decoder needs a draft and ``has_draft`` is False,
        or ``options`` (validated by its own ``check``) are not this decoder's."""
        if self.drafted and has_draft is False:
            raise RecspecError(f"decoder {self.name} needs a draft model: {DRAFT_HINT[self.kind]}")
        if not isinstance(options, self.options):
            raise RecspecError(f"decoder {self.name} takes {self.options.__name__}, not {type(options).__name__}")
        options.check(self)
        if self.validate is not None:
            self.validate(options)


_REGISTRY: dict[str, dict[str, Decoder]] = {ITEMS: {}, TEXT: {}, KNOWLEDGE: {}}


def register(name: str, kind: str, run: Callable[..., Any], options: type, *, drafted: bool = False,
             exact: bool = False, takes: tuple[str, ...] = (), validate: Callable[[Any], None] | None = None
             ) -> Decoder:
    """Register decoder ``name`` of ``kind`` (once: a second registration of a name is an error)."""
    if kind not in _REGISTRY:
        raise ValueError(f"unknown decoder kind {kind!r}")
    if name in _REGISTRY[kind]:
        raise ValueError(f"decoder {name!r} ({kind}) is registered twice")
    unknown = set(takes) - set(getattr(options, "OWNED", {}))
    if unknown:
        raise ValueError(f"decoder {name!r} takes options {sorted(unknown)} that {options.__name__} does not own")
    spec = Decoder(name, kind, run, options, drafted, exact, frozenset(takes), validate)
    _REGISTRY[kind][name] = spec
    return spec


def decoder(name: str, kind: str) -> Decoder:
    """The decoder ``name`` of ``kind``; an unknown name is a one-line error listing the known ones."""
    found = _REGISTRY[kind].get(name) if isinstance(name, str) else None
    if found is None:
        raise RecspecError(f"unknown decoder {name!r}; choose one of {', '.join(names(kind))}")
    return found


def names(kind: str, drafted: bool | None = None, exact: bool | None = None) -> tuple[str, ...]:
    """The decoders of ``kind`` in registration order; ``drafted`` / ``exact``: only those that do
    (True) or do not (False) need a draft / are exact."""
    return tuple(spec.name for spec in _REGISTRY[kind].values()
                 if (drafted is None or spec.drafted == drafted) and (exact is None or spec.exact == exact))


def takers(kind: str, option: str) -> tuple[str, ...]:
    """The decoders of ``kind`` that take the owned option ``option``."""
    return tuple(spec.name for spec in _REGISTRY[kind].values() if option in spec.takes)


def check_owned(options: Any, spec: Decoder) -> None:
    """Refuse a set value (not the field's default) of an option in ``type(options).OWNED`` (field:
    how the command line spells it) that ``spec`` does not take."""
    owned: dict[str, str] = getattr(options, "OWNED", {})
    for item in fields(options):
        if item.name in owned and item.name not in spec.takes and getattr(options, item.name) != item.default:
            raise RecspecError(f"{owned[item.name]} is an option of {' and '.join(takers(spec.kind, item.name))}, "
                               f"not of {spec.name}")
