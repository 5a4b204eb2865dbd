"""Pipeline parallelism: the model as a list of layers, DeepSpeed's 1F1B schedule, and the bubble it leaves.

The layers (`Embed`, `Block`, `Head`) are dslab-tiny's pieces without attention: the token embedding, Qwen2's
RMSNorm + SwiGLU MLP as a residual block, and the output head. A learner lists them as LayerSpecs for
`deepspeed.pipe.PipelineModule` (chapter 11's exercise 11.pipeline); each stage builds only its own.
`sequential_twin` builds the same layers with the same weights in one process (the plain PyTorch reference the
checker compares with). `schedule` reads the instructions DeepSpeed's `TrainSchedule` gives each stage; `Busy` is a
stage that takes a fixed time, and `time_busy_stages` times DeepSpeed's schedule with it where CPU ranks share cores.
Everything here runs on a rank or in the kernel alike.
"""
import time

import torch

BASE_SEED = 0   # PipelineModule(seed_layers=True, base_seed=BASE_SEED): layer i is built after seeding BASE_SEED + i


def _qwen2_config(hidden_size, intermediate_size):
    from transformers import Qwen2Config

    return Qwen2Config(hidden_size=hidden_size, intermediate_size=intermediate_size, hidden_act="silu")


class Embed(torch.nn.Module):
    """Token ids [batch, seq] -> hidden states [batch, seq, hidden]."""

    def __init__(self, vocab_size, hidden_size):
        super().__init__()
        self.tokens = torch.nn.Embedding(vocab_size, hidden_size)

    def forward(self, input_ids):
        return self.tokens(input_ids)


class Block(torch.nn.Module):
    """h + MLP(RMSNorm(h)): the feed-forward half of a Qwen2 decoder layer, Qwen2's own modules."""

    def __init__(self, hidden_size, intermediate_size):
        from transformers.models.qwen2.modeling_qwen2 import Qwen2MLP, Qwen2RMSNorm

        super().__init__()
        self.norm = Qwen2RMSNorm(hidden_size, eps=1e-6)
        self.mlp = Qwen2MLP(_qwen2_config(hidden_size, intermediate_size))

    def forward(self, hidden):
        return hidden + self.mlp(self.norm(hidden))


class Head(torch.nn.Module):
    """Hidden states -> logits [batch, seq, vocab] (final RMSNorm, then the output projection)."""

    def __init__(self, hidden_size, vocab_size):
        from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

        super().__init__()
        self.norm = Qwen2RMSNorm(hidden_size, eps=1e-6)
        self.out = torch.nn.Linear(hidden_size, vocab_size, bias=False)

    def forward(self, hidden):
        return self.out(self.norm(hidden))


def tiny_layers(blocks=4, vocab_size=10240, hidden_size=256, intermediate_size=688, seed=BASE_SEED):
    """dslab-tiny's pieces in order, built in this process: Embed, `blocks` Blocks, Head (torch.nn.Sequential)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(Embed(vocab_size, hidden_size),
                               *[Block(hidden_size, intermediate_size) for _ in range(blocks)],
                               Head(hidden_size, vocab_size))


def lm_loss(logits, labels):
    """Next-token cross-entropy: the logits at position t predict the token at t + 1 (as HF's causal LMs do)."""
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1))


def sequential_twin(specs, base_seed=BASE_SEED):
    """The LayerSpecs built in one process, in order, as torch.nn.Sequential: the same weights as the pipeline's.

    PipelineModule(seed_layers=True) seeds layer i with base_seed + i before building it (deepspeed/runtime/pipe/
    module.py, via ds_utils.set_random_seed); doing the same here gives every layer the weights its stage built.
    """
    from deepspeed.runtime.utils import set_random_seed

    layers = []
    for index, spec in enumerate(specs):
        set_random_seed(base_seed + index)
        layers.append(spec.build())
    return torch.nn.Sequential(*layers)


def train_one_process(model, steps_of_micro_batches, lr, loss_fn=lm_loss):
    """Plain PyTorch: per step, backward of loss / m for each of its m micro-batches, then AdamW.

    Returns the per-step losses as DeepSpeed's pipeline reports them: the sum of the micro-batch losses / m.
    """
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    for micro_batches in steps_of_micro_batches:
        total = torch.zeros(())
        for inputs, labels in micro_batches:
            loss = loss_fn(model(inputs), labels)
            (loss / len(micro_batches)).backward()   # the engine scales each micro-batch's loss by 1/m
            total += loss.detach()
        optimizer.step()
        optimizer.zero_grad()
        losses.append((total / len(micro_batches)).item())
    return losses


# --------------------------------------------------------------------------------------------- the schedule

