"""The Hugging Face Trainer on DeepSpeed, measured (chapter 09): which "auto" values of a ds_config the Trainer fills
and from where, the bytes each rank holds when `from_pretrained` runs with or without ZeRO-3 partitioning, and what
dslab/recipes/hf_sft.py leaves for the notebook on every rank (`save_trainer_result`, a no-op when the script runs by
hand).

The training itself is plain transformers + peft + DeepSpeed in the recipe; nothing here is needed to train.
"""
import os

from dslab import this_rank

# Where the Trainer takes each "auto" of a DeepSpeed config from: transformers/integrations/deepspeed.py,
# HfTrainerDeepSpeedConfig.trainer_config_process (when TrainingArguments is built) and trainer_config_finalize (when
# train() starts, once the model and the number of steps are known). A key set to a number must equal what the
# TrainingArguments say (the "mismatch" error); the last five are filled only where they say "auto".
AUTO_SOURCES = {
    "train_micro_batch_size_per_gpu": "per_device_train_batch_size",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "train_batch_size": "world_size x per-device batch x accumulation steps",
    "gradient_clipping": "max_grad_norm",
    "optimizer.params.lr": "learning_rate",
    "optimizer.params.betas": "[adam_beta1, adam_beta2]",
    "optimizer.params.eps": "adam_epsilon",
    "optimizer.params.weight_decay": "weight_decay",
    "scheduler.params.warmup_min_lr": "0 (not a TrainingArguments value)",
    "scheduler.params.warmup_max_lr": "learning_rate",
    "scheduler.params.warmup_num_steps": "warmup_steps (a fraction < 1: of the total steps)",
    "scheduler.params.total_num_steps": "the steps train() will run",
    "fp16.enabled": "fp16",
    "bf16.enabled": "bf16",
    "zero_optimization.reduce_bucket_size": "hidden_size x hidden_size (model config)",
    "zero_optimization.stage3_prefetch_bucket_size": "0.9 x hidden_size x hidden_size",
    "zero_optimization.stage3_param_persistence_threshold": "10 x hidden_size",
}


def auto_sources(start=0, stop=None):
    """AUTO_SOURCES as table rows [{"ds_config key", "filled from (TrainingArguments / model)"}], rows start:stop."""
    return [{"ds_config key": key, "filled from (TrainingArguments / model)": source}
            for key, source in list(AUTO_SOURCES.items())[start:stop]]


def flatten(config, prefix=""):
    """{"a.b.c": value} for every leaf of a nested config dict (lists are leaves)."""
    leaves = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            leaves.update(flatten(value, name + "."))
        else:
            leaves[name] = value
    return leaves


def resolved_autos(file_config, resolved_config):
    """What the Trainer made of a config: one row per key that was "auto" in the file (its value on the ranks and
    where it came from), then each key the Trainer added that the file did not have."""
    before, after = flatten(file_config), flatten(resolved_config)
    rows = [{"key": key, "in the file": value, "resolved": after.get(key), "from": AUTO_SOURCES.get(key, "?")}
            for key, value in before.items() if value == "auto"]
    rows += [{"key": key, "in the file": "(absent)", "resolved": value, "from": "added by accelerate's DeepSpeedPlugin"}
             for key, value in after.items() if key not in before]
    return rows


def resolve_for_trainer(ds_config, hidden_size=256, steps=100, **training_args):
    """`ds_config` as the Trainer resolves it on one process: the real TrainingArguments(deepspeed=...) built with
    `training_args` (use_cpu=True added), then the check Trainer.train() runs first (deepspeed_init ->
    trainer_config_finalize) for a model of `hidden_size` and `steps` steps. ValueError if the Trainer refuses it."""
    import copy
    from types import SimpleNamespace

    from transformers import TrainingArguments
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    try:
        args = TrainingArguments(**{"output_dir": "runs/resolve-for-trainer", "use_cpu": True, "report_to": "none",
                                    **training_args}, deepspeed=copy.deepcopy(ds_config))
        hf_config = args.hf_deepspeed_config
        hf_config.trainer_config_finalize(args, SimpleNamespace(config=SimpleNamespace(hidden_size=hidden_size)), steps)
        return hf_config.config
    finally:
        unset_hf_deepspeed_config()  # a ZeRO-3 config must not stay live: from_pretrained would partition


