"""Chapter 00 (setup): how many ranks a hostfile makes, and how they are numbered.

Solutions: notebooks/solutions/00_solutions.py."""
from dslab.exercises import expect

# ---- Chapter 00: setup -------------------------------------------------------------------------
# A hostfile with 3 machines, slots=2 each; `deepspeed --hostfile hostfile train.py` run once, on one machine.
expect("00.world_size", 6, wrong=(1, 2, 3, 4),
       hint="the launcher is run once, but it starts one process per slot on every machine of the hostfile, "
            "and every process is one rank: machines x slots per machine.")
expect("00.global_rank", 5, wrong=(1, 2, 4, 6),
       hint="ranks are numbered machine by machine, in hostfile order: node_rank x slots_per_machine + local_rank.")