def schedule(micro_batches, stages):
    """{stage: [[instruction names of step 0], [step 1], ...]} from DeepSpeed's TrainSchedule (the 1F1B schedule).

    A name carries its micro-batch where it computes: "F2" / "B2" (forward / backward of micro-batch 2).
    """
    from deepspeed.runtime.pipe.schedule import BackwardPass, ForwardPass, TrainSchedule

    out = {}
    for stage in range(stages):
        steps, done = [], {"F": 0, "B": 0}
        for cmds in TrainSchedule(micro_batches=micro_batches, stages=stages, stage_id=stage).steps():
            names = []
            for cmd in cmds:
                if isinstance(cmd, (ForwardPass, BackwardPass)):
                    # a stage runs the forwards in micro-batch order, and the backwards too: count them
                    kind = "F" if isinstance(cmd, ForwardPass) else "B"
                    names.append(f"{kind}{done[kind]}")
                    done[kind] += 1
                else:
                    names.append(type(cmd).__name__)
            steps.append(names)
        out[stage] = steps
    return out


def computes(step):
    """True if a schedule step (a list of instruction names) runs a forward or a backward pass."""
    return any(name[0] in "FB" and name[1:].isdigit() for name in step)


def in_flight(micro_batches, stages):
    """{stage: the most micro-batches it has run forward and not yet backward at once}, counted in DeepSpeed's
    schedule: the activations a stage must keep. 1F1B gives stage s min(p - s, m); DeepSpeed allocates
    max(2, that) activation buffers (TrainSchedule.num_pipe_buffers)."""
    out = {}
    for stage, steps in schedule(micro_batches, stages).items():
        open_now = most = 0
        for step in steps:
            for name in step:
                if computes([name]):
                    open_now += 1 if name[0] == "F" else -1
                    most = max(most, open_now)
        out[stage] = most
    return out


def bubble_fraction(micro_batches, stages):
    """The share of a stage's time slots with nothing to compute in a 1F1B (or GPipe) step: (p - 1) / (m + p - 1)."""
    return (stages - 1) / (micro_batches + stages - 1)


def schedule_bubble(micro_batches, stages):
    """Idle share of each stage, counted in DeepSpeed's schedule: steps without compute / all steps."""
    steps = schedule(micro_batches, stages)
    return {stage: sum(not computes(s) for s in st) / len(st) for stage, st in steps.items()}


def bubble_table(stages=(2, 4, 8), micro_batches=(1, 4, 8, 16, 32)):
    """Rows {"micro-batches", "2 stages", ...}: each stage's idle share, counted in DeepSpeed's schedule."""
    rows = []
    for m in micro_batches:
        row = {"micro-batches": m}
        for p in stages:
            row[f"{p} stages"] = round(max(schedule_bubble(m, p).values()), 3)
        rows.append(row)
    return rows


def schedule_table(micro_batches=4, stages=2):
    """Rows {"step", "stage 0", "stage 1", ...}: what each stage computes at each step ("" when it waits)."""
    steps = schedule(micro_batches, stages)
    rows = []
    for step_id in range(len(steps[0])):
        row = {"step": step_id}
        for stage in range(stages):
            row[f"stage {stage}"] = " ".join(n for n in steps[stage][step_id] if computes([n]))
        rows.append(row)
    return rows


def schedule_chart(micro_batches=4, stages=2):
    """A timeline of the 1F1B schedule (one row per stage, one box per step); returns (Figure, schedule_table rows).

    Each box is one schedule step; forward and backward drawn the same width (on a real model a backward
    takes about twice a forward). Empty slots are the bubble.
    """
    from dslab import plots

    plt = plots.pyplot()
    rows = schedule_table(micro_batches, stages)
    fig, ax = plt.subplots(figsize=(0.55 * len(rows) + 1.5, 0.6 * stages + 1.0))
    for row in rows:
        for stage in range(stages):
            text = row[f"stage {stage}"]
            color = "#cfe3f7" if text.startswith("F") else "#f7d9c4" if text.startswith("B") else "#f2f2f2"
            ax.add_patch(plt.Rectangle((row["step"], stages - 1 - stage), 0.95, 0.9, color=color))
            ax.text(row["step"] + 0.47, stages - 1 - stage + 0.45, text, ha="center", va="center", fontsize=8)
    ax.set_xlim(0, len(rows))
    ax.set_ylim(0, stages)
    ax.set_yticks([stages - 1 - s + 0.45 for s in range(stages)], [f"stage {s}" for s in range(stages)])
    ax.set_xlabel("schedule step")
    bubble = bubble_fraction(micro_batches, stages)
    ax.set_title(f"DeepSpeed TrainSchedule, {micro_batches} micro-batches, {stages} stages: "
                 f"{bubble:.0%} of each stage's slots idle", fontsize=9)
    fig.tight_layout()
    return fig, rows


# ------------------------------------------------------------------------------------ timing the schedule

class Wait(torch.autograd.Function):
    """Identity that sleeps `forward_s` in forward and `backward_s` in backward (a device busy computing)."""

    @staticmethod
    def forward(ctx, x, forward_s, backward_s):
        time.sleep(forward_s)
        ctx.backward_s = backward_s
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.backward_s)
        return grad, None, None


class Busy(torch.nn.Module):
    """A stage layer that takes a fixed time: a small Linear, then a wait of forward_s / backward_s seconds.

    Two CPU ranks sharing two cores with other work cannot compute at the same time reliably; a stage that waits
    instead of computing behaves like a stage with a device of its own, so the schedule's timing shows through.
    """

    def __init__(self, hidden_size, forward_s, backward_s):
        super().__init__()
        self.linear = torch.nn.Linear(hidden_size, hidden_size)
        self.forward_s, self.backward_s = forward_s, backward_s

    def forward(self, x):
        return Wait.apply(self.linear(x), self.forward_s, self.backward_s)


