"""Instructor solutions for notebooks/12_debugging_hangs.ipynb (checked by tests/test_exercises.py)."""
import deepspeed

# 12.read_report: `launch.run("runs/12/uneven.py", world_size=2, hang_timeout=10)` reports
#   rank 0 (pid ...): blocked in all_reduce (torch/distributed/distributed_c10d.py:...), called from uneven.py:14
#   rank 1 (pid ...): blocked in barrier (torch/distributed/distributed_c10d.py:...), called from uneven.py:16
# Rank 0 has a third sample, so it calls all_reduce a third time; rank 1, out of samples, is already at the barrier.
read_report = {0: ("all_reduce", 14), 1: ("barrier", 16)}

# 12.uneven_fix: every rank takes as many steps as the longest shard has samples; a rank out of samples still
# joins each all_reduce, adding 0 to the sum and 0 to the count, so the mean stays that of all 5 samples.
uneven_fixed = '''\
import deepspeed
import torch
import torch.distributed as dist

deepspeed.init_distributed(dist_backend="gloo")
rank, world_size = dist.get_rank(), dist.get_world_size()
samples = torch.arange(1.0, 6.0)              # 1, 2, 3, 4, 5: their mean is 3
shard = samples[rank::world_size]             # rank 0: 1, 3, 5; rank 1: 2, 4
steps = -(-len(samples) // world_size)        # ceil(5 / 2) = 3 steps on every rank: the longest shard's
total = torch.zeros(2)                        # [sum of the samples, how many], over every rank
for i in range(steps):
    if i < len(shard):
        step = torch.stack([shard[i], torch.tensor(1.0)])
    else:
        step = torch.zeros(2)                 # out of samples: join the collective, add nothing
    dist.all_reduce(step)
    total += step
dist.barrier()
if rank == 0:
    print(f"mean {total[0].item() / total[1].item():.4f} over {total[1].item():.0f} samples", flush=True)
'''



# 12.zero3_generate: under ZeRO-3 every forward pass all-gathers each layer's shards from every rank, so every rank must
# run as many forward passes as the longest generation: synced_gpus=True keeps a rank that is done running them.
def generate_on_ranks(model, prompt, new_tokens):
    ds_config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
    engine, *_ = deepspeed.initialize(model=model, config=ds_config)
    out = engine.module.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                 pad_token_id=0, synced_gpus=True)
    return out[0, prompt.shape[1]:]


SOLUTIONS = {
    "12.read_report": read_report,
    "12.uneven_fix": uneven_fixed,
    "12.zero3_generate": generate_on_ranks,
}