# ----------------------------------------------------------------------------------------------------
# What a rank holds after from_pretrained, with and without ZeRO-3 partitioning at load time
# ----------------------------------------------------------------------------------------------------
def held_bytes(model):
    """What this rank holds of the model's parameters: whole tensors (p.data) and ZeRO-3 partitions (p.ds_tensor).

    Under ZeRO-3 p.data is an empty placeholder except for the few small parameters kept whole on every rank
    (stage3_param_persistence_threshold); each rank's share of the values lives in p.ds_tensor.
    """
    out = {"whole_numel": 0, "whole_bytes": 0, "partition_numel": 0, "partition_bytes": 0, "model_numel": 0}
    for p in model.parameters():  # unique Parameter objects: a tied head is counted once
        out["whole_numel"] += p.data.numel()
        out["whole_bytes"] += p.data.numel() * p.data.element_size()
        part = getattr(p, "ds_tensor", None)
        if part is not None:
            out["partition_numel"] += part.numel()
            out["partition_bytes"] += part.numel() * part.element_size()
        out["model_numel"] += getattr(p, "ds_numel", p.numel())
    out["held_bytes"] = out["whole_bytes"] + out["partition_bytes"]
    out["held_numel"] = out["whole_numel"] + out["partition_numel"]
    return out


def load_measurements(model_path, ds_config, trainer_config=None):
    """Bytes this rank holds after loading `model_path` three ways; every rank must call it (ZeRO-3 loading is
    collective). `ds_config`: a ZeRO-3 config with numbers (no "auto"). trainer_config: a Trainer's live
    HfDeepSpeedConfig, set aside for the loads that must see none and given back after. Returns {"ways": {way:
    held_bytes}} and, for the partitioned load, whether its gathered weights equal the checkpoint's."""
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.integrations.deepspeed import set_hf_deepspeed_config, unset_hf_deepspeed_config

    unset_hf_deepspeed_config()  # no config is live for the first two loads
    ways = {}
    try:
        model = AutoModelForCausalLM.from_pretrained(model_path, use_safetensors=True)
        ways["from_pretrained, no DeepSpeed config"] = held_bytes(model)

        HfDeepSpeedConfig(ds_config)  # created and dropped at once: transformers keeps only a weak reference
        model = AutoModelForCausalLM.from_pretrained(model_path, use_safetensors=True)
        ways["HfDeepSpeedConfig(ds_config), not kept"] = held_bytes(model)

        dschf = HfDeepSpeedConfig(ds_config)  # kept alive: from_pretrained now loads under deepspeed.zero.Init
        model = AutoModelForCausalLM.from_pretrained(model_path, use_safetensors=True)
        ways["dschf = HfDeepSpeedConfig(ds_config), kept"] = held_bytes(model)
        equal = equals_checkpoint(model, model_path)
        del dschf, model
    finally:
        if trainer_config is not None:
            set_hf_deepspeed_config(trainer_config)  # the Trainer's config is the live one again
    return {"ways": ways, "partitioned_weights_equal_checkpoint": equal}


def equals_checkpoint(model, model_path, name="model.layers.0.mlp.gate_proj.weight"):
    """Gather one weight of a ZeRO-3 model and compare it with the checkpoint file: loaded, not left at random.
    None for a checkpoint in several files (not compared)."""
    import deepspeed
    import torch
    from safetensors.torch import load_file
    from transformers.utils import cached_file

    try:
        path = cached_file(model_path, "model.safetensors")  # a local folder or the Hugging Face cache
    except OSError:
        return None
    saved = load_file(path)[name]
    param = dict(model.named_parameters())[name]
    with deepspeed.zero.GatheredParameters([param]):
        return bool(torch.equal(param.data.to(saved.dtype), saved))


