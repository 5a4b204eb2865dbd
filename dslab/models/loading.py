"""Loading the course's models: dslab-tiny (or any causal LM), its tokenizer, and a LoRA adapter on top.

Everything loads through AutoModelForCausalLM / AutoTokenizer.from_pretrained, the same code path as a real
Qwen2 checkpoint: pass a hub id such as Qwen/Qwen2-0.5B (or set DSLAB_MODEL) and nothing else changes.
`load_model` is the one loader: with `adapter=` it puts a checked LoRA adapter on the base (the adapter's own
files are read and checked here, before PEFT sees them). Building dslab-tiny from scratch is dslab.tiny.pretrain.
"""
import contextlib
import json
import os
from pathlib import Path

from dslab.files import atomic_dir
from dslab.messages import say
from dslab.data import DATA_DIR

DEFAULT_MODEL_DIR = DATA_DIR / "dslab-tiny"
# dslab's one dtype vocabulary (the names DeepSpeed configs use) -> torch's name, used only where torch is called.
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# Weights saved as a pickle (transformers' older format, shards included): unpickling runs whatever code the file
# holds, so they are never loaded here.
PICKLED_WEIGHTS = "pytorch_model*.bin"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
SHAPE_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads")


class ModelError(ValueError):
    """A model that cannot be loaded or built as asked (no such folder, weights only as a pickle, a size below 1);
    the message says the fix."""


class AdapterError(ModelError):
    """An adapter directory or state dict that must not be used (empty, size-0, or not an adapter at all)."""


def torch_dtype(name):
    """The torch dtype for "fp32" / "bf16" / "fp16"; ValueError naming the choices for anything else."""
    import torch

    if name not in DTYPES:
        raise ValueError(say("dtype.unknown", name=name, choices=", ".join(DTYPES)))
    return getattr(torch, DTYPES[name])


def resolve_model(path=None, adapter=None):
    """What to load (a str): `path`, else the local base an `adapter` records, else $DSLAB_MODEL, else dslab-tiny."""
    return str(path or (adapter_base(adapter) if adapter else None) or os.environ.get("DSLAB_MODEL")
               or DEFAULT_MODEL_DIR)