def time_train_batch(engine, micro_batch, micro_batches, repeats=3):
    """Seconds of the fastest of `repeats` engine.train_batch calls over `micro_batches` copies of (inputs, labels).

    Sets the engine's batch to that many micro-batches per step (engine.set_train_batch_size); call it on every
    stage, with micro-batches shaped as in training (a stage sizes its receive buffers once).
    """
    import torch.distributed as tdist

    engine.set_train_batch_size(engine.train_micro_batch_size_per_gpu() * micro_batches * engine.dp_world_size)
    best = None
    for _ in range(repeats):
        tdist.barrier()   # both stages start together
        start = time.perf_counter()
        engine.train_batch(iter([micro_batch] * micro_batches))
        took = time.perf_counter() - start
        best = took if best is None else min(best, took)
    return best


def time_busy_stages(micro_batches=(1, 2, 4, 8), stages=2, forward_s=0.030, backward_s=0.060, repeats=5):
    """Run on every rank: DeepSpeed's schedule timed on `stages` Busy layers (one per stage; with more ranks than
    stages, several pipelines side by side), train_batch for each micro-batch count, then ZeRO-2 asked of the same
    module. Returns {"seconds": {m: fastest of `repeats` train_batch calls}, "zero2_refused": DeepSpeed's message}.

    Waits of 30 + 60 ms and the fastest of 5 calls: against slots of that size the few milliseconds a loaded machine
    adds to a step (the sends, a rank waiting for a core) stay small, so the line's intercept reads as p - 1 slots.

    A refused deepspeed.initialize has already hooked the module's parameters, which is why it comes last.
    """
    import deepspeed
    from deepspeed.pipe import LayerSpec, PipelineModule

    net = PipelineModule(layers=[LayerSpec(Busy, 16, forward_s, backward_s) for _ in range(stages)],
                         num_stages=stages, loss_fn=torch.nn.functional.mse_loss)
    copies = torch.distributed.get_world_size() // stages   # data-parallel copies of the pipeline
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "train_batch_size": 4 * copies,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0, "torch_adam": True}},
              "steps_per_print": 10**6}
    engine, *_ = deepspeed.initialize(model=net, config=config)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))
    seconds = {m: time_train_batch(engine, (x, x), micro_batches=m, repeats=repeats) for m in micro_batches}
    try:
        deepspeed.initialize(model=net, config={**config, "zero_optimization": {"stage": 2}})
        refused = None
    except AssertionError as error:
        refused = str(error)
    return {"seconds": seconds, "zero2_refused": refused}


def fit_line(xs, ys):
    """Least-squares (intercept, slope) of y = intercept + slope * x."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, slope


def bubble_report(times, stages):
    """From {m: seconds per train_batch}, the fit T(m) = a + b m and each m's bubble, measured vs theory.

    b is the time one micro-batch takes a stage; a is the bubble: (p - 1) micro-batch slots in theory. The
    measured bubble at m is a / T(m) (idle share), the theory (p - 1) / (m + p - 1).
    """
    ms = sorted(times)
    intercept, slope = fit_line(ms, [times[m] for m in ms])
    rows = [{"micro_batches": m, "seconds": times[m], "measured_bubble": intercept / times[m],
             "theory_bubble": bubble_fraction(m, stages)} for m in ms]
    return {"intercept_s": intercept, "slope_s": slope, "slots": intercept / slope, "rows": rows}


def layer_costs(layers, inputs, labels, loss_fn=lm_loss, repeats=3):
    """CPU seconds of each layer's forward + backward, alone on its real input (the fastest of `repeats`).

    layers: the model as a sequence (e.g. sequential_twin); the last one gets `loss_fn(output, labels)`, the
    others a gradient of ones. CPU time, not wall time: time spent waiting for a core does not count. On one
    thread, as each rank here has: idle OpenMP threads spinning for a busy core would count as CPU time.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _layer_costs(layers, inputs, labels, loss_fn, repeats)
    finally:
        torch.set_num_threads(threads)


def _layer_costs(layers, inputs, labels, loss_fn, repeats):
    costs, hidden = [], inputs
    for index, layer in enumerate(layers):
        best = None
        for _ in range(repeats):
            x = hidden.detach().requires_grad_(hidden.is_floating_point())
            start = time.process_time()
            out = layer(x)
            if index == len(layers) - 1:
                loss_fn(out, labels).backward()
            else:
                out.backward(torch.ones_like(out))
            took = time.process_time() - start
            best = took if best is None else min(best, took)
        costs.append(best)
        with torch.no_grad():
            hidden = layer(hidden)
    return costs


def stage_parameters(module):
    """{"layers": [class names], "params": count} of what this rank's stage of a PipelineModule holds."""
    return {"layers": [type(layer).__name__ for layer in module.forward_funcs],
            "params": sum(p.numel() for p in module.parameters())}
