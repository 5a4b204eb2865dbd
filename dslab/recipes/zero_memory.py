"""Train the same model under several ZeRO setups; measure each rank's bytes, losses, step time and traffic."""
import gc
import time

import torch

from dslab import dist, memory
from dslab.config import make_config
from dslab.models import build_model, count_parameters, load_model, resolve_model, tiny_config

# setups: a list of {"zero_stage": S, "offload_optimizer": bool, "offload_param": bool}, run one after another;
# a setup may also set "grad_accum_steps", "comms" (log collectives in the last step) and "config" (merged
# into the DeepSpeed config by make_config).
args = dist.recipe_args(setups=[{"zero_stage": 2}], model=None, shape={}, steps=3, grad_accum_steps=2,
                        micro_batch_size=2, seq_len=32, lr=1e-3, seed=0, comms=False)
rank, world_size = dist.init()

import deepspeed
import deepspeed.comm as ds_comm
from deepspeed.accelerator import get_accelerator
from transformers import AutoConfig

vocab = (AutoConfig.from_pretrained(resolve_model(args.model)) if args.model else tiny_config(**args.shape)).vocab_size
# Each rank trains on its own fixed micro-batches of random tokens (the same ones under every setup).
g = torch.Generator().manual_seed(args.seed + rank)
batches = [torch.randint(3, vocab, (args.micro_batch_size, args.seq_len), generator=g) for _ in range(8)]


def run(zero_stage, offload_optimizer=False, offload_param=False, grad_accum_steps=None, config=None, comms=None):
    """Train `steps` optimizer steps; snapshot memory after the first backward of the last step."""
    accum = grad_accum_steps or args.grad_accum_steps
    comms = args.comms if comms is None else comms
    model = load_model(args.model) if args.model else build_model(tiny_config(**args.shape), seed=args.seed)
    params = count_parameters(model)  # before ZeRO-3 partitions them away
    ds_config = make_config(zero_stage=zero_stage, offload_optimizer=offload_optimizer, offload_param=offload_param,
                            precision="bf16", micro_batch_size=args.micro_batch_size, grad_accum_steps=accum,
                            world_size=world_size, lr=args.lr, **(config or {}))
    get_accelerator().reset_peak_memory_stats()  # peak_device (on a GPU) then belongs to this setup alone
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    # Adam's step counter before any training step (DeepSpeed's stage-0 bf16 optimizer primes it; see ch. 04)
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    primed = max([int(st["step"]) for st in inner.state.values() if "step" in st] or [0])
    losses, seconds, snapshot, traffic = [], [], None, {}
    for step in range(args.steps):
        last = step == args.steps - 1
        start, total = time.perf_counter(), 0.0
        for micro, tokens in enumerate(batches[:accum]):
            if last and comms:  # log every collective of this micro-step (DeepSpeed's comms logger)
                ds_comm.configure(enabled=True, prof_all=True)
            tokens = tokens.to(engine.device)
            loss = engine(input_ids=tokens, labels=tokens).loss
            engine.backward(loss)
            if last and micro == 0 and accum > 1:
                # after backward of a micro-step that is NOT the accumulation boundary: stage 1 still holds
                # full gradients, stage 2 only its partition; Adam's states exist since the first step.
                snapshot = memory.measure_engine(engine)
            engine.step()
            total += loss.item()
            if last and comms:
                ds_comm.configure(enabled=False)
                kind = "boundary" if micro == accum - 1 else "micro"  # boundary: the step that updates weights
                traffic[kind] = {op: {int(size): rec[0] for size, rec in sizes.items()}
                                 for op, sizes in ds_comm.comms_logger.comms_dict.items()}
                ds_comm.comms_logger.comms_dict = {}
        seconds.append(time.perf_counter() - start)
        losses.append(total / accum)
    out = {"zero_stage": zero_stage, "offload_optimizer": offload_optimizer, "offload_param": offload_param,
           "grad_accum_steps": accum, "config": config or {}, "precision": "bf16", "params": params,
           "optimizer": type(engine.optimizer).__name__, "inner_optimizer": type(inner).__name__,
           "adam_steps_at_start": primed, "memory": snapshot, "losses": losses, "step_seconds": seconds,
           "comms": traffic}
    del engine, model
    gc.collect()
    return out


runs = []
for setup in args.setups:
    runs.append(run(**setup))
    if runs[-1]["memory"]:
        dist.print0(f"ZeRO-{setup['zero_stage']}" + (" + offload optimizer" if setup.get("offload_optimizer") else "")
                    + (" + offload params" if setup.get("offload_param") else "")
                    + f": rank 0 holds {memory.human(runs[-1]['memory']['total'])} of model states")
dist.save_result({"rank": rank, "world_size": world_size, "runs": runs})
