"""Training a draft on alignment data (`recspec align train`): the draft gets its target's item
index, tokenizer family and prompt template; selection by validation acceptance when the target
is given (mean accepted steps of speculative beam search on validation users), else by the
validation alignment loss."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from recspec.align.data import PARTS
from recspec.align.task import AlignmentTask, check_method, read_manifest
from recspec.devices import resolve_device
from recspec.errors import RecspecError
from recspec.itemids.index import ItemIndex
from recspec.models.checkpoint import INDEX_FILE, load_trained, trained_model_dir, write_run_info
from recspec.models.examples import PromptEncoder, PromptTemplate
from recspec.fit import prepare_training_dir
from recspec.models.presets import build_model, get_preset, preset_template, preset_tokenizer
from recspec.models.tokenizer import identifier_token_ids, index_fingerprint, load_tokenizer_dir
from recspec.models.head import HeadConfig
from recspec.models.train import TrainConfig, TrainResult, refuse_packing, resolve_precision, train

ACCEPTANCE_METRIC = "accepted_steps"


def acceptance_evaluator(target, task: AlignmentTask, users: int, k: int, draft_beams: int, relaxed: bool,
                         bind: Callable[[Any], Any] = lambda draft: draft):
    """``evaluate(draft)``: mean accepted steps (and target calls) of speculative beam search with
    the loaded ``target`` on the first ``users`` validation prompts, strict or relaxed (seeded);
    ``bind`` turns the model being trained into what drafts (a head: bound to the target)."""
    from recspec.decoding.speculative_beam import SpecConfig, speculative_beam_search

    valid = task.examples[PARTS[1]]
    prompts = task.encoder.prompts(valid, np.arange(min(users, len(valid))))
    config = SpecConfig(draft_beams=max(draft_beams, k), verify="relaxed" if relaxed else "strict")

    def evaluate(draft) -> dict[str, float]:
        device = next(draft.parameters()).device
        stats = speculative_beam_search(target.to(device), bind(draft), prompts, task.trie.to(device), k,
                                        task.encoder.pad_id, config, batch_size=64).stats.summary()
        return {ACCEPTANCE_METRIC: stats["accepted_steps"], "target_calls": stats["target_calls"]}

    return evaluate


def align_fit(data_dir: Path, out_dir: Path, method: str, alpha: float = 0.5, preset: str = "draft-tiny",
              target_dir: Path | None = None, config: TrainConfig | None = None, eval_users: int = 256,
              eval_k: int = 10, eval_beams: int = 40, overwrite: bool = False, progress: bool = True) -> TrainResult:
    """Train a fresh ``preset`` draft on the alignment data of ``data_dir`` with ``method``. The
    draft of a target no preset built (one made by `recspec import`) is a fresh ``preset`` model
    over the target's own tokenizer, with its prompt template; a draft of the target's preset family
    (draft-tiny for target-mini, draft-llm for an LLM preset) takes the target's prompt too (an LLM
    target's may be the short one)."""
    from recspec.align.data import manifest_dataset

    check_method(method, alpha)
    config = config or TrainConfig()
    refuse_packing(config, "alignment training")
    manifest = read_manifest(data_dir)
    index = ItemIndex.load(Path(data_dir) / INDEX_FILE)
    if index_fingerprint(index) != manifest["index_fingerprint"]:
        raise RecspecError(f"{data_dir}: {INDEX_FILE} does not match the manifest; the data folder was altered")
    out_dir = prepare_training_dir(out_dir, overwrite)
    dataset = manifest_dataset(manifest, index)
    if manifest.get("preset") is None:  # an imported target: its tokenizer and prompt
        tokenizer = load_tokenizer_dir(trained_model_dir(manifest["target"]), index)
        template = PromptTemplate.from_json(manifest["prompt"])
    else:  # a draft of the target's preset family reads the target's own prompt (short or not)
        tokenizer = preset_tokenizer(preset, index)
        same_family = get_preset(preset).llm == get_preset(manifest["preset"]).llm
        template = PromptTemplate.from_json(manifest["prompt"]) if same_family else preset_template(preset, tokenizer)
    encoder = PromptEncoder(index, dataset.item_ids, tokenizer, template)
    trie = index.trie(identifier_token_ids(tokenizer, index), vocab_size=len(tokenizer))
    task = AlignmentTask.load(Path(data_dir), encoder, trie, method, alpha)
    info: dict[str, Any] = {"dataset": manifest["dataset"], "format": manifest.get("format_of_dataset"),
                            "split": manifest["split"], "max_history": manifest["max_history"], "preset": preset,
                            "only_indexed_items": manifest.get("only_indexed_items"),
                            "alignment": {"method": method, "alpha": alpha, "data": str(Path(data_dir).resolve())}}
    write_run_info(out_dir, index, info)  # a resume's settings checked before anything is built
    model = build_model(preset, tokenizer, seed=config.seed)
    if target_dir is None:
        return train(model, task, out_dir, config, progress=progress)
    target, _ = load_trained(target_dir, task.encoder.index)
    evaluate = acceptance_evaluator(target, task, eval_users, eval_k, eval_beams, method == "atspeed-r")
    return train(model, task, out_dir, config, evaluate=evaluate, progress=progress, metric=ACCEPTANCE_METRIC)


