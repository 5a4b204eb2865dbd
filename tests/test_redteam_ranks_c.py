"""Red-team tests of 01.average_gradients, 04.offload_loop, 10.reduce_to_owners, 11.ulysses and 12.uneven_fix: the
checkers that run a learner's code on launched ranks. What each exercise registers (exercises.get(id).wrong), what
tests/test_exercises.py adds (HARD_CODED, EXTRA) and tests/test_exercises_parallel.py's HARD_CODED are counted, and
none repeated; this file adds wrong answers that make other mistakes (one of them holding for the chapter's numbers
only, or copying the checker's reference), each refused with its mistake named, and right answers in unusual but
valid forms, each accepted:

- 01.average_gradients: a flat buffer all-reduced once and copied back, and gradients divided first with the
  all-reduces started together, are right; a mean kept on rank 0 (dist.reduce), a flat buffer never copied back and a
  "mean of the chapter's two ranks" (x 0.5) are not;
- 04.offload_loop: loss.backward() on the engine's output under ZeRO-3 with offload (DeepSpeed's hooks divide and
  reduce), a config from train_batch_size alone with "Adam", and a loss divided by the loop with scale_wrt_gas=False
  are right; engine.step() only at the window's end, an extra optimizer.step(), the chapter's 4 accumulation steps
  and its bf16 are not (the last two are refused before any rank starts);
- 10.reduce_to_owners: the division first with torch.distributed's async reduces, and copied parts reduced with
  deepspeed.comm, are right; every buffer gathered for the checker's own mean, and a reduce followed by the owner's
  broadcast, are not (the bytes name both; tests/test_exercises_parallel.py has the mean "of two ranks");
- 11.ulysses: the batch-first layout (batch_dim_idx=0, gather_idx=1) and attention written out in a Module on a group
  made with new_group are right; the checker's one-process attention on gathered slices (no gradient goes back to
  the other ranks), the attention run twice and the call under torch.no_grad() are not;
- 12.uneven_fix: a fix whose ranks agree on the number of steps with an all_reduce(MAX), given as its text and as the
  path of the file holding it, is accepted (its four registered wrong fixes stand, one printing the chapter's answer).
  Each script runs in launches of its own (one per world size): the text costs the 2 launches, and the path none,
  since the checker judges a script it ran before on that run again.

The answers of the other four run in the launches every rank check of the session shares, one per world size
(tests/support.py: run_rank_exercises_together, which calls prepare_all_on_ranks below)."""
import ast
import dis
import functools
import re
import tempfile
import types
from pathlib import Path

import pytest

from dslab import exercises
from dslab.exercises import ch04, loops

import support
from support import said


# ---------------------------------------------------------------------------------------------- 01.average_gradients

def _average_flat_buffer(model):
    """Every gradient in one flat buffer, one all_reduce, the mean copied back into each p.grad (DDP's buckets)."""
    import torch
    import torch.distributed as dist

    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    for grad, mean in zip(grads, flat.split([g.numel() for g in grads])):
        grad.copy_(mean.view_as(grad))


def _average_divided_first(model):
    """Each gradient divided first, then the all_reduces started together (async_op) and waited for."""
    import torch.distributed as dist

    world_size, pending = dist.get_world_size(), []
    for p in model.parameters():
        p.grad.div_(world_size)
        pending.append(dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, async_op=True))
    for work in pending:
        work.wait()


def _average_on_rank0(model):
    """The sum reduced to rank 0 and divided there: the other ranks keep what the reduce left them."""
    import torch.distributed as dist

    for p in model.parameters():
        dist.reduce(p.grad, dst=0)
        p.grad /= dist.get_world_size()


def _average_flat_buffer_kept(model):
    """The flat buffer all-reduced and divided, but never copied back into the gradients."""
    import torch
    import torch.distributed as dist

    flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()


def _average_times_a_half(model):
    """The mean of the chapter's two ranks, written as a product."""
    import torch.distributed as dist

    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad.mul_(0.5)


AVERAGE_WRONG = (
    (_average_on_rank0, "only rank 0 ended with the mean gradients, not rank"),
    (_average_flat_buffer_kept, "p.grad did not change on any rank"),
    (_average_times_a_half, "you divided the sum by 2, but the check ran on 3 ranks"),
)
AVERAGE_RIGHT = (_average_flat_buffer, _average_divided_first)
AVERAGE_HARD_CODED = (_average_times_a_half,)


# ---------------------------------------------------------------------------------------------- 04.offload_loop

