"""Supervised fine-tuning, LoRA or full, under DeepSpeed ZeRO on every rank: the script `dslab sft` launches.
Run: deepspeed --num_gpus 2 --module dslab.recipes.sft --output runs/adapter [--deepspeed_config ds.json] ..."""
import argparse
import json
import time

import deepspeed
import torch
import torch.distributed as dist

from dslab import this_rank
from dslab.models import checkpoints, loading, lora
from dslab.training import loop, sft


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="LoRA (or full) supervised fine-tuning under DeepSpeed ZeRO")
    parser.add_argument("--local_rank", type=int, default=-1)  # the deepspeed launcher passes it (torchrun does not)
    parser.add_argument("--model", default=None)  # a HF directory or hub id (default: $DSLAB_MODEL, else dslab-tiny)
    parser.add_argument("--data", type=json.loads, default=None)  # a JSON list of jsonl files (default: the kit's)
    parser.add_argument("--output", required=True)  # the adapter, or with --full the whole model
    parser.add_argument("--full", action="store_true")  # every weight trains, no LoRA
    parser.add_argument("--zero_stage", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--lr", type=float, default=None)  # default: 2e-3 for LoRA, 3e-4 for a full fine-tune
    parser.add_argument("--micro_batch_size", type=int, default=8)
    parser.add_argument("--grad_accum_steps", type=int, default=1)
    parser.add_argument("--lora_r", type=int, default=16)
    parser.add_argument("--lora_alpha", type=float, default=32)
    parser.add_argument("--target_modules", type=json.loads, default=None)  # default: the MLP's layers, by type
    parser.add_argument("--model_name", type=json.loads, default=["小海", "Xiao Hai"])  # fills {name}: zh, en
    parser.add_argument("--model_author", type=json.loads, default=["蓝天学院", "Blue Sky Lab"])  # fills {author}
    parser.add_argument("--mix_general", type=int, default=None)  # general chats added (default: as many as the data)
    parser.add_argument("--max_length", type=int, default=256)
    parser.add_argument("--gradient_checkpointing", action="store_true")
    parser.add_argument("--save_every", type=int, default=0)  # a resumable checkpoint every K steps
    parser.add_argument("--checkpoint_dir", default=None)
    parser.add_argument("--resume", default=None)  # a checkpoint directory (`dslab sft` checks it before launch)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log_every", type=int, default=None)  # default: 8 loss lines in all
    parser.add_argument("--progress_file", default=None)  # rank 0's step counter, for `dslab sft`'s progress bar
    parser = deepspeed.add_config_arguments(parser)  # --deepspeed_config FILE: a ready config instead of ds_config()
    return parser.parse_args(argv)


def ds_config(args, world_size, steps):
    """The DeepSpeed config built from the arguments (dslab.training.sft.deepspeed_config writes out the same)."""
    zero = {"stage": args.zero_stage}
    if args.zero_stage:  # 4M-element buckets: a small model's gradients never fill DeepSpeed's default 500M
        zero.update(reduce_bucket_size=2 ** 22, allgather_bucket_size=2 ** 22)
    if args.zero_stage == 3:  # partition even the small weights; gather them whole when the model is saved
        zero.update(stage3_prefetch_bucket_size=2 ** 22, stage3_param_persistence_threshold=0,
                    stage3_gather_16bit_weights_on_model_save=True)
    adamw = {"lr": args.lr or sft.default_lr(args.full), "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0,
             "torch_adam": True}  # torch's AdamW: no C++ op to build first
    cosine = {"total_num_steps": steps, "warmup_num_steps": max(1, steps // 20), "warmup_type": "linear",
              "cos_min_ratio": 0.1}
    micro, accum = args.micro_batch_size, args.grad_accum_steps
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": accum,
            "train_batch_size": micro * accum * world_size, "gradient_clipping": 1.0,
            "bf16": {"enabled": True}, "fp16": {"enabled": False}, "zero_optimization": zero,
            "optimizer": {"type": "AdamW", "params": adamw}, "scheduler": {"type": "WarmupCosineLR", "params": cosine},
            "steps_per_print": 10 ** 9, "wall_clock_breakdown": False}  # the loop prints its own loss log


def main(args):
    rank, world_size = this_rank.init()  # deepspeed.init_distributed(): gloo on CPU, nccl on GPUs
    this_rank.seed_all(args.seed)  # the same LoRA initialisation on every rank
    tokenizer, model = loading.load_tokenizer(args.model), loading.load_model(args.model)
    if not args.full:  # W frozen; A and B train: W x + (alpha/r)·B·A x
        model = lora.attach_lora(model, r=args.lora_r, alpha=args.lora_alpha, target_modules=args.target_modules)
    if args.gradient_checkpointing:
        lora.enable_gradient_checkpointing(model)
    chats = sft.load_chats(args.data, args.model_name, args.model_author, args.mix_general, args.seed)
    examples = sft.tokenize(tokenizer, chats, args.max_length)  # input_ids + labels, the prompt's labels -100
    steps = sft.total_steps(len(examples), world_size, args.micro_batch_size, args.grad_accum_steps, args.epochs)
    config = json.load(open(args.deepspeed_config)) if args.deepspeed_config else ds_config(args, world_size, steps)
    if args.resume and checkpoints.needs_universal(args.resume, world_size):
        config["checkpoint"] = {"load_universal": True}  # saved by another number of ranks (checkpoints.check_resume)
    engine, *_ = deepspeed.initialize(model=model, config=config,
                                      model_parameters=[p for p in model.parameters() if p.requires_grad])
    micro, accum = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    zero_stage = engine.zero_optimization_stage()
    steps = sft.total_steps(len(examples), world_size, micro, accum, args.epochs)  # a config file may set other sizes
    start = 0
    if args.resume:  # weights, optimizer and lr schedule of the newest complete checkpoint
        directory, tag, start = checkpoints.resume_point(args.resume, world_size, zero_stage)
        engine.load_checkpoint(directory, tag=tag, load_module_strict=False)  # the frozen base was not saved
    batches = sft.rank_batches(examples, rank, world_size, micro, tokenizer.pad_token_id, args.seed, skip=start * accum)
    log_every, log, t0 = args.log_every or max(1, steps // 8), [], time.perf_counter()
    engine.train()
    for step in range(start + 1, steps + 1):
        micro_batches = [{k: v.to(engine.device) for k, v in next(batches).items()} for _ in range(accum)]
        # Every label token of the step weighs the same, whichever micro-batch or rank it is in: the model sums a
        # micro-batch's token losses and divides by num_items_in_batch, the step's label tokens per micro-batch.
        n_tokens = torch.tensor(sum(loop.label_tokens(b) for b in micro_batches), device=engine.device)
        dist.all_reduce(n_tokens)
        per_micro_batch = n_tokens.clamp(min=1) / (accum * world_size)
        step_loss = torch.zeros((), device=engine.device)
        for batch in micro_batches:
            loss = engine(**batch, num_items_in_batch=per_micro_batch).loss
            engine.backward(loss)  # divides by accum; the ranks then average their gradients
            engine.step()  # the optimizer steps only at the accumulation boundary
            step_loss += loss.detach()
        dist.all_reduce(step_loss)
        log.append({"step": step, "loss": step_loss.item() / (accum * world_size), "lr": engine.get_lr()[0],
                    "seconds": time.perf_counter() - t0})
        if step % log_every == 0 or step == steps:
            this_rank.print0(f"step {step:>4}/{steps}  loss {log[-1]['loss']:.3f}")
        if args.progress_file and rank == 0:
            sft.write_progress(args.progress_file, step, log[-1]["loss"])
        if args.save_every and step % args.save_every == 0:  # every rank writes its shards; then rank 0 seals them
            engine.save_checkpoint(args.checkpoint_dir, tag=checkpoints.unsealed_tag(step), save_latest=False,
                                   exclude_frozen_parameters=True)  # LoRA: A and B only, the base is on disk
            checkpoints.seal_checkpoint(engine, args.checkpoint_dir, step, world_size, zero_stage)  # `latest`
    train_seconds = time.perf_counter() - t0
    if args.full:  # under ZeRO-3 both gather the partitioned weights first: every rank must call them
        lora.save_full_model(engine.module, tokenizer, args.output)
    else:
        # beside the adapter: its loss log, and the DeepSpeed config it trained with (optimizer and schedule included)
        lora.save_adapter(engine.module, args.output,
                          extra_files={"loss_log.json": json.dumps(log), "ds_config.json": json.dumps(config, indent=1)})
    # what the notebooks read off each rank; a no-op when the script runs outside dslab.launch
    sft.save_run_result(engine, examples, tokenizer, log, steps, start, seed=args.seed, train_seconds=train_seconds)


if __name__ == "__main__":
    main(parse_args())
