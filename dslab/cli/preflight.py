"""The checks before a run: `dslab env`, `prepare`, `config check|new`, `estimate`, `measure`, `comm`.

The work is done by dslab.env, dslab.config.build / dslab.config.check, dslab.zero.memory and dslab.zero.runner; this
file parses the arguments, calls them and prints. Each command returns its exit status.
"""
import contextlib
import json
import os
import sys
from pathlib import Path

from dslab import env, this_rank
from dslab.config import build, check
from dslab.zero import memory, runner
from dslab.messages import say


def add_commands(subparsers):
    """`dslab env`, `dslab prepare`, `dslab config check|new`, `dslab estimate`, `dslab measure` and `dslab comm`."""
    _add_env_commands(subparsers)
    _add_config_commands(subparsers)
    _add_memory_commands(subparsers)
    _add_comm_command(subparsers)


# --------------------------------------------------------------------------- env, prepare

def _env(args):
    this_rank.send_deepspeed_logs_to_stderr()
    rep = env.machine_facts()
    print(json.dumps(rep, indent=2, sort_keys=True) if args.json else env.format_report(rep))
    return 0


def _prepare(args):
    this_rank.send_deepspeed_logs_to_stderr()
    try:
        env.prepare(only=args.only, verbose=args.verbose)
    except RuntimeError as exc:
        print(exc)
        return 1
    return 0


def _add_env_commands(subparsers):
    parser = subparsers.add_parser("env", help="what this machine offers DeepSpeed, and which course features run")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.set_defaults(func=_env)
    prep = subparsers.add_parser("prepare", help="build the JIT ops the course uses (shm_comm, cpu_adam, fused_adam) "
                                 "now")
    prep.add_argument("--only", nargs="+", choices=[name for name, _, _ in env.COURSE_OPS], help="build only these")
    prep.add_argument("--verbose", action="store_true", help="show the compiler's output")
    prep.set_defaults(func=_prepare)


# --------------------------------------------------------------------------- config check, config new

def _config_check(args):
    path = Path(args.file)
    if not path.exists() and os.sep not in args.file:  # a ready-made config by name
        try:
            path = build.config_path(args.file)
        except FileNotFoundError:
            pass
    try:
        check.resolve_world_size(args.world_size)  # --world-size 0: refused before the file is read
        cfg = build.load_config(path)
    except FileNotFoundError:
        print(say("config.no_file", file=args.file, bundled=", ".join(build.BUNDLED)))
        return 1
    except check.ConfigError as exc:
        print(exc)
        return 1
    this_rank.send_deepspeed_logs_to_stderr()
    device = None if args.device == "auto" else args.device
    problems = check.check_config(cfg, world_size=args.world_size, device=device, allow_auto=args.hf_trainer)
    if problems:
        n = len(problems)
        print(say("problems.file", file=args.file, n=n, s="s" if n != 1 else ""))
        for p in problems:
            print(f"  {p}")
        return 1
    print(say("config.ok", file=args.file))
    for line in check.summary(cfg, args.world_size).splitlines():
        print(f"  {line}")
    return 0


def _config_new(args):
    this_rank.send_deepspeed_logs_to_stderr()
    # Without --world-size the file leaves train_batch_size out: DeepSpeed computes it on any number of ranks.
    extra = {} if args.world_size else {"train_batch_size": None}
    try:
        cfg = build.make_config(zero_stage=args.zero, offload_optimizer=args.offload_optimizer,
                                 offload_param=args.offload_param, precision=args.precision,
                                 micro_batch_size=args.micro_batch_size, grad_accum_steps=args.grad_accum_steps,
                                 world_size=args.world_size, lr=args.lr, **extra)
    except ValueError as exc:  # check.ConfigError is a ValueError
        print(exc)
        return 1
    if args.output:
        try:
            build.save_config(cfg, args.output, option="--output")
        except OSError as exc:  # a folder there, or nowhere to write: the message says which and the fix
            print(f"error: {exc}", file=sys.stderr)
            return 1
        print(f"wrote {args.output}")
    else:
        print(build.to_json(cfg), end="")
    return 0


