"""Chapter 14 (ms-swift and LLaMA-Factory): how many optimizer steps a Trainer-based framework runs.

Solutions: notebooks/solutions/14_solutions.py."""
import math
import random

from dslab.exercises import Mistake, exercise, references


def trainer_steps_reference(n_examples, per_device, world_size, grad_accum_steps, epochs):
    """Optimizer steps of the Hugging Face Trainer (swift, LLaMA-Factory): every rank gets ⌈n / world⌉ examples
    (the sampler pads), its loader keeps the short last batch, and an epoch's last accumulation window steps even
    when short (transformers' Trainer: len_dataloader // accum + (len_dataloader % accum > 0)). By the identity
    ⌈⌈a/b⌉/c⌉ = ⌈a/(bc)⌉ that is ⌈n / (per_device · world · accum)⌉ per epoch."""
    batches = math.ceil(math.ceil(n_examples / world_size) / per_device)
    return epochs * max(1, math.ceil(batches / grad_accum_steps))


def _cases(seed):
    """Sizes the learner has not seen: chapter 14's own, then random ones, including exact multiples."""
    rng = random.Random(seed)
    cases = [(236, 8, 2, 1, 12)]
    for _ in range(40):
        per_device, world, accum = rng.choice([1, 2, 4, 8, 16]), rng.choice([1, 2, 3, 4, 8]), rng.choice([1, 2, 3, 4])
        n = rng.randrange(1, 5000) if rng.random() < 0.7 else per_device * world * accum * rng.randrange(1, 50)
        cases.append((n, per_device, world, accum, rng.randrange(1, 6)))
    return cases


def _dslab_floor(n, per_device, world, accum, epochs):
    return epochs * max(1, n // world // per_device // accum)


def _no_world(n, per_device, world, accum, epochs):
    return epochs * math.ceil(n / (per_device * accum))


def _no_accumulation(n, per_device, world, accum, epochs):
    return epochs * math.ceil(n / (per_device * world))


def _ceil_over_all_epochs(n, per_device, world, accum, epochs):
    return math.ceil(n * epochs / (per_device * world * accum))


def _no_padding(n, per_device, world, accum, epochs):
    return epochs * max(1, math.ceil(math.ceil((n // world) / per_device) / accum))


def _chapter_number(n, per_device, world, accum, epochs):
    return 180


@exercise("14.trainer_steps",
          wrong=((_dslab_floor, "drops the short last batch"), (_no_world, "world size"),
                 (_no_accumulation, "accumulation"), (_ceil_over_all_epochs, "each epoch"),
                 (_chapter_number, "the same number")),
          hint="write steps(n_examples, per_device, world_size, grad_accum_steps, epochs): each rank gets its share "
               "of the examples, its data loader keeps the short last batch, and the last accumulation window of "
               "an epoch still steps.")
def _check_trainer_steps(fn):
    if not callable(fn):
        raise Mistake("answer with your function itself: answer = steps")
    cases = _cases(seed=random.randrange(1 << 30))
    got = [fn(*case) for case in cases]
    wrong = [(case, g) for case, g in zip(cases, got) if g != trainer_steps_reference(*case)]
    if not wrong:
        from dslab.training import sft_plan

        leaned = references.leaned_on(fn, (trainer_steps_reference, sft_plan.trainer_steps))
        if leaned:
            raise Mistake(f"your function gets its number from {leaned}, the rule this checker compares with (or "
                          "dslab's copy of it): it agrees on every size by construction and works nothing out. "
                          "Compute it from the arguments: each rank's share, its batches, the accumulation windows, "
                          "the epochs")
        return True
    if len(set(got)) == 1:
        raise Mistake(f"your function gives the same number ({got[0]}) for every size: compute it from the arguments")
    (n, per_device, world, accum, epochs), answer = wrong[0]
    said = (f"for n={n}, per_device={per_device}, world_size={world}, grad_accum_steps={accum}, epochs={epochs} your "
            f"function gives {answer}, the Trainer runs {trainer_steps_reference(*wrong[0][0])}")
    for mistake, words in MISTAKES:   # the mistake that gives the learner's number for every size checked
        if all(g == mistake(*case) for case, g in zip(cases, got)):
            raise Mistake(f"{said}: {words}")
    raise Mistake(said)


MISTAKES = ((_dslab_floor, "it drops the short last batch of each epoch, as dslab's loop does; the Trainer keeps it "
                           "(its loader does not drop_last)"),
            (_no_world, "it leaves out the world size: every rank takes per_device examples per micro-step, so a "
                        "step eats per_device x world_size x grad_accum_steps"),
            (_no_accumulation, "it leaves out gradient accumulation: a step runs grad_accum_steps micro-batches"),
            (_ceil_over_all_epochs, "it rounds up once over all epochs: the Trainer rounds up in each epoch (every "
                                    "epoch ends with its own short step)"),
            (_no_padding, "it gives each rank n_examples // world_size examples and drops the rest: the Trainer's "
                          "loader drops none, it loops back to the first examples to fill the last batches, so every "
                          "rank runs ⌈n_examples / (world_size x per_device)⌉ batches"))
