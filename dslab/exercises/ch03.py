"""Chapter 03 (gradient accumulation): the accumulation arithmetic, a fixed loop, a per-token loss, and a whole
DeepSpeed run with accumulation, written by the learner and run on 2 and 3 ranks.

Solutions: notebooks/solutions/03_solutions.py."""
import random

from dslab import compat
from dslab.training.accumulation import (accumulate_backward, big_batch_backward, count_targets, equivalent, grads,
                                         small_lm, split, token_batch)
from dslab.exercises import Mistake, engine_loop, exercise, expect, loops, references


# 03.grad_accum_steps: train_batch_size 512 on 16 ranks with a micro batch of 4.
expect("03.grad_accum_steps", 512 // (4 * 16),
       wrong=((32, "32 = 512 / 16 is what each rank takes per optimizer step: divide that by the micro batch, 4"),
              (128, "128 = 512 / 4 leaves out the 16 ranks: each rank runs its own micro-batches, so "
                    "train_batch_size = micro batch x accumulation steps x world size"),
              (2048, "2048 multiplies where it should divide: gradient_accumulation_steps = train_batch_size / "
                     "(micro batch x world size)"),
              (64, "64 = 4 x 16 is what one micro-step takes on all the ranks together: how many of those make 512?"),
              (1, "with 1 accumulation step, 16 ranks of 4 samples make 64 samples per step, not 512")),
       hint="train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps x world_size; "
            "solve for gradient_accumulation_steps (every rank runs its own micro-batches).")


def _draw_window(rng=None, ks=(3, 5, 6), rows=(2,)):
    """A window drawn now: k micro-batches (not the chapter's 4) of `rows` rows (never k nor 4, so that dividing by
    the rows tells apart from dividing by k), a sequence length and a seed."""
    rng = rng or random.SystemRandom()
    return {"k": rng.choice(ks), "rows": rng.choice(rows), "seq_len": rng.randint(8, 16),
            "seed": rng.randrange(1 << 30)}


class _Passes:
    """What a loop does with the model, seen from the model: the rows of each forward pass that autograd records,
    and how many of those forwards each backward pass reaches (the same graph task: one backward call)."""

    def __init__(self, model):
        self.rows, self.reached = [], {}
        self._handle = model.register_forward_hook(self._forward, with_kwargs=True)

    def _forward(self, module, args, kwargs, output):
        import torch

        ids = kwargs.get("input_ids", args[0] if args else None)
        logits = getattr(output, "logits", None)
        if not torch.is_grad_enabled() or not torch.is_tensor(ids) or logits is None or not logits.requires_grad:
            return
        self.rows.append(int(ids.shape[0]))
        logits.register_hook(self._backward)

    def _backward(self, grad):
        task = compat.autograd_graph_task_id()
        self.reached[task] = self.reached.get(task, 0) + 1

    def remove(self):
        self._handle.remove()


def _window_grads(fn, window, lengths=None, passes=None):
    """Gradients `fn(model, micro_batches)` leaves over a window of window["k"] micro-batches, and the big batch's;
    `passes` (a list) receives what _Passes saw of fn's forward and backward passes."""
    model = small_lm(seed=0)
    batch = token_batch(window["k"] * window["rows"], window["seq_len"], model.config.vocab_size, lengths=lengths,
                        seed=window["seed"])
    big_batch_backward(model, batch)
    want = grads(model)
    model.zero_grad(set_to_none=True)
    seen = _Passes(model)
    try:
        fn(model, split(batch, window["k"]))
    finally:
        seen.remove()
    if passes is not None:
        passes.append(seen)
    return grads(model), want


def _no_accumulation(seen, window):
    """The Mistake of a loop that does not accumulate: one forward over more rows than a micro-batch holds (the
    micro-batches concatenated), or one backward through several micro-batches' graphs (their losses summed first).
    Either holds the big batch's activations at once, what accumulation exists to avoid, whatever the gradient."""
    k, rows = window["k"], window["rows"]
    if seen.rows and max(seen.rows) > rows:
        return Mistake(f"no accumulation: one forward pass over {max(seen.rows)} rows, but each of the {k} "
                       f"micro-batches holds {rows}. Concatenated micro-batches are the big batch itself, with its "
                       "activation memory, which is what accumulation avoids. Run forward and backward on each "
                       "micro-batch in turn, each loss / len(micro_batches)")
    if seen.reached and max(seen.reached.values()) > 1:
        return Mistake(f"one backward through {max(seen.reached.values())} micro-batches: their losses were added "
                       "up and back-propagated once, which keeps every micro-batch's graph (its activations) alive "
                       "until then, the memory of the big batch that accumulation avoids. Call backward on each "
                       "micro-batch's loss / len(micro_batches) as soon as it is computed")
    return None


def _concatenated(model, micro_batches):
    import torch

    window = {key: torch.cat([mb[key] for mb in micro_batches]) for key in micro_batches[0]}
    model(**window).loss.backward()                 # the big batch itself: no accumulation