def _hub_id(name):
    """True if `name` has the form of a Hugging Face hub id ("repo" or "namespace/repo")."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def check_model(path=None, adapter=None, weights=True):
    """What load_model would load (resolve_model), checked before transformers sees it; ModelError says the fix.

    A local folder needs config.json and safetensors weights: a checkpoint whose weights are only a pickle
    (pytorch_model.bin) is refused, since unpickling can run any code the file holds (weights=False: the weights
    are not looked at, for what only reads the folder's config). A name that is no folder here must have a hub
    id's form and is left to the hub, unless its parent folder exists here (runs/merged): then it is taken for a
    local folder that is missing.
    """
    name = resolve_model(path, adapter)
    folder = Path(name)
    if folder.is_dir():
        if not (folder / "config.json").is_file():
            if (folder / ADAPTER_CONFIG).is_file():
                raise ModelError(say("model.is_adapter", path=name, config=ADAPTER_CONFIG))
            raise ModelError(say("model.no_config", path=name))
        if weights and not any(folder.glob("*.safetensors")):
            pickles = sorted(f.name for f in folder.glob(PICKLED_WEIGHTS))
            if pickles:
                raise ModelError(say("model.pickle_only", path=name, file=pickles[0]))
            raise ModelError(say("model.no_weights", path=name))
        return name
    if folder.exists():
        raise ModelError(say("model.is_file", path=name))
    if not _hub_id(name) or folder.parent != Path(".") and folder.parent.is_dir():
        raise ModelError(say("model.missing", path=name, default=str(DEFAULT_MODEL_DIR)))
    return name


@contextlib.contextmanager
def hub_errors(name):
    """Around a from_pretrained of `name`: a hub id the hub (or its cache) cannot give raises ModelError."""
    try:
        yield
    except OSError as exc:
        if Path(name).exists():
            raise  # a local folder checked by check_model: transformers' own message says what else is wrong
        why = str(exc).strip().splitlines()[0].rstrip(".") if str(exc).strip() else type(exc).__name__
        raise ModelError(say("model.not_on_hub", path=name, why=why)) from None


def load_model(path=None, adapter=None, dtype="fp32", merge_adapter=False, trust_remote_code=False):
    """A causal LM in eval mode, weights from safetensors only.

    path: local HF directory or hub id (see resolve_model). adapter: a LoRA adapter directory, checked and put
    on top (a PeftModel); merge_adapter=True folds it into the weights and returns the plain model (what
    DeepSpeed AutoTP needs: it splits plain linear layers, not LoRA wrappers). dtype: "fp32", "bf16" or "fp16".
    A missing folder, a pickle-only checkpoint or a broken adapter raises ModelError (see check_model).
    """
    from transformers import AutoModelForCausalLM

    if adapter:
        read_adapter(adapter)  # a broken adapter fails here, before anything big is loaded
    name = check_model(path, adapter)
    with hub_errors(name):
        model = AutoModelForCausalLM.from_pretrained(name, dtype=torch_dtype(dtype), use_safetensors=True,
                                                     trust_remote_code=trust_remote_code)
    if adapter:
        model = apply_adapter(model, adapter)
        if merge_adapter:
            model = model.merge_and_unload()
    return model.eval()


def load_tokenizer(path=None, adapter=None, trust_remote_code=False):
    """The tokenizer saved beside the model (chat template included); same `path`/`adapter` rule as load_model."""
    from transformers import AutoTokenizer

    name = check_model(path, adapter)
    if Path(name).is_dir() and not any((Path(name) / f).is_file() for f in TOKENIZER_FILES):
        raise ModelError(say("model.no_tokenizer", path=name, files=", ".join(TOKENIZER_FILES[:2])))
    with hub_errors(name):
        return AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)


def tiny_config(**overrides):
    """A Qwen2Config of the dslab-tiny shape; keyword overrides change it (e.g. num_hidden_layers=8)."""
    from transformers import Qwen2Config
    shape = dict(
        vocab_size=10240,           # byte-level BPE: 6,763 Chinese characters + merges learned on the corpus
        hidden_size=256,
        intermediate_size=688,      # ~8/3 x hidden, rounded to a multiple of 16, as SwiGLU models do
        num_hidden_layers=4,
        num_attention_heads=4,      # head_dim 64
        num_key_value_heads=2,      # grouped-query attention, like Qwen2
        max_position_embeddings=1024,
        rope_theta=10000.0,
        tie_word_embeddings=True,   # the output head shares the embedding matrix: 1M fewer parameters
        bos_token_id=None, eos_token_id=2, pad_token_id=0,
    )
    shape.update(overrides)
    for key in SHAPE_SIZES:  # torch would fail later, deep inside building the model, or build an empty one
        if not shape[key] >= 1:
            raise ModelError(say("number.at_least", name=key, least=1, value=shape[key]))
    return Qwen2Config(**shape)


def build_model(config, seed=0):
    """A randomly initialised causal LM for `config`, the same weights for the same seed."""
    import torch
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config)


def count_parameters(model):
    """Number of distinct parameters (tied weights counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def save_pretrained(model, tokenizer, output):
    """Save model (safetensors), generation config and tokenizer files in Hugging Face format, atomically."""
    from transformers import GenerationConfig
    end, eot = tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.convert_tokens_to_ids("<|endoftext|>")
    # Stop at the end of a chat turn and at the end of a document; greedy unless asked otherwise.
    model.generation_config = GenerationConfig(eos_token_id=[end, eot], pad_token_id=eot, do_sample=False,
                                               max_new_tokens=64)
    with atomic_dir(output) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)


# ----------------------------------------------------------------------------------------------------
# LoRA adapters on disk: read, check, put on a base model
# ----------------------------------------------------------------------------------------------------
def is_adapter_key(key):
    """True for the state-dict keys PEFT saves for an adapter (LoRA matrices, modules_to_save)."""
    return "lora_" in key or "modules_to_save" in key


# PEFT also saves the (frozen) embedding / output head when an adapter targets one of them.
_EMBEDDING_KEYS = ("embed_tokens.weight", "embed_tokens.base_layer.weight", "lm_head.weight",
                   "lm_head.base_layer.weight", "wte.weight", "embed_out.weight")


def check_adapter_state(state_dict, where=None):
    """Raise AdapterError unless `state_dict` holds real (non-empty) LoRA tensors, and not a whole model.

    where: what the message calls the tensors (default: "adapter", in the learner's language)."""
    where = where or say("adapter.where_plain")
    if not state_dict:
        raise AdapterError(say("adapter.empty", where=where))
    empty = sorted(k for k, v in state_dict.items() if v.numel() == 0)  # sorted: the same example every time
    if empty:
        raise AdapterError(say("adapter.placeholders", where=where, n=len(empty), example=empty[0],
                               shape=tuple(state_dict[empty[0]].shape)))
    lora_keys = [k for k in state_dict if is_adapter_key(k)]
    foreign = [k for k in state_dict if not is_adapter_key(k) and not k.endswith(_EMBEDDING_KEYS)]
    if not lora_keys or foreign:
        example = (foreign or list(state_dict))[0]
        raise AdapterError(say("adapter.full_state", where=where, plain=len(state_dict) - len(lora_keys),
                               total=len(state_dict), example=example))


def _looks_like_full_model(path):
    return (path / "config.json").exists() and any(path.glob("model*.safetensors")) or (path / "pytorch_model.bin").exists()


def read_adapter(adapter_dir):
    """(adapter config dict, state dict) of a saved PEFT adapter, checked; AdapterError says what is wrong."""
    from safetensors.torch import load_file

    path = Path(adapter_dir)
    if path.is_file():
        if path.suffix == ".safetensors":  # someone pointed at a weights file: say what it holds
            check_adapter_state(load_file(str(path)), where=repr(str(adapter_dir)))
        raise AdapterError(say("adapter.is_file", path=str(adapter_dir), config=ADAPTER_CONFIG, weights=ADAPTER_WEIGHTS))
    if not path.is_dir():
        raise AdapterError(say("adapter.missing", path=str(adapter_dir)))
    if not (path / ADAPTER_CONFIG).exists():
        if _looks_like_full_model(path):
            raise AdapterError(say("adapter.full_model", path=str(adapter_dir)))
        raise AdapterError(say("adapter.no_config", path=str(adapter_dir), config=ADAPTER_CONFIG))
    weights = path / ADAPTER_WEIGHTS
    if not weights.exists():  # so PEFT, which prefers safetensors, never falls back to a pickled .bin
        raise AdapterError(say("adapter.no_weights", path=str(adapter_dir), config=ADAPTER_CONFIG, weights=ADAPTER_WEIGHTS))
    state = load_file(str(weights))
    check_adapter_state(state, where=say("adapter.where", path=str(adapter_dir)))
    config = json.loads((path / ADAPTER_CONFIG).read_text())
    return config, state


def adapter_base(adapter_dir):
    """The base model an adapter records (PEFT's base_model_name_or_path) if it is a local directory, else None."""
    config, _ = read_adapter(adapter_dir)
    recorded = config.get("base_model_name_or_path")
    return recorded if recorded and Path(recorded).is_dir() else None


def check_adapter_fits(base, state, adapter_dir):
    """AdapterError unless every LoRA matrix of `state` fits the layer of `base` it adapts (same in/out sizes)."""
    import torch

    for key, tensor in state.items():
        if ".lora_A." not in key and ".lora_B." not in key:
            continue
        layer = key.split(".lora_")[0].removeprefix("base_model.model.")
        try:
            module = base.get_submodule(layer)
        except AttributeError:
            raise AdapterError(say("adapter.unknown_layer", path=str(adapter_dir), layer=layer)) from None
        if isinstance(module, torch.nn.Linear):
            size, wanted = (tensor.shape[1], module.in_features) if ".lora_A." in key else (tensor.shape[0], module.out_features)
            if size != wanted:
                raise AdapterError(say("adapter.other_base", path=str(adapter_dir), layer=layer, size=size, wanted=wanted))


def untie_output_head(model):
    """Give lm_head its own copy of the embedding matrix, so merging a LoRA on lm_head leaves inputs alone.

    With tie_word_embeddings the head and the input embedding are one tensor: merging B·A into the head
    would also change every token's input embedding, and the merged model would answer differently.
    """
    import torch

    head, emb = model.get_output_embeddings(), model.get_input_embeddings()
    if head is None or emb is None or head.weight is not emb.weight:
        return False
    head.weight = torch.nn.Parameter(emb.weight.detach().clone(), requires_grad=emb.weight.requires_grad)
    model.config.tie_word_embeddings = False
    if hasattr(model.config, "get_text_config"):
        model.config.get_text_config().tie_word_embeddings = False
    return True


def apply_adapter(base, adapter_dir):
    """The loaded `base` with a checked adapter from `adapter_dir` on top: a PeftModel in eval mode."""
    from peft import PeftModel

    _, state = read_adapter(adapter_dir)  # fail with a clear message before PEFT does with an obscure one
    check_adapter_fits(base, state, adapter_dir)
    head = next((n for n, m in base.named_modules() if m is base.get_output_embeddings()), None)
    if head and any(f".{head}." in k for k in state):
        untie_output_head(base)  # the adapter changes the head: it must stop sharing the input embedding
    return PeftModel.from_pretrained(base, str(adapter_dir)).eval()
