"""`dslab sft`: LoRA (or full) fine-tuning on N ranks. dslab.training.sft checks the inputs and launches the ranks; this
file parses the arguments, calls it and prints the outcome. The command returns its exit status."""
import sys

from dslab import data, launch, this_rank
from dslab.config import check
from dslab.models import checkpoints, loading, lora
from dslab.training import equivalents, sft, sft_plan


def add_commands(subparsers):
    """`dslab sft`."""
    p = subparsers.add_parser("sft", help="LoRA (or full) supervised fine-tuning on N ranks through DeepSpeed",
                              description="Fine-tune a causal LM on chat data with DeepSpeed ZeRO; saves a PEFT "
                                          "adapter (or, with --full, a whole HF model).")
    p.add_argument("--model", default=None, help="base model directory or hub id (default: data/dslab-tiny)")
    p.add_argument("--data", nargs="+", default=None, help="jsonl files: query/response or messages rows "
                                                          "(default: data/self_cognition.jsonl)")
    p.add_argument("--output", required=True, help="where the adapter (or model) is written, atomically")
    p.add_argument("--zero", type=int, default=2, choices=[0, 1, 2, 3], help="ZeRO stage (default 2)")
    p.add_argument("--world-size", type=int, default=2, help="number of ranks (default 2)")
    p.add_argument("--lora-r", type=int, default=16, help="LoRA rank r (default 16)")
    p.add_argument("--lora-alpha", type=float, default=32, help="LoRA alpha; the update is scaled by alpha/r")
    p.add_argument("--target-modules", nargs="+", default=None,
                   help="layers that get adapters (default: the linear layers of every block's MLP, found by type: "
                        "gate_proj up_proj down_proj on Qwen2/3, Llama, Mistral)")
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default 2e-3 LoRA, 3e-4 full)")
    p.add_argument("--micro-batch-size", type=int, default=8, help="examples per rank per micro-step")
    p.add_argument("--grad-accum-steps", type=int, default=1)
    p.add_argument("--model-name", nargs="+", default=list(sft.DEFAULT_NAME), help="name for {name}: one, or zh then en")
    p.add_argument("--model-author", nargs="+", default=list(sft.DEFAULT_AUTHOR),
                   help="author for {author}: one, or zh then en")
    p.add_argument("--mix-general", type=int, default=None,
                   help="general dialogue chats mixed in (default: as many as the data; 0: none)")
    p.add_argument("--full", action="store_true", help="full fine-tuning instead of LoRA (saves a whole model)")
    p.add_argument("--gradient-checkpointing", action="store_true", help="recompute activations in backward")
    p.add_argument("--deepspeed", default=None, help="a ready DeepSpeed JSON config instead of the built one")
    p.add_argument("--save-every", type=int, default=0, help="write a resumable checkpoint every K steps")
    p.add_argument("--checkpoint-dir", default=None, help="where checkpoints go (default OUTPUT-checkpoints)")
    p.add_argument("--resume", default=None, help="a checkpoint directory to continue from (its newest checkpoint); "
                   "another --world-size works with ZeRO 1-3 if the global batch stays the same")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=None, help="print the loss every K steps (default: 8 lines in all)")
    p.add_argument("--timeout", type=float, default=None, help="stop all ranks after this many seconds")
    p.add_argument("--print-equivalent", choices=equivalents.TARGETS, default=None,
                   help="print this run for the Hugging Face Trainer (hf), ms-swift (swift) or LLaMA-Factory "
                        "(llamafactory), write the files its command reads into OUTPUT-<tool>/, and exit: nothing "
                        "is trained, loaded or launched")
    p.set_defaults(func=run_sft)


def run_sft(args):
    """Fine-tune as the arguments say; print where the result went, or what stopped the run before it began."""
    if args.print_equivalent:
        return print_equivalent(args)
    this_rank.quiet()
    try:
        result = sft.run(model=args.model, data=args.data, output=args.output, zero_stage=args.zero,
                         world_size=args.world_size, lora_r=args.lora_r, lora_alpha=args.lora_alpha,
                         target_modules=args.target_modules, epochs=args.epochs, lr=args.lr,
                         micro_batch_size=args.micro_batch_size, grad_accum_steps=args.grad_accum_steps,
                         model_name=args.model_name, model_author=args.model_author, mix_general=args.mix_general,
                         full=args.full, gradient_checkpointing=args.gradient_checkpointing, deepspeed=args.deepspeed,
                         save_every=args.save_every, checkpoint_dir=args.checkpoint_dir, resume=args.resume,
                         seed=args.seed, log_every=args.log_every, timeout=args.timeout,
                         progress=expected_steps(args) if sys.stderr.isatty() else False)
    except (sft.SFTError, checkpoints.CheckpointError, data.DataError, check.ConfigError, launch.LaunchError,
            loading.ModelError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    kind = "model" if args.full else "adapter"
    loss = f", final loss {result['final_loss']:.3f}" if result["final_loss"] is not None else ""
    print(f"saved the {kind} to {args.output} (ZeRO-{result['zero_stage']}, {result['world_size']} ranks, "
          f"{result['steps']} steps{loss}, {result['train_seconds']:.0f} s)")
    return 0


def expected_steps(args):
    """Total optimizer steps, for the progress bar (the recipe computes the same); None if the data is unreadable."""
    try:
        n = len(sft.load_chats(args.data, args.model_name, args.model_author, args.mix_general, args.seed))
    except Exception:  # sft.run reports data problems properly
        return None
    return sft.total_steps(n, args.world_size, args.micro_batch_size, args.grad_accum_steps, args.epochs)


def print_equivalent(args):
    """`dslab sft ... --print-equivalent hf|swift|llamafactory`: the same run for another tool (dslab.training.equivalents),
    printed, with the files its command reads written into OUTPUT-<tool>/ (dslab.training.sft_plan)."""
    this_rank.quiet()  # reading a --deepspeed file imports DeepSpeed, which talks on import
    try:
        plan = sft_plan.plan_from_args(args)
        text, written = equivalents.render(args.print_equivalent, plan)
        sft_plan.write(sft_plan.work_dir(plan, args.print_equivalent), written)  # what the printed lines read
        print(text, end="")
    except (sft.SFTError, data.DataError, check.ConfigError, sft_plan.EquivalentError, loading.ModelError,
            OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0
