"""The `dslab` command: one sub-command per step of the course (env, config, sft, merge, infer, ...)."""
import argparse
import importlib
import sys

# Each module here defines add_commands(subparsers); every parser it adds sets `func`,
# a callable taking the parsed args and returning the exit status.
COMMAND_MODULES = [
    "dslab.env",
    "dslab.config",
    "dslab.launch",
    "dslab.models",
    "dslab.infer",
    "dslab.evaluate",
    "dslab.memory",
    "dslab.sft",
    "dslab.lora",
    "dslab.slides",
]


def build_parser():
    """Parser with every sub-command the installed modules provide."""
    parser = argparse.ArgumentParser(prog="dslab", description="dslab: a hands-on DeepSpeed course kit")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:  # a real missing dependency, not a module still to be written
                raise
            continue
        module.add_commands(subparsers)
    return parser


def main(argv=None):
    """Entry point of the console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
