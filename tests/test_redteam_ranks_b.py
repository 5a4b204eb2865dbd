"""Red-team tests of 03.engine_loop, 03.fix_loop, 13.profiled_flops, 13.forward_flops and 14.trainer_steps: checkers
that judge the work, not only the answer it returns. For each, wrong answers (one hard-coded or leaning on a reference
function of the chapter or the checker) are refused with their mistake named, and right answers in unusual but valid
forms are accepted:

- 03.engine_loop reads the gradient the optimizer steps with at each accumulation boundary (Adam hides a gradient
  scaled alike everywhere): engine.backward(loss, scale_wrt_gas=False) is refused, engine.backward(loss / accum,
  scale_wrt_gas=False) and loss.backward() on the engine's output under ZeRO 1-3 are right (deepspeed 0.19.8 hooks that
  output), loss.backward() under ZeRO-0 is refused as DeepSpeed refuses it;
- 03.fix_loop watches the forward and backward passes: the window as one batch is no accumulation;
- 13.profiled_flops watches deepspeed.initialize and the profiler's report: the right number must be what the
  profiler counted, at profile_step, on a ZeRO-2 bf16 engine;
- 13.forward_flops and 14.trainer_steps refuse a function that gets its number from the reference it is compared with.

The answers run on ranks here run in the launches every rank check of the session shares, one per world size
(tests/support.py: run_rank_exercises_together, which calls prepare_all_on_ranks below)."""
import functools
import math

import pytest
from deepspeed import initialize   # noqa: F401  (an answer below calls it by this name, as `from deepspeed import ...`)

from dslab import exercises

import support
from support import accepted, refused, said


# ---------------------------------------------------------------------------------------------- 03.engine_loop

def _mlp(d_in, d_out):
    import torch

    return torch.nn.Sequential(torch.nn.Linear(d_in, 6), torch.nn.SiLU(), torch.nn.Linear(6, d_out))


def _config(micro, accum, world, lr, stage):
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": accum,
            "train_batch_size": micro * accum * world, "gradient_clipping": 0.0, "zero_optimization": {"stage": stage},
            "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.0}}}


def _config_zero0(micro, accum, world, lr):
    return _config(micro, accum, world, lr, 0)


def _config_zero1(micro, accum, world, lr):
    return _config(micro, accum, world, lr, 1)


def _config_zero2(micro, accum, world, lr):
    return _config(micro, accum, world, lr, 2)


def _config_zero3(micro, accum, world, lr):
    return _config(micro, accum, world, lr, 3)


def _train_with(model, ds_config, micro_batches, backward):
    import deepspeed
    import torch.nn.functional as F

    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    accum = engine.gradient_accumulation_steps()
    for x, y in micro_batches:
        loss = F.mse_loss(engine(x), y)
        if backward == "loss.backward":           # DeepSpeed's hooks on the engine's output divide and reduce
            loss.backward()
        elif backward == "divided, no gas scaling":
            engine.backward(loss / accum, scale_wrt_gas=False)
        elif backward == "no gas scaling":         # nobody divides: the window's gradient is accum x too large
            engine.backward(loss, scale_wrt_gas=False)
        elif backward == "by 4, no gas scaling":   # the chapter's 4 accumulation steps, written in
            engine.backward(loss / 4, scale_wrt_gas=False)
        elif backward == "divided, loss.backward":  # and the hook on the engine's output divides again
            (loss / accum).backward()
        engine.step()


def _train(backward):
    return functools.partial(_train_with, backward=backward)


ENGINE_LOOP_RIGHT = (
    (_mlp, _config_zero2, _train("loss.backward")),
    (_mlp, _config_zero3, _train("divided, no gas scaling")),
)
ENGINE_LOOP_WRONG = (
    ((_mlp, _config_zero2, _train("no gas scaling")), "scale_wrt_gas=False) does not divide"),
    ((_mlp, _config_zero0, _train("loss.backward")), "loss.backward() at ZeRO stage 0"),
    ((_mlp, _config_zero2, _train("by 4, no gas scaling")), "you divided the loss by 4"),
    ((_mlp, _config_zero1, _train("divided, loss.backward")), "DeepSpeed's hook on the engine's output divides"),
)


# ---------------------------------------------------------------------------------------------- 13.profiled_flops

def _profile_config(rows, profile_step, stage=2, profiler=True, **extra):
    cfg = {"train_micro_batch_size_per_gpu": rows, "bf16": {"enabled": True}, "zero_optimization": {"stage": stage},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}, "steps_per_print": 10 ** 9}
    if profiler:
        cfg["flops_profiler"] = {"enabled": True, "profile_step": profile_step, "top_modules": 1, "detailed": False}
    return {**cfg, **extra}


