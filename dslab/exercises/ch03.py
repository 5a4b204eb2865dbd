"""Chapter 03 (gradient accumulation): the accumulation arithmetic, a fixed loop, a per-token loss.

Solutions: notebooks/solutions/03_solutions.py."""
from dslab.accumulation import (big_batch_backward, count_targets, equivalent, grads, small_lm, split,
                                token_batch)
from dslab.exercises import Mistake, exercise, expect


# 03.grad_accum_steps: train_batch_size 512 on 16 ranks with a micro batch of 4.
expect("03.grad_accum_steps", 512 // (4 * 16), wrong=(32, 128, 2),
       hint="train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps x world_size; "
            "solve for gradient_accumulation_steps (every rank runs its own micro-batches).")


def _window_grads(fn, lengths=None):
    """Gradients `fn(model, micro_batches)` leaves over a 4-micro-batch window, and the big batch's."""
    model = small_lm(seed=0)
    batch = token_batch(8, 16, model.config.vocab_size, lengths=lengths, seed=3)
    big_batch_backward(model, batch)
    want = grads(model)
    model.zero_grad(set_to_none=True)
    fn(model, split(batch, 4))
    return grads(model), want


def _sum_losses(model, micro_batches):
    for mb in micro_batches:
        model(**mb).loss.backward()


def _divide_by_rows(model, micro_batches):
    for mb in micro_batches:
        (model(**mb).loss / mb["input_ids"].shape[0]).backward()


def _mean_of_means(model, micro_batch, window_targets):
    return model(**micro_batch).loss / 4


def _sum_of_token_losses(model, micro_batch, window_targets):
    return model(**micro_batch).loss * count_targets(micro_batch)


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


@exercise("03.fix_loop", wrong=(_sum_losses, _divide_by_rows, _zero_grad_each_time),
          hint="write fn(model, micro_batches) that runs forward and backward on each micro-batch so the "
               "summed .grad equals the big batch's: what must each micro-batch's loss be divided by?")
def _check_fix_loop(fn):
    if not callable(fn):
        raise Mistake("answer with the function itself: answer = my_loop")
    got, want = _window_grads(fn)
    if not got:
        raise Mistake("no parameter has a gradient: call backward() on each micro-batch's loss")
    if set(got) == set(want) and equivalent(got, want):
        return True
    k = 4
    s = _multiple_of_reference(got, want) if set(got) == set(want) else None
    if s is not None and abs(s - k) < 1e-3:
        raise Mistake(f"you summed: .grad holds {k} x the big batch's gradient (each micro-batch's mean loss, "
                      f"added {k} times). Divide each loss by the number of micro-batches, len(micro_batches) "
                      "(DeepSpeed's engine.backward divides by gradient_accumulation_steps for you)")
    if s is not None and abs(s - 1 / k) < 1e-4:
        raise Mistake(f"the gradient is 1/{k} of the big batch's: you divided by the number of micro-batches twice")
    if s is not None:
        raise Mistake(f"your gradient is {s:.3g} x the big batch's: divide each micro-batch's mean loss by the "
                      f"number of micro-batches ({k}), not by the rows or tokens of a micro-batch")
    last = small_lm(seed=0)
    mb = split(token_batch(8, 16, last.config.vocab_size, seed=3), 4)[-1]
    (last(**mb).loss / k).backward()
    if set(got) == set(grads(last)) and equivalent(got, grads(last)):
        raise Mistake("only the last micro-batch's gradient is left in .grad: zero_grad() inside the loop erased "
                      "the others. Zero the gradients once per window, before the first micro-batch")
    raise Mistake("the gradients differ from the big batch's: run forward and backward once per micro-batch, "
                  "each loss divided by len(micro_batches)")


@exercise("03.token_loss", wrong=(_mean_of_means, _sum_of_token_losses),
          hint="the big batch averages over every target token of the window; each micro-batch should "
               "contribute (sum of its token losses) / window_targets. HF models take num_items_in_batch=.")
def _check_token_loss(fn):
    lengths = [16, 3, 16, 9, 5, 16, 12, 7]     # padded rows: micro-batches hold different token counts

    def loop(model, micro_batches):
        window_targets = sum(count_targets(mb) for mb in micro_batches)
        for mb in micro_batches:
            fn(model, mb, window_targets).backward()

    got, want = _window_grads(loop, lengths)
    if set(got) == set(want) and equivalent(got, want):
        return True
    means, _ = _window_grads(lambda model, mbs: [(model(**mb).loss / len(mbs)).backward() for mb in mbs], lengths)
    if set(got) == set(means) and equivalent(got, means):
        raise Mistake("you averaged per micro-batch (mean of means): a token in a micro-batch with few target "
                      "tokens weighs more than one in a full micro-batch. Divide each micro-batch's sum of token "
                      "losses by window_targets")
    raise Mistake("the gradients differ from the big batch's: each micro-batch should give (sum of its token "
                  "losses) / window_targets; HF causal LMs do it with num_items_in_batch=window_targets")
