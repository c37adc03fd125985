"""Hugging Face helpers every layer may use: resolving a model (a cached asset by name, or any
local model folder, its checksums checked), loading tokenizers and bodies with one-line errors,
checking a model folder before transformers reads it (no remote code, ever: :func:`refuse_remote_code`;
safetensors that hold exactly the weights its config describes: :func:`check_weights_fit`), and the
transformer call options recspec relies on (``logits_to_keep``, the KV cache's keyword). Causal LMs for
decoding are loaded by :func:`recspec.models.hf.load_causal_lm`."""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from recspec.assets import ASSETS, require
from recspec.errors import RecspecError
from recspec.fileio import CHECKSUMS, read_json, verify_checksums
from recspec.statefile import OBJECT_FILES

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

CONFIG_FILE, TOKENIZER_CONFIG_FILE = "config.json", "tokenizer_config.json"
#: The sizes of a config that shape its model's weights: each a positive integer where it is set.
SIZE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim")


def resolve_model_dir(spec: str | Path) -> Path:
    """The folder of a model given by asset name (``smollm2``) or by path to a HF model folder."""
    path = Path(spec).expanduser()
    if str(spec) in ASSETS and not path.exists():
        return require(str(spec))
    if not (path / "config.json").is_file():
        raise RecspecError(f"model {spec!r}: not a cached asset ({', '.join(ASSETS)}) "
                           f"and not a Hugging Face model folder (no config.json)")
    if (path / CHECKSUMS).is_file():  # a folder recspec wrote (e.g. `recspec distill`'s best/)
        verify_checksums(path, "the model folder is damaged; make it again or restore it from a copy")
    refuse_remote_code(path)
    return path


@contextlib.contextmanager
def loading_errors(folder: Path, action: str = "load the model") -> Iterator[None]:
    """Turn what transformers, tokenizers and safetensors raise on a damaged, malformed or
    mismatched model folder into one line naming the folder and what could not be done
    (``action``): a config cut short (``ValueError``), a config field of the wrong type
    (huggingface_hub's ``StrictDataclassError``) or a zero head count (``ZeroDivisionError``), a
    truncated safetensors file, a tokenizer_config.json field of the wrong type or shape
    (``TypeError``, ``KeyError``, ``AttributeError``), a broken chat template (jinja's
    ``TemplateError``), and what the tokenizers library raises as a bare ``Exception``: a
    tokenizer.json of another structure, a word outside a word-level vocabulary that has no
    unknown token."""
    from huggingface_hub.errors import StrictDataclassError
    from jinja2 import TemplateError
    from safetensors import SafetensorError

    try:
        yield
    except (OSError, ValueError, TypeError, KeyError, AttributeError, ZeroDivisionError, json.JSONDecodeError,
            SafetensorError, StrictDataclassError, TemplateError) as err:
        raise _cannot(folder, action, err) from None
    except Exception as err:
        if type(err) is not Exception:  # the tokenizers library's errors are bare Exceptions; nothing else is
            raise
        raise _cannot(folder, action, err) from None


def _cannot(folder: Path, action: str, err: BaseException) -> RecspecError:
    detail = " ".join(str(err).split())[:200]
    return RecspecError(f"{folder}: cannot {action} ({detail}); the folder is damaged or not a model of this kind")


def _shown(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" ... ({len(names)} in all)" if len(names) > 3 else "")


def model_json(path: Path, required: bool = True) -> dict[str, Any]:
    """The JSON object in ``path`` (a model folder's config.json or tokenizer_config.json; ``{}``
    for an absent file that is not ``required``); malformed JSON, or a value other than an
    object, is one line naming the file."""
    if not required and not path.is_file():
        return {}
    data = read_json(path)
    if not isinstance(data, dict):
        raise RecspecError(f"{path}: holds {type(data).__name__}, not a JSON object; the model folder is damaged")
    return data


def _is_subclass(value: object, base: type) -> bool:
    return isinstance(value, type) and issubclass(value, base)


