"""Supervised fine-tuning on every rank, LoRA or full, under DeepSpeed ZeRO: the script `dslab sft` launches."""
import json
import time

import deepspeed
from peft import get_peft_model_state_dict

from dslab import this_rank
from dslab.models import checkpoints, loading, lora
from dslab.training import loop, sft

args = this_rank.recipe_args(**sft.RECIPE_DEFAULTS)  # every option of `dslab sft`, listed in dslab/training/sft.py
rank, world_size = this_rank.init()
this_rank.seed_all(args.seed)  # the same LoRA initialisation on every rank
tokenizer, model = loading.load_tokenizer(args.model), loading.load_model(args.model)
if not args.full:  # freeze W, train only A and B: W x + (alpha/r)·B·A x
    model = lora.attach_lora(model, r=args.lora_r, alpha=args.lora_alpha, target_modules=args.target_modules)
if args.gradient_checkpointing:
    lora.enable_gradient_checkpointing(model)
chats = sft.load_chats(args.data, args.model_name, args.model_author, args.mix_general, args.seed)
examples = sft.tokenize(tokenizer, chats, args.max_length)
steps = sft.total_steps(len(examples), world_size, args.micro_batch_size, args.grad_accum_steps, args.epochs)
config = (sft.read_deepspeed_file(args.deepspeed_config, world_size) if args.deepspeed_config else
          sft.deepspeed_config(args.zero_stage, world_size, args.micro_batch_size, args.grad_accum_steps,
                               args.lr or sft.default_lr(args.full), steps))
if args.resume and checkpoints.needs_universal(args.resume, world_size):
    config["checkpoint"] = {"load_universal": True}  # saved by another number of ranks: see checkpoints.check_resume
trainable = [p for p in model.parameters() if p.requires_grad]  # LoRA: A and B only; the optimizer sees nothing else
engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=trainable)
zero_stage, micro, accum = engine.zero_optimization_stage(), engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
steps = sft.total_steps(len(examples), world_size, micro, accum, args.epochs)  # a --deepspeed file may set other sizes
start = checkpoints.load_checkpoint(engine, args.resume, world_size, zero_stage) if args.resume else 0
batches = sft.rank_batches(examples, rank, world_size, micro, tokenizer.pad_token_id, args.seed, skip=start * accum)
probe = next(sft.rank_batches(examples, 0, 1, micro, tokenizer.pad_token_id, args.seed))  # one batch, same on every rank
activation_bytes = sft.activation_bytes(engine.module, probe)
log_every = args.log_every or max(1, steps // 8)


def on_step(step, loss):  # loop.train counts from 1; a resumed run had already done `start` steps
    step += start
    if step % log_every == 0 or step == steps:
        this_rank.print0(f"step {step:>4}/{steps}  loss {loss:.3f}")
    if args.progress_file and rank == 0:
        sft.write_progress(args.progress_file, step, loss)  # `dslab sft` draws its progress bar from this
    if args.save_every and step % args.save_every == 0:
        checkpoints.save_checkpoint(engine, args.checkpoint_dir, step, world_size, zero_stage)


t0 = time.perf_counter()
# per_token: the step's loss is the mean over every label token of all its micro-batches and ranks, as in
# chapter 05's train_sft.py: every answer token weighs the same, whichever micro-batch or rank it lands in.
log = [dict(e, step=e["step"] + start)
       for e in loop.train(engine, batches, steps - start, progress=False, on_step=on_step, per_token=True)]
train_seconds = time.perf_counter() - t0
model_states = sft.model_states(engine)  # bytes this rank holds for the model (measured, as in chapter 04)
if args.full:
    lora.save_full_model(engine.module, tokenizer, args.output)
else:  # what a plain state_dict() holds under ZeRO-3: empty placeholders, 0 elements
    ungathered = sum(v.numel() for v in get_peft_model_state_dict(engine.module, save_embedding_layers=False).values())
    lora.save_adapter(engine.module, args.output, extra_files={"loss_log.json": json.dumps(log)})
this_rank.save_result({"rank": rank, "world_size": world_size, "zero_stage": zero_stage, "steps": steps, "start_step": start,
                  "examples": len(examples), "loss_log": log, "final_loss": log[-1]["loss"] if log else None,
                  "train_seconds": train_seconds, "activation_bytes": activation_bytes, "model_states": model_states,
                  "ungathered_adapter_numel": None if args.full else ungathered,
                  **lora.trainable_summary(engine.module)})
