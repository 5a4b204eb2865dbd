"""Gradient accumulation in DeepSpeed: micro x accumulation x ranks sequences make one step, equal to one big batch."""
import copy

import torch

from dslab import dist
from dslab.accumulation import batch_triples, compare, hf_auto_batch, small_lm, token_batch
from dslab.config import make_config

args = dist.recipe_args(micro_batch_size=2, grad_accum_steps=4, seq_len=32, lr=0.1, seed=0)
rank, world_size = dist.init()

import deepspeed
from deepspeed.utils import safe_get_full_grad

micro, gas = args.micro_batch_size, args.grad_accum_steps
base = small_lm(seed=args.seed)                                   # same seed on every rank: same weights
global_batch = token_batch(micro * gas * world_size, args.seq_len, base.config.vocab_size, seed=args.seed)
per_rank = micro * gas
mine = {k: v[rank * per_rank:(rank + 1) * per_rank] for k, v in global_batch.items()}   # this rank's share


def weights(model):
    return {n: p.detach().cpu().clone() for n, p in model.named_parameters()}


def grad_norm(model):
    return torch.cat([p.grad.cpu().flatten() for p in model.parameters() if p.grad is not None]).norm().item()


# Reference: one process, the whole global batch, mean loss, one SGD step. (SGD, not Adam: Adam's first
# step is about lr * sign(gradient), so it would hide a gradient that is k times too large.)
ref = copy.deepcopy(base)
ref(**global_batch).loss.backward()
torch.optim.SGD(ref.parameters(), lr=args.lr).step()


def deepspeed_step(zero_stage, micro_batch_size, accum, mode="engine"):
    """One optimizer step of a DeepSpeed engine over this rank's share; a row per micro-step, and the weights.

    mode "engine": engine.backward(loss), the normal way (DeepSpeed divides the loss by accum);
    "divided_twice": engine.backward(loss / accum), a loop ported from plain PyTorch that already divides;
    "no_gas_scaling": engine.backward(loss, scale_wrt_gas=False), what transformers' Trainer passes.
    """
    model = copy.deepcopy(base)
    # fp32, no clipping; optimizer=None removes make_config's AdamW so the SGD below is used.
    cfg = make_config(zero_stage=zero_stage, precision="fp32", micro_batch_size=micro_batch_size,
                      grad_accum_steps=accum, world_size=world_size, gradient_clipping=0.0, optimizer=None,
                      zero_allow_untested_optimizer=zero_stage > 0)     # ZeRO only vouches for Adam-like ones
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=args.lr),
                                      config=cfg)
    rows = []
    for i in range(accum):
        mb = {k: v[i * micro_batch_size:(i + 1) * micro_batch_size] for k, v in mine.items()}
        on_device = {k: v.to(engine.device) for k, v in mb.items()}     # cpu here, cuda:N on a GPU
        boundary = engine.is_gradient_accumulation_boundary()     # True on the last micro-step only
        loss = engine(**on_device).loss
        before = weights(engine.module)
        if mode == "divided_twice":
            engine.backward(loss / accum)
        else:
            engine.backward(loss, scale_wrt_gas=(mode == "engine"))
        row = {"micro_step": i, "boundary": boundary, "loss": loss.item()}
        if i == 0 and zero_stage == 0 and accum > 1:
            # the gradient this backward left in .grad, over the same micro-batch's plain gradient
            twin = copy.deepcopy(base)
            twin(**mb).loss.backward()
            row["grad_over_plain_grad"] = grad_norm(engine.module) / grad_norm(twin)
        if boundary:   # gradients are summed over micro-steps and averaged over ranks; read before step()
            full = [safe_get_full_grad(p).cpu().flatten() for p in engine.module.parameters()]
            row["grad_norm"] = torch.cat(full).norm().item()
        engine.step()                                             # updates only at the boundary
        row["weights_changed"] = any(not torch.equal(before[n], p.cpu()) for n, p in engine.module.named_parameters())
        row["global_steps"] = engine.global_steps
        rows.append(row)
    info = {"zero_stage": zero_stage, "mode": mode, "train_batch_size": engine.train_batch_size(),
            "micro_batch_size": engine.train_micro_batch_size_per_gpu(),
            "grad_accum_steps": engine.gradient_accumulation_steps(), "world_size": world_size}
    return rows, weights(engine.module), info


start = weights(base)
ref_step = torch.cat([(p.detach() - start[n]).flatten() for n, p in ref.named_parameters()]).norm()
runs = {}
for name, setup in {"accumulate": (0, micro, gas, "engine"),
                    "big_micro_batch": (0, micro * gas, 1, "engine"),
                    "accumulate_zero1": (1, micro, gas, "engine"),
                    "divided_twice": (0, micro, gas, "divided_twice"),
                    "no_gas_scaling_zero0": (0, micro, gas, "no_gas_scaling"),
                    "no_gas_scaling_zero1": (1, micro, gas, "no_gas_scaling")}.items():
    rows, w, info = deepspeed_step(*setup)
    step = torch.cat([(w[n] - start[n]).flatten() for n in w]).norm()
    runs[name] = {"micro_steps": rows, "vs_reference": compare(w, weights(ref)),
                  "step_ratio": (step / ref_step).item(), **info}

# DeepSpeed derives whichever batch number is missing (and refuses a wrong product); transformers'
# Trainer fills "auto" values from its own arguments. Both read the world size of this 2-rank job.
triples = batch_triples(total=micro * gas * world_size, micro_batch_size=micro, grad_accum_steps=gas)
hf_filled = hf_auto_batch(micro_batch_size=micro, grad_accum_steps=gas)

for name, run in runs.items():
    dist.print0(f"{name:21s} ZeRO-{run['zero_stage']} micro {run['micro_batch_size']} x accum "
                f"{run['grad_accum_steps']} x world {world_size} = {run['train_batch_size']}: "
                f"step / reference step = {run['step_ratio']:.3f}")
dist.save_result({"rank": rank, "runs": runs, "reference_grad_norm": grad_norm(ref), "triples": triples,
                  "hf_filled": hf_filled})