def refuse_remote_code(folder: Path) -> None:
    """Refuse, before transformers reads anything of ``folder``, what could make it run code from
    the folder or ask on standard input whether to: an ``auto_map`` in config.json or
    tokenizer_config.json, a ``model_type`` or ``architectures`` transformers does not know, a
    ``tokenizer_class`` that is not one of its tokenizers (transformers would import an unknown
    one from the folder, and load any other class it knows by that name, a model too, as the
    tokenizer). recspec also passes ``trust_remote_code=False`` to every loader; with these checks
    transformers never even reaches the question."""
    import transformers
    from transformers import CONFIG_MAPPING, PreTrainedModel, PreTrainedTokenizerBase
    from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

    config = model_json(folder / CONFIG_FILE)
    tokenizer = model_json(folder / TOKENIZER_CONFIG_FILE, required=False)
    for name, data in ((CONFIG_FILE, config), (TOKENIZER_CONFIG_FILE, tokenizer)):
        if "auto_map" in data:
            raise RecspecError(f"{folder / name}: its auto_map points at code in the model folder "
                               f"({' '.join(str(data['auto_map']).split())[:120]}); recspec never runs a model "
                               f"folder's code: save the model with a transformers class and without auto_map")
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        raise RecspecError(f"{folder / CONFIG_FILE}: model_type {model_type!r} is not one transformers "
                           f"{transformers.__version__} knows; recspec loads only those (never a folder's own code)")
    architectures = config.get("architectures") or []
    models = architectures if isinstance(architectures, list) else [architectures]
    tokenizers = [name for name in (tokenizer.get("tokenizer_class"), config.get("tokenizer_class"))
                  if name is not None]
    unknown = [repr(name) for name in models
               if not (isinstance(name, str) and _is_subclass(getattr(transformers, name, None), PreTrainedModel))]
    unknown += [repr(name) for name in tokenizers if not (isinstance(name, str) and _is_subclass(
        tokenizer_class_from_name(name), PreTrainedTokenizerBase))]
    if unknown:
        raise RecspecError(f"{folder}: {_shown(unknown)} named in its {CONFIG_FILE} / {TOKENIZER_CONFIG_FILE} "
                           f"is not a model or tokenizer class transformers {transformers.__version__} has; recspec "
                           f"loads only those (never a folder's own code): save the model and tokenizer with them")


def load_config(folder: Path) -> PreTrainedConfig:
    """The model config of ``folder`` (:func:`refuse_remote_code` first), its sizes (:data:`SIZE_FIELDS`)
    checked positive integers; every problem one line naming the file."""
    from transformers import AutoConfig

    refuse_remote_code(folder)
    with loading_errors(folder, "read config.json"):
        config = AutoConfig.from_pretrained(folder, trust_remote_code=False)
    text = config.get_text_config()
    bad = [f"{name} {value!r}" for name in SIZE_FIELDS if (value := getattr(text, name, None)) is not None
           and (isinstance(value, bool) or not isinstance(value, int) or value < 1)]
    if bad:
        raise RecspecError(f"{folder / CONFIG_FILE}: {', '.join(bad)}: sizes must be positive integers; fix "
                           f"config.json")
    return config


def safetensors_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in the model weights of ``folder`` (``model*.safetensors``, as
    transformers names them; a trainer's state beside them is not the model's), from their
    headers alone (no tensor is read). A folder without them is refused, and a pickled weights
    file there is named, never opened (unpickling could run code)."""
    from safetensors import safe_open

    files = sorted(folder.glob("model*.safetensors"))  # transformers' names: whole, or its shards
    if not files:
        pickles = sorted(path.name for pattern in OBJECT_FILES for path in folder.glob(pattern))
        only = (f" (only serialized Python objects: {', '.join(pickles[:3])}, which recspec never opens: they could "
                f"run code)") if pickles else ""
        raise RecspecError(f"{folder}: no *.safetensors weights{only}; save the model with "
                           f"save_pretrained(safe_serialization=True)")
    shapes: dict[str, tuple[int, ...]] = {}
    for path in files:
        with loading_errors(folder, f"read the header of {path.name}"), safe_open(str(path), framework="pt") as file:
            shapes.update({name: tuple(file.get_slice(name).get_shape()) for name in file.keys()})
    return shapes


def check_weights_fit(folder: Path) -> PreTrainedConfig:
    """The config of ``folder`` (:func:`load_config`) once its safetensors hold exactly the weights
    of the causal LM that config describes, else one line naming the tensors missing, unexpected
    or of another shape (a weight tied to one that is present may be absent). Checked before any
    weight is read or any memory allocated: the model is built on the meta device from the
    config and compared with the safetensors headers, so a config that does not describe these
    weights (more layers than they hold, another vocabulary or width, an untied head not saved)
    is refused instead of loaded with randomly initialised weights. The build stops once it
    registers twice as many weights as the files hold: a config of a million layers would
    otherwise take minutes and gigabytes to build even on the meta device."""
    from torch.nn.modules.module import register_module_parameter_registration_hook
    from transformers import AutoModelForCausalLM

    config = load_config(folder)
    saved = safetensors_shapes(folder)
    registered, limit = itertools.count(1), 2 * len(saved) + 8

    def stop_when_too_many(module: torch.nn.Module, name: str, param: torch.nn.Parameter) -> None:
        if next(registered) > limit:
            layers = getattr(config.get_text_config(), "num_hidden_layers", None)
            raise RecspecError(f"{folder / CONFIG_FILE}: describes a model of more than {limit} weight tensors "
                               f"(num_hidden_layers {layers}) but its safetensors hold {len(saved)}; fix config.json "
                               f"or save the model and its config together (save_pretrained)")

    hook = register_module_parameter_registration_hook(stop_when_too_many)
    try:
        with loading_errors(folder, "build the model config.json describes"), torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=False)
    finally:
        hook.remove()
    own = model.state_dict(keep_vars=True)  # tied weights: one tensor under several names
    present = {id(tensor) for name, tensor in own.items() if name in saved}
    problems = [f"{what} {_shown(names)}" for what, names in (
        ("missing", [name for name, tensor in own.items() if name not in saved and id(tensor) not in present]),
        ("unexpected", [name for name in saved if name not in own]),
        ("of another shape:", [f"{name} {list(saved[name])} (config.json: {list(own[name].shape)})"
                               for name in saved if name in own and tuple(own[name].shape) != saved[name]])) if names]
    if problems:
        raise RecspecError(f"{folder}: its safetensors weights do not fit the model config.json describes "
                           f"({'; '.join(problems)}); fix config.json or save the model and its config together "
                           f"(save_pretrained)")
    return config


def check_finite_weights(model: torch.nn.Module, folder: Path) -> None:
    """Refuse a model with a NaN or infinite weight (damaged weights decode to garbage)."""
    for name, tensor in model.state_dict().items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise RecspecError(f"{folder}: weight {name} holds NaN or infinite values; the model file is damaged")


def load_tokenizer(spec: str | Path):
    """The tokenizer of a model (asset name or folder, :func:`resolve_model_dir`), never with the
    folder's own code; a malformed one is one line (:func:`loading_errors`)."""
    from transformers import AutoTokenizer

    folder = resolve_model_dir(spec)
    with loading_errors(folder, "load its tokenizer"):
        return AutoTokenizer.from_pretrained(folder, trust_remote_code=False)


