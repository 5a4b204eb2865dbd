"""ZeRO++ hierarchical partitioning (hpZ): ZeRO-3 with a second copy of the parameters within each group of ranks.

Plain ZeRO-3 splits every parameter over all N ranks and all-gathers it from all of them before each use, in the
forward and again in the backward. With `"zero_hpz_partition_size": g` each rank also keeps a secondary shard of
1/g of every parameter, filled without communication when the parameter is released after its first use
(deepspeed/runtime/zero/partition_parameters.py, _partition_param_sec); later gathers in the step read the
secondary shards within the rank's group of g consecutive ranks (deepspeed/utils/groups.py,
_create_zero_param_parallel_group: [0..g-1], [g..2g-1], ...). With g = the ranks of one node, the backward
all-gathers never leave the node. `gathers_by_pass` runs one configuration on a rank and records the collectives
of the forward and of the backward of its last step with DeepSpeed's comms logger.
"""
import copy


def zero3_config(zero_hpz_partition_size=1, micro_batch_size=2):
    """A ZeRO-3 ds_config (fp32) that releases every layer after use, so the backward must gather it again.

    The three stage3_* keys at 0 turn off what would keep gathered layers until the backward on a model this
    small (prefetching, reuse distance, live-parameter budget); persistence 0 partitions even the small norms.
    """
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_max_live_parameters": 0,
            "stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 0, "reduce_bucket_size": 2**22}
    if zero_hpz_partition_size > 1:
        zero["zero_hpz_partition_size"] = zero_hpz_partition_size
    return {"train_micro_batch_size_per_gpu": micro_batch_size, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0, "torch_adam": True}},
            "gradient_clipping": 0.0, "steps_per_print": 10**6,
            "comms_logger": {"enabled": True, "prof_all": True},
            "zero_optimization": zero}


def _all_gathers(raw):
    """[[message bytes, calls], ...] of the all-gathers among the comms logger's records (a JSON-ready list)."""
    out = {}
    for name, by_size in raw.items():
        if name.split(" |")[0].startswith("all_gather"):
            for size, record in by_size.items():
                out[size] = out.get(size, 0) + record[0]
    return [[size, calls] for size, calls in sorted(out.items())]


def gathers_by_pass(ds_config, steps, model_path=None):
    """Run on every rank: train dslab-tiny under `ds_config` on `steps` (lists of token batches, one per rank);
    in the last step, record the all-gathers of the forward and of the backward separately.

    Returns {"losses", "forward", "backward"} where forward/backward list [message bytes (the shard each rank
    sends), calls] pairs, plus "primary" / "secondary": this rank's shard of the embedding after the
    forward (elements; secondary None without hpZ).
    """
    import deepspeed
    import torch.distributed as tdist
    from deepspeed.comm import comms_logger

    from dslab import models

    engine, *_ = deepspeed.initialize(model=copy.deepcopy(models.load_model(model_path)).train(), config=ds_config)
    rank = tdist.get_rank()
    losses, passes = [], {}
    for index, batches in enumerate(steps):
        tokens = batches[rank % len(batches)].to(engine.device)
        last = index == len(steps) - 1
        comms_logger.reset_data()
        loss = engine(input_ids=tokens, labels=tokens).loss
        if last:
            passes["forward"] = _all_gathers(comms_logger.get_raw_data())
            embed = engine.module.model.embed_tokens.weight   # released after the forward: shards only
            passes["primary"] = embed.ds_tensor.numel()
            secondary = getattr(embed, "ds_secondary_tensor", None)
            passes["secondary"] = None if secondary is None else secondary.numel()
            comms_logger.reset_data()
        engine.backward(loss)
        engine.step()
        if last:
            passes["backward"] = _all_gathers(comms_logger.get_raw_data())
        losses.append(loss.item())
    comms_logger.reset_data()
    return {"losses": losses, **passes}


def gathered_bytes(pairs):
    """Bytes a rank sends in all-gathers: the sum of message size x calls over [size, calls] pairs."""
    return sum(size * calls for size, calls in pairs)
