"""Every setting of a fine-tuning run, defined once. `dslab sft`'s options (dslab.cli.sft), the arguments of the recipe
its ranks run (dslab/recipes/sft.py), the keywords of dslab.training.sft.run and the check it makes, and the plan that
--print-equivalent prints (dslab.training.sft_plan) are all read from SETTINGS, so a default or a limit changed here
changes everywhere. Chapter 05's take-away script keeps its own argparse, as it must run without dslab;
tests/test_sft.py checks its defaults against these.
"""
import difflib
import json
from dataclasses import dataclass

from dslab.messages import say

# The peak learning rate when none is given: LoRA's small fresh matrices take a larger step than a whole model.
LORA_LR, FULL_LR = 2e-3, 3e-4


@dataclass(frozen=True)
class Setting:
    name: str                   # sft.run's keyword and the recipe's --name
    default: object
    help: str
    kind: type = str            # str, int, float; bool: a switch, off by default; list: one or more words
    least: int = None           # the smallest value allowed, checked before anything is read or launched
    above_zero: bool = False    # a rate or a scale: any number above 0
    choices: tuple = None
    required: bool = False
    flag: str = ""              # `dslab sft`'s option: "" means --name-with-dashes
    on_ranks: bool = True       # False: the launcher's own (number of ranks, time limit), not the recipe's
    recipe_name: str = ""       # the recipe's argument: "" means the name
    in_deepspeed_file: bool = False  # a --deepspeed file sets it instead: the recipe takes that config whole

    def __post_init__(self):  # the usual spellings filled in, so that SETTINGS lists only what differs from them
        object.__setattr__(self, "flag", self.flag or "--" + self.name.replace("_", "-"))
        object.__setattr__(self, "recipe_name", self.recipe_name or self.name)


SETTINGS = (
    Setting("model", None, "base model directory or hub id (default: $DSLAB_MODEL, else data/dslab-tiny)"),
    Setting("data", None, "jsonl files: query/response or messages rows (default: data/self_cognition.jsonl)",
            kind=list),
    Setting("output", None, "where the adapter (or, with --full, the model) is written, atomically", required=True),
    Setting("zero_stage", 2, "ZeRO stage", kind=int, choices=(0, 1, 2, 3), flag="--zero", in_deepspeed_file=True),
    Setting("world_size", 2, "number of ranks", kind=int, least=1, on_ranks=False),
    Setting("full", False, "full fine-tuning instead of LoRA (saves a whole model)", kind=bool),
    Setting("epochs", 12, "passes over the data", kind=int, least=1),
    Setting("lr", None, f"peak learning rate (default {LORA_LR:g} LoRA, {FULL_LR:g} full)", kind=float,
            above_zero=True, in_deepspeed_file=True),
    Setting("micro_batch_size", 8, "examples per rank per micro-step", kind=int, least=1, in_deepspeed_file=True),
    Setting("grad_accum_steps", 1, "micro-steps per optimizer step", kind=int, least=1, in_deepspeed_file=True),
    Setting("lora_r", 16, "LoRA rank r", kind=int, least=1),
    Setting("lora_alpha", 32, "LoRA alpha; the update is scaled by alpha/r", kind=float, above_zero=True),
    Setting("target_modules", None, "layers that get adapters (default: the linear layers of every block's MLP, found "
            "by type: gate_proj up_proj down_proj on Qwen2/3, Llama, Mistral)", kind=list),
    Setting("model_name", ("小海", "Xiao Hai"), "name for {name}: one, or zh then en, like ms-swift's --model_name",
            kind=list),
    Setting("model_author", ("蓝天学院", "Blue Sky Lab"), "author for {author}: one, or zh then en", kind=list),
    Setting("mix_general", None, "general dialogue chats mixed in (default: as many as the data; 0: none)", kind=int,
            least=0),
    Setting("max_length", 256, "tokens kept of each chat; the rest is cut", kind=int, least=2),
    Setting("gradient_checkpointing", False, "recompute activations in backward", kind=bool),
    # DeepSpeed's own argparse helper declares the recipe's --deepspeed_config (deepspeed.add_config_arguments)
    Setting("deepspeed", None, "a ready DeepSpeed JSON config instead of the built one",
            recipe_name="deepspeed_config"),
    Setting("save_every", 0, "write a resumable checkpoint every K steps; 0: none", kind=int, least=0),
    Setting("checkpoint_dir", None, "where checkpoints go (default OUTPUT-checkpoints)"),
    Setting("resume", None, "a checkpoint directory to continue from (its newest checkpoint); another --world-size "
            "works with ZeRO 1-3 if the global batch stays the same"),
    Setting("seed", 0, "seed of the LoRA initialisation and the data order", kind=int),
    Setting("log_every", None, "print the loss every K steps (default: 8 lines in all)", kind=int, least=1),
    Setting("timeout", None, "stop all ranks after this many seconds", kind=float, above_zero=True, on_ranks=False),
)
BY_NAME = {s.name: s for s in SETTINGS}
DEFAULTS = {s.name: s.default for s in SETTINGS}