def load_base_model(spec: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
    """The transformer body without its LM head (for embeddings), in eval mode."""
    from transformers import AutoModel

    folder = resolve_model_dir(spec)
    with loading_errors(folder):
        model = AutoModel.from_pretrained(folder, dtype=dtype, trust_remote_code=False)
    check_finite_weights(model, folder)
    return model.to(device).eval()


def eos_token_ids(value: int | Sequence[int] | None) -> list[int]:
    """The end-of-sequence ids an ``eos_token_id`` setting names (a generation config's or a
    tokenizer's: none, one id, or several) as a list, so that every reader of it agrees."""
    return [] if value is None else [value] if isinstance(value, int) else list(value)


def forward_parameters(model) -> frozenset[str]:
    """The names ``model.forward`` takes: read once per forward function (reading a signature is
    slow next to a small call, and every decoding call asks for it)."""
    forward = model.forward
    return _signature_names(getattr(forward, "__func__", forward))


@functools.cache
def _signature_names(forward) -> frozenset[str]:
    return frozenset(inspect.signature(forward).parameters)


def keep_logits_at(model, keep: int | torch.Tensor) -> dict[str, int | torch.Tensor]:
    """``{"logits_to_keep": keep}`` where ``model.forward`` takes it, else ``{}`` (all positions'
    logits). ``keep``: a count of last positions, or int64 ``[n]``, the positions whose logits
    every row needs (the output layer then runs for those alone: logits ``[b, n, V]``)."""
    return {"logits_to_keep": keep} if "logits_to_keep" in forward_parameters(model) else {}


def with_cache(model, cache) -> dict[str, object]:
    """The keyword argument that hands ``model.forward`` its KV cache ``cache``: ``{"cache":
    cache}`` where forward takes ``cache`` (transformers 5.24 on, which deprecates
    ``past_key_values`` and drops it in 5.40; a model that no longer knows the old name would
    take it into its ``**kwargs`` and run without its cache, saying nothing), else
    ``{"past_key_values": cache}`` where it takes that (transformers 5.0-5.23). A model whose
    forward takes neither is a :class:`RecspecError`."""
    parameters = forward_parameters(model)
    for name in ("cache", "past_key_values"):
        if name in parameters:
            return {name: cache}
    raise RecspecError(f"{type(model).__name__}.forward takes no KV cache (neither `cache` nor `past_key_values`); "
                       f"recspec's decoders need a transformers 5 causal LM")


def returned_cache(out):
    """The KV cache a forward returned: ``out.cache`` (transformers 5.24 on), else
    ``out.past_key_values``."""
    cache = getattr(out, "cache", None)
    return out.past_key_values if cache is None else cache
