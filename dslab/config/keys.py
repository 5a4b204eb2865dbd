"""The keys DeepSpeed reads, level by level, found by running DeepSpeed's own config readers.

DeepSpeed ignores keys it does not read at the top level (a typo such as "zero_optimisation" just means "no ZeRO")
and refuses unknown keys inside the sections its pydantic models validate, but only once every rank runs
deepspeed.initialize. So the list comes from the installed DeepSpeed itself, not from a copy typed in by hand:
schema() records every key it looks up, with the kinds of values and the pydantic models that validate its sections;
optimizer_param_keys() and signature_keys() read what "optimizer.params" and "scheduler.params" may hold from
the signatures of the classes DeepSpeed builds. dslab.config.check compares a config with them.
"""
from functools import lru_cache

from dslab import compat

# Read from the raw config outside the section readers the probe runs (deepspeed.initialize, and DeepSpeedConfig's
# __init__ and warning checks), so the probe below cannot see them.
_EXTRA_TOP_KEYS = {"sequence_parallel_size": "posint", "data_parallel_size": "posint", "vocabulary_size": "int"}
_PROBE = "__dslab_probe__"


def _section(keys=(), kinds=None, children=None, removed=None, deprecated=None, refuses_unknown=False):
    """One level of the config: its keys, their kinds ("bool", "int", ...), nested sections, retired keys, and
    whether DeepSpeed refuses a key it does not know there (a pydantic model) or ignores it (a plain dict)."""
    return {"keys": set(keys), "kinds": dict(kinds or {}), "children": dict(children or {}),
            "removed": dict(removed or {}), "deprecated": dict(deprecated or {}), "refuses_unknown": refuses_unknown}


def _model_section(model):
    """Known keys (field names and JSON aliases), kinds and nested sections of a DeepSpeed pydantic config."""
    import enum
    import typing

    from deepspeed.runtime.config_utils import DeepSpeedConfigModel

    # DeepSpeedConfigModel forbids extra fields: an unknown key fails deepspeed.initialize with a ValidationError.
    section = _section(refuses_unknown=model.model_config.get("extra") == "forbid")
    for name, field in model.model_fields.items():
        names = {name} | ({field.alias} if field.alias else set())
        section["keys"] |= names
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        if extra.get("deprecated"):
            new = extra.get("new_param") or "its replacement"
            new_field = model.model_fields.get(new)
            for n in names:  # name the replacement as JSON files spell it (its alias, if it has one)
                section["deprecated"][n] = (new_field.alias if new_field and new_field.alias else new)
        annotation = field.annotation
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if typing.get_origin(annotation) is typing.Union and len(args) == 1:
            annotation = args[0]
        kind = child = None
        if annotation is bool:
            kind = "bool"
        elif annotation is int:
            kind = "int"
        elif annotation is float:
            kind = "float"
        elif isinstance(annotation, type) and issubclass(annotation, DeepSpeedConfigModel):
            child = _model_section(annotation)
        elif isinstance(annotation, type) and issubclass(annotation, enum.Enum):
            kind = None  # DeepSpeed's own validation names the allowed values
        for n in names:
            if kind:
                section["kinds"][n] = kind
            if child:
                section["children"][n] = child
    return section


