"""The coding exercises of chapters 10-13 whose checkers run the learner's function on launched ranks
(dslab.exercises.on_ranks): the instructor's solution passes on 2 and 3 ranks (3 and 4 for 11.tensor_data) with cases
drawn at check time, and what the checker measures around it is what DeepSpeed does; every usual mistake is refused
with the message naming it; an answer that types in the chapter's numbers fails; cases never repeat the chapter's.

Each exercise's solution, wrong answers and hard-coded answers run in the launches every exercise on ranks shares, one
per world size, with tests/test_exercises.py's answers (tests/support.py: run_rank_exercises_together).
"""
import contextlib
import functools
import io
import random
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from dslab import exercises
from dslab.exercises import ch10, ch11_pipeline, ch11_tensor_data, ch11_ulysses, ch12, ch13, on_ranks

import support

ROOT = Path(__file__).resolve().parent.parent
SOLUTIONS = {}
for chapter in ("10", "11", "12", "13"):
    SOLUTIONS.update(runpy.run_path(str(ROOT / "notebooks" / "solutions" / f"{chapter}_solutions.py"))["SOLUTIONS"])

# exercise id: (trial, draw_case, world sizes)
ON_RANKS = {
    "10.reduce_to_owners": (ch10.OWNERS_TRIAL, ch10.draw_owners_case, on_ranks.WORLD_SIZES),
    "11.pipeline": (ch11_pipeline.PIPELINE_TRIAL, ch11_pipeline.draw_pipeline_case, on_ranks.WORLD_SIZES),
    "11.tensor_data": (ch11_tensor_data.TENSOR_DATA_TRIAL, ch11_tensor_data.draw_tensor_data_case,
                       ch11_tensor_data.TENSOR_DATA_WORLD_SIZES),
    "11.ulysses": (ch11_ulysses.ULYSSES_TRIAL, ch11_ulysses.draw_ulysses_case, on_ranks.WORLD_SIZES),
    "12.zero3_generate": (ch12.GENERATE_TRIAL, ch12.draw_generate_case, on_ranks.WORLD_SIZES),
    "13.profiled_flops": (ch13.PROFILE_TRIAL, ch13.draw_profile_case, on_ranks.WORLD_SIZES),
}


# ------------------------------------------------------- answers that hold for the chapter's own numbers only

def _owners_by_two(grads):
    import deepspeed.comm as dist
    import torch

    parts = torch.tensor_split(grads, dist.get_world_size())
    for owner, part in enumerate(parts):
        dist.reduce(part, dst=owner)
    return parts[dist.get_rank()] / 2            # the chapter's 2 ranks


def _pipeline_chapters_losses(shape, steps):
    import deepspeed
    import torch
    from deepspeed.pipe import LayerSpec, PipelineModule

    from dslab.parallel import pipeline

    specs = [LayerSpec(pipeline.Embed, shape["vocab"], shape["hidden"]),
             *[LayerSpec(pipeline.Block, shape["hidden"], shape["intermediate"]) for _ in range(shape["blocks"])],
             LayerSpec(pipeline.Head, shape["hidden"], shape["vocab"])]
    net = PipelineModule(layers=specs, num_stages=torch.distributed.get_world_size(), loss_fn=pipeline.lm_loss,
                         partition_method="uniform", seed_layers=True, base_seed=pipeline.BASE_SEED)
    ds_config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4, "train_batch_size": 8,
                 "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0, "torch_adam": True}},
                 "gradient_clipping": 0.0}
    engine, *_ = deepspeed.initialize(model=net, config=ds_config)
    return engine, [9.348933, 9.045598, 8.495984]   # the losses the chapter printed once


def _tensor_data_typed_grid(model, autotp_size, steps):
    import deepspeed
    import torch

    rank = torch.distributed.get_rank()
    ds_config = {"train_micro_batch_size_per_gpu": steps[0][0].shape[0], "gradient_accumulation_steps": 1,
                 "train_batch_size": steps[0][0].shape[0] * 4,
                 "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0, "torch_adam": True}},
                 "gradient_clipping": 0.0, "tensor_parallel": {"autotp_size": 2}, "zero_optimization": {"stage": 1}}
    engine, *_ = deepspeed.initialize(model=model, config=ds_config)
    layout = {"tensor_parallel": [rank - rank % 2, rank - rank % 2 + 1], "data_parallel": [rank % 2, rank % 2 + 2]}
    replica = rank // 2                           # 4 ranks in pairs, as on the chapter's live ranks
    losses = []
    for batches in steps:
        loss = engine(input_ids=batches[replica], labels=batches[replica]).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return engine, layout, losses