def _add_config_commands(subparsers):
    parser = subparsers.add_parser("config", help="check or create DeepSpeed configs")
    sub = parser.add_subparsers(dest="config_command", metavar="ACTION")
    parser.set_defaults(func=lambda args: parser.print_help() or 2)

    check_cmd = sub.add_parser("check", help="list every problem in a DeepSpeed JSON config (exit 1 if any)")
    check_cmd.add_argument("file", help=f"a JSON file, or a ready-made config name ({', '.join(build.BUNDLED)})")
    check_cmd.add_argument("--world-size", type=int, default=None,
                           help="number of ranks it will run on (default: $WORLD_SIZE, else 1)")
    check_cmd.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "any"],
                           help="accelerator to check fp16/bf16 against (auto: this machine; any: skip)")
    check_cmd.add_argument("--hf-trainer", action="store_true",
                           help='the file goes to transformers\' Trainer, which fills "auto" values')
    check_cmd.set_defaults(func=_config_check)

    new = sub.add_parser("new", help="print (or write) a config built by dslab.config.build.make_config")
    new.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3], help="ZeRO stage")
    new.add_argument("--offload-optimizer", action="store_true", help="optimizer states to CPU (ZeRO-Offload)")
    new.add_argument("--offload-param", action="store_true", help="parameters to CPU (needs --zero 3)")
    new.add_argument("--precision", default="bf16", choices=build.PRECISIONS)
    new.add_argument("--micro-batch-size", type=int, default=1, help="train_micro_batch_size_per_gpu")
    new.add_argument("--grad-accum-steps", type=int, default=1, help="gradient_accumulation_steps")
    new.add_argument("--world-size", type=int, default=None,
                     help="ranks, to write train_batch_size (default: leave it out; DeepSpeed computes it)")
    new.add_argument("--lr", type=float, default=1e-3, help="learning rate")
    new.add_argument("-o", "--output", help="write to this file (atomically) instead of printing")
    new.set_defaults(func=_config_new)


# --------------------------------------------------------------------------- estimate, measure

def _print_report(rep, as_json):
    print(json.dumps(rep, indent=2) if as_json else memory.format_report(rep))


def _estimate(args):
    # the optimizer / master-weight levers of chapter 13 (Muon, bf16 master weights and states)
    choice = {"optimizer": args.optimizer, "master_weights": args.master_weights,
              "optimizer_states": args.optimizer_states, "muon_fraction": args.muon_fraction}
    try:
        rep = memory.bytes_per_rank(args.params, args.world_size, args.zero, args.precision, args.offload_optimizer,
                            args.offload_param, trainable=args.trainable, **choice)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    _print_report(rep, args.json)
    if not args.json and not memory.describe_levers(rep):  # DeepSpeed's estimators know only Adam's fp32 states
        est = memory.deepspeed_estimate(args.params, args.world_size, args.zero, args.offload_optimizer,
                                        args.offload_param)
        if est:
            # its functions take one parameter count and give each parameter gradients and optimizer states
            some_frozen = rep.get("trainable", rep["params"]) < rep["params"]
            print(f"DeepSpeed's {est['function']}: {memory.human(est['device'])} per GPU, "
                  f"{memory.human(est['host'])} per CPU (it also counts fp32 gradients and a 1.5x host buffer "
                  "factor" + ("; it assumes every parameter trains" if some_frozen else "") + ")")
    return 0


def _model_shape(args):
    """tiny_config overrides from the model-shape options (--hidden-size, --layers, --vocab-size, ..., --params)."""
    shape = {k: v for k, v in (("hidden_size", args.hidden_size), ("num_hidden_layers", args.layers),
                                ("vocab_size", args.vocab_size), ("intermediate_size", args.intermediate_size))
             if v is not None}
    if args.hidden_size is not None and args.intermediate_size is None:
        shape.update(intermediate_size=runner.hidden_shape(args.hidden_size)["intermediate_size"])
    if args.params is not None:
        shape = runner.shape_for_params(args.params, **{k: v for k, v in shape.items() if k != "hidden_size"})
    return shape


