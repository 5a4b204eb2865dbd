"""bf16 training of dslab-tiny on every rank: bf16 weights, fp32 master weights in the optimizer, no loss scale."""
import torch

from dslab import dist
from dslab.config import make_config
from dslab.models import build_model, count_parameters, tiny_config

args = dist.recipe_args(zero_stage=1, steps=6, micro_batch_size=4, seq_len=64, lr=1e-3, seed=0)
rank, world_size = dist.init()

import deepspeed
from deepspeed.utils import safe_get_full_fp32_param

config = tiny_config()                                 # the dslab-tiny shape, random init (4.0M parameters)
# Each rank memorises its own fixed batch of random tokens: the loss must fall within a few steps.
g = torch.Generator().manual_seed(args.seed + rank)
tokens = torch.randint(3, config.vocab_size, (args.micro_batch_size, args.seq_len), generator=g)


def train_deepspeed():
    """DeepSpeed bf16: returns engine, losses, bf16 weights before and after, and the fp32 master copy."""
    model = build_model(config, seed=args.seed)
    ds_config = make_config(zero_stage=args.zero_stage, precision="bf16", micro_batch_size=args.micro_batch_size,
                            world_size=world_size, lr=args.lr)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    params = dict(engine.module.named_parameters())
    start = {n: p.detach().cpu().clone() for n, p in params.items()}   # bf16 copies before training
    batch = tokens.to(engine.device)                                   # the engine's device: cpu or cuda:N
    losses = []
    for _ in range(args.steps):
        loss = engine(input_ids=batch, labels=batch).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    # safe_get_full_fp32_param gathers the optimizer's master copy of a parameter (a collective: all ranks call it)
    master = {n: safe_get_full_fp32_param(p).detach().cpu() for n, p in params.items()}
    return engine, losses, start, {n: p.detach().cpu().clone() for n, p in params.items()}, master


def train_pure_bf16():
    """The same training in plain torch with bf16 weights and no master copy: the optimizer updates bf16 directly."""
    model = build_model(config, seed=args.seed).to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    losses = []
    for _ in range(args.steps):
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    end = {n: p.detach().clone() for n, p in model.named_parameters()}
    return losses, start, end, end   # here the "master" is the bf16 weight itself


def summary(start, end, master):
    """How many weights moved in the master copy, and how many of those the bf16 copy shows."""
    moved_master = sum(int((master[n] != start[n].float()).sum()) for n in start)
    moved_bf16 = sum(int((end[n] != start[n]).sum()) for n in start)
    lost = sum(int(((master[n] != start[n].float()) & (end[n] == start[n])).sum()) for n in start)
    norm = [n for n in start if n.endswith("norm.weight")]                    # RMSNorm gains, all 1.0 at init
    return {
        "moved_in_master": moved_master,
        "moved_in_bf16_copy": moved_bf16,
        "moved_in_master_only": lost,                         # updates the bf16 copy cannot show (yet)
        "norm_weights": sum(start[n].numel() for n in norm),
        "norm_weights_moved_in_master": sum(int((master[n] != 1.0).sum()) for n in norm),
        "norm_weights_moved_in_bf16": sum(int((end[n] != 1.0).sum()) for n in norm),
        # the bf16 weights the model computes with are exactly the master copy rounded to bf16
        "bf16_copy_is_rounded_master": all(torch.equal(end[n], master[n].to(torch.bfloat16)) for n in start),
    }


engine, losses, start, end, master = train_deepspeed()
result = {
    "rank": rank, "world_size": world_size, "parameters": count_parameters(engine.module),
    "zero_stage": engine.zero_optimization_stage(), "optimizer": type(engine.optimizer).__name__,
    "param_dtypes": sorted({str(p.dtype) for p in engine.module.parameters()}),
    "master_dtypes": sorted({str(t.dtype) for t in master.values()}),
    "losses": losses, "fp32_master": summary(start, end, master),
}
losses_b, start, end, master = train_pure_bf16()
result.update(pure_bf16_losses=losses_b, pure_bf16=summary(start, end, master))

dist.print0(f"bf16 on {world_size} ranks, ZeRO-{result['zero_stage']}, {result['parameters']:,} parameters, "
            f"weights {result['param_dtypes']}, master weights {result['master_dtypes']}")
dist.print0("loss per step (rank 0): " + " ".join(f"{x:.3f}" for x in losses))
dist.save_result(result)
