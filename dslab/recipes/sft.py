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
from dslab.training import loop, sft, sft_settings


def parse_args(argv=None):
    """The run's settings (dslab.training.sft_settings: the ones `dslab sft` takes, less the launcher's own), with the
    arguments a launcher or `dslab sft` adds."""
    parser = argparse.ArgumentParser(description="LoRA (or full) supervised fine-tuning under DeepSpeed ZeRO")
    parser.add_argument("--local_rank", type=int, default=-1)  # the deepspeed launcher passes it (torchrun does not)
    sft_settings.add_recipe_arguments(parser, leave_out=("deepspeed_config",))  # declared by DeepSpeed, just below
    parser.add_argument("--progress_file", default=None)  # rank 0's step counter, for `dslab sft`'s progress bar
    parser = deepspeed.add_config_arguments(parser)  # --deepspeed_config FILE: a ready config instead of the built one
    return parser.parse_args(argv)


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
    lr = args.lr or sft_settings.default_lr(args.full)
    config = json.load(open(args.deepspeed_config)) if args.deepspeed_config else \
        sft.deepspeed_config(args.zero_stage, world_size, args.micro_batch_size, args.grad_accum_steps, lr, steps)
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
