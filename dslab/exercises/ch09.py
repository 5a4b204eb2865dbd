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
    _with(train_micro_batch_size_per_gpu=8),                                       # disagrees with the arguments
    _with(zero_optimization={"stage": 2}),                                         # weights not partitioned
    _with(zero_optimization={"stage": 3}),                                         # save_model cannot gather
    _with(optimizer=None),                                                         # the Trainer's optimizer
    _with(optimizer={"type": "AdamW", "params": {"lr": 2e-3}}),                    # lr disagrees
    _with(bf16=None),                                                              # DeepSpeed in fp32
    _with(zero_optimization={"stage": 3, "stage3_gather_16bit_weight_on_model_save": True}),  # a typo'd key
)


def check_ds_config(ds_config):
    """Run the Trainer's own checks on the learner's config for TRAINER_ARGS and name what is wrong."""
    from dslab import config_check, hf_bridge

    if not isinstance(ds_config, dict):
        raise Mistake(f"the answer is a {type(ds_config).__name__}; write the DeepSpeed config as a dict")
    try:
        config_check.validate(ds_config, allow_auto=True)  # typos and values DeepSpeed would silently ignore
    except config_check.ConfigError as err:
        raise Mistake(f"dslab config check finds: {err}") from None
    try:
        resolved = hf_bridge.resolve_for_trainer(ds_config, **TRAINER_ARGS)
    except ValueError as err:
        raise Mistake(f"the Trainer refuses it: {err}") from None
    zero = resolved.get("zero_optimization", {})
    if zero.get("stage") != 3:
        raise Mistake(f"zero_optimization.stage is {zero.get('stage')}: only stage 3 partitions the weights")
    if zero.get("stage3_gather_16bit_weights_on_model_save") is not True:
        raise Mistake("without \"stage3_gather_16bit_weights_on_model_save\": true, trainer.save_model() of a whole "
                      "model cannot gather it (accelerate's get_state_dict raises) and writes a DeepSpeed checkpoint")
    if resolved.get("train_micro_batch_size_per_gpu") != 2 or resolved.get("gradient_accumulation_steps") != 4:
        raise Mistake("DeepSpeed needs the batch sizes: set train_micro_batch_size_per_gpu and "
                      "gradient_accumulation_steps to \"auto\" (the Trainer writes 2 and 4)")
    optimizer = resolved.get("optimizer")
    if not optimizer:
        raise Mistake("no \"optimizer\" section: the Trainer would build its own torch AdamW and hand it to DeepSpeed; "
                      "add {\"type\": \"AdamW\", \"params\": {\"lr\": \"auto\"}}")
    if optimizer.get("type", "").lower() not in ("adamw", "adam") or optimizer.get("params", {}).get("lr") != 1e-4:
        raise Mistake(f"the optimizer is {optimizer}: DeepSpeed's AdamW with \"lr\": \"auto\" takes 1e-4 from the "
                      "arguments")
    if not resolved.get("bf16", {}).get("enabled"):
        raise Mistake("no \"bf16\" section: the Trainer fills bf16.enabled only where the key exists, so DeepSpeed "
                      "would train in fp32 although --bf16 is set; add \"bf16\": {\"enabled\": \"auto\"}")
    return True


# 16 GPUs x 4 per device x 8 accumulation steps.
expect("09.train_batch_size", 512, wrong=(64, 32, 128, 4),
       hint="train_batch_size = world_size x per_device_train_batch_size x gradient_accumulation_steps.")
# 7.6e9 bf16 weights: 14.16 GiB whole on each rank; 1/8 of it per rank when loaded under zero.Init.
expect("09.zero3_load_gib", [7.6e9 * 2 / 2**30, 7.6e9 * 2 / 2**30 / 8], rel=1e-2,
       wrong=([7.6e9 * 2 / 2**30 / 8, 7.6e9 * 2 / 2**30 / 8], [7.6e9 * 4 / 2**30, 7.6e9 * 4 / 2**30 / 8],
              [7.6e9 * 2 / 2**30, 7.6e9 * 2 / 2**30], [15.2, 1.9]),
       hint="bf16 is 2 bytes per parameter (GiB = 2**30 bytes); without a config every rank builds the whole model, "
            "with a live ZeRO-3 HfDeepSpeedConfig each rank loads only its 1/N partition.")
exercise("09.ds_config", hint="answer = a dict: stage 3 with the gather flag, \"auto\" batch sizes, AdamW with "
                              "\"lr\": \"auto\", \"bf16\": {\"enabled\": \"auto\"}",
         wrong=WRONG_DS_CONFIGS)(check_ds_config)