def default_lr(full):
    """The peak learning rate of a run that names none."""
    return FULL_LR if full else LORA_LR


def flag(name):
    """`dslab sft`'s option for a setting: flag("zero_stage") is "--zero"."""
    return BY_NAME[name].flag


def replaced_by_deepspeed_file():
    """The options a --deepspeed file overrides, as `dslab sft` spells them."""
    return [s.flag for s in SETTINGS if s.in_deepspeed_file]


# ----------------------------------------------------------------------------------------------------
# Reading the settings: keywords, `dslab sft`'s command line, the recipe's command line
# ----------------------------------------------------------------------------------------------------
def resolve(given):
    """{name: value} of every setting: `given`'s, the defaults for the rest. A name that is no setting raises
    TypeError naming the closest one (as Python would for a misspelt keyword, but with the fix)."""
    for name in given:
        if name not in BY_NAME:
            raise TypeError(say("sft.unknown_setting", name=name, hint=closest(name)))
    return {**DEFAULTS, **given}


def closest(name):
    """The setting `name` most likely meant, matched against every spelling of each: zero -> zero_stage (its flag is
    --zero), deepspeed_config -> deepspeed (the recipe's name)."""
    spellings = {}
    for s in SETTINGS:
        for spelling in (s.name, s.flag[2:].replace("-", "_"), s.recipe_name):
            spellings.setdefault(spelling, s.name)
    typed = name.lstrip("-").replace("-", "_")
    return spellings[difflib.get_close_matches(typed, spellings, n=1, cutoff=0)[0]]


def add_cli_options(parser):
    """Every setting as an option of `dslab sft` (--name-with-dashes, or its own flag), parsed into args.<name>."""
    for s in SETTINGS:
        shown = "" if s.default is None or s.default is False else f" (default {_words(s.default)})"
        if s.kind is bool:
            parser.add_argument(s.flag, dest=s.name, action="store_true", help=s.help)
        elif s.kind is list:
            parser.add_argument(s.flag, dest=s.name, nargs="+", default=_as_list(s.default), help=s.help + shown)
        else:
            parser.add_argument(s.flag, dest=s.name, type=s.kind, default=s.default, choices=s.choices,
                                required=s.required, help=s.help + shown)


def add_recipe_arguments(parser, leave_out=()):
    """The settings the ranks get, as the recipe's arguments (--name_with_underscores), except `leave_out`. A list is
    one JSON word: dslab.launch.keyword_argv writes it so, and it passes the deepspeed launcher's argv unchanged."""
    for s in SETTINGS:
        if not s.on_ranks or s.recipe_name in leave_out:
            continue
        if s.kind is bool:
            parser.add_argument(f"--{s.recipe_name}", action="store_true", help=s.help)
        else:
            parser.add_argument(f"--{s.recipe_name}", type=json.loads if s.kind is list else s.kind,
                                default=_as_list(s.default) if s.kind is list else s.default, required=s.required,
                                help=s.help)


def recipe_arguments(values, always=()):
    """{the recipe's argument: value} for the settings in `values` the ranks get. Those at their default are left out,
    so the deepspeed command a run prints stays short enough to read (and to copy to a cluster), except `always`."""
    chosen = {}
    for s in SETTINGS:
        value = _as_list(values[s.name]) if s.kind is list else values[s.name]
        if s.on_ranks and (s.name in always or value != (_as_list(s.default) if s.kind is list else s.default)):
            chosen[s.recipe_name] = value
    return chosen


def _as_list(value):
    return None if value is None else list(value)


def _words(value):
    return " ".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)
