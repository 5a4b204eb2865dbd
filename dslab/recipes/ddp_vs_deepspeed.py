"""One model, three trainers: one process on the full batch, torch DDP, and DeepSpeed ZeRO-0 reach the same weights."""
import copy

import torch

from dslab import dist
from dslab.config import make_config
from dslab.models import build_model, tiny_config

args = dist.recipe_args(steps=3, lr=1e-2, global_batch=4, seq_len=16, seed=0)
rank, world_size = dist.init()

import deepspeed
from torch.nn.parallel import DistributedDataParallel as DDP

# A very small model of the course's architecture (Qwen2), fp32 so all three runs can agree to ~1e-6.
config = tiny_config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=2, num_key_value_heads=1)
base = build_model(config, seed=args.seed)             # same seed on every rank -> same initial weights
dist.seed_all(args.seed)                               # ... and the same data on every rank
batches = [torch.randint(config.vocab_size, (args.global_batch, args.seq_len)) for _ in range(args.steps)]
local = args.global_batch // world_size                # each rank trains on its slice of every batch
mine = slice(rank * local, (rank + 1) * local)

# DeepSpeed config: ZeRO-0 (plain data parallelism), fp32, AdamW. Clipping off, as in the baselines.
ds_config = make_config(zero_stage=0, precision="fp32", micro_batch_size=local, world_size=world_size,
                        lr=args.lr, gradient_clipping=0.0)
adamw = {k: v for k, v in ds_config["optimizer"]["params"].items() if k != "torch_adam"}  # same lr, betas, eps, wd


def loss_of(model, tokens):
    return model(input_ids=tokens, labels=tokens).loss   # mean over this batch's tokens


# 1. Reference: one process, the whole global batch; no communication at all.
ref = copy.deepcopy(base)
opt = torch.optim.AdamW(ref.parameters(), **adamw)
ref_losses = []
for tokens in batches:
    opt.zero_grad()
    loss = loss_of(ref, tokens)
    loss.backward()
    opt.step()
    ref_losses.append(loss.item())

# 2. torch DDP: backward() all-reduces the gradients and divides by world_size (an average).
ddp = DDP(copy.deepcopy(base))
opt = torch.optim.AdamW(ddp.parameters(), **adamw)
for tokens in batches:
    opt.zero_grad()
    loss_of(ddp, tokens[mine]).backward()
    opt.step()

# 3. DeepSpeed: the engine owns the optimizer; engine.backward averages gradients the same way.
model = copy.deepcopy(base)
engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
losses = []
for tokens in batches:
    loss = loss_of(engine, tokens[mine])
    engine.backward(loss)
    engine.step()        # optimizer step + zero_grad
    losses.append(loss.item())


def max_diff(a, b):
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


result = {"rank": rank, "ddp_vs_ref": max_diff(ddp.module, ref), "deepspeed_vs_ref": max_diff(engine.module, ref),
          "ddp_vs_deepspeed": max_diff(ddp.module, engine.module), "moved": max_diff(base, ref),
          "parameters": sum(p.numel() for p in base.parameters()), "losses": losses, "ref_losses": ref_losses,
          "optimizer": type(engine.optimizer).__name__, "adamw": adamw, "zero_stage": engine.zero_optimization_stage()}
dist.print0(f"{args.steps} steps on {world_size} ranks: max |DDP - reference| = {result['ddp_vs_ref']:.1e}, "
            f"max |DeepSpeed - reference| = {result['deepspeed_vs_ref']:.1e}")
dist.save_result(result)