# ----------------------------------------------------------------------------------------------------
# What each rank of dslab/recipes/hf_sft.py reports
# ----------------------------------------------------------------------------------------------------
def save_trainer_result(trainer, model_path):
    """Save what chapter 09 reads off this rank after training (dslab.this_rank.save_rank_result); a no-op outside
    dslab.launch, so the measurements stay out of a run on a cluster. All ranks must call it (ZeRO-3 gathers)."""
    if not os.environ.get(this_rank.RESULT_DIR_ENV):
        return
    import torch.distributed as tdist

    from dslab.models import lora

    engine = trainer.model_wrapped  # the DeepSpeedEngine the Trainer built
    state = trainer.accelerator.state
    result = {
        "rank": tdist.get_rank(), "world_size": tdist.get_world_size(),
        "distributed_type": str(state.distributed_type), "backend": tdist.get_backend(),
        "args_device": str(trainer.args.device), "engine_device": str(engine.device),
        "engine_class": type(engine).__name__, "zero_stage": engine.zero_optimization_stage(),
        "resolved_config": state.deepspeed_plugin.hf_ds_config.config, "engine_config": engine.config,
        "global_step": trainer.state.global_step, "log_history": trainer.state.log_history,
        "engine_held": held_bytes(engine.module), **lora.trainable_summary(engine.module),
    }
    if engine.zero_optimization_stage() == 3:
        result.update(zero3_report(trainer, model_path))
        settle_gloo_workers()
    this_rank.save_rank_result(result)


def settle_gloo_workers(seconds=0.25):
    """After zero3_report's gathers, and before the script exits: let gloo's worker threads finish with them.

    On CPU, DeepSpeed gathers ZeRO-3 weights with all_gather into narrow views it drops at once, so the views'
    Python objects live on inside gloo's work. The worker thread that frees a finished work takes the GIL to free
    them. A worker still waiting for the GIL when the interpreter shuts down is ended inside C++, and the rank aborts
    ("terminate called without an active exception") after all its work is done; a core dump of such a rank shows
    exactly that (~AsyncAllgatherWork -> decref -> PyThread_exit_thread). On 2 busy cores a worker can wait longer
    than the few milliseconds from the last gather to the end of the script. The barrier waits for every earlier
    collective of the group; the sleep releases the GIL so that a worker not yet scheduled can take it.
    """
    import time

    import torch.distributed as tdist

    tdist.barrier()
    time.sleep(seconds)


def zero3_report(trainer, model_path):
    """ZeRO-3 only (every rank calls it): what a plain state dict holds, what the Trainer's gather holds, the naive
    save_pretrained written beside the output (rank 0), the engine's logits on a probe batch (rank 0 writes them
    beside the adapter), and the three ways of loading."""
    import torch
    from peft import get_peft_model_state_dict
    from safetensors.torch import save

    from dslab.models import lora
    from dslab.files import atomic_write_bytes

    engine, output_dir = trainer.model_wrapped, trainer.args.output_dir
    if trainer.is_world_process_zero():  # first, while every weight is released: a forward leaves some gathered
        trainer.model.save_pretrained(f"{output_dir}-naive")  # the common mistake: no gather, size-0 tensors
    out = {"plain_adapter_numel": sum(v.numel() for v in get_peft_model_state_dict(engine.module).values())}
    # What Trainer.save_model gathers for a full model (accelerate's get_state_dict): allowed by the config's
    # stage3_gather_16bit_weights_on_model_save; a collective, whose result only rank 0 keeps.
    whole = trainer.accelerator.get_state_dict(engine)
    out["gathered_numel"] = sum(v.numel() for v in whole.values()) if whole else 0
    out["gather_flag"] = engine.zero_gather_16bit_weights_on_model_save()
    engine.eval()
    with torch.no_grad():  # every rank runs the forward: ZeRO-3 gathers each layer from all of them
        logits = engine(input_ids=lora.probe_ids(engine.module.config.vocab_size)).logits.float()
    if trainer.is_world_process_zero():
        atomic_write_bytes(os.path.join(output_dir, "probe_logits.safetensors"), save({"logits": logits.contiguous()}))
    hf_config = trainer.accelerator.state.deepspeed_plugin.hf_ds_config
    out["load"] = load_measurements(model_path, hf_config.config, trainer_config=hf_config)
    return out