class _Recorder(dict):
    """A dict that notes every key DeepSpeed's config readers look up in it."""

    def __init__(self, data, seen):
        super().__init__(data)
        self.seen = seen

    def _note(self, key):
        if key != _PROBE:
            self.seen.add(key)

    def get(self, key, default=None):
        self._note(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self._note(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self._note(key)
        return super().__contains__(key)

    def keys(self):
        outer = self

        class _Keys:
            def __contains__(self, key):
                return outer.__contains__(key)

            def __iter__(self):
                return iter([k for k in dict.keys(outer) if k != _PROBE])

            def __len__(self):
                return len(outer)

        return _Keys()

    def __copy__(self):
        return self


@lru_cache(maxsize=None)
def schema():
    """The keys DeepSpeed reads, found by running its own config readers on recording dicts.

    DeepSpeed ignores keys it does not read (a typo such as "zero_optimisation" just means
    "no ZeRO"), so the list has to come from the readers themselves: each top-level key that
    DeepSpeedConfig looks up, and for each section the keys its reader looks up or the fields of
    the pydantic model it builds.

    Returns {"top": the top level as a section (keys, kinds, children, removed, deprecated), "models": {top-level
    key: the pydantic model DeepSpeed validates that section with}, "auto_ok": keys for which "auto" is one of
    DeepSpeed's own values}. Computed once per process (it imports DeepSpeed).
    """
    from deepspeed.runtime import constants
    from deepspeed.utils import logger

    models = {}

    def built(model, data):
        if _PROBE in data:  # this model was built from the section we planted the marker in
            models[data.pop(_PROBE)] = model

    def read(param_dict):
        try:
            compat.read_config_sections(param_dict)
        except Exception:  # a scalar reader given our probe dict; what it looked up is already noted
            pass

    level = logger.level
    logger.setLevel("ERROR")
    try:
        with compat.watching_config_models(built):
            top_keys = set()
            read(_Recorder({_PROBE: ""}, top_keys))
            nested = {}
            for key in sorted(top_keys):
                seen = set()
                read(_Recorder({key: _Recorder({_PROBE: key}, seen), _PROBE: ""}, set()))
                nested[key] = seen
    finally:
        logger.setLevel(level)

    # optimizer/scheduler "params" are read only when "type" is present, so the probe misses them.
    # (Their contents are checked against the optimizer's / scheduler's signature instead.)
    nested[constants.OPTIMIZER] |= {constants.TYPE, constants.OPTIMIZER_PARAMS}
    nested[constants.SCHEDULER] |= {constants.TYPE, constants.SCHEDULER_PARAMS}

    names = {value: name for name, value in vars(constants).items() if name.isupper() and isinstance(value, str)}
    kinds = dict(_EXTRA_TOP_KEYS)
    for key in top_keys:
        default = getattr(constants, f"{names.get(key, '')}_DEFAULT", None)
        kind = {bool: "bool", int: "int", float: "float", str: "str"}.get(type(default))
        if kind:
            kinds[key] = kind
    kinds.update(train_batch_size="posint", train_micro_batch_size_per_gpu="posint",
                 gradient_accumulation_steps="posint", steps_per_print="posint", gradient_clipping="float")

    children = {}
    for key in top_keys:
        if key in models:
            children[key] = _model_section(models[key])
        elif nested.get(key):
            children[key] = _section(nested[key])
        else:
            children[key] = None  # a scalar, or a section whose keys DeepSpeed does not fix (e.g. pipeline)
    children = {k: v for k, v in children.items() if v is not None}
    removed = compat.removed_config_keys()
    zero = children.get("zero_optimization")
    if zero is not None:
        zero["removed"] = removed["zero_optimization"]
    top = _section(top_keys | set(_EXTRA_TOP_KEYS), kinds, children, removed=removed["top"])
    # Keys where "auto" is DeepSpeed's own value (data_types.keep_in_fp32_modules), not the HF placeholder.
    auto_ok = {getattr(constants, name[:-len("_DEFAULT")]) for name, value in vars(constants).items()
               if name.endswith("_DEFAULT") and value == "auto"
               and isinstance(getattr(constants, name[:-len("_DEFAULT")], None), str)}
    return {"top": top, "models": {k: m for k, m in models.items() if k in top_keys},
            "auto_ok": frozenset(auto_ok | {"replace_method"})}


def known_keys(path=""):
    """Sorted keys DeepSpeed reads at a dotted section path ("" = top level, "zero_optimization", ...)."""
    section = schema()["top"]
    for part in [p for p in path.split(".") if p]:
        section = section["children"][part]
    return sorted(section["keys"])



# --------------------------------------------------------------------------- optimizer and scheduler params

# "optimizer.params" and "scheduler.params" become keyword arguments of the class DeepSpeed builds, so the keys
# it accepts are that class's signature (several classes where DeepSpeed picks one by the setup).
_ADAM_EXTRAS = {"torch_adam", "adam_w_mode", "fp32_optimizer_states"}  # read by DeepSpeed itself, not passed on
_OPTIMIZER_CLASSES = {
    "adam": ["torch.optim.Adam", "torch.optim.AdamW", "deepspeed.ops.adam.DeepSpeedCPUAdam",
             "deepspeed.ops.adam.FusedAdam"],
    "adagrad": ["torch.optim.Adagrad", "deepspeed.ops.adagrad.DeepSpeedCPUAdagrad"],
    "lion": ["deepspeed.ops.lion.FusedLion", "deepspeed.ops.lion.DeepSpeedCPULion"],
    "lamb": ["deepspeed.ops.lamb.FusedLamb"],
}
_OPTIMIZER_CLASSES["adamw"] = _OPTIMIZER_CLASSES["adam"]


def signature_keys(dotted_names):
    """Keyword names the classes accept (besides the parameters/optimizer they are built on)."""
    import importlib
    import inspect

    keys = set()
    for dotted in dotted_names:
        module, _, name = dotted.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module), name)
            keys |= set(inspect.signature(cls).parameters)
        except (ImportError, AttributeError, ValueError, TypeError):
            continue
    return keys - {"self", "params", "model_params", "optimizer", "args", "kwargs"}


def optimizer_param_keys(name):
    """Keys "optimizer.params" may hold for optimizer type `name` (DeepSpeed's names or a torch.optim class).

    Empty for DeepSpeed's mu* / muon optimizers, whose parameters depend on optional packages (not checked).
    """
    from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS

    lower = name.lower()
    if lower in _OPTIMIZER_CLASSES:
        return signature_keys(_OPTIMIZER_CLASSES[lower]) | (_ADAM_EXTRAS if lower.startswith("adam") else set())
    if lower in DEEPSPEED_OPTIMIZERS:
        return set()
    return signature_keys([f"torch.optim.{name}"])
