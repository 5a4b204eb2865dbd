"""Chapter 00 (setup): how many ranks a hostfile makes, and how they are numbered.

Solutions: notebooks/solutions/00_solutions.py."""
from dslab.exercises import expect

# ---- Chapter 00: setup -------------------------------------------------------------------------
# A hostfile with 3 machines, slots=2 each; `deepspeed --hostfile hostfile train.py` run once, on one machine.
expect("00.world_size", 6,
       wrong=((1, "1 is the one command you typed: the launcher starts a process per slot on every machine of the "
                  "hostfile, and each process is a rank"),
              (2, "2 is the ranks of one machine (its slots): the launcher starts them on all 3 machines"),
              (3, "3 is the number of machines: each runs one process per slot, 2 of them"),
              (4, "4 leaves out the machine you launched from: it is in the hostfile, so it runs its 2 ranks too")),
       hint="the launcher is run once, but it starts one process per slot on every machine of the hostfile, "
            "and every process is one rank: machines x slots per machine.")
expect("00.global_rank", 5,
       wrong=((1, "1 is the local rank, its place on its own machine: the global rank also counts every process of "
                  "the machines before it"),
              (2, "2 is the node rank (the machine's number): the global rank counts processes, 2 per machine"),
              (4, "4 is the process with local rank 0 on machine 2: local rank 1 comes after it"),
              (6, "6 counts from 1: ranks start at 0, so machine 2 holds ranks 4 and 5")),
       hint="ranks are numbered machine by machine, in hostfile order: node_rank x slots_per_machine + local_rank.")
