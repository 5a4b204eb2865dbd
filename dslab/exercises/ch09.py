"""Chapter 09 (the Hugging Face Trainer on DeepSpeed): an "auto" batch size, ZeRO-3 loading, and a ds_config the
Trainer accepts.

Solutions: notebooks/solutions/09_solutions.py."""
import copy

from dslab.exercises import Mistake, exercise, expect

# Exercise 09.ds_config: the arguments the learner's config must agree with.
TRAINER_ARGS = {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 4, "learning_rate": 1e-4,
                "bf16": True}
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
    (_with(zero_optimization={"stage": 2}), "zero_optimization.stage is 2"),       # weights not partitioned
    (_with(zero_optimization={"stage": 3}), "stage3_gather_16bit_weights_on_model_save"),  # no whole model gathered
    (_with(optimizer=None), 'no "optimizer" section'),                             # the Trainer's optimizer
    (_with(optimizer={"type": "AdamW", "params": {"lr": 2e-3}}), "ds optimizer.params.lr=0.002"),  # lr disagrees
    (_with(bf16={"enabled": False}), "ds bf16.enabled=False vs hf bf16"),          # disagrees with --bf16
    (_with(zero_optimization={"stage": 3, "stage3_gather_16bit_weight_on_model_save": True}),  # a typo'd key
     "unknown key 'stage3_gather_16bit_weight_on_model_save'"),
    (_with(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=4, train_batch_size=8,  # the task's numbers
           optimizer={"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": "auto"}}),       # copied, not "auto"
     "(the same recipe, other arguments)"),
)


def _other_trainer_args(rng=None):
    """Arguments drawn now, other than the task's: a config that copies the task's numbers instead of leaving them
    to the Trainer ("auto") disagrees with these."""
    import random

    rng = rng or random.SystemRandom()
    return {"per_device_train_batch_size": rng.choice((1, 3, 4)), "gradient_accumulation_steps": rng.choice((1, 2, 8)),
            "learning_rate": rng.choice((5e-5, 2e-4, 3e-4)), "bf16": True}


def check_ds_config(ds_config):
    """Run the Trainer's own checks on the learner's config, for TRAINER_ARGS and for other arguments drawn now (the
    same config file serves every run of the recipe), and name what is wrong."""
    from dslab.config import check

    if not isinstance(ds_config, dict):
        raise Mistake(f"the answer is a {type(ds_config).__name__}; write the DeepSpeed config as a dict")
    try:
        check.validate(ds_config, allow_auto=True)  # typos and values DeepSpeed would silently ignore
    except check.ConfigError as err:
        raise Mistake(f"dslab config check finds: {err}") from None
    _check_for(ds_config, TRAINER_ARGS)
    other = _other_trainer_args()
    try:
        _check_for(ds_config, other)
    except Mistake as mistake:
        said = " ".join(f"--{key} {value}" for key, value in other.items() if key != "bf16")
        raise Mistake(f"with {said} (the same recipe, other arguments): {mistake}. Values the arguments own belong "
                      "to the Trainer: write \"auto\" for them") from None
    return True


def _check_for(ds_config, trainer_args):
    """The Trainer's resolution of `ds_config` for `trainer_args`, checked; a Mistake naming what is wrong."""
    from dslab.training import hf_bridge

    try:
        resolved = hf_bridge.resolve_for_trainer(ds_config, **trainer_args)
    except ValueError as err:
        raise Mistake(f"the Trainer refuses it: {err}") from None
    zero = resolved.get("zero_optimization", {})
    if zero.get("stage") != 3:
        raise Mistake(f"zero_optimization.stage is {zero.get('stage')}: only stage 3 partitions the weights")
    if zero.get("stage3_gather_16bit_weights_on_model_save") is not True:
        raise Mistake("without \"stage3_gather_16bit_weights_on_model_save\": true, trainer.save_model() still gathers "
                      "the LoRA adapter (PEFT's own path), but not a whole model (after merge_and_unload, or a full "
                      "fine-tune): accelerate's get_state_dict raises and the Trainer writes a DeepSpeed checkpoint "
                      "instead; the exercise asks for the whole model")
    micro, accum = trainer_args["per_device_train_batch_size"], trainer_args["gradient_accumulation_steps"]
    if resolved.get("train_micro_batch_size_per_gpu") != micro or resolved.get("gradient_accumulation_steps") != accum:
        raise Mistake(f"DeepSpeed needs the batch sizes: set train_micro_batch_size_per_gpu and "
                      f"gradient_accumulation_steps to \"auto\" (the Trainer writes {micro} and {accum})")
    optimizer = resolved.get("optimizer")
    if not optimizer:
        raise Mistake("no \"optimizer\" section: the Trainer would build its own torch AdamW and hand it to DeepSpeed; "
                      "add {\"type\": \"AdamW\", \"params\": {\"lr\": \"auto\"}}")
    lr = trainer_args["learning_rate"]
    if optimizer.get("type", "").lower() not in ("adamw", "adam") or optimizer.get("params", {}).get("lr") != lr:
        raise Mistake(f"the optimizer is {optimizer}: DeepSpeed's AdamW with \"lr\": \"auto\" takes {lr} from the "
                      "arguments")
    # When the engine starts, accelerate adds "bf16": {"enabled": true} if the section is missing
    # (DeepSpeedPlugin.set_mixed_precision); its own code runs here on the resolved config.
    from accelerate.utils import DeepSpeedPlugin

    plugin = DeepSpeedPlugin(hf_ds_config=copy.deepcopy(resolved))
    plugin.set_mixed_precision("bf16" if trainer_args["bf16"] else "no")
    if not plugin.deepspeed_config.get("bf16", {}).get("enabled"):
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
exercise("09.ds_config", hint="answer = a dict: stage 3 with the gather flag, \"auto\" batch sizes, AdamW with "
                              "\"lr\": \"auto\", \"bf16\": {\"enabled\": \"auto\"}",
         wrong=WRONG_DS_CONFIGS)(check_ds_config)