def _ulysses_head_dim_32(q, k, v):
    import torch
    import torch.nn.functional as F
    from deepspeed.sequence.layer import DistributedAttention

    def local_attention(q, k, v, *args, **kwargs):   # softmax(q k^T / sqrt(32)): the chapter's head_dim, typed in
        out = F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)), is_causal=True,
                                             scale=32 ** -0.5)
        return out.permute(2, 0, 1, 3)

    attention = DistributedAttention(local_attention, torch.distributed.group.WORLD, scatter_idx=2, gather_idx=0)
    return attention(q, k, v, batch_dim_idx=1)


def _generate_sixteen(model, prompt, new_tokens):
    import deepspeed

    engine, *_ = deepspeed.initialize(model=model, config={"train_micro_batch_size_per_gpu": 1,
                                                          "zero_optimization": {"stage": 3}})
    out = engine.module.generate(prompt, max_new_tokens=16, min_new_tokens=16, do_sample=False, pad_token_id=0,
                                 synced_gpus=True)                  # the chapter's longer count, typed in
    return out[0, prompt.shape[1]:]


def _profile_fixed_count(model, batches, profile_step):
    return 5_923_766_272                          # dslab-tiny's 4 x 128-token forward, the chapter's number


HARD_CODED = {
    "10.reduce_to_owners": (_owners_by_two, "is the sum over the 3 ranks divided by 2"),
    "11.pipeline": (_pipeline_chapters_losses, "train_micro_batch_size_per_gpu is 2"),
    "11.tensor_data": (_tensor_data_typed_grid, "must count every rank"),
    "11.ulysses": (_ulysses_head_dim_32, "differs from attention over the whole sequence"),
    "12.zero3_generate": (_generate_sixteen, "generated 16 tokens"),
    "13.profiled_flops": (_profile_fixed_count, "DeepSpeed's profiler counts"),
}


def _prepare_answers(exercise_id):
    """Run the solution, the registered wrong answers and the hard-coded one (later checks reuse the runs)."""
    ex = exercises.get(exercise_id)
    ex.prepare([SOLUTIONS[exercise_id], *(answer for answer, _ in ex.wrong), HARD_CODED[exercise_id][0]])
    return ex


def prepare_all_on_ranks():
    """Every exercise of this file, prepared (within support.run_rank_exercises_together)."""
    for exercise_id in ON_RANKS:
        _prepare_answers(exercise_id)


@functools.lru_cache(maxsize=None)
def _prepared(exercise_id):
    """The exercise, every known answer run first: those of all exercises on ranks together, one launch per world
    size (what a batch could not run runs now, per exercise)."""
    support.run_rank_exercises_together()
    return _prepare_answers(exercise_id)


def _said(exercise_id, answer):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        ok = exercises.check(exercise_id, answer)
    return ok, out.getvalue()


def _results(exercise_id, world_size):
    """(case, per-rank results) of the solution's run on `world_size` ranks (from the prepared launch)."""
    trial, _, _ = ON_RANKS[exercise_id]
    case = on_ranks.cached_case(trial, SOLUTIONS[exercise_id], world_size)
    [(case, results)] = on_ranks.run(trial, [SOLUTIONS[exercise_id]], world_size, case)
    return case, results


# ------------------------------------------------------------------------------------------- the tests

def test_cases_are_drawn_anew_and_never_the_chapters_numbers():
    """Two checks draw different cases; none repeats a number the chapter used (so none typed in can pass)."""
    rng = random.Random(0)
    for exercise_id, (_, draw, world_sizes) in ON_RANKS.items():
        for world_size in world_sizes:
            cases = [draw(world_size, rng) for _ in range(30)]
            assert len({repr(c) for c in cases}) > 20, exercise_id
            assert all(c["world_size"] == world_size for c in cases)
    for _ in range(50):
        for n in (2, 3):
            pipe = ch11_pipeline.draw_pipeline_case(n, rng)
            assert pipe["shape"]["blocks"] != 4 and pipe["micro_batches"] != 4 and pipe["micro_batch_size"] != 2
            assert pipe["shape"]["blocks"] + 2 >= n                       # every stage gets a layer
            sp = ch11_ulysses.draw_ulysses_case(n, rng)
            assert sp["heads"] % n == 0 and sp["seq"] % n == 0            # Ulysses splits both evenly
            assert ch10.draw_owners_case(n, rng)["numel"] % n               # parts of unequal size
            gen = ch12.draw_generate_case(n, rng)
            assert len(set(gen["new_tokens"])) == n and not {4, 16} & set(gen["new_tokens"])
            prof = ch13.draw_profile_case(n, rng)
            assert prof["profile_step"] != 2 and 0 < prof["profile_step"] < len(prof["seq_lens"])
            assert len(set(prof["seq_lens"])) == len(prof["seq_lens"])    # every step's count differs
        for n in ch11_tensor_data.TENSOR_DATA_WORLD_SIZES:
            tp = ch11_tensor_data.draw_tensor_data_case(n, rng)
            shape = tp["shape"]
            assert n % tp["autotp_size"] == 0 and shape["num_key_value_heads"] % tp["autotp_size"] == 0
            assert shape["vocab_size"] % tp["autotp_size"] == 0 and shape["intermediate_size"] % tp["autotp_size"] == 0