def _summed_then_backward(model, micro_batches):
    total = sum(model(**mb).loss for mb in micro_batches) / len(micro_batches)
    total.backward()                                # one backward: every micro-batch's graph alive until here


def _sum_losses(model, micro_batches):
    for mb in micro_batches:
        model(**mb).loss.backward()


def _divide_by_rows(model, micro_batches):
    for mb in micro_batches:
        (model(**mb).loss / mb["input_ids"].shape[0]).backward()


def _divide_by_four(model, micro_batches):
    for mb in micro_batches:
        (model(**mb).loss / 4).backward()          # the chapter's number of micro-batches, hard-coded


def _mean_of_means(model, micro_batch, window_targets):
    return model(**micro_batch).loss / 4


def _sum_of_token_losses(model, micro_batch, window_targets):
    return model(**micro_batch).loss * count_targets(micro_batch)


def _fixed_window_targets(model, micro_batch, window_targets):
    return model(**micro_batch).loss * count_targets(micro_batch) / 76   # one window's count, hard-coded


def _zero_grad_each_time(model, micro_batches):
    for mb in micro_batches:
        model.zero_grad()                           # erases the micro-batches before this one
        (model(**mb).loss / len(micro_batches)).backward()


def _multiple_of_reference(got, want):
    """s if got == s x want for one number s (to float32 rounding), else None."""
    import torch
    g = torch.cat([got[n].flatten() for n in want])
    w = torch.cat([want[n].flatten() for n in want])
    s = float(g @ w / (w @ w))
    return s if (g - s * w).norm() <= 1e-5 * g.norm() else None


@exercise("03.fix_loop",
          wrong=((_sum_losses, "you summed"), (_divide_by_rows, "not by the rows or tokens"),
                 (_zero_grad_each_time, "zero_grad() inside the loop"), (_divide_by_four, "you divided by 4"),
                 (_concatenated, "no accumulation: one forward pass over"),
                 (_summed_then_backward, "one backward through")),
          hint="write fn(model, micro_batches) that runs forward and backward on each micro-batch so the "
               "summed .grad equals the big batch's: what must each micro-batch's loss be divided by?")
def _check_fix_loop(fn):
    if not callable(fn):
        raise Mistake("answer with the function itself: answer = my_loop")
    window = _draw_window()
    k = window["k"]
    passes = []
    got, want = _window_grads(fn, window, passes=passes)
    if not got:
        raise Mistake("no parameter has a gradient: call backward() on each micro-batch's loss")
    mistake = _no_accumulation(passes[0], window)
    if mistake is not None:
        raise mistake
    if set(got) == set(want) and equivalent(got, want):
        leaned = references.leaned_on(fn, (accumulate_backward,))
        if leaned:
            raise Mistake(f"your loop hands the work to {leaned}, the chapter's own loop (printed at the start of "
                          "the chapter): write the loop itself, forward and backward on each micro-batch in turn, "
                          "each loss / len(micro_batches)")
        return True
    s = _multiple_of_reference(got, want) if set(got) == set(want) else None
    if s is not None and abs(s - k) < 1e-3:
        raise Mistake(f"you summed: .grad holds {k} x the big batch's gradient (each micro-batch's mean loss, "
                      f"added {k} times). Divide each loss by the number of micro-batches, len(micro_batches) "
                      "(DeepSpeed's engine.backward divides by gradient_accumulation_steps for you)")
    if s is not None and abs(s - 1 / k) < 1e-4:
        raise Mistake(f"the gradient is 1/{k} of the big batch's: you divided by the number of micro-batches twice")
    if s is not None and abs(s - k / 4) < 1e-3:
        raise Mistake(f"you divided by 4, the chapter's number of micro-batches, but this window has {k}: divide "
                      "by len(micro_batches)")
    if s is not None:
        raise Mistake(f"your gradient is {s:.3g} x the big batch's: divide each micro-batch's mean loss by the "
                      f"number of micro-batches ({k} here), not by the rows or tokens of a micro-batch")
    last = small_lm(seed=0)
    mb = split(token_batch(k * window["rows"], window["seq_len"], last.config.vocab_size, seed=window["seed"]), k)[-1]
    (last(**mb).loss / k).backward()
    if set(got) == set(grads(last)) and equivalent(got, grads(last)):
        raise Mistake("only the last micro-batch's gradient is left in .grad: zero_grad() inside the loop erased "
                      "the others. Zero the gradients once per window, before the first micro-batch")
    raise Mistake("the gradients differ from the big batch's: run forward and backward once per micro-batch, "
                  "each loss divided by len(micro_batches)")


@exercise("03.token_loss",
          wrong=((_mean_of_means, "mean of means"), (_sum_of_token_losses, "not divided by window_targets"),
                 (_fixed_window_targets, "a number fixed in your code")),
          hint="the big batch averages over every target token of the window; each micro-batch should "
               "contribute (sum of its token losses) / window_targets. HF models take num_items_in_batch=.")