def _trained(model, batches, ds_config, start):
    engine, *_ = start(model=model, model_parameters=model.parameters(), config=ds_config)
    for tokens in batches:
        engine.backward(engine(input_ids=tokens, labels=tokens).loss)
        engine.step()
    return engine


def _profiled_all_reduce(model, batches, profile_step):
    import torch
    import torch.distributed as dist

    cfg = _profile_config(batches[0].shape[0], profile_step)
    del cfg["train_micro_batch_size_per_gpu"]          # the batch as DeepSpeed derives it from train_batch_size
    cfg["train_batch_size"] = batches[0].shape[0] * dist.get_world_size()
    engine = _trained(model, batches, cfg, initialize)   # deepspeed.initialize under its imported name
    count = torch.tensor([engine.flops_profiler.flops if dist.get_rank() == 0 else 0], dtype=torch.int64)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)       # only rank 0 profiled; the others hold 0
    return int(count.item())


def _profiled_to_a_file(model, batches, profile_step):
    import tempfile

    import deepspeed
    import torch

    with tempfile.TemporaryDirectory() as folder:
        cfg = _profile_config(batches[0].shape[0], profile_step, gradient_accumulation_steps=1,
                              flops_profiler={"enabled": True, "profile_step": profile_step, "module_depth": 1,
                                              "output_file": f"{folder}/profile.txt"})
        engine = _trained(model, batches, cfg, start=deepspeed.initialize)
    count = torch.tensor([float(getattr(engine.flops_profiler, "flops", 0))], dtype=torch.float64)
    deepspeed.comm.broadcast(count, src=0)
    return int(count.item())


def _profiled_at_zero1(model, batches, profile_step):
    import torch

    engine = _trained(model, batches, _profile_config(batches[0].shape[0], profile_step, stage=1), initialize)
    count = [engine.flops_profiler.flops if torch.distributed.get_rank() == 0 else None]
    torch.distributed.broadcast_object_list(count, src=0)
    return count[0]


def _trained_then_counted_by_hand(model, batches, profile_step):
    from dslab import flops

    _trained(model, batches, _profile_config(batches[0].shape[0], profile_step, profiler=False), initialize)
    return flops.forward_flops(model.config, *batches[profile_step].shape)["total"]


def _the_chapters_profiler_count(model, batches, profile_step):
    from dslab import flops

    rows, seq = batches[profile_step].shape           # the chapter's arithmetic, no engine at all
    return flops.rule_of_thumb_gap(sum(p.numel() for p in model.parameters()), model.config, rows, seq)["profiler"]


PROFILE_RIGHT = (_profiled_all_reduce, _profiled_to_a_file)
PROFILE_WRONG = (
    (_profiled_at_zero1, "runs ZeRO stage 1 in bf16"),
    (_trained_then_counted_by_hand, "has no flops profiler"),
    (_the_chapters_profiler_count, "without building a DeepSpeed engine"),
)


def prepare_all_on_ranks():
    """The answers of this file that run on ranks (within support.run_rank_exercises_together)."""
    exercises.get("03.engine_loop").prepare([*ENGINE_LOOP_RIGHT, *(a for a, _ in ENGINE_LOOP_WRONG)])
    exercises.get("13.profiled_flops").prepare([*PROFILE_RIGHT, *(a for a, _ in PROFILE_WRONG)])


@functools.lru_cache(maxsize=None)
def _ran_on_ranks():
    support.run_rank_exercises_together()
    prepare_all_on_ranks()          # what the shared batch could not run runs now, per exercise


@pytest.mark.parametrize("answer", ENGINE_LOOP_RIGHT, ids=("loss.backward_zero2", "divided_no_gas_scaling_zero3"))
def test_engine_loop_accepts_other_right_backwards(answer):
    _ran_on_ranks()
    accepted("03.engine_loop", answer)


@pytest.mark.parametrize("answer, words", ENGINE_LOOP_WRONG,
                         ids=("no_gas_scaling", "loss.backward_zero0", "by_four", "divided_before_loss.backward"))
def test_engine_loop_refuses_a_gradient_scaled_or_a_backward_deepspeed_refuses(answer, words):
    _ran_on_ranks()
    refused("03.engine_loop", answer, words)


