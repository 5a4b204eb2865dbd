"""The `dslab` command: one sub-command per step of the course (env, config, sft, merge, infer, ...)."""
import argparse

from dslab import messages
from dslab.cli import launch, models, preflight, sft, workshop

# Each command group defines add_commands(subparsers); every parser it adds sets `func`, a callable taking the
# parsed args and returning the exit status. Library modules hold no argparse: the command line lives here only.
COMMAND_GROUPS = (preflight, launch, models, sft, workshop)


def build_parser():
    """The `dslab` parser with every sub-command."""
    parser = argparse.ArgumentParser(prog="dslab", description="dslab: a hands-on DeepSpeed course kit")
    parser.add_argument("--lang", choices=messages.LANGUAGES, default=None,
                        help="language of dslab's messages (default: Chinese when the locale is zh_*, else English)")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for group in COMMAND_GROUPS:
        group.add_commands(subparsers)
    return parser


def main(argv=None):
    """Entry point of the console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.lang:
        messages.set_language(args.lang)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)
