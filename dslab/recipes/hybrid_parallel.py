"""Chapter 11 on 4 ranks: ZeRO-3 against ZeRO++ hpZ (the all-gathers of a forward and a backward, and the bytes each
rank sent and received in them), then AutoTP x data parallel (2 x 2) with ZeRO-1. Each rank saves its losses,
its place in the grid and what it sent."""
import json

from dslab import dist, hpz, tensor_parallel

args = dist.recipe_args(steps=2, micro_batch_size=2, seq_len=64, autotp_size=2, hpz_size=2, zero_stage=1)
rank, world_size = dist.init()
data_parallel_size = world_size // args.autotp_size   # model replicas: one per tensor-parallel group
# Step s gives replica d (the ranks with data-parallel rank d) the batch s * replicas + d: every replica its own data,
# the same batch on the ranks of a tensor-parallel group.
steps = tensor_parallel.replica_batches(args.steps, data_parallel_size, args.micro_batch_size, args.seq_len)

# ZeRO-3 first: an AutoTP engine leaves its tensor-parallel groups in DeepSpeed's global state, and an engine
# without "tensor_parallel" initialized after it in the same process fails (engine.py, checkpoint_mp_rank).
hpz_runs = {}
for name, size in (("ZeRO-3", 1), ("ZeRO-3 + hpZ", args.hpz_size)):
    ds_config = hpz.zero3_config(zero_hpz_partition_size=size, micro_batch_size=args.micro_batch_size)
    dist.print0(f"{name}: zero_optimization = {json.dumps(ds_config['zero_optimization'], sort_keys=True)}")
    # plain data parallel over all 4 ranks: step s gives rank r the batch steps[s][r % replicas]
    hpz_runs[name] = hpz.gathers_by_pass(ds_config, steps)

tp_config = {
    "train_micro_batch_size_per_gpu": args.micro_batch_size,
    "gradient_accumulation_steps": 1,
    # DeepSpeed checks micro x accumulation x world_size with ALL ranks, tensor-parallel ones included
    # (runtime/config.py): 2 x 1 x 4 = 8, though each step sees 2 x 2 replicas = 4 distinct samples.
    "train_batch_size": args.micro_batch_size * world_size,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0, "torch_adam": True}},
    "gradient_clipping": 0.0,
    "tensor_parallel": {"autotp_size": args.autotp_size},
    "zero_optimization": {"stage": args.zero_stage},
    "steps_per_print": 10**6,
}
dist.print0(json.dumps(tp_config, indent=2, sort_keys=True))
tp = tensor_parallel.train_tp(tp_config, steps)
print(f"rank {rank}: tensor-parallel rank {tp['layout']['tp_rank']} of group {tp['layout']['tp_group']}, "
      f"data-parallel rank {tp['layout']['dp_rank']} of group {tp['layout']['dp_group']}: "
      f"losses {' '.join(f'{x:.4f}' for x in tp['losses'])}", flush=True)
dist.save_result({"rank": rank, "world_size": world_size, "hpz": hpz_runs, "tp": tp, "tp_config": tp_config})
