"""Instructor solutions for notebooks/13_where_time_goes.ipynb (checked by tests/test_exercises.py)."""
import deepspeed
import torch

from dslab.zero import memory


# 13.forward_flops: what DeepSpeed's flops profiler counts for one forward pass of a Qwen2-style model.
def my_forward_flops(config, batch_size, seq_len):
    tokens = batch_size * seq_len
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    h, inter = config.hidden_size, config.intermediate_size
    # q and o: hidden <-> heads x head_dim; k and v: hidden -> kv_heads x head_dim; gate, up, down: hidden <-> inter
    linear_per_layer = 2 * h * heads * head_dim + 2 * h * kv_heads * head_dim + 3 * h * inter
    attention_per_layer = 4 * batch_size * heads * seq_len * seq_len * head_dim  # Q K^T and A V, the whole square
    silu_per_layer = tokens * inter
    layers = config.num_hidden_layers * (2 * tokens * linear_per_layer + attention_per_layer + silu_per_layer)
    return layers + 2 * tokens * h * config.vocab_size  # + the output head


# 13.muon_bytes: Muon on 90 % of the parameters, ZeRO-2, bf16: 4 (fp32 master) + 0.9 x (2 + 2) (the bf16 momentum
# and the staged copy ZeRO-2 keeps of it between steps) + 0.1 x 8 (Adam's two fp32 moments) = 8.4.
muon_bytes = memory.optimizer_bytes("bf16", optimizer="muon", muon_fraction=0.9, zero_stage=2)["total"]

# 13.bf16_states: bf16 master weights and bf16 Adam moments on the accelerator: 2 + 2 + 2 bytes per parameter.
bf16_states = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0, "torch_adam": True}},
    "zero_optimization": {"stage": 2},
}



# 13.profiled_flops: the profiler counts one forward pass at global step profile_step (the (profile_step + 1)th
# step, counted from 0), on rank 0 only; its count stays on the profiler after that step. Rank 0 sends it to the
# others.
def profiled_flops(model, batches, profile_step):
    ds_config = {
        "train_micro_batch_size_per_gpu": batches[0].shape[0],
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0, "torch_adam": True}},
        "flops_profiler": {"enabled": True, "profile_step": profile_step, "top_modules": 1, "detailed": False},
        "steps_per_print": 1_000_000,
    }
    engine, *_ = deepspeed.initialize(model=model, config=ds_config)
    for tokens in batches:
        loss = engine(input_ids=tokens, labels=tokens).loss
        engine.backward(loss)
        engine.step()
    rank = torch.distributed.get_rank()
    count = [engine.flops_profiler.flops if rank == 0 else None]   # only rank 0 profiled
    torch.distributed.broadcast_object_list(count, src=0)
    return count[0]


SOLUTIONS = {
    "13.forward_flops": my_forward_flops,
    "13.muon_bytes": muon_bytes,
    "13.bf16_states": bf16_states,
    "13.profiled_flops": profiled_flops,
}
