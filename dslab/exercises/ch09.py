"""Chapter 09 (the Hugging Face Trainer on DeepSpeed): an "auto" batch size, ZeRO-3 loading, and a ds_config the
Trainer accepts.

Solutions: notebooks/solutions/09_solutions.py."""
import copy

from dslab.exercises import Mistake, classic_adam_mistake, exercise, expect, resolved_config, resolved_optimizer

# Exercise 09.ds_config: the arguments the learner's config must agree with, on the chapter's 2 ranks. "auto" or the
# same number on both sides both work: the Trainer fills "auto" and checks a number against its own value
# (transformers/integrations/deepspeed.py, HfTrainerDeepSpeedConfig.trainer_config_process / fill_match), and a key
# left out is neither filled nor checked: DeepSpeed then derives it or takes its default.
TRAINER_ARGS = {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 4, "learning_rate": 1e-4,
                "bf16": True}
WORLD_SIZE = 2
_GOOD = {
    "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
    "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
    "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
}


def _with(**changes):
    """_GOOD with top-level keys replaced (None: removed): the wrong answers a learner might give."""
    config = copy.deepcopy(_GOOD)
    for key, value in changes.items():
        if value is None:
            config.pop(key)
        else:
            config[key] = value
    return config


WRONG_DS_CONFIGS = (
    (_with(train_micro_batch_size_per_gpu=8),                                      # disagrees with the arguments
     "ds train_micro_batch_size_per_gpu=8 vs hf per_device_train_batch_size=2"),
    (_with(zero_optimization={"stage": 2}), "zero_optimization.stage is 2"),       # the chapter's ZeRO-2 config
    (_with(zero_optimization={"stage": 3}), "stage3_gather_16bit_weights_on_model_save"),  # no whole model gathered
    (_with(optimizer=None), 'no "optimizer" section'),                             # the Trainer's optimizer
    (_with(optimizer={"type": "AdamW", "params": {"lr": 2e-3}}), "ds optimizer.params.lr=0.002"),  # lr disagrees
    (_with(bf16={"enabled": False}), "ds bf16.enabled=False vs hf bf16"),          # disagrees with --bf16
    (_with(zero_optimization={"stage": 3, "stage3_gather_16bit_weight_on_model_save": True}),  # a typo'd key
     "unknown key 'stage3_gather_16bit_weight_on_model_save'"),
    (_with(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=4, train_batch_size=8,  # one process's
           optimizer={"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": "auto"}}),       # total, written in
     "ds train_batch_size=8 vs hf train_batch_size (calculated)=16"),
    (_with(train_micro_batch_size_per_gpu=None, gradient_accumulation_steps=None),  # left out: neither filled nor
     "a micro batch of 8 and gradient_accumulation_steps 1"),                      # checked, DeepSpeed derives them
    (_with(optimizer={"type": "Adam", "params": {"lr": "auto", "adam_w_mode": False}}), "classic Adam"),
    (_with(optimizer={"type": "AdamW", "params": {"weight_decay": "auto"}}), "lr 0.001"),   # FusedAdam's default
)


def _total_on_ranks():
    return TRAINER_ARGS["per_device_train_batch_size"] * TRAINER_ARGS["gradient_accumulation_steps"] * WORLD_SIZE


class _ArgumentsOnRanks:
    """TrainingArguments as the Trainer sees them on `world_size` ranks (this process has no process group)."""

    def __init__(self, args, world_size):
        self._args, self.world_size = args, world_size

    def __getattr__(self, name):
        return getattr(self._args, name)


