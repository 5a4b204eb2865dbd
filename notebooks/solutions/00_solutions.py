"""Instructor solutions for notebooks/00_setup.ipynb (checked by tests/test_exercises.py)."""

machines, per_machine = 3, 2          # hostfile: 3 machines, slots=2 each; the launcher is run once

SOLUTIONS = {
    # one rank per process: 3 machines x 2 processes
    "00.world_size": machines * per_machine,
    # node_rank 2, local_rank 1: ranks 0-1 live on machine 0, 2-3 on machine 1, 4-5 on machine 2
    "00.global_rank": 2 * per_machine + 1,
}