# In a process of its own: the ZeRO-3 engine changes torch.nn.functional.linear for the whole process.
ZERO3_THEN_THE_NEXT_EXERCISE = """
import deepspeed, torch
from dslab import this_rank
from dslab.exercises import on_ranks
this_rank.init_single_process(quiet=True)
plain = torch.nn.functional.linear
net = torch.nn.Linear(4, 4)
deepspeed.initialize(model=net, model_parameters=net.parameters(), config={
    "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}})
swapped = torch.nn.functional.linear is not plain
on_ranks._as_in_a_new_process()     # what serve() does between two exercises' jobs
print(swapped, torch.nn.functional.linear is plain)
"""


def test_the_next_exercise_gets_torchs_linear_back_after_a_zero3_engine():
    """A ZeRO-3 engine leaves DeepSpeed's F.linear in place, and the flops profiler would count each linear layer
    twice in the next exercise's trial (13.profiled_flops after 12.zero3_generate, in one launch); serve() puts
    torch's back."""
    proc = subprocess.run([sys.executable, "-c", ZERO3_THEN_THE_NEXT_EXERCISE], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[-2:] == ["True", "True"], proc.stdout[-2000:]


@pytest.mark.parametrize("exercise_id", sorted(ON_RANKS))
def test_solution_passes_and_what_it_measures_holds(exercise_id):
    _prepared(exercise_id)
    ok, said = _said(exercise_id, SOLUTIONS[exercise_id])
    assert ok and said.strip() == "Correct!", said
    for world_size in ON_RANKS[exercise_id][2]:
        case, results = _results(exercise_id, world_size)
        assert len(results) == world_size
        if exercise_id == "11.pipeline":       # bit for bit: the same operations in the same order, on n ranks
            first = results[0]
            assert first["losses"] == first["reference"]
            assert [r["stage"] for r in results] == list(range(world_size))
            assert sum(r["params"] for r in results) == first["whole"]
            assert [r["layers"][0] for r in results][0] == "Embed" and results[-1]["layers"][-1] == "Head"
        elif exercise_id == "11.tensor_data":  # DeepSpeed's grid: consecutive tensor-parallel groups, strided data
            t = case["autotp_size"]
            for rank, r in enumerate(results):
                first_rank = rank - rank % t
                assert r["deepspeed"]["tensor_parallel"] == list(range(first_rank, first_rank + t))
                assert r["deepspeed"]["data_parallel"] == list(range(rank % t, world_size, t))
                assert r["census"]["split_local"] * t == r["census"]["split_full"]   # 1/T of every split layer
                assert r["census"]["split_full"] + r["census"]["replicated"] == sum(
                    p.numel() for p in ch11_tensor_data.tensor_data_model(case).parameters())
        elif exercise_id == "11.ulysses":      # 4 all-to-alls each way, each of one rank's own slice
            local = case["seq"] // world_size * case["batch"] * case["heads"] * case["head_dim"] * 4
            for r in results:
                assert r["forward"] == {"all_to_all_single": {"calls": 4, "bytes": 4 * local}}
                assert r["backward"] == {"all_to_all_single": {"calls": 4, "bytes": 4 * local}}
        elif exercise_id == "10.reduce_to_owners":   # gloo's reduces, to the byte within 1 %; less than an all-reduce
            for r in results:
                assert abs(r["sent"] / r["reduces"] - 1) < 0.01 and r["reduces"] < r["all_reduce"]
        elif exercise_id == "12.zero3_generate":     # every rank its own length, greedy as one process
            assert [len(r["got"]) for r in results] == case["new_tokens"]
        elif exercise_id == "13.profiled_flops":     # the profiler's count, the arithmetic's, on every rank
            want = results[0]["totals"][case["profile_step"]]
            assert [r["got"] for r in results] == [want] * world_size


@pytest.mark.parametrize("exercise_id", sorted(ON_RANKS))
def test_usual_mistakes_are_named(exercise_id):
    ex = _prepared(exercise_id)
    assert len(ex.wrong) >= 3
    for answer, words in ex.wrong:
        ok, said = _said(exercise_id, answer)
        assert not ok and said.startswith("Not quite: ") and words in said, (answer.__name__, said)


@pytest.mark.parametrize("exercise_id", sorted(ON_RANKS))
def test_a_hard_coded_answer_fails(exercise_id):
    _prepared(exercise_id)
    answer, words = HARD_CODED[exercise_id]
    ok, said = _said(exercise_id, answer)
    assert not ok and said.startswith("Not quite: ") and words in said, said