def _offload_module(d_in, d_out):
    """A model class of its own, defined where it is built."""
    import torch

    class TwoLayers(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.hidden = torch.nn.Linear(d_in, 7)
            self.out = torch.nn.Linear(7, d_out)

        def forward(self, x):
            return self.out(torch.nn.functional.gelu(self.hidden(x)))

    return TwoLayers()


def _offload_config_from_the_total(micro_batch_size, grad_accum_steps, world_size, lr):
    """train_batch_size and the micro batch only (DeepSpeed derives the accumulation steps), "Adam" (in AdamW mode,
    DeepSpeed's default) with its settings written out, clipping as an int, pin_memory off."""
    offload = {"device": "cpu", "pin_memory": False}
    return {"train_batch_size": micro_batch_size * grad_accum_steps * world_size,
            "train_micro_batch_size_per_gpu": micro_batch_size, "gradient_clipping": 0,
            "optimizer": {"type": "Adam", "params": {"lr": lr, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0}},
            "zero_optimization": {"stage": 3, "offload_optimizer": offload, "offload_param": dict(offload)}}


def _offload_config_steps_only(micro_batch_size, grad_accum_steps, world_size, lr):
    """The micro batch and the accumulation steps, no train_batch_size (DeepSpeed multiplies them by the ranks)."""
    return {"train_micro_batch_size_per_gpu": micro_batch_size, "gradient_accumulation_steps": grad_accum_steps,
            "gradient_clipping": 0.0, "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.0}},
            "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                  "offload_param": {"device": "cpu"}}}


def _offload_train_loss_backward(model, ds_config, micro_batches):
    """loss.backward() on a loss written out from the engine's output: under ZeRO-3 DeepSpeed's hooks on that output
    divide by gradient_accumulation_steps and reduce the gradients to the offloaded optimizer."""
    import deepspeed

    engine = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)[0]
    for x, y in micro_batches:
        loss = ((engine(x) - y) ** 2).mean()
        loss.backward()
        engine.step()


def _offload_train_divided_by_the_loop(model, ds_config, micro_batches):
    """The loop divides the loss by the engine's accumulation steps and tells engine.backward not to."""
    import deepspeed
    import torch.nn.functional as F

    engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters()],
                                      config=ds_config)
    for i in range(len(micro_batches)):
        x, y = micro_batches[i]
        loss = F.mse_loss(engine(x), y, reduction="mean")
        engine.backward(loss / engine.gradient_accumulation_steps(), scale_wrt_gas=False)
        engine.step()


def _offload_config_four_micro_batches(micro_batch_size, grad_accum_steps, world_size, lr):
    """The chapter's 4 accumulation steps written in."""
    config = ch04._offload_loop_config(micro_batch_size, grad_accum_steps, world_size, lr)
    del config["train_batch_size"]
    return {**config, "gradient_accumulation_steps": 4}


def _offload_config_in_bf16(micro_batch_size, grad_accum_steps, world_size, lr):
    """The chapter's bf16 section kept."""
    return {**ch04._offload_loop_config(micro_batch_size, grad_accum_steps, world_size, lr), "bf16": {"enabled": True}}


OFFLOAD_WRONG = (
    ((loops.small_model, ch04._offload_loop_config, loops.with_mistake("step at boundary")),
     "engine.step() was called"),
    ((loops.small_model, ch04._offload_loop_config, loops.with_mistake("optimizer step")),
     "optimizer stepped outside the engine"),
    ((loops.small_model, _offload_config_four_micro_batches, loops.train),
     "makes DeepSpeed accumulate 4 micro-batch(es) per optimizer step"),
    ((loops.small_model, _offload_config_in_bf16, loops.train), "bf16 is enabled: the reference trains in fp32"),
)
OFFLOAD_RIGHT = (
    (_offload_module, _offload_config_from_the_total, _offload_train_loss_backward),
    (loops.small_model, _offload_config_steps_only, _offload_train_divided_by_the_loop),
)
OFFLOAD_HARD_CODED = (OFFLOAD_WRONG[2][0],)


# ---------------------------------------------------------------------------------------------- 10.reduce_to_owners

def _owners_divided_first(grads):
    """DeepSpeed's order (divide, then reduce), with torch.distributed itself: the parts cut by split at the sizes
    tensor_split gives, the reduces started together and waited for."""
    import torch.distributed as dist

    world_size, rank = dist.get_world_size(), dist.get_rank()
    base, extra = divmod(grads.numel(), world_size)
    parts = grads.div_(world_size).split([base + (r < extra) for r in range(world_size)])
    pending = [dist.reduce(part, dst=owner, async_op=True) for owner, part in enumerate(parts)]
    for work in pending:
        work.wait()
    return parts[rank]


