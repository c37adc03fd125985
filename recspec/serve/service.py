"""The models behind the service: request checks, prompts, and one batched decode per group.

:class:`RecommendService` is synchronous and knows nothing of HTTP: ``parse`` / ``parse_chat`` /
``parse_completion`` turn a validated body into a :class:`Query` (a prompt, ``k``, a decoder and
excluded items) or raise :class:`BadRequest` before any model work; ``decode`` runs queries that share
:attr:`Query.key` as one left-padded batch through one decoder (the batcher calls it from its
decode thread). Exclusions are exact: the search runs over a trie of the catalogue without those
items (kept in a small LRU cache), so a request with ``exclude`` gets what the decoder returns
for a catalogue that lacks them.

An answer may hold fewer than ``k`` items, and then says why (:attr:`Answer.fewer_reason`):
``dsbd`` draws its ``k`` beams independently from the target's beam distribution, with
replacement (DSBD's beam sampling; its exactness, Theorem 3.1, rests on independent draws), and an
item drawn more than once comes out once. This is the algorithm, not a fault: where the
distribution is peaked (a confident model, or exclusions that leave only ``k`` items) many draws
repeat one item, so a dsbd answer for ``k = 10`` may hold a handful of items, or one.

``auto`` is chosen from measurements (:func:`~recspec.auto.choose`). A service created with
``serving=True`` (the HTTP server) never measures inside a request: the choices for the ``k``
values it expects are made before it is ready (:meth:`RecommendService.prepare`); a batch whose
``k`` and size have no choice yet runs ``tree-beam`` (exact, no measurement needed) while a
background thread makes that choice for the next batches; and what it measures is kept in memory,
never written into the model folders it serves (records already there are read). Without
``serving`` (the Python API) a missing choice is made when first needed and kept beside the models,
as ``recspec recommend --decoder auto`` does.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from recspec.auto import Choice, choose
from recspec.calibration import Memory
from recspec.data.splits import Examples
from recspec.decoding.registry import ITEMS, decoder as registered, names
from recspec.errors import RecspecError
from recspec.itemids.trie import ItemTrie
from recspec.models.presets import MAX_POSITIONS
from recspec.models.tokenizer import identifier_token_ids
from recspec.recommend import AUTO, DSBD, TREE_BEAM, DecodeOptions, Recommender, run_decoder
from recspec.serve.schemas import ChatCompletionRequest, CompletionRequest, OpenAIRequest, RecommendRequest

#: Tries of distinct exclusion sets kept for reuse.
EXCLUDE_TRIES = 64
#: The most values of ``k`` a serving ``auto`` measures in the background (each measurement shares
#: the cores with decoding); a batch of any other ``k`` it has no choice for runs ``tree-beam``.
BACKGROUND_K = 32

log = logging.getLogger("recspec.serve")


class BadRequest(Exception):
    """A request the models cannot answer: ``status`` (422 unless said), ``kind`` (the metrics
    label), a one-line message, the body field it concerns (``param``) and, for unknown items, the ids."""

    def __init__(self, message: str, kind: str = "invalid", status: int = 422, items: list[str] | None = None,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.kind, self.status, self.items, self.param = kind, status, items, param


@dataclass(frozen=True)
class Query:
    """One request, ready to decode: ``prompt`` int64 ``[P]``, ``k``, the requested ``decoder``
    (``auto`` included), ``exclude`` (sorted index rows), ``timeout_s`` (None: the server's)."""

    prompt: torch.Tensor
    k: int
    decoder: str
    exclude: tuple[int, ...] = ()
    timeout_s: float | None = None

    @property
    def key(self) -> tuple[int, str, tuple[int, ...]]:
        """Queries with the same key can share one batched decode."""
        return self.k, self.decoder, self.exclude


@dataclass(frozen=True)
class Answer:
    """One query's result: raw item ids and scores best first, identifiers (token strings),
    the decoder that ran, AS and target calls of its user, the batch size and its decode time;
    ``fewer_reason``: why it holds fewer than ``k`` items (None when it holds ``k``; module doc)."""

    items: list[str]
    scores: list[float]
    identifiers: list[str]
    decoder: str
    accepted_steps: float
    drafted_steps: float
    target_calls: float
    batch_size: int
    decode_s: float
    fewer_reason: str | None = None


def fewer_reason(decoder: str, k: int, returned: int) -> str | None:
    """Why ``decoder`` answered ``returned`` items for ``k`` asked (None when ``returned`` is ``k``):
    the only decoder the service runs that can is ``dsbd`` (module doc)."""
    if returned >= k:
        return None
    if decoder == DSBD:
        return (f"dsbd draws its {k} beams independently, with replacement (DSBD's beam sampling), and "
                f"{k - returned} of the draws repeated an item, which comes out once; ask a beam decoder "
                f"(tree-beam, spec-strict) for {k} distinct items")
    return f"{decoder} found {returned} of the {k} items asked for"


def _duplicates(values: list[str]) -> list[str]:
    return sorted(value for value, count in Counter(values).items() if count > 1)


class RecommendService:
    """``recommender`` (target, optional draft, index, trie) served with ``decoder`` by default
    and ``options`` for the sampling / speculative decoders; ``max_batch`` sizes ``auto``'s choice;
    ``serving``: never measure inside a request, nor write into the model folders (module doc)."""

    def __init__(self, recommender: Recommender, decoder: str = AUTO, options: DecodeOptions = DecodeOptions(),
                 max_batch: int = 16, serving: bool = False) -> None:
        self.recommender = recommender
        self.options = options
        self.max_batch = max_batch
        self.serving = serving
        self.decoder = self.check_decoder(decoder)
        self.max_history = int(recommender.info.get("max_history") or 20)
        self.num_items = len(recommender.index.item_keys)
        self._item_row = {key: i for i, key in enumerate(recommender.encoder.item_keys)}  # the ids a history may hold
        self._token_ids = identifier_token_ids(recommender.tokenizer, recommender.index)
        self._tries: OrderedDict[tuple[int, ...], ItemTrie] = OrderedDict()
        self._choices: dict[tuple[int, int], Choice] = {}
        self._records: Memory | None = {} if serving else None  # a server's measurements stay in memory
        self._lock = threading.Lock()  # the choices and the values of k asked for, between threads
        self._asked: set[int] = set()  # values of k handed to the background thread
        self._unmeasured: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._measurer: threading.Thread | None = None
        #: whether prompts are chat messages (an LLM preset): /v1/chat/completions serves them
        self.chat = bool(getattr(recommender.tokenizer, "chat_template", None))

    @property
    def decoders(self) -> list[str]:
        """The decoders the loaded models can run."""
        return list(names(ITEMS, drafted=None if self.recommender.draft is not None else False))

    def check_decoder(self, name: str | None) -> str:
        name = self.decoder if name is None else name
        try:
            spec = registered(name, ITEMS)
        except RecspecError as err:
            raise BadRequest(str(err), "unknown_decoder", param="decoder") from None
        if spec.drafted and self.recommender.draft is None:
            raise BadRequest(f"decoder {name} needs a draft model and the server has none loaded; start it with "
                             f"--draft or ask for one of {', '.join(self.decoders)}", "needs_draft", param="decoder")
        return name

    def check_k(self, k: int, excluded: int = 0, param: str = "k") -> None:
        """Refuse ``k`` (the body's field ``param``) outside [1, the items left after ``excluded`` are taken out]."""
        available = self.num_items - excluded
        if not 1 <= k <= available:
            raise BadRequest(f"{param}={k} is outside [1, {available}]: the catalogue has {self.num_items} items"
                             + (f", {excluded} excluded" if excluded else ""), "bad_k", param=param)

    def parse(self, request: RecommendRequest) -> Query:
        """A recommend body as a :class:`Query`; unknown or duplicate ids, a bad ``k`` or decoder raise."""
        for name, ids in (("history", request.history), ("exclude", request.exclude)):
            repeated = _duplicates(ids)
            if repeated:
                raise BadRequest(f"{name} repeats item id(s) {', '.join(repeated[:10])}", "duplicate_items",
                                 items=repeated, param=name)
        unknown = [key for key in request.history if key not in self._item_row]
        unknown += [key for key in request.exclude if key not in self.recommender.index.key_to_position]
        if unknown:
            shown = ", ".join(unknown[:10]) + (f" and {len(unknown) - 10} more" if len(unknown) > 10 else "")
            param = "history" if unknown[0] in request.history else "exclude"
            raise BadRequest(f"unknown item id(s) {shown}", "unknown_items", items=unknown, param=param)
        decoder = self.check_decoder(request.decoder)
        self.check_k(request.k, len(request.exclude))
        history = np.array([self._item_row[key] for key in request.history[-self.max_history:]], dtype=np.int64)
        examples = Examples(np.zeros(1, dtype=np.int64), history[None, :], np.zeros(2, dtype=np.int64),
                            np.zeros(0, dtype=np.int64))
        prompt = self.recommender.encoder.prompts(examples)[0]
        exclude = tuple(sorted(self.recommender.index.positions(request.exclude).tolist()))
        return Query(prompt, request.k, decoder, exclude, _seconds(request.timeout_ms))

    def parse_chat(self, request: ChatCompletionRequest) -> Query:
        """A chat body as a :class:`Query`: the messages through the tokenizer's chat template."""
        if not self.chat:
            raise BadRequest("this model's prompts are identifier tokens, not chat messages; use /v1/completions "
                             "or /v1/recommend", "not_chat", param="messages")
        messages = [message.for_template() for message in request.messages]
        try:
            text = self.recommender.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as err:  # a template that refuses these roles or their order
            raise BadRequest(f"the chat template refused these messages: {err}", "bad_messages",
                             param="messages") from None
        return self.text_query(text, request, "messages")

    def parse_completion(self, request: CompletionRequest) -> Query:
        """A completions body as a :class:`Query`: the raw prompt, tokenized as it stands."""
        return self.text_query(request.prompt, request, "prompt")

    def text_query(self, text: str, request: OpenAIRequest, param: str) -> Query:
        """The :class:`Query` of a prompt ``text`` for an OpenAI-style ``request`` (``n`` items)."""
        decoder = self.check_decoder(request.decoder)
        self.check_k(request.n, 0, "n")
        try:
            ids = self.recommender.tokenizer(text, add_special_tokens=False)["input_ids"]
        except Exception as err:  # a word-level vocabulary without an unknown token: a word it lacks
            raise BadRequest(f"{param}: this model's tokenizer cannot encode it ({err})", "bad_prompt",
                             param=param) from None
        limit = MAX_POSITIONS - self.recommender.trie.depth
        if not 1 <= len(ids) <= limit:
            raise BadRequest(f"{param}: {len(ids)} tokens; this model takes 1 to {limit}", "too_long", param=param)
        return Query(torch.tensor(ids, dtype=torch.int64), request.n, decoder, (), _seconds(request.timeout_ms))

    def warm_up(self, k: int) -> None:
        """Decode one request for ``k`` items (a history of the catalogue's first item) with the
        default decoder, so that the first real request does not pay for first-call work
        (allocations, kernels chosen, caches filled); readiness waits for it."""
        first = next(iter(self._item_row))
        self.decode([self.parse(RecommendRequest(history=[first], k=min(k, self.num_items)))])

    def trie(self, exclude: tuple[int, ...]) -> ItemTrie:
        """The item trie without the index rows ``exclude`` (the full trie for none)."""
        if not exclude:
            return self.recommender.trie
        if exclude not in self._tries:
            keep = np.setdiff1d(np.arange(self.num_items), np.array(exclude, dtype=np.int64))
            device = self.recommender.trie.device
            self._tries[exclude] = self.recommender.index.trie(self._token_ids, len(self.recommender.tokenizer),
                                                               keep).to(device)
            while len(self._tries) > EXCLUDE_TRIES:
                self._tries.popitem(last=False)
        self._tries.move_to_end(exclude)
        return self._tries[exclude]

    def choice(self, k: int, batch: int) -> Choice:
        """``auto``'s choice for ``k`` at ``batch`` users, per power-of-two batch size. One made
        already is reused; else, serving, ``tree-beam`` runs while the choice is made in the
        background (:meth:`measure_later`), and otherwise it is made now (module doc)."""
        size = self._size_class(batch)
        with self._lock:
            made = self._choices.get((k, size))
        if made is not None:
            return made
        if not self.serving:
            return self.measure(k, size)
        self.measure_later(k)
        return Choice(TREE_BEAM, DecodeOptions(), {},
                      f"auto: tree-beam (no choice measured yet for k={k} at batch {size}; it is made outside "
                      f"the request path)")

    def measure(self, k: int, size: int) -> Choice:
        """Make ``auto``'s choice for ``k`` at the batch size class ``size`` now (from the records
        kept, measuring what they lack: :func:`~recspec.auto.choose`) and keep it."""
        made = choose(self.recommender, k, size, records=self._records)
        with self._lock:
            self._choices[(k, size)] = made
        return made

    def prepare(self, k: int) -> dict[int, Choice]:
        """Make ``auto``'s choices for ``k`` at every batch size it distinguishes (powers of two up
        to ``max_batch``) that it has not made yet, so that the requests never wait for what they
        measure on a new device; returns them by batch size."""
        sizes = sorted({self._size_class(batch) for batch in range(1, self.max_batch + 1)})
        with self._lock:
            made = {size: self._choices.get((k, size)) for size in sizes}
        return {size: choice or self.measure(k, size) for size, choice in made.items()}

    def measure_later(self, k: int) -> None:
        """Have the background thread :meth:`prepare` ``k`` (once per ``k``, at most
        :data:`BACKGROUND_K` values), outside any request."""
        with self._lock:
            if k in self._asked or len(self._asked) >= BACKGROUND_K:
                return
            self._asked.add(k)
            if self._measurer is None:
                self._measurer = threading.Thread(target=self._measure_loop, name="recspec-measure", daemon=True)
                self._measurer.start()
        self._unmeasured.put(k)

    def _measure_loop(self) -> None:
        """The background thread: prepare each ``k`` handed to it, in order (a daemon: a measurement
        keeps nothing on disk, so it may be cut short when the process exits)."""
        while True:
            k = self._unmeasured.get()
            try:
                self.prepare(k)
            except Exception:  # noqa: BLE001 - its batches keep running tree-beam
                log.exception("recspec serve: auto could not measure k=%d; it runs tree-beam for it", k)

    def auto_choices(self) -> list[dict[str, Any]]:
        """``auto``'s choices made so far (k, batch size, decoder, reason), by k and batch size."""
        with self._lock:
            made = sorted(self._choices.items())
        return [{"k": k, "batch": size, "decoder": choice.decoder, "reason": choice.reason}
                for (k, size), choice in made]

    def _size_class(self, batch: int) -> int:
        """The batch size ``auto`` chooses for at ``batch`` users: the next power of two, at most ``max_batch``."""
        return min(self.max_batch, 1 << max(0, batch - 1).bit_length())

    def decode(self, queries: list[Query]) -> list[Answer]:
        """Decode ``queries`` (one :attr:`Query.key`) as one batch."""
        first = queries[0]
        if any(query.key != first.key for query in queries):
            raise ValueError("a batch must share one key (k, decoder, exclusions)")
        recommender = self.recommender
        name, options = first.decoder, self.options
        if name == AUTO:
            choice = self.choice(first.k, len(queries))
            name, options = choice.decoder, replace(choice.options, seed=self.options.seed)
        started = time.perf_counter()
        decoded = run_decoder(name, recommender.model, recommender.draft, [query.prompt for query in queries],
                              self.trie(first.exclude), first.k, recommender.encoder.pad_id, options)
        seconds = time.perf_counter() - started
        topk = decoded.topk
        if not bool(torch.isfinite(topk.scores[topk.items >= 0]).all()):
            raise RuntimeError("the model gave non-finite scores; its weights are damaged or diverged")
        keys, identifiers = recommender.index.item_keys, recommender.index.identifiers
        levels = float(recommender.trie.depth)
        stats = decoded.stats
        answers = []
        for row, (items, scores) in enumerate(zip(topk.items.tolist(), topk.scores.tolist())):  # per user, once
            real = [(item, score) for item, score in zip(items, scores) if item >= 0]
            answers.append(Answer(
                items=[keys[item] for item, _ in real], scores=[round(score, 6) for _, score in real],
                identifiers=["".join(identifiers[item]) for item, _ in real], decoder=name,
                accepted_steps=0.0 if stats is None else float(stats.accepted_steps[row]),
                drafted_steps=0.0 if stats is None else float(stats.drafted_steps[row]),
                target_calls=levels if stats is None else float(stats.target_calls[row]),
                batch_size=len(queries), decode_s=seconds, fewer_reason=fewer_reason(name, first.k, len(real))))
        return answers


def _seconds(milliseconds: int | None) -> float | None:
    return None if milliseconds is None else milliseconds / 1e3
