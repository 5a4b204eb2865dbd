"""Which all-gathers ZeRO-3 runs to fetch parameters in one step, replayed from the model's module order.

DeepSpeed 0.19.8 (partitioned_param_coordinator.py) records the order in which modules run in the first step;
from the second on, each module's hook fetches the parameters it is missing, then prefetches the next ones in
that order, up to stage3_prefetch_bucket_size elements per all-gather (and stage3_max_live_parameters in
memory). After a module runs, its parameters are freed unless they come back within stage3_max_reuse_distance
elements of the trace or the prefetcher already looked past their next use. fetch_calls() replays these rules
on a trace of forward module order, then backward in reverse. Checked against DeepSpeed's comms log on the
course's Qwen2 shapes: the same all-gather calls, message for message, for prefetch buckets from 0 to the
whole model and reuse distances 0 and 1e9 (with a small stage3_max_live_parameters it was one call off).

The first step after deepspeed.initialize has no recorded order yet, so nothing is prefetched and every module's
parameters are released right after it runs: each module gathers its own in forward and again in backward
(first_step_fetches). Before that, the forward's first hook (reset_step) checks that every rank recorded the same
module order, still empty: TRACE_CHECK.
"""
import collections

# reset_step -> assert_ints_same_as_other_ranks(order): broadcasts the list's length (one int64) from rank 0, then
# the list itself, which in the first step is empty: (what, elements, dtype) as the comms logger records them.
TRACE_CHECK = (("the recorded module order's length (still 0)", 1, "int64"),
               ("the recorded module order (still empty)", 0, "int64"))


def model_trace(shape=None):
    """{"numels", "modules"} of a dslab-tiny-shaped model: parameter sizes in model.parameters() order, and for
    each module in the order its forward runs, the indexes of its own parameters (shared ones included).

    The model is built and run on the meta device: shapes only, no memory, no weights.
    """
    import torch
    from transformers import AutoModelForCausalLM

    from dslab.models.loading import tiny_config

    with torch.device("meta"):
        net = AutoModelForCausalLM.from_config(tiny_config(**(shape or {})))
    order = []
    for module in net.modules():
        module.register_forward_pre_hook(lambda mod, args, m=module: order.append(m))
    with torch.device("meta"):
        net(input_ids=torch.zeros(1, 2, dtype=torch.long))
    index = {id(p): i for i, p in enumerate(net.parameters())}
    modules = [sorted(index[id(p)] for _, p in m.named_parameters(recurse=False)) for m in order]
    return {"numels": [p.numel() for p in net.parameters()], "modules": modules}


def plain_trace(numels):
    """A trace for a bare parameter list: each parameter its own module, run in parameter order."""
    return {"numels": list(numels), "modules": [[i] for i in range(len(numels))]}


def ready_order(trace):
    """Parameter indexes in the order their gradients become ready: the reverse of their first use in forward."""
    first = {}
    for step, params in enumerate(trace["modules"]):
        for p in params:
            first.setdefault(p, step)
    unused = [p for p in range(len(trace["numels"])) if p not in first]
    return sorted(first, key=lambda p: -first[p]) + unused


def persistent(trace, threshold):
    """Indexes of the parameters ZeRO-3 keeps whole on every rank: those of at most `threshold` elements."""
    return {i for i, n in enumerate(trace["numels"]) if n <= threshold}


def fetch_calls(trace, prefetch_bucket_size, max_reuse_distance, max_live_parameters=10**9, keep=()):
    """The parameter all-gathers of one fwd+bwd in the steady state: a list of calls, each a list of indexes.

    keep: persistent parameter indexes, never fetched.
    """
    numels = trace["numels"]
    steps = [[p for p in params if p not in keep] for params in trace["modules"]]
    steps = steps + steps[::-1]  # backward visits the modules in reverse
    queue = collections.deque((p, step) for step, params in enumerate(steps) for p in params)
    next_use_seen = collections.defaultdict(lambda: -1)  # the latest use the prefetcher has looked at
    available, n_available, calls = set(), 0, []
    for step, params in enumerate(steps):
        missing = [p for p in params if p not in available]
        if missing:  # fetch what this module needs now
            calls.append(missing)
            available.update(missing)
            n_available += sum(numels[p] for p in missing)
        # pop this module's own entries off the trace queue
        expected = {p for p in params if next_use_seen[p] < step}
        popped = set()
        while queue and len(popped) < len(expected):
            p, at = queue.popleft()
            next_use_seen[p] = at
            popped.add(p)
        # prefetch the next parameters in the trace, up to the bucket (and the live-parameter budget)
        budget, numel, prefetch = min(max_live_parameters - n_available, prefetch_bucket_size), 0, []
        while queue and numel < budget:
            p, at = queue.popleft()
            next_use_seen[p] = max(next_use_seen[p], at)
            if p not in available and p not in prefetch:
                prefetch.append(p)
                numel += numels[p]
        if prefetch:
            calls.append(prefetch)
            available.update(prefetch)
            n_available += numel
        # release: not if the prefetcher saw a later use, nor if one comes within max_reuse_distance elements
        release = {p for p in params if next_use_seen[p] <= step + 1}
        traversed = 0
        for later in steps[step + 1:]:
            if traversed >= max_reuse_distance:
                break
            for p in later:
                release.discard(p)
                traversed += numels[p]
        for p in release & available:
            available.discard(p)
            n_available -= numels[p]
    return calls


def first_step_fetches(trace, keep=()):
    """ZeRO-3's parameter all-gathers in the first step: one per module, in forward and again in backward (lists of
    parameter indexes; keep: the persistent ones, never gathered)."""
    return fetch_calls(trace, prefetch_bucket_size=0, max_reuse_distance=0, keep=keep)