@pytest.mark.parametrize("answer", PROFILE_RIGHT, ids=lambda a: a.__name__)
def test_profiled_flops_accepts_other_ways_to_read_and_share_the_count(answer):
    _ran_on_ranks()
    accepted("13.profiled_flops", answer)


@pytest.mark.parametrize("answer, words", PROFILE_WRONG, ids=lambda a: getattr(a, "__name__", "words"))
def test_profiled_flops_refuses_a_right_number_the_asked_profiler_did_not_count(answer, words):
    _ran_on_ranks()
    refused("13.profiled_flops", answer, words)


# ---------------------------------------------------------------------------------------------- 03.fix_loop

def _the_chapters_big_batch(model, micro_batches):
    import torch

    from dslab.training import accumulation

    window = {key: torch.cat([mb[key] for mb in micro_batches]) for key in micro_batches[0]}
    accumulation.big_batch_backward(model, window)     # the chapter's reference: one forward over the window


def _two_micro_batches_per_forward(model, micro_batches):
    import torch

    for i in range(0, len(micro_batches), 2):
        part = micro_batches[i:i + 2]
        merged = {key: torch.cat([mb[key] for mb in part]) for key in part[0]}
        (model(**merged).loss * len(part) / len(micro_batches)).backward()


def _losses_summed_then_one_backward(model, micro_batches):
    losses = [model(**mb).loss for mb in micro_batches]
    (sum(losses) / len(losses)).backward()


def _row_by_row_backwards(model, micro_batches):
    rows = sum(mb["input_ids"].shape[0] for mb in micro_batches)
    for mb in reversed(micro_batches):               # any order; finer micro-batches of one row each
        for r in range(mb["input_ids"].shape[0]):
            model(**{key: t[r:r + 1] for key, t in mb.items()}).loss.mul(1 / rows).backward()


def _token_weighted(model, micro_batches):
    from dslab.training.accumulation import count_targets

    model.zero_grad(set_to_none=True)
    window = sum(count_targets(mb) for mb in micro_batches)
    for mb in micro_batches:
        (model(**mb).loss * count_targets(mb) / window).backward()


def test_fix_loop_refuses_the_window_as_one_batch_and_accepts_real_accumulation():
    refused("03.fix_loop", _the_chapters_big_batch, "no accumulation: one forward pass over")
    refused("03.fix_loop", _two_micro_batches_per_forward, "no accumulation: one forward pass over")
    refused("03.fix_loop", _losses_summed_then_one_backward, "one backward through")
    accepted("03.fix_loop", _row_by_row_backwards)
    accepted("03.fix_loop", _token_weighted)


# ---------------------------------------------------------------------------------------------- 13.forward_flops

def _flops_from_the_reference(config, batch_size, seq_len):
    from dslab import flops

    return flops.forward_flops(config, batch_size, seq_len)["total"]


def _flops_through_a_helper(config, batch_size, seq_len):
    return _table_total(config, batch_size, seq_len)


def _table_total(config, batch_size, seq_len):
    import importlib

    flops = importlib.import_module("dslab.flops")
    return round(sum(row["GFLOP"] for row in flops.forward_table(config, batch_size, seq_len)[:-1]) * 1e9)


def _flops_of_the_chapters_shape(config, batch_size, seq_len):
    return 5_923_766_272                             # dslab-tiny, 4 x 128 tokens: the chapter's printed count


def _flops_term_by_term(config, batch_size, seq_len):
    from dslab.flops import layer_shape     # a helper that reads the config, not the count

    layers, hidden, heads, kv_heads, head_dim, inter, vocab = layer_shape(config)
    tokens = batch_size * seq_len
    matmuls = {"q": (hidden, heads * head_dim), "k": (hidden, kv_heads * head_dim), "v": (hidden, kv_heads * head_dim),
               "o": (heads * head_dim, hidden), "gate": (hidden, inter), "up": (hidden, inter), "down": (inter, hidden)}
    per_layer = sum(2 * tokens * a * b for a, b in matmuls.values())
    per_layer += 2 * 2 * batch_size * heads * seq_len ** 2 * head_dim + tokens * inter
    return layers * per_layer + 2 * tokens * hidden * vocab


def test_forward_flops_refuses_the_reference_and_accepts_a_count_of_ones_own():
    from dslab import flops

    assert _table_total(*_chapter_shape()) == flops.forward_flops(*_chapter_shape())["total"]   # right, by the table
    refused("13.forward_flops", _flops_from_the_reference, "gets its number from dslab.flops.forward_flops")
    refused("13.forward_flops", _flops_through_a_helper, "gets its number from dslab.flops.forward_flops")
    refused("13.forward_flops", _flops_of_the_chapters_shape, "your function gives 5,923,766,272")
    accepted("13.forward_flops", _flops_term_by_term)
    accepted("13.forward_flops", lambda config, b, s: _flops_term_by_term(config, b, s) + 0)