def _check_token_loss(fn):
    if not callable(fn):
        raise Mistake("answer with the function itself: answer = my_micro_loss")
    rng = random.SystemRandom()
    window = _draw_window(rng, ks=(3, 4, 5), rows=(2, 3))
    # padded rows of random lengths: micro-batches hold different numbers of target tokens
    lengths = [rng.randint(2, window["seq_len"]) for _ in range(window["k"] * window["rows"])]
    targets = []

    def loop(model, micro_batches):
        window_targets = sum(count_targets(mb) for mb in micro_batches)
        targets.append(window_targets)
        for mb in micro_batches:
            fn(model, mb, window_targets).backward()

    got, want = _window_grads(loop, window, lengths)
    if set(got) == set(want) and equivalent(got, want):
        return True
    means, _ = _window_grads(lambda model, mbs: [(model(**mb).loss / len(mbs)).backward() for mb in mbs], window,
                             lengths)
    s = _multiple_of_reference(got, means) if set(got) == set(means) else None
    if s is not None:
        raise Mistake("you averaged per micro-batch (a mean of means): a token in a micro-batch with few target "
                      "tokens weighs more than one in a full micro-batch. Divide each micro-batch's sum of token "
                      "losses by window_targets")
    s = _multiple_of_reference(got, want) if set(got) == set(want) else None
    if s is not None and abs(s - targets[0]) <= 1e-3 * targets[0]:
        raise Mistake(f"your gradient is {targets[0]} x the big batch's: the sum of the token losses, not divided by "
                      "window_targets")
    if s is not None:
        raise Mistake(f"your gradient is {s:.3g} x the big batch's: this window has {targets[0]} target tokens. "
                      "Divide each micro-batch's sum of token losses by window_targets, the argument: a number fixed "
                      "in your code is not this window's count")
    raise Mistake("the gradients differ from the big batch's: each micro-batch should give (sum of its token "
                  "losses) / window_targets; HF causal LMs do it with num_items_in_batch=window_targets")


# 03.engine_loop: the learner writes make_model, make_config and train (dslab/exercises/engine_loop.py says how they
# are called); the checker runs them on 2 and 3 launched ranks and compares the gradient at each accumulation boundary
# and the weights with plain PyTorch. The wrong answers below are the right three functions with one mistake each
# (loss.backward() is one only at ZeRO stage 0: at stages 1-3 DeepSpeed hooks the engine's output and it is right).
def _config_without_accumulation(micro_batch_size, grad_accum_steps, world_size, lr):
    # one micro-batch per optimizer step
    return loops.config(micro_batch_size, 1, world_size, lr, gradient_accumulation_steps=None)


def _config_for_two_ranks(micro_batch_size, grad_accum_steps, world_size, lr):
    return loops.config(micro_batch_size, grad_accum_steps, 2, lr)                 # the chapter's world size


def _config_without_world(micro_batch_size, grad_accum_steps, world_size, lr):
    return loops.config(micro_batch_size, grad_accum_steps, world_size, lr,
                        train_batch_size=micro_batch_size * grad_accum_steps)


def _config_clipping_by_default(micro_batch_size, grad_accum_steps, world_size, lr):
    return loops.config(micro_batch_size, grad_accum_steps, world_size, lr, gradient_clipping=None)  # 1.0


def _config_zero0(micro_batch_size, grad_accum_steps, world_size, lr):
    return loops.config(micro_batch_size, grad_accum_steps, world_size, lr, zero={"stage": 0})


_RIGHT = (loops.small_model, loops.config)
ENGINE_LOOP_WRONG = (
    ((loops.small_model, _config_without_accumulation, loops.train), "no accumulation boundary"),
    ((*_RIGHT, loops.with_mistake("loss divided")), "the loss is divided twice"),
    ((*_RIGHT, loops.with_mistake("optimizer step")), "optimizer stepped outside the engine"),
    ((*_RIGHT, loops.with_mistake("zero_grad")), "zero_grad fighting the engine"),
    ((loops.small_model, _config_for_two_ranks, loops.train), "takes the world size as 2"),
    ((loops.small_model, _config_without_world, loops.train), "leaves out the world size"),
    ((loops.small_model, _config_zero0, loops.with_mistake("loss.backward")), "loss.backward() at ZeRO stage 0"),
    ((*_RIGHT, loops.with_mistake("no gas scaling")), "engine.backward(loss, scale_wrt_gas=False) does not divide"),
    ((*_RIGHT, loops.with_mistake("step at boundary")), "call it after every micro-batch"),
    ((loops.small_model, _config_clipping_by_default, loops.train), "gradient_clipping is 1.0"),
)


@exercise("03.engine_loop", wrong=ENGINE_LOOP_WRONG,
          prepare=lambda answers: engine_loop.prepare(answers, "accumulate"),
          hint="write make_model(d_in, d_out), make_config(micro_batch_size, grad_accum_steps, world_size, lr) and "
               "train(model, ds_config, micro_batches), then answer = (make_model, make_config, train)")
def _check_engine_loop(answer):
    return engine_loop.check(answer, "accumulate")