def _owners_copied_parts(grads):
    """Each part a copy (index_select of its positions) reduced to its owner with deepspeed.comm's ReduceOp; the owner
    keeps its copy, scaled by 1 / world_size."""
    import deepspeed.comm as dist
    import torch

    world_size, rank, mine = dist.get_world_size(), dist.get_rank(), None
    for owner, positions in enumerate(torch.arange(grads.numel()).tensor_split(world_size)):
        part = grads.index_select(0, positions)
        dist.reduce(part, dst=owner, op=dist.ReduceOp.SUM)
        if owner == rank:
            mine = part
    return mine * (1.0 / world_size)


def _owners_gathered_mean(grads):
    """The checker's own reference: every rank's buffer gathered, torch.stack(...).mean(0), this rank's part."""
    import deepspeed.comm as dist
    import torch

    everyone = [torch.empty_like(grads) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, grads)
    return torch.tensor_split(torch.stack(everyone).mean(0), dist.get_world_size())[dist.get_rank()]


def _owners_reduce_then_broadcast(grads):
    """Each part reduced to its owner, divided there, then broadcast so that every rank holds the whole mean."""
    import deepspeed.comm as dist
    import torch

    world_size, rank = dist.get_world_size(), dist.get_rank()
    parts = torch.tensor_split(grads, world_size)
    for owner, part in enumerate(parts):
        dist.reduce(part, dst=owner)
        if owner == rank:
            part /= world_size
        dist.broadcast(part, src=owner)
    return parts[rank]


OWNERS_WRONG = (
    (_owners_gathered_mean, "one reduce per part to its owner sends"),
    (_owners_reduce_then_broadcast, "one reduce per part to its owner sends"),
)
OWNERS_RIGHT = (_owners_divided_first, _owners_copied_parts)
OWNERS_HARD_CODED = (_owners_gathered_mean,)


# ---------------------------------------------------------------------------------------------- 11.ulysses

def _ulysses_batch_first(q, k, v):
    """q, k, v as [batch, seq, heads, head_dim]: DistributedAttention gathers the sequence from dim 1
    (batch_dim_idx=0, gather_idx=1); sdpa by transpose; the output back to sequence-first."""
    import torch
    import torch.nn.functional as F
    from deepspeed.sequence.layer import DistributedAttention

    def local_attention(q, k, v, *args, **kwargs):
        heads_first = (t.transpose(1, 2) for t in (q, k, v))
        return F.scaled_dot_product_attention(*heads_first, is_causal=True).transpose(1, 2)

    attention = DistributedAttention(local_attention, torch.distributed.group.WORLD, scatter_idx=2, gather_idx=1)
    return attention(*(t.transpose(0, 1) for t in (q, k, v)), batch_dim_idx=0).transpose(0, 1)


def _ulysses_written_out(q, k, v):
    """Attention written out in a Module (scores, the future masked, softmax) on [seq, batch, heads, head_dim] with
    einsum; the group of every rank made with new_group; DistributedAttention's arguments positional."""
    import math

    import torch
    from deepspeed.sequence.layer import DistributedAttention

    class CausalAttention(torch.nn.Module):
        def forward(self, q, k, v, *args, **kwargs):
            scores = torch.einsum("sbhd,tbhd->bhst", q, k) / math.sqrt(q.shape[-1])
            future = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool).triu(1)
            return torch.einsum("bhst,tbhd->sbhd", scores.masked_fill(future, float("-inf")).softmax(-1), v)

    everyone = torch.distributed.new_group(list(range(torch.distributed.get_world_size())))
    return DistributedAttention(CausalAttention(), everyone, 2, 0)(q, k, v, 1)


def _ulysses_gathered_reference(q, k, v):
    """The checker's own one-process attention on the whole sequence, every rank's slices gathered (all_gather) with
    this rank's own in place: right numbers, but the gradients of this rank's keys and values from the positions the
    other ranks hold never come back."""
    import torch
    import torch.distributed as dist

    from dslab.exercises import ch11_ulysses

    rank, world_size = dist.get_rank(), dist.get_world_size()
    whole = []
    for mine in (q, k, v):
        slices = [torch.empty_like(mine) for _ in range(world_size)]
        dist.all_gather(slices, mine.detach())
        slices[rank] = mine
        whole.append(torch.cat(slices, dim=0))
    return ch11_ulysses._attention(*whole)[rank * q.shape[0]:(rank + 1) * q.shape[0]]