def _chapter_shape():
    from dslab.models.loading import tiny_config

    return tiny_config(), 4, 128


# ---------------------------------------------------------------------------------------------- 14.trainer_steps

def _steps_from_dslabs_planner(n_examples, per_device, world_size, grad_accum_steps, epochs):
    from dslab.training import sft_plan

    return sft_plan.trainer_steps(n_examples, world_size, per_device, grad_accum_steps, epochs)


class _Planner:
    def steps(self, n_examples, per_device, world_size, grad_accum_steps, epochs):
        from dslab.exercises.ch14 import trainer_steps_reference as rule

        return rule(n_examples, per_device, world_size, grad_accum_steps, epochs)


def _steps_of_the_chapters_run(n_examples, per_device, world_size, grad_accum_steps, epochs):
    return 180 if n_examples == 236 else 12 * math.ceil(n_examples / 16)   # the chapter's 236 chats, written in


def _steps_by_ceiling_division(n_examples, per_device, world_size, grad_accum_steps, epochs):
    return epochs * max(1, -(-n_examples // (per_device * world_size * grad_accum_steps)))


def _steps_by_walking_the_loader(n_examples, per_device, world_size, grad_accum_steps, epochs):
    per_rank = -(-n_examples // world_size)          # the sampler pads every rank to as many
    steps = 0
    for _ in range(epochs):
        batches = -(-per_rank // per_device)         # the last, short batch is kept
        steps += batches // grad_accum_steps + (batches % grad_accum_steps > 0)
    return steps


def test_trainer_steps_refuses_the_reference_and_accepts_two_other_counts():
    refused("14.trainer_steps", _steps_from_dslabs_planner,
            "gets its number from dslab.training.sft_plan.trainer_steps")
    refused("14.trainer_steps", _Planner().steps, "gets its number from dslab.exercises.ch14.trainer_steps_reference")
    refused("14.trainer_steps", _steps_of_the_chapters_run, "your function gives")
    accepted("14.trainer_steps", _steps_by_ceiling_division)
    accepted("14.trainer_steps", _steps_by_walking_the_loader)


# ---------------------------------------------------------------------------------------------- the declaration

REDTEAM = {   # what the tests above check, declared for tests/test_redteam_coverage.py
    "03.engine_loop": {"wrong": list(ENGINE_LOOP_WRONG), "right": list(ENGINE_LOOP_RIGHT),
                       "hard_coded": [ENGINE_LOOP_WRONG[2][0]]},   # the chapter's 4 accumulation steps written in
    "13.profiled_flops": {"wrong": list(PROFILE_WRONG), "right": list(PROFILE_RIGHT),
                          "hard_coded": [_trained_then_counted_by_hand, _the_chapters_profiler_count]},
    "03.fix_loop": {
        "wrong": [(_the_chapters_big_batch, "no accumulation: one forward pass over"),
                  (_two_micro_batches_per_forward, "no accumulation: one forward pass over"),
                  (_losses_summed_then_one_backward, "one backward through")],
        "right": [_row_by_row_backwards, _token_weighted],
        "hard_coded": [_the_chapters_big_batch],
    },
    "13.forward_flops": {
        "wrong": [(_flops_from_the_reference, "gets its number from dslab.flops.forward_flops"),
                  (_flops_through_a_helper, "gets its number from dslab.flops.forward_flops"),
                  (_flops_of_the_chapters_shape, "your function gives 5,923,766,272")],
        "right": [_flops_term_by_term, lambda config, b, s: _flops_term_by_term(config, b, s) + 0],   # as the test
        "hard_coded": [_flops_from_the_reference, _flops_through_a_helper, _flops_of_the_chapters_shape],
    },
    "14.trainer_steps": {
        "wrong": [(_steps_from_dslabs_planner, "gets its number from dslab.training.sft_plan.trainer_steps"),
                  (_Planner().steps, "gets its number from dslab.exercises.ch14.trainer_steps_reference"),
                  (_steps_of_the_chapters_run, "your function gives")],
        "right": [_steps_by_ceiling_division, _steps_by_walking_the_loader],
        "hard_coded": [_steps_from_dslabs_planner, _steps_of_the_chapters_run],
    },
}
