"""Rounding noise: checked against a bound and shown as that bound, never as its value.

Two computations that should agree (one process and two ranks, accumulation and one big batch, a merged model and
base + adapter) still differ by rounding, and by how much depends on the CPU's kernels: 2.8e-09 on one machine,
3.1e-09 on another. Printed, such a value is a number no other machine reproduces; the bound the code checks is the
claim. So chapters print `noise.bound(diff, 1e-6)`, which checks the value and shows "<= 1e-06".
"""


def bound(value, limit):
    """"<= limit" (as text) once `value` is checked to be within it; raises ValueError naming both if it is not."""
    if not abs(value) <= limit:
        raise ValueError(f"{value:.3g} is above {limit:g}: more than rounding noise")
    return f"<= {limit:g}"
