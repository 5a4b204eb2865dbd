"""`python -m dslab.launch guard SPEC`: the guard process that dslab.launch.guard.start_guard starts (not a command
for people: the `dslab launch` command is dslab.cli.launch)."""
import json
import sys

from dslab.launch.guard import watch

if sys.argv[1:2] == ["guard"]:
    watch(json.loads(sys.argv[2]))
