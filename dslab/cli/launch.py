"""`dslab launch`: run a script or a dslab recipe on N ranks through the deepspeed launcher (dslab.launch.run)."""
import argparse
import sys

from dslab import launch


def add_commands(subparsers):
    """`dslab launch`."""
    p = subparsers.add_parser("launch", help="run a script on N ranks through the deepspeed launcher")
    p.add_argument("--world-size", type=int, default=2, help="number of ranks (processes)")
    p.add_argument("--master-port", type=int, default=None, help="rendezvous port (a free one if omitted or taken)")
    p.add_argument("--include", default=None, help="GPUs to use, deepspeed style: localhost:0,1")
    p.add_argument("--timeout", type=float, default=None, help="stop all ranks after this many seconds")
    p.add_argument("--hang-timeout", type=float, default=None, metavar="S",
                   help="if no rank makes progress (prints or uses CPU) for S seconds, print every rank's stack "
                        "(py-spy) and the collective it waits in, then stop all ranks")
    p.add_argument("--run-dir", default=None, help="where per-rank logs and results go (default ./runs)")
    p.add_argument("--verbose", action="store_true", help="also show DeepSpeed's own log lines")
    p.add_argument("script", help="a script path or a dslab recipe name")
    p.add_argument("script_args", nargs=argparse.REMAINDER,
                   help="the script's own arguments (a recipe's: see its argparse parser), passed on as typed")
    p.set_defaults(func=_launch)


def _launch(args):
    try:
        launch.run(args.script, world_size=args.world_size, master_port=args.master_port, include=args.include,
                   stream="all" if args.verbose else None, timeout=args.timeout, run_dir=args.run_dir,
                   script_args=args.script_args, hang_timeout=args.hang_timeout)
    except launch.LaunchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0
