"""The knowledge generation job: many users or items, one persisted result at a time.

:class:`KnowledgeTask` holds what every method needs (the data set and its streaming split, the
target model and tokenizer); :class:`KnowledgeConfig` names what determines the texts (side,
part, method, verification, token budget, pools); :func:`make_generator` turns both into a
function from a batch of entities (``batch_size`` of them, one by default) to their
:class:`~recspec.decoding.text_rounds.Generation`; :func:`run_job` runs it over the entities still
missing from a store.

Methods:

* ``ar``: recspec's plain greedy loop (:func:`~recspec.decoding.text_rounds.generate_texts`
  without drafts); with ``draft`` (a text head, ``recspec distill --head``) greedy speculative
  decoding drafted by the head's trees (:mod:`recspec.decoding.head_trees`), the same text;
* ``hf``: transformers ``generate``, greedy, a left-padded batch of requests per call;
* ``prompt-lookup``: transformers prompt lookup decoding (``prompt_lookup_num_tokens``), greedy;
* ``resd``: REST-style retrieval drafting from one global pool of earlier knowledge (plus the
  request's temporary branches), greedy verification;
* ``laser``: drafting from the pool chosen by the grouping (default: LASER's binary router),
  greedy or relaxed verification.

With ``batch_size`` > 1 every method but ``prompt-lookup`` decodes a batch of requests at once
(the text round loop batches any drafts; the throughput path for bulk knowledge such as the
old-part pools). Each batch is persisted in one transaction, so a crash loses at most the batch in
flight, and a batch drafts from the pools as they stand when it starts.

``resd`` and ``laser`` with ``draft`` draft hybrid trees: the retrieved continuations and the
head's branches in one tree per step (:class:`~recspec.knowledge.decode.HybridTrees`).

Earlier knowledge (the pools) is the old-part store of the same side, model, prompt version and
split, passed as ``pool``. Generating the old part itself with ``resd`` or ``laser`` and no
``pool`` drafts from the knowledge the job has produced so far (greedy verification keeps it
the greedy decoding's text).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from recspec.accel.int8 import INT8_PRODUCTS_VERSION, int8_serves
from recspec.data import load_dataset
from recspec.calibration import COST_CONTEXT, call_cost, sized_round_cost
from recspec.decoding.cost import CallCost
from recspec.decoding.head_trees import HeadDrafter, HeadTreeConfig
from recspec.decoding.registry import KNOWLEDGE, Decoder, decoder as registered, names, register
from recspec.decoding.text_rounds import Generation, Sessions, TextDrafter, generate_texts
from recspec.errors import RecspecError
from recspec.knowledge.decode import HybridTrees, RetrievalDrafter, eos_ids, hf_generate
from recspec.knowledge.pools import PoolSet
from recspec.knowledge.prompts import PROMPT_VERSION, item_prompt_ids, user_prompt_ids
from recspec.knowledge.retrieval import MAX_DEPTH, MAX_NODES, RetrievalConfig
from recspec.knowledge.router import PoolRouting, route_pools
from recspec.knowledge.store import KnowledgeStore, model_fingerprint, read_rows, read_settings
from recspec.knowledge.stream import check_side_part, stream_split
from recspec.knowledge.verify import Verification
from recspec.hub import load_tokenizer, resolve_model_dir
from recspec.models.checkpoint import weights_fingerprint
from recspec.models.head import HEAD_WEIGHTS, head_dir
from recspec.models.hf import load_causal_lm
from recspec.models.text_head import TEXT_HEAD, TextHeadDraft, load_text_head
from recspec.precision import DTYPES

#: The knowledge decoders' names (registered below, :mod:`recspec.decoding.registry`).
AR, HF, PROMPT_LOOKUP, RESD, LASER = "ar", "hf", "prompt-lookup", "resd", "laser"
#: Methods a text head drafts for: greedy speculative decoding (``ar``), and beside retrieval.
HEAD_METHODS = (AR, RESD, LASER)
# Settings a pool store must share with the job that drafts from it (same token ids, prompt wording,
# entities and streaming split).
POOL_KEYS = ("model", "prompt_version", "dataset", "split", "side")


@dataclass(frozen=True)
class KnowledgeConfig:
    """What determines the generated texts (all of it is recorded in the store)."""

    side: str = "user"
    part: str = "new"
    method: str = LASER
    verification: Verification = field(default_factory=lambda: Verification("relaxed"))
    max_new_tokens: int = 128
    grouping: str = "router"
    groups: int = 5
    min_interactions: int = 10
    retrieval: RetrievalConfig = field(default_factory=RetrievalConfig)
    prompt_lookup_tokens: int = 10
    max_history: int = 10
    max_prompt_tokens: int = 1024
    batch_size: int = 1
    draft: str | None = None
    head_tree: HeadTreeConfig = field(default_factory=HeadTreeConfig)
    head_int8: bool = True  # the head's logits and decoder layer in int8 on the CPU (recspec.accel.int8)

    def __post_init__(self) -> None:
        check_side_part(self.side, self.part)
        registered(self.method, KNOWLEDGE)
        if self.verification.kind == "sample":
            raise RecspecError("knowledge jobs verify greedy or relaxed; sampled text with a head's trees is "
                               "`recspec generate --decoder spec-sample --tree`")
        if self.verification.kind == "relaxed" and self.method != LASER:
            raise RecspecError(f"relaxed verification is LASER's; method {self.method} verifies greedily "
                               f"(use --decoder laser or --verify greedy)")
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise RecspecError(f"--max-new-tokens must be a positive integer, got {self.max_new_tokens!r}")
        r = self.retrieval
        if not (1 <= r.max_nodes <= MAX_NODES and 1 <= r.max_depth <= MAX_DEPTH and r.max_suffix >= 1):
            raise RecspecError(f"draft trees hold 1 to {MAX_NODES} nodes, 1 to {MAX_DEPTH} deep, and need a "
                               f"suffix of at least 1 token; got {r.max_nodes} nodes, depth {r.max_depth}, "
                               f"suffix {r.max_suffix}")
        if self.max_history < 1 or self.max_prompt_tokens < 1:
            raise RecspecError("--max-history and --max-prompt-tokens must be positive")
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise RecspecError(f"--batch-size must be a positive integer, got {self.batch_size!r}")
        if self.draft is not None and self.method not in HEAD_METHODS:
            raise RecspecError(f"--draft (a text head, `recspec distill --head`) drafts for methods "
                               f"{', '.join(HEAD_METHODS)}; method {self.method} does not draft with one")
        if self.batch_size > 1 and self.method == PROMPT_LOOKUP:
            raise RecspecError("prompt lookup decoding (transformers) runs one request at a time; drop --batch-size")

    def check(self, decoder: Decoder) -> None:
        """Nothing more: a knowledge config is checked whole when made (:meth:`__post_init__`)."""

    @property
    def pool_grouping(self) -> str:
        return "global" if self.method == RESD else self.grouping

    def settings(self) -> dict[str, Any]:
        """The method-specific part of a store's settings. Pools and draft limits are recorded only
        for relaxed verification, where they change the text; greedy texts do not depend on them."""
        settings: dict[str, Any] = {"side": self.side, "part": self.part, "method": self.method,
                                    "verify": self.verification.describe(), "max_new_tokens": self.max_new_tokens,
                                    "max_history": self.max_history, "max_prompt_tokens": self.max_prompt_tokens}
        if self.verification.kind == "relaxed":
            settings["pools"] = {"grouping": self.pool_grouping, "retrieval": self.retrieval.shape()}
            if self.draft is not None:  # the head's weights and precision by KnowledgeTask.store_settings
                settings["head_tree"] = self.head_tree.shape()
            if self.pool_grouping != "global":
                settings["pools"].update(groups=self.groups, min_interactions=self.min_interactions)
        if self.method == PROMPT_LOOKUP:
            settings["prompt_lookup_tokens"] = self.prompt_lookup_tokens
        if self.batch_size > 1:  # padding may change a near-tie, so batched texts are kept apart
            settings["batch_size"] = self.batch_size
        return settings


class KnowledgeTask:
    """The data set, its streaming split and the target model, loaded once (the model when first
    used: a process that only plans and stores the work never loads it), in ``dtype`` (a name of
    :data:`~recspec.precision.DTYPES`, resolved by :func:`~recspec.precision.text_precisions`; a
    16-bit one is part of the store's identity: its texts are its own)."""

    def __init__(self, model: str = "smollm2", dataset: str = "ml-100k", old_share: float = 0.75,
                 future_share: float = 0.1, seed: int = 0, device: str = "cpu", dtype: str = "float32") -> None:
        self.model_dir = resolve_model_dir(model)
        self.dataset = load_dataset(dataset)
        self.split = stream_split(self.dataset, old_share, future_share, seed)
        self.tokenizer = load_tokenizer(self.model_dir)
        self.device, self.dtype = device, DTYPES[dtype]
        self.seed = seed
        self._routings: dict[tuple[str, str, int, int], PoolRouting] = {}
        self._heads: dict[tuple[str, bool], TextHeadDraft] = {}
        self._round_costs: dict[tuple[str, bool, HeadTreeConfig], CallCost] = {}
        self.identity = {"model": {"name": self.model_dir.name, "fingerprint": model_fingerprint(self.model_dir)},
                         "prompt_version": PROMPT_VERSION, "dataset": self.dataset.name,
                         "split": self.split.settings, **({} if dtype == "float32" else {"dtype": dtype})}

    @cached_property
    def model(self):
        return load_causal_lm(self.model_dir, device=self.device, dtype=self.dtype)

    @cached_property
    def eos(self) -> list[int]:
        return eos_ids(self.model, self.tokenizer)

    def raw_ids(self, side: str) -> list[str]:
        """The data set's raw user or item ids, by dense index."""
        return self.dataset.user_ids if side == "user" else self.dataset.item_ids

    def entity_id(self, side: str, entity: int) -> str:
        return self.raw_ids(side)[entity]

    def stored_texts(self, side: str, store: Path) -> dict[int, list[int]]:
        """Entity (dense index) -> token ids of every text in ``store``."""
        lookup = {raw: i for i, raw in enumerate(self.raw_ids(side))}
        return {lookup[row.entity]: row.tokens for row in read_rows(store)}

    def entities(self, side: str, part: str, limit: int | None = None) -> np.ndarray:
        """The users or items of ``part`` in index order, the first ``limit`` if given."""
        entities = self.split.entities(side, part)
        if limit is not None:
            if limit < 1:
                raise RecspecError(f"--limit must be positive, got {limit}")
            entities = entities[:limit]
        return entities

    def prompt(self, config: KnowledgeConfig, entity: int) -> list[int]:
        """The chat-formatted prompt token ids of ``entity`` (truncation: see prompts)."""
        if config.side == "item":
            return item_prompt_ids(self.tokenizer, self.dataset, entity, config.max_prompt_tokens)
        part = self.split.old if config.part == "old" else self.split.new
        return user_prompt_ids(self.tokenizer, self.dataset, entity, part[entity], config.max_history,
                               config.max_prompt_tokens)

    def routing(self, config: KnowledgeConfig) -> PoolRouting:
        """The pool routing of ``config``'s side and pool settings, computed once per task (the
        collaborative pools train an MF-BPR model)."""
        key = (config.side, config.pool_grouping, config.groups, config.min_interactions)
        if key not in self._routings:
            self._routings[key] = route_pools(self.dataset, self.split, *key, self.seed)
        return self._routings[key]

    def store_settings(self, config: KnowledgeConfig) -> dict[str, Any]:
        """What a store of ``config``'s texts records: the model, prompts and split, the method's
        settings, and the head's weights where they change the text (relaxed verification)."""
        settings = {**self.identity, **config.settings()}
        if config.draft is not None and config.verification.kind == "relaxed":
            settings["head_sha256"] = weights_fingerprint(head_dir(config.draft, TEXT_HEAD), HEAD_WEIGHTS)
            if config.head_int8 and int8_serves(self.device):  # the draft's int8 products change a relaxed text
                settings["head_int8"] = INT8_PRODUCTS_VERSION
        return settings

    def head(self, path: str, int8: bool = True) -> TextHeadDraft:
        """The text head in ``path`` bound to the model, its products in int8 where they can be with
        ``int8`` (loaded once per path and precision), refused unless it was trained for this
        model."""
        if (path, int8) not in self._heads:
            self._heads[path, int8] = TextHeadDraft(load_text_head(path, self.model_dir, self.device), self.model,
                                                    int8)
        return self._heads[path, int8]

    def head_drafter(self, config: KnowledgeConfig) -> HeadDrafter:
        """The drafter of ``config``'s text head; its trees sized from the cost model of a round
        (:func:`~recspec.calibration.sized_round_cost`) when the tree is ``sized`` and
        verification greedy."""
        assert config.draft is not None
        head, tree = self.head(config.draft, config.head_int8), config.head_tree
        if not tree.sized or config.verification.kind != "greedy":
            return HeadDrafter(head, tree)
        key = (config.draft, config.head_int8, tree)
        if key not in self._round_costs:
            self._round_costs[key] = sized_round_cost(self.model, self.model_dir, head, tree)
        return HeadDrafter(head, tree, self._round_costs[key])

    def retrieval_cost(self, config: KnowledgeConfig) -> CallCost | None:
        """The target's call cost that sizes ``config``'s retrieval trees (kept beside the model by
        :func:`~recspec.calibration.call_cost`), or None where they are not sized: not ``sized``,
        a relaxed text (it depends on the tree), or beside a head (the hybrid's merged trees)."""
        if not config.retrieval.sized or config.verification.kind != "greedy" or config.draft is not None:
            return None
        return call_cost(self.model, self.model_dir, COST_CONTEXT)

    def pool_texts(self, config: KnowledgeConfig, pool: Path) -> dict[int, list[int]]:
        """Entity -> tokens of the old-part store ``pool``, after checking it fits this job."""
        settings, expected = read_settings(pool), self.store_settings(config)
        for key in POOL_KEYS:
            if settings.get(key) != expected.get(key):
                raise RecspecError(f"{pool}: pool written with {key}={settings.get(key)!r}, this job has "
                                   f"{key}={expected.get(key)!r}; use the old-part store of the same settings")
        if settings.get("part") != "old" or settings.get("verify") != "greedy":
            raise RecspecError(f"{pool}: a pool holds greedy old-part knowledge; this store has part="
                               f"{settings.get('part')}, verify={settings.get('verify')}")
        return self.stored_texts(config.side, pool)


#: (entities, their prompt ids) -> one Generation each
Generator = Callable[[list[int], list[list[int]]], list[Generation]]
#: Batches of (entities, their prompt ids), in the order a job runs them.
Batches = list[tuple[list[int], list[list[int]]]]
#: Runs a job's batches and yields each with its generations as it completes (any order).
Runner = Callable[["KnowledgeTask", "KnowledgeConfig", "PoolSet | None", Batches],
                  Iterator[tuple[list[int], list[Generation]]]]


def build_pools(task: KnowledgeTask, config: KnowledgeConfig, pool_texts: dict[int, list[int]] | None
                ) -> PoolSet | None:
    """The pools ``config.method`` drafts from, over ``pool_texts`` (None for the methods that do
    not draft); each pool's trie is built when first needed."""
    if config.method not in DRAFTING:
        return None
    return PoolSet(task.routing(config), pool_texts or {}, config.retrieval.window)


def make_generator(task: KnowledgeTask, config: KnowledgeConfig, pools: PoolSet | None) -> Generator:
    """A :data:`Generator` for ``config.method`` drafting from ``pools`` (:func:`build_pools`); each
    batch is decoded in one call of the method's loop (one ``generate`` call for ``hf``)."""
    head = task.head_drafter(config) if config.draft is not None else None
    return registered(config.method, KNOWLEDGE).run(task, config, pools, head)


def _text_generator(task: KnowledgeTask, config: KnowledgeConfig, pools: PoolSet | None,
                    head: HeadDrafter | None) -> Generator:
    """Every request of a batch in one :func:`~recspec.decoding.text_rounds.generate_texts` call:
    ``ar`` drafted by the head (or nothing), ``resd`` / ``laser`` by retrieval from the pools as
    they stand when the batch starts (and the head beside it: hybrid trees)."""
    model, budget, eos, rule = task.model, config.max_new_tokens, task.eos, config.verification.rule
    if config.method in DRAFTING and pools is None:
        raise RecspecError(f"method {config.method} drafts from pools: build them with build_pools")
    cost = task.retrieval_cost(config) if pools is not None else None

    def drafter(entities: list[int], prompts: list[list[int]]) -> TextDrafter | None:
        if pools is None:
            return None if head is None else head.batch(prompts)
        retrieval = Sessions([RetrievalDrafter(pools.trie_for(entity), config.retrieval).session(prompt)
                              for entity, prompt in zip(entities, prompts)], cost)
        return retrieval if head is None else HybridTrees(retrieval, head.batch(prompts))

    def generate(entities: list[int], prompts: list[list[int]]) -> list[Generation]:
        return generate_texts(model, prompts, budget, eos, drafter(entities, prompts), rule)

    return generate


def _hf_generator(task: KnowledgeTask, config: KnowledgeConfig, pools: PoolSet | None,
                  head: HeadDrafter | None) -> Generator:
    lookup = config.prompt_lookup_tokens if config.method == PROMPT_LOOKUP else None
    return lambda entities, prompts: hf_generate(task.model, prompts, config.max_new_tokens, task.eos, lookup)


# exact: the target's greedy text (``laser`` verifies LASER's relaxed rule); drafted: from the pools
register(AR, KNOWLEDGE, _text_generator, KnowledgeConfig, exact=True)
register(HF, KNOWLEDGE, _hf_generator, KnowledgeConfig, exact=True)
register(PROMPT_LOOKUP, KNOWLEDGE, _hf_generator, KnowledgeConfig, exact=True)
register(RESD, KNOWLEDGE, _text_generator, KnowledgeConfig, drafted=True, exact=True)
register(LASER, KNOWLEDGE, _text_generator, KnowledgeConfig, drafted=True)
#: The knowledge decoders that draft from pools of earlier knowledge.
DRAFTING = names(KNOWLEDGE, drafted=True)


def local_runner(task: KnowledgeTask, config: KnowledgeConfig, pools: PoolSet | None,
                 batches: Batches) -> Iterator[tuple[list[int], list[Generation]]]:
    """The batches decoded one after another in this process (a job whose pools grow with its
    own output sees each text before the next request)."""
    generate = make_generator(task, config, pools)
    for entities, prompts in batches:
        yield entities, generate(entities, prompts)


@dataclass
class JobSummary:
    """What a job did in this call: requests, tokens, seconds (generation, of which the prompts'
    prefill, and pool building), target calls and accepted draft tokens."""

    requests: int = 0
    skipped: int = 0
    tokens: int = 0
    calls: int = 0
    wall_s: float = 0.0
    prefill_s: float = 0.0
    retrieval_s: float = 0.0
    pool_build_s: float = 0.0

    def add(self, generation: Generation) -> None:
        self.requests += 1
        self.tokens += len(generation.tokens)
        self.calls += generation.calls
        self.wall_s += generation.wall_s
        self.prefill_s += generation.prefill_s
        self.retrieval_s += generation.retrieval_s

    def line(self) -> str:
        if not self.requests:
            return f"nothing to do ({self.skipped} already in the store)"
        return (f"{self.requests} generated ({self.skipped} already stored): {self.tokens} tokens in "
                f"{self.wall_s:.1f} s ({self.prefill_s:.1f} s of prefill), {self.tokens / self.wall_s:.1f} tokens/s, "
                f"AAL {self.tokens / self.calls:.2f} "
                f"tokens per target call, ART {1e3 * self.retrieval_s / self.requests:.1f} ms per request, "
                f"pools built in {self.pool_build_s:.1f} s")


def run_job(task: KnowledgeTask, config: KnowledgeConfig, out: Path, pool: Path | None = None,
            limit: int | None = None, progress: bool = True, runner: Runner = local_runner) -> JobSummary:
    """Generate ``config``'s knowledge for every entity of the side and part (the first
    ``limit``) missing from the store ``out``, persisting each result as it completes;
    ``runner`` decodes the batches (default: in this process)."""
    if config.method in DRAFTING and pool is None and config.part == "new":
        raise RecspecError(f"method {config.method} drafts from earlier knowledge: pass --pool with the "
                           f"old-part store of side {config.side}")
    entities = task.entities(config.side, config.part, limit)
    summary = JobSummary()
    own = pool is None and config.method in DRAFTING
    texts = task.pool_texts(config, pool) if pool is not None else (
        task.stored_texts(config.side, out) if own and Path(out).is_file() else None)
    pools = build_pools(task, config, texts)  # bad settings fail before the store exists
    fresh = not Path(out).exists()
    try:
        with KnowledgeStore(out, task.store_settings(config)) as store:
            done = store.done()
            todo = [int(e) for e in entities if task.entity_id(config.side, int(e)) not in done]
            summary.skipped = len(entities) - len(todo)
            prompt_of = {entity: task.prompt(config, entity) for entity in todo}
            if config.batch_size > 1:  # batch prompts of similar lengths: less padding
                todo.sort(key=lambda entity: len(prompt_of[entity]))
            batches = [(todo[start:start + config.batch_size],
                        [prompt_of[entity] for entity in todo[start:start + config.batch_size]])
                       for start in range(0, len(todo), config.batch_size)]
            with tqdm(total=len(todo), desc=f"{config.side} {config.part} knowledge ({config.method})",
                      unit="request", disable=not progress) as bar:
                for batch, generations in runner(task, config, pools, batches):
                    store.add([(task.entity_id(config.side, entity),
                                task.tokenizer.decode(generation.tokens, skip_special_tokens=True), generation)
                               for entity, generation in zip(batch, generations)])
                    for entity, generation in zip(batch, generations):
                        summary.add(generation)
                        if own:
                            pools.add(entity, generation.tokens)
                    bar.update(len(batch))
                    bar.set_postfix_str(f"{summary.tokens / summary.wall_s:.1f} tok/s, "
                                        f"AAL {summary.tokens / summary.calls:.2f}")
    except BaseException:
        if fresh and Path(out).is_file() and next(iter(read_rows(out)), None) is None:  # new and empty: leave none
            Path(out).unlink()
        raise
    summary.pool_build_s = pools.build_s if pools is not None else 0.0
    return summary


def set_threads(threads: int | None) -> None:
    """Use ``threads`` CPU threads for torch (None: torch's default)."""
    if threads is not None:
        if threads < 1:
            raise RecspecError(f"--threads must be positive, got {threads}")
        torch.set_num_threads(threads)


def describe_store(path: Path, examples: int = 2) -> str:
    """A summary of a store: its settings, counts, speed and acceptance, and a few texts."""
    settings = read_settings(path)
    rows = list(read_rows(path))
    lines = [f"{path}: {len(rows)} {settings.get('side')} texts ({settings.get('part')} part), method "
             f"{settings.get('method')}, verify {settings.get('verify')}, model {settings['model']['name']}, "
             f"prompt {settings.get('prompt_version')}"]
    if rows:
        tokens = np.array([r.new_tokens for r in rows])
        wall = sum(r.wall_s for r in rows)
        calls = sum(r.calls for r in rows)
        lines.append(f"tokens per text: mean {tokens.mean():.1f}, min {tokens.min()}, max {tokens.max()}; "
                     f"{tokens.sum() / wall:.1f} tokens/s over {wall:.1f} s; AAL {tokens.sum() / calls:.2f} tokens per "
                     f"target call; ART {1e3 * sum(r.retrieval_s for r in rows) / len(rows):.1f} ms per request")
        for row in rows[:examples]:
            lines.append(f"--- {row.entity} ({row.new_tokens} tokens, {row.wall_s:.1f} s)\n{row.text}")
    return "\n".join(lines)