def trainer_resolution(ds_config, world_size=WORLD_SIZE, hidden_size=256, steps=100, **trainer_args):
    """`ds_config` as the Trainer hands it to DeepSpeed on `world_size` ranks: the real TrainingArguments(deepspeed=
    ...) (use_cpu=True), then transformers' HfTrainerDeepSpeedConfig passes, trainer_config_process (fill "auto",
    note a number that differs) and trainer_config_finalize (bucket sizes from the hidden size; raise on a
    difference), with the arguments' world size; then accelerate's DeepSpeedPlugin.set_mixed_precision, which adds
    a "bf16" section where --bf16 is set and the config has none. ValueError if the Trainer refuses it."""
    from types import SimpleNamespace

    from accelerate.utils import DeepSpeedPlugin
    from transformers import TrainingArguments
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig, unset_hf_deepspeed_config

    try:
        args = TrainingArguments(**{"output_dir": "runs/resolve-for-trainer", "use_cpu": True, "report_to": "none",
                                    **trainer_args}, deepspeed=copy.deepcopy(ds_config))
        on_ranks = _ArgumentsOnRanks(args, world_size)
        hf_config = HfTrainerDeepSpeedConfig(copy.deepcopy(ds_config))
        hf_config.trainer_config_process(on_ranks)
        hf_config.trainer_config_finalize(on_ranks, SimpleNamespace(config=SimpleNamespace(hidden_size=hidden_size)),
                                          steps)
        plugin = DeepSpeedPlugin(hf_ds_config=copy.deepcopy(hf_config.config))
        plugin.set_mixed_precision("bf16" if trainer_args.get("bf16") else "no")
        return plugin.deepspeed_config
    finally:
        unset_hf_deepspeed_config()  # a ZeRO-3 config must not stay live: from_pretrained would partition


def check_ds_config(ds_config):
    """Run the Trainer's own checks on the learner's config for TRAINER_ARGS on the chapter's 2 ranks, then DeepSpeed's
    own reading of what the Trainer hands it, and name what is wrong."""
    from dslab.config import check

    if not isinstance(ds_config, dict):
        raise Mistake(f"the answer is a {type(ds_config).__name__}; write the DeepSpeed config as a dict")
    # typos and values DeepSpeed would ignore; a batch triple that does not multiply out is the Trainer's to name
    problems = [p for p in check.check_config(ds_config, world_size=WORLD_SIZE, allow_auto=True)
                if not (p.key == "train_batch_size" and "!=" in p.problem)]
    if problems:
        raise Mistake(f"dslab config check finds: {check.ConfigError.from_problems(problems)}")
    try:
        handed = trainer_resolution(ds_config, **TRAINER_ARGS)
    except ValueError as err:
        said = f"the Trainer refuses it: {err}"
        if "train_batch_size (calculated)" in str(err):
            said += (f" train_batch_size counts every rank: on the chapter's {WORLD_SIZE} ranks the Trainer computes "
                     f"{TRAINER_ARGS['per_device_train_batch_size']} x {TRAINER_ARGS['gradient_accumulation_steps']} "
                     f"x {WORLD_SIZE} = {_total_on_ranks()}; write \"auto\", or leave it out (DeepSpeed then derives "
                     "it), so that the config holds on any number of ranks")
        raise Mistake(said) from None
    _check_resolved(resolved_config(handed, WORLD_SIZE), TRAINER_ARGS)
    return True