def head_fit(data_dir: Path, target_dir: Path, out_dir: Path, method: str, alpha: float = 0.5,
             layers: int = 1, feature_weight: float = 1.0, config: TrainConfig | None = None,
             eval_users: int = 256, eval_k: int = 10, eval_beams: int = 40, overwrite: bool = False,
             progress: bool = True, context_heads: int = 0) -> TrainResult:
    """Train a draft head for the target of ``target_dir`` on its alignment data ``data_dir``
    (:mod:`recspec.align.head`): ``layers`` blocks of the target's width with an MLP of twice
    that, attending over the prompt's features with ``context_heads`` heads (0: not at all);
    epochs selected by validation acceptance."""
    from recspec.align.head import HeadAlignmentTask, HeadStore
    from recspec.models.head import DraftHead, bind_head, head_fingerprint
    from recspec.recommend import Recommender

    check_method(method, alpha)
    config = config or TrainConfig()
    refuse_packing(config, "alignment training")
    manifest = read_manifest(data_dir)
    recommender = Recommender.load(target_dir)
    if index_fingerprint(recommender.index) != manifest["index_fingerprint"]:
        raise RecspecError(f"{data_dir}: alignment data made for another item index than {target_dir}'s")
    hidden = recommender.model.config.get_text_config().hidden_size
    head = HeadConfig(hidden=hidden, intermediate=2 * hidden, layers=layers, levels=recommender.trie.depth,
                      context_heads=context_heads)
    head.check()  # before the folder is made: a bad shape leaves nothing behind
    out_dir = prepare_training_dir(out_dir, overwrite)
    torch.manual_seed(config.seed)
    model = DraftHead(head)
    bound = bind_head(model, recommender.model, recommender.tokenizer, recommender.index)
    info = {"target": str(Path(target_dir).resolve()),
            "alignment": {"method": method, "alpha": alpha, "feature_weight": feature_weight,
                          "data": str(Path(data_dir).resolve())}}
    store = HeadStore(out_dir, head_fingerprint(trained_model_dir(target_dir), recommender.index), info,
                      shape=asdict(head))
    store.read_checkpoint()  # a checkpoint trained otherwise is refused before the feature pass
    base = AlignmentTask.load(Path(data_dir), recommender.encoder, recommender.trie.to("cpu"), method, alpha)
    task = HeadAlignmentTask(base, bound, store, feature_weight)
    device = resolve_device(config.device)
    task.keep_features(device, resolve_precision(config.precision, device), progress=progress)
    evaluate = acceptance_evaluator(recommender.model, task, eval_users, eval_k, eval_beams, method == "atspeed-r",
                                    bind=lambda trained: bind_head(trained, recommender.model, recommender.tokenizer,
                                                                   recommender.index))
    return train(model, task, out_dir, config, evaluate=evaluate, progress=progress, metric=ACCEPTANCE_METRIC)
