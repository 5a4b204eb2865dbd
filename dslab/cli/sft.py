"""`dslab sft`: LoRA (or full) fine-tuning on N ranks. dslab.training.sft checks the inputs and launches the ranks; this
file parses the arguments, calls it and prints the outcome. The command returns its exit status."""
import sys

from dslab import data, launch, this_rank
from dslab.config import check
from dslab.models import checkpoints, loading, lora
from dslab.training import equivalents, sft, sft_plan, sft_settings


def add_commands(subparsers):
    """`dslab sft`."""
    p = subparsers.add_parser("sft", help="LoRA (or full) supervised fine-tuning on N ranks through DeepSpeed",
                              description="Fine-tune a causal LM on chat data with DeepSpeed ZeRO; saves a PEFT "
                                          "adapter (or, with --full, a whole HF model).")
    sft_settings.add_cli_options(p)  # every setting of the run, defined once
    p.add_argument("--print-equivalent", choices=equivalents.TARGETS, default=None,
                   help="print this run for the Hugging Face Trainer (hf), ms-swift (swift) or LLaMA-Factory "
                        "(llamafactory), write the files its command reads into OUTPUT-<framework>/, and exit: nothing "
                        "is trained, loaded or launched")
    p.set_defaults(func=run_sft)


def run_sft(args):
    """Fine-tune as the arguments say; print where the result went, or what stopped the run before it began."""
    if args.print_equivalent:
        return print_equivalent(args)
    this_rank.quiet()
    try:
        result = sft.run(**{name: getattr(args, name) for name in sft_settings.DEFAULTS},
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
    """`dslab sft ... --print-equivalent hf|swift|llamafactory`: the same run for another framework
    (dslab.training.equivalents), printed, with the files its command reads written into OUTPUT-<framework>/
    (dslab.training.sft_plan)."""
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