def _check_resolved(ds, trainer_args):
    """What DeepSpeed reads from the config the Trainer hands it, against the task; a Mistake naming what differs."""
    zero = ds.zero_config
    if zero.stage != 3:
        raise Mistake(f"zero_optimization.stage is {zero.stage}: only stage 3 partitions the weights")
    if not zero.gather_16bit_weights_on_model_save:
        raise Mistake("without \"stage3_gather_16bit_weights_on_model_save\": true, trainer.save_model() still gathers "
                      "the LoRA adapter (PEFT's own path), but not a whole model (after merge_and_unload, or a full "
                      "fine-tune): accelerate's get_state_dict raises and the Trainer writes a DeepSpeed checkpoint "
                      "instead; the exercise asks for the whole model")
    micro, accum = trainer_args["per_device_train_batch_size"], trainer_args["gradient_accumulation_steps"]
    if (ds.train_micro_batch_size_per_gpu, ds.gradient_accumulation_steps) != (micro, accum):
        raise Mistake(f"DeepSpeed reads a micro batch of {ds.train_micro_batch_size_per_gpu} and "
                      f"gradient_accumulation_steps {ds.gradient_accumulation_steps} (train_batch_size "
                      f"{ds.train_batch_size} on {WORLD_SIZE} ranks: a key the config leaves out is neither filled "
                      "nor checked by the Trainer, and DeepSpeed derives it), not the arguments' "
                      f"{micro} and {accum}: write \"auto\" for train_micro_batch_size_per_gpu and "
                      "gradient_accumulation_steps (or the same numbers)")
    optimizer = resolved_optimizer(ds)
    if optimizer is None:
        raise Mistake("no \"optimizer\" section: the Trainer would build its own torch AdamW and hand it to DeepSpeed; "
                      "add {\"type\": \"AdamW\", \"params\": {\"lr\": \"auto\"}}")
    kind, lr, built = optimizer
    if kind == "Adam":
        raise classic_adam_mistake(built)
    if kind != "AdamW":
        raise Mistake(f"the optimizer is {kind!r} ({built}): the task asks DeepSpeed's AdamW, "
                      "{\"type\": \"AdamW\", \"params\": {\"lr\": \"auto\"}}")
    if lr != trainer_args["learning_rate"]:
        raise Mistake(f"DeepSpeed's AdamW would run with lr {lr} (the default of {built}: the config gives no lr, so "
                      f"the Trainer fills none): write \"lr\": \"auto\" to take {trainer_args['learning_rate']} from "
                      "the arguments")
    if not ds.bfloat16_config.enabled:
        raise Mistake("DeepSpeed would train in fp32 although --bf16 is set: leave \"bf16\" out (accelerate adds it) "
                      "or write \"bf16\": {\"enabled\": \"auto\"}")


# 16 GPUs x 4 per device x 8 accumulation steps.
expect("09.train_batch_size", 512,
       wrong=((64, "64 = 16 GPUs x 4 leaves out the 8 accumulation steps"),
              (32, "32 = 4 x 8 is one GPU's share of a step: multiply by the 16 GPUs"),
              (128, "128 = 16 x 8 leaves out the per-device batch of 4"),
              (4, "4 is the per-device batch: train_batch_size counts every GPU and every accumulation step")),
       hint="train_batch_size = world_size x per_device_train_batch_size x gradient_accumulation_steps.")
# 7.6e9 bf16 weights: 14.16 GiB whole on each rank; 1/8 of it per rank when loaded under zero.Init.
_WHOLE_GIB = 7.6e9 * 2 / 2**30
expect("09.zero3_load_gib", [_WHOLE_GIB, _WHOLE_GIB / 8], rel=1e-2,
       wrong=(([_WHOLE_GIB / 8, _WHOLE_GIB / 8], "without a DeepSpeed config every rank builds the whole model: "
                                                 "7.6e9 x 2 bytes, 14.2 GiB on each"),
              ([2 * _WHOLE_GIB, 2 * _WHOLE_GIB / 8], "that counts 4 bytes per parameter (fp32): the model is stored "
                                                     "in bf16, 2 bytes each"),
              ([_WHOLE_GIB, _WHOLE_GIB], "with a live ZeRO-3 HfDeepSpeedConfig, from_pretrained loads under "
                                         "deepspeed.zero.Init: each rank keeps only its 1/8"),
              ([15.2, 1.9], "those are GB (1e9 bytes): answer in GiB (2^30 bytes)")),
       hint="bf16 is 2 bytes per parameter (GiB = 2**30 bytes); without a config every rank builds the whole model, "
            "with a live ZeRO-3 HfDeepSpeedConfig each rank loads only its 1/N partition.")
exercise("09.ds_config", hint="answer = a dict: stage 3 with the gather flag, \"auto\" batch sizes (or the "
                              "arguments' numbers), AdamW with "
                              "\"lr\": \"auto\", \"bf16\": {\"enabled\": \"auto\"}",
         wrong=WRONG_DS_CONFIGS)(check_ds_config)