def _measure(args):
    from dslab.launch import LaunchError

    try:
        shape = _model_shape(args)
    except ValueError as exc:  # --params below 1
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.model and shape:
        print("error: give either --model PATH or shape options (--hidden-size, --layers, ...), not both",
              file=sys.stderr)
        return 2
    out = sys.stderr if args.json else sys.stdout  # keep stdout pure JSON
    try:
        with contextlib.redirect_stdout(out):
            rep = runner.measure(args.zero, args.world_size, args.offload_optimizer, args.offload_param,
                               model=args.model, shape=shape or None, steps=args.steps, timeout=args.timeout)
    except (LaunchError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    _print_report(rep, args.json)
    return 0


def _comm(args):
    from dslab.comm import step_bytes
    from dslab.launch import LaunchError

    out = sys.stderr if args.json else sys.stdout  # keep stdout pure JSON
    try:
        with contextlib.redirect_stdout(out):
            reps = step_bytes.measure(args.zero, args.world_size, args.dtype, args.offload, shape=_model_shape(args),
                                      grad_accum_steps=args.grad_accum_steps, timeout=args.timeout)
    except (LaunchError, ValueError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(reps[0] if len(reps) == 1 else reps, indent=2))
    else:
        print("\n\n".join(step_bytes.format_report(rep) for rep in reps))
    return 0


def _add_shape_args(parser):
    parser.add_argument("--hidden-size", type=int, default=None, help="model shape: hidden size")
    parser.add_argument("--layers", type=int, default=None, help="model shape: number of layers")
    parser.add_argument("--vocab-size", type=int, default=None, help="model shape: vocabulary size")
    parser.add_argument("--intermediate-size", type=int, default=None, help="model shape: MLP width "
                        "(default ~8/3 x hidden)")
    parser.add_argument("--params", type=float, default=None, help="pick a hidden size for about this many "
                        "parameters")


def _add_comm_command(subparsers):
    com = subparsers.add_parser("comm", help="run N real ranks and measure the bytes each sends per optimizer "
                                "step, next to the ZeRO paper's ideal and DeepSpeed's algorithm")
    com.add_argument("--zero", type=int, nargs="+", required=True, choices=[0, 1, 2, 3],
                     help="ZeRO stage(s); several run one after another on the same ranks")
    com.add_argument("--world-size", type=int, default=2, help="number of data-parallel ranks N")
    com.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"], help="training dtype")
    com.add_argument("--offload", action="store_true", help="optimizer (stages 1-3) and parameters (stage 3) to CPU")
    com.add_argument("--grad-accum-steps", type=int, default=1, help="micro-steps per optimizer step")
    _add_shape_args(com)
    com.add_argument("--timeout", type=float, default=900, help="stop all ranks after this many seconds")
    com.add_argument("--json", action="store_true", help="print the report as JSON")
    com.set_defaults(func=_comm)


def _add_setup_args(parser):
    parser.add_argument("--zero", type=int, required=True, choices=[0, 1, 2, 3], help="ZeRO stage")
    parser.add_argument("--world-size", type=int, default=2, help="number of data-parallel ranks N")
    parser.add_argument("--offload-optimizer", action="store_true", help="optimizer states to CPU (stages 1-3)")
    parser.add_argument("--offload-param", action="store_true", help="parameters to CPU (stage 3)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def _add_memory_commands(subparsers):
    est = subparsers.add_parser("estimate", help="ZeRO model-state bytes per rank from the paper's formulas")
    est.add_argument("--params", type=float, required=True, help="number of parameters Ψ (1.5e9 works)")
    est.add_argument("--trainable", type=float, default=None,
                     help="how many of them train (default: all). LoRA: the adapters, with --params counting them "
                     "too; a frozen parameter keeps only its weight (2 bytes in bf16), no gradient or optimizer state")
    _add_setup_args(est)
    est.add_argument("--precision", default="bf16", choices=list(memory.BYTES_PER_PARAM))
    est.add_argument("--optimizer", default="adam", choices=memory.OPTIMIZERS,
                     help="muon: Muon on the layers' 2-D weight matrices, Adam on the rest (needs --muon-fraction)")
    est.add_argument("--muon-fraction", type=float, default=None,
                     help="share of the parameters in the layers' 2-D weight matrices (dslab-tiny: 0.52)")
    est.add_argument("--master-weights", default="fp32", choices=memory.STATE_DTYPES,
                     help="bf16: bf16_master_weights_and_grads (needs --optimizer-states bf16 or --offload-optimizer)")
    est.add_argument("--optimizer-states", default="fp32", choices=memory.STATE_DTYPES,
                     help="bf16: bf16_optimizer_states, Adam's moments in bf16 (needs --master-weights bf16)")
    est.set_defaults(func=_estimate)

    mea = subparsers.add_parser("measure", help="run N real ranks and measure each rank's model-state bytes")
    _add_setup_args(mea)
    mea.add_argument("--model", default=None, help="a local Hugging Face checkpoint directory (default: a "
                     "randomly initialised dslab-tiny shape)")
    _add_shape_args(mea)
    mea.add_argument("--steps", type=int, default=2, help="optimizer steps before the snapshot (>= 2)")
    mea.add_argument("--timeout", type=float, default=900, help="stop all ranks after this many seconds")
    mea.set_defaults(func=_measure)