def _ulysses_twice(q, k, v):
    """The right attention, run once more under no_grad to look at the output first."""
    import torch
    import torch.nn.functional as F
    from deepspeed.sequence.layer import DistributedAttention

    def local_attention(q, k, v, *args, **kwargs):
        out = F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)), is_causal=True)
        return out.permute(2, 0, 1, 3)

    attention = DistributedAttention(local_attention, torch.distributed.group.WORLD)
    with torch.no_grad():
        assert attention(q, k, v, batch_dim_idx=1).shape == q.shape
    return attention(q, k, v, batch_dim_idx=1)


def _ulysses_without_gradients(q, k, v):
    """The right attention under torch.no_grad(), to save memory."""
    import torch
    import torch.nn.functional as F
    from deepspeed.sequence.layer import DistributedAttention

    def local_attention(q, k, v, *args, **kwargs):
        out = F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)), is_causal=True)
        return out.permute(2, 0, 1, 3)

    with torch.no_grad():
        return DistributedAttention(local_attention, torch.distributed.group.WORLD)(q, k, v, batch_dim_idx=1)


ULYSSES_WRONG = (
    (_ulysses_gathered_reference, "q/k/v gradients differ from one process's"),
    (_ulysses_twice, "the forward called {'all_to_all_single': 8}"),
    (_ulysses_without_gradients, "carries no gradient back to q, k and v"),
)
ULYSSES_RIGHT = (_ulysses_batch_first, _ulysses_written_out)
ULYSSES_HARD_CODED = (_ulysses_gathered_reference,)


# ---------------------------------------------------------------------------------------------- 12.uneven_fix

UNEVEN_AGREED_STEPS = '''\
import deepspeed
import torch
import torch.distributed as dist

deepspeed.init_distributed(dist_backend="gloo")
rank, world_size = dist.get_rank(), dist.get_world_size()
samples = torch.arange(1.0, 6.0)
shard = samples[rank::world_size]
steps = torch.tensor(len(shard))
dist.all_reduce(steps, op=dist.ReduceOp.MAX)      # the ranks agree: as many steps as the longest shard
total = torch.zeros(2)
for i in range(int(steps)):
    step = torch.stack([shard[i], torch.tensor(1.0)]) if i < len(shard) else torch.zeros(2)
    dist.all_reduce(step)
    total += step
dist.barrier()
if rank == 0:
    print(f"mean {total[0].item() / total[1].item():.4f} over {total[1].item():.0f} samples", flush=True)
'''
_SCRIPTS = tempfile.TemporaryDirectory(prefix="dslab-redteam-")   # removed when the session's interpreter exits
UNEVEN_AGREED_STEPS_FILE = str(Path(_SCRIPTS.name) / "uneven_fixed.py")   # the answer as the path of a %%writefile
Path(UNEVEN_AGREED_STEPS_FILE).write_text(UNEVEN_AGREED_STEPS, encoding="utf-8")
UNEVEN_RIGHT = (UNEVEN_AGREED_STEPS, UNEVEN_AGREED_STEPS_FILE)


# ---------------------------------------------------------------------------------------------- the tests

# What this file tests, per exercise: wrong answers and their words, right answers, and those of the wrong answers that
# hold for the chapter's numbers only or copy the checker's reference (each also among "wrong").
REDTEAM = {
    "01.average_gradients": {"wrong": list(AVERAGE_WRONG), "right": list(AVERAGE_RIGHT),
                             "hard_coded": list(AVERAGE_HARD_CODED)},
    "04.offload_loop": {"wrong": list(OFFLOAD_WRONG), "right": list(OFFLOAD_RIGHT),
                        "hard_coded": list(OFFLOAD_HARD_CODED)},
    "10.reduce_to_owners": {"wrong": list(OWNERS_WRONG), "right": list(OWNERS_RIGHT),
                            "hard_coded": list(OWNERS_HARD_CODED)},
    "11.ulysses": {"wrong": list(ULYSSES_WRONG), "right": list(ULYSSES_RIGHT), "hard_coded": list(ULYSSES_HARD_CODED)},
    "12.uneven_fix": {"wrong": [], "right": list(UNEVEN_RIGHT), "hard_coded": []},
}


def _name(answer):
    if isinstance(answer, str):
        return "path" if answer == UNEVEN_AGREED_STEPS_FILE else "text"
    if isinstance(answer, tuple):
        return "-".join(_name(part) for part in answer)
    if isinstance(answer, functools.partial):
        return answer.keywords.get("mistake", answer.func.__name__).replace(" ", "_")
    return answer.__name__.strip("_")


