"""Instructor solutions for notebooks/11_parallelism.ipynb (checked by tests/test_exercises.py)."""
import deepspeed
import torch
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec, PipelineModule
from deepspeed.sequence.layer import DistributedAttention
from deepspeed.utils import groups

from dslab.parallel import pipeline

# 11.bubble: 4 stages, 12 micro-batches: (p - 1) / (m + p - 1).
bubble = pipeline.bubble_fraction(micro_batches=12, stages=4)

# 11.min_micro_batches: the fewest micro-batches that keep 8 stages at most 10 % idle.
min_micro_batches = next(m for m in range(1, 10_000) if pipeline.bubble_fraction(m, 8) <= 0.1)

# 11.tp_dp_config: 8 ranks in tensor-parallel groups of 2 = 4 model replicas (data-parallel degree 4); ZeRO-1; micro
# batch 4; 32 distinct samples per step -> accumulation 32 / (4 x 4 replicas) = 2. DeepSpeed's batch check counts all
# 8 ranks: 4 x 2 x 8 = 64.
tp_dp_config = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 2,
    "train_batch_size": 64,
    "bf16": {"enabled": True},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}},
    "gradient_clipping": 1.0,
    "tensor_parallel": {"autotp_size": 2},
    "zero_optimization": {"stage": 1},
}


# 11.pipeline: one stage per rank, each building only its own LayerSpecs (seeded, so that one process can build the
# same weights); in a pipeline, gradient_accumulation_steps is the number of micro-batches train_batch streams, and
# train_batch_size counts data-parallel copies of the pipeline: 1 here.
def train_pipeline(shape, steps):
    specs = [LayerSpec(pipeline.Embed, shape["vocab"], shape["hidden"]),
             *[LayerSpec(pipeline.Block, shape["hidden"], shape["intermediate"]) for _ in range(shape["blocks"])],
             LayerSpec(pipeline.Head, shape["hidden"], shape["vocab"])]
    net = PipelineModule(layers=specs, num_stages=torch.distributed.get_world_size(), loss_fn=pipeline.lm_loss,
                         partition_method="uniform", seed_layers=True, base_seed=pipeline.BASE_SEED)
    micro_batch_size, micro_batches = steps[0][0].shape[0], len(steps[0])
    ds_config = {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": micro_batches,
        "train_batch_size": micro_batch_size * micro_batches * 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0, "torch_adam": True}},
        "gradient_clipping": 0.0,
        "steps_per_print": 1_000_000,
    }
    engine, *_ = deepspeed.initialize(model=net, config=ds_config)
    losses = []
    for micro in steps:
        loss = engine.train_batch(data_iter=iter([(tokens, tokens) for tokens in micro]))
        losses.append(loss.item())
    return engine, losses


# 11.tensor_data: AutoTP in groups of autotp_size, ZeRO-1 over the data-parallel groups; DeepSpeed's batch check counts
# every rank; the ranks of one tensor-parallel group (one replica) take the same batch, chosen by the data-parallel
# rank.
def train_tensor_data(model, autotp_size, steps):
    world_size, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    micro_batch_size = steps[0][0].shape[0]
    ds_config = {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": 1,
        "train_batch_size": micro_batch_size * 1 * world_size,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0, "torch_adam": True}},
        "gradient_clipping": 0.0,
        "tensor_parallel": {"autotp_size": autotp_size},
        "zero_optimization": {"stage": 1},
        "steps_per_print": 1_000_000,
    }
    engine, *_ = deepspeed.initialize(model=model, config=ds_config)
    layout = {"tensor_parallel": torch.distributed.get_process_group_ranks(groups.get_tensor_model_parallel_group()),
              "data_parallel": torch.distributed.get_process_group_ranks(groups.get_data_parallel_group())}
    replica = groups.get_data_parallel_rank()
    print(f"rank {rank}: tensor-parallel group {layout['tensor_parallel']}, data-parallel group "
          f"{layout['data_parallel']}: replica {replica}")
    losses = []
    for batches in steps:
        tokens = batches[replica]
        loss = engine(input_ids=tokens, labels=tokens).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return engine, layout, losses


# 11.ulysses: attention over the whole sequence from each rank's slice; DistributedAttention's all-to-all gives each
# rank every position for heads / ranks of the heads (scatter the heads, dim 2; gather the sequence, dim 0).
def local_attention(q, k, v, *args, **kwargs):
    out = F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)), is_causal=True)
    return out.permute(2, 0, 1, 3)


def ulysses_attention(q, k, v):
    attention = DistributedAttention(local_attention, torch.distributed.group.WORLD, scatter_idx=2, gather_idx=0)
    return attention(q, k, v, batch_dim_idx=1)


SOLUTIONS = {
    "11.bubble": bubble,
    "11.min_micro_batches": min_micro_batches,
    "11.tp_dp_config": tp_dp_config,
    "11.pipeline": train_pipeline,
    "11.tensor_data": train_tensor_data,
    "11.ulysses": ulysses_attention,
}
