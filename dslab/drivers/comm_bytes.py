"""What each rank sends in one optimizer step, per ds_config: DeepSpeed's comms logger and the socket counter."""
import argparse
import contextlib
import io
import json

import torch

from dslab import this_rank
from dslab.comm import step_bytes, wire
from dslab.models.loading import build_model, tiny_config

parser = argparse.ArgumentParser(description="bytes each rank sends in one optimizer step, per ds_config")
parser.add_argument("--local_rank", type=int, default=-1)  # passed by the deepspeed launcher unless --no_local_rank
# One DeepSpeed config per setup, run one after another (dslab.comm.step_bytes.comm_config builds them with
# "comms_logger": {"enabled": true, "prof_all": true}), as one JSON list.
parser.add_argument("--ds_configs", type=json.loads, default=[])
parser.add_argument("--shape", type=json.loads, default={})  # tiny_config overrides, a JSON object
parser.add_argument("--seq_len", type=int, default=32)
parser.add_argument("--warmup_steps", type=int, default=2)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--ddp", type=json.loads, default=[])  # also measure torch DDP, once per no_sync value listed
parser.add_argument("--ddp_micro_steps", type=int, default=2)
parser.add_argument("--ddp_precision", default="fp32")
args = parser.parse_args()
rank, world_size = this_rank.init()

import deepspeed                   # after this_rank.init, which quiets DeepSpeed's logs first
import deepspeed.comm as ds_comm   # torch.distributed's calls, plus the comms logger

runs = []
for ds_config in args.ds_configs:
    model = build_model(tiny_config(**args.shape), seed=args.seed)   # the same weights on every rank
    numels = [p.numel() for p in model.parameters()]                  # what the prediction is computed from
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    g = torch.Generator().manual_seed(args.seed + rank)               # each rank its own micro-batch
    tokens = torch.randint(3, model.config.vocab_size, (engine.train_micro_batch_size_per_gpu(), args.seq_len),
                           generator=g).to(engine.device)
    for step in range(args.warmup_steps + 1):   # warm-up steps first: ZeRO-3 records its fetch order in step 1
        if step == args.warmup_steps:           # the measured step: empty the comms log, read the byte counter
            ds_comm.reset_log()
            before = wire.bytes_written()
        for _ in range(engine.gradient_accumulation_steps()):
            loss = engine(input_ids=tokens, labels=tokens).loss
            engine.backward(loss)
            engine.step()                       # the optimizer step runs at the last micro-step only
    sent = wire.bytes_written() - before        # every byte this process wrote: gloo's sockets, nothing else
    with contextlib.redirect_stdout(io.StringIO()):   # log_summary prints a table on rank 0; we keep the dict
        summary = ds_comm.log_summary(return_dict=True)["summary"]
    logged = {op: {int(size): rec["count"] for size, rec in sizes.items()}
              for op, sizes in summary.items() if op != "log_summary_barrier"}   # its own barrier is logged too
    runs.append({"bytes": sent, "comms_logger": logged, "loss": loss.item()})
    this_rank.print0(f"ZeRO-{engine.zero_optimization_stage()}: rank 0 sent {sent:,} bytes in one optimizer step")
    engine.destroy()

ddp = [step_bytes.ddp_step_bytes(args.shape, no_sync, args.ddp_micro_steps, args.ddp_precision, seq_len=args.seq_len,
                                 warmup_steps=args.warmup_steps, seed=args.seed) for no_sync in args.ddp]
this_rank.save_rank_result({"rank": rank, "world_size": world_size, "numels": numels if runs else None,
                            "runs": runs, "ddp": ddp})