def prepare_all_on_ranks():
    """The answers of this file that run on ranks (within support.run_rank_exercises_together); 12.uneven_fix's
    scripts run in launches of their own when checked."""
    for exercise_id, answers in REDTEAM.items():
        prepare = exercises.get(exercise_id).prepare
        if prepare is not None:
            prepare([*answers["right"], *(answer for answer, _ in answers["wrong"])])


@functools.lru_cache(maxsize=None)
def _ran_on_ranks():
    support.run_rank_exercises_together()
    prepare_all_on_ranks()          # what the shared batch could not run runs now, per exercise


WRONG = [(e, a, w) for e, answers in REDTEAM.items() for a, w in answers["wrong"]]
RIGHT = [(e, a) for e, answers in REDTEAM.items() for a in answers["right"]]


@pytest.mark.parametrize("exercise_id, answer, words", WRONG, ids=[f"{e}-{_name(a)}" for e, a, _ in WRONG])
def test_wrong_answers_are_refused_naming_the_mistake(exercise_id, answer, words):
    _ran_on_ranks()
    verdict, text = said(exercise_id, answer)
    assert verdict is False and text.startswith("Not quite: "), text
    assert words in text, f"expected {words!r} in:\n{text}"


@pytest.mark.parametrize("exercise_id, answer", RIGHT, ids=[f"{e}-{_name(a)}" for e, a in RIGHT])
def test_right_answers_in_unusual_forms_are_accepted(exercise_id, answer):
    _ran_on_ranks()
    verdict, text = said(exercise_id, answer)
    assert (verdict, text) == (True, "Correct!\n"), text


def _instructions(code):
    return tuple((i.opname, _instructions(i.argval) if isinstance(i.argval, types.CodeType) else i.argval)
                 for i in dis.get_instructions(code))


def _code(answer):
    """What an answer does, its name, docstring, comments and line numbers aside: two copies of it compare equal."""
    if isinstance(answer, tuple):
        return tuple(_code(part) for part in answer)
    if isinstance(answer, functools.partial):
        return _code(answer.func), answer.args, tuple(sorted(answer.keywords.items()))
    code = getattr(answer, "__code__", None)
    return answer if code is None else _instructions(code)


def test_no_answer_here_repeats_one_the_other_tests_run():
    """Neither the objects nor their code: what the exercise registers, tests/test_exercises.py's HARD_CODED and
    EXTRA, tests/test_exercises_parallel.py's HARD_CODED."""
    import test_exercises
    import test_exercises_parallel

    for exercise_id, answers in REDTEAM.items():
        known = [answer for answer, _ in exercises.get(exercise_id).wrong]
        known += [*test_exercises.EXTRA.get(exercise_id, []), test_exercises.SOLUTIONS[exercise_id]]
        known += [test_exercises.HARD_CODED[exercise_id]] if exercise_id in test_exercises.HARD_CODED else []
        known += [test_exercises_parallel.HARD_CODED[exercise_id][0]] \
            if exercise_id in test_exercises_parallel.HARD_CODED else []
        for answer in [*answers["right"], *(answer for answer, _ in answers["wrong"])]:
            assert all(answer is not other and _code(answer) != _code(other) for other in known), \
                f"{exercise_id}: {_name(answer)} repeats an answer the other tests run"
        wrong = [answer for answer, _ in answers["wrong"]]
        assert all(any(h is w for w in wrong) for h in answers["hard_coded"]), exercise_id


def test_a_fixed_script_checked_again_starts_no_rank(monkeypatch):
    """12.uneven_fix judges a script that finished on a world size before on that run (its samples and log): the
    path of a file holding the same text costs no launch."""
    from dslab.exercises import ch12

    monkeypatch.setattr(ch12, "_FINISHED", {})
    launched = []

    def run_fixed(source, world_size):     # what a right script prints, from the samples the checker put in
        launched.append(world_size)
        samples = ast.literal_eval(re.search(r"^samples = torch\.tensor\((\[.*?\])\)", source, re.M).group(1))
        return f"mean {sum(samples) / len(samples):.4f} over {len(samples)} samples\n"

    monkeypatch.setattr(ch12, "_run_fixed", run_fixed)
    assert said("12.uneven_fix", UNEVEN_AGREED_STEPS) == (True, "Correct!\n")
    assert said("12.uneven_fix", UNEVEN_AGREED_STEPS_FILE) == (True, "Correct!\n")
    assert launched == [2, 3]
