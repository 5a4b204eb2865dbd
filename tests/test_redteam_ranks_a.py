"""Red-team tests of 11.pipeline, 11.tensor_data, 12.zero3_generate and 07.init_inference: checkers that judge the
work done on the ranks, not only the numbers the learner's function returns. For each, wrong answers (one hard-coded
or leaning on a reference function of the package) are refused with their mistake named, and right answers in
unusual but valid forms are accepted:

- 11.pipeline: the PipelineEngine must have trained (engine.global_steps, the engine.train_batch calls the trial
  saw), the losses returned must be what train_batch returned, and each stage's weights must be those of the same
  layers trained in one process: losses from pipeline.train_one_process, weights copied in, an extra optimizer step
  or typed-in losses are refused;
- 11.tensor_data: the same for the AutoTP engine (global_steps; each rank's slices against one process's model);
- 12.zero3_generate: the tokens must come from a generate whose model ZeRO-3 partitioned (ds_numel, ds_tensor), run
  in step with the other ranks; a plain model, a copy made before deepspeed.initialize, a ZeRO-1 or 2 engine are
  refused, and ZeRO-1 without an optimizer is named as DeepSpeed's refusal it is;
- 07.init_inference runs on 2 and then 3 ranks: a tp_size typed in is named.

The answers here run in the launches every rank check of the session shares, one per world size (tests/support.py:
run_rank_exercises_together, which calls prepare_all_on_ranks below)."""
import functools

import pytest

from dslab import compat, exercises

import support
from support import accepted, refused, said


# ---------------------------------------------------------------------------------------------- 11.pipeline

def _pipeline_engine(shape, steps, **config):
    """The solution's PipelineModule and engine, untrained: (specs, engine)."""
    import deepspeed
    import torch
    from deepspeed.pipe import LayerSpec, PipelineModule

    from dslab.parallel import pipeline

    specs = [LayerSpec(pipeline.Embed, shape["vocab"], shape["hidden"]),
             *[LayerSpec(pipeline.Block, shape["hidden"], shape["intermediate"]) for _ in range(shape["blocks"])],
             LayerSpec(pipeline.Head, shape["hidden"], shape["vocab"])]
    net = PipelineModule(layers=specs, num_stages=torch.distributed.get_world_size(), loss_fn=pipeline.lm_loss,
                         partition_method="uniform", seed_layers=True, base_seed=pipeline.BASE_SEED)
    micro, count = steps[0][0].shape[0], len(steps[0])
    ds_config = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": count,
                 "train_batch_size": micro * count,
                 "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0, "torch_adam": True}},
                 "gradient_clipping": 0.0, "steps_per_print": 10**6, **config}
    engine, *_ = deepspeed.initialize(model=net, config=ds_config)
    return specs, engine


def _pipeline_train(engine, steps, times=1):
    return [[engine.train_batch(data_iter=iter([(t, t) for t in micro])).item() for _ in range(times)][-1]
            for micro in steps]


def _pipeline_weights_copied_in(shape, steps):
    """The package's one-process training, its weights copied into the stages and global_steps set by hand."""
    import torch

    from dslab.parallel import pipeline

    specs, engine = _pipeline_engine(shape, steps)
    twin = pipeline.sequential_twin(specs)
    losses = pipeline.train_one_process(twin, [[(t, t) for t in micro] for micro in steps], lr=1e-3)
    with torch.no_grad():
        for i, layer in enumerate(engine.module.forward_funcs):
            layer.load_state_dict(twin[compat.pipeline_local_start(engine.module) + i].state_dict())
    engine.global_steps = len(steps)
    return engine, losses


def _pipeline_each_step_twice(shape, steps):
    specs, engine = _pipeline_engine(shape, steps)
    return engine, _pipeline_train(engine, steps, times=2)


def _pipeline_typed_losses(shape, steps):
    specs, engine = _pipeline_engine(shape, steps)
    _pipeline_train(engine, steps)
    return engine, [9.348933, 9.045598, 8.495984][:len(steps)]     # numbers a run printed once


def _pipeline_extra_optimizer_step(shape, steps):
    """One more optimizer step after the loop, on zeroed gradients: AdamW's momentum still moves every weight."""
    import torch

    specs, engine = _pipeline_engine(shape, steps)
    losses = _pipeline_train(engine, steps)
    for p in engine.module.parameters():
        p.grad = torch.zeros_like(p)
    engine.optimizer.step()
    return engine, losses


def _pipeline_client_optimizer(shape, steps):
    """torch's AdamW handed to deepspeed.initialize, the micro batch derived from train_batch_size, one iterator over
    every step's micro-batches, the losses kept as tensors, a list returned."""
    import deepspeed
    import torch
    from deepspeed.pipe import LayerSpec, PipelineModule

    from dslab.parallel import pipeline

    layers = [LayerSpec(pipeline.Embed, shape["vocab"], shape["hidden"])]
    layers += [LayerSpec(pipeline.Block, shape["hidden"], shape["intermediate"]) for _ in range(shape["blocks"])]
    layers.append(LayerSpec(pipeline.Head, shape["hidden"], shape["vocab"]))
    net = PipelineModule(layers, loss_fn=pipeline.lm_loss, num_stages=torch.distributed.get_world_size(),
                         partition_method="uniform", seed_layers=True, base_seed=pipeline.BASE_SEED)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=0.0)
    engine, *_ = deepspeed.initialize(model=net, optimizer=optimizer, config={
        "train_batch_size": steps[0][0].shape[0] * len(steps[0]), "gradient_accumulation_steps": len(steps[0]),
        "gradient_clipping": 0.0})
    pairs = iter([(tokens, tokens) for micro in steps for tokens in micro])
    return [engine, [engine.train_batch(pairs) for _ in steps]]


def _pipeline_topology(shape, steps):
    """The stages given as a topology (pipe x data = ranks x 1), the data from a generator."""
    import deepspeed
    import torch
    from deepspeed.pipe import LayerSpec, PipelineModule
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology

    from dslab.parallel import pipeline

    world_size = torch.distributed.get_world_size()
    specs = [LayerSpec(pipeline.Embed, shape["vocab"], shape["hidden"])]
    specs += [LayerSpec(pipeline.Block, shape["hidden"], shape["intermediate"])] * shape["blocks"]
    specs += [LayerSpec(pipeline.Head, shape["hidden"], shape["vocab"])]
    net = PipelineModule(layers=specs, topology=PipeDataParallelTopology(num_pp=world_size, num_dp=1),
                         loss_fn=pipeline.lm_loss, partition_method="uniform", seed_layers=True,
                         base_seed=pipeline.BASE_SEED)
    engine, _, _, _ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config={
        "train_micro_batch_size_per_gpu": steps[0][0].shape[0], "gradient_accumulation_steps": len(steps[0]),
        "optimizer": {"type": "AdamW", "params": {"lr": 0.001, "weight_decay": 0, "torch_adam": True}},
        "gradient_clipping": 0})

    def pairs(micro_batches):
        for tokens in micro_batches:
            yield tokens, tokens

    return engine, [float(engine.train_batch(data_iter=pairs(micro))) for micro in steps]


PIPELINE_WRONG = (
    (_pipeline_weights_copied_in, "engine.train_batch ran 0 times"),
    (_pipeline_each_step_twice, "times on rank 0 (engine.global_steps: "),
    (_pipeline_typed_losses, "but its engine.train_batch calls returned"),
    (_pipeline_extra_optimizer_step, "weights differ from the same layers trained in one process"),
)
PIPELINE_RIGHT = (_pipeline_client_optimizer, _pipeline_topology)


# ---------------------------------------------------------------------------------------------- 11.tensor_data

def _tensor_data_engine(model, autotp_size, steps):
    """The solution's AutoTP engine, untrained: (engine, layout, this rank's replica)."""
    import deepspeed
    import torch
    from deepspeed.utils import groups

    rows = steps[0][0].shape[0]
    engine, *_ = deepspeed.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": rows, "gradient_accumulation_steps": 1,
        "train_batch_size": rows * torch.distributed.get_world_size(),
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0, "torch_adam": True}},
        "gradient_clipping": 0.0, "tensor_parallel": {"autotp_size": autotp_size}, "zero_optimization": {"stage": 1},
        "steps_per_print": 10**6})
    layout = {"tensor_parallel": torch.distributed.get_process_group_ranks(groups.get_tensor_model_parallel_group()),
              "data_parallel": torch.distributed.get_process_group_ranks(groups.get_data_parallel_group())}
    return engine, layout, groups.get_data_parallel_rank()


def _tensor_data_step(engine, tokens):
    loss = engine(input_ids=tokens, labels=tokens).loss
    engine.backward(loss)
    engine.step()
    return loss.item()


def _tensor_data_steps_set_by_hand(model, autotp_size, steps):
    """The package's one-process training for the losses, engine.global_steps set to match."""
    import copy

    from dslab.parallel import tensor_parallel

    alone = copy.deepcopy(model)
    engine, layout, replica = _tensor_data_engine(model, autotp_size, steps)
    losses = [step[replica] for step in tensor_parallel.train_one_process(alone, steps)]
    engine.global_steps = len(steps)
    return engine, layout, losses


def _tensor_data_each_batch_twice(model, autotp_size, steps):
    engine, layout, replica = _tensor_data_engine(model, autotp_size, steps)
    return engine, layout, [[_tensor_data_step(engine, b[replica]) for _ in range(2)][0] for b in steps]


def _tensor_data_typed_losses(model, autotp_size, steps):
    engine, layout, replica = _tensor_data_engine(model, autotp_size, steps)
    for batches in steps:
        _tensor_data_step(engine, batches[replica])
    return engine, layout, [5.5] * len(steps)


def _tensor_data_derived_micro(model, autotp_size, steps):
    """The micro batch derived from train_batch_size, the replica read as this rank's place in its data-parallel group,
    the engine called positionally, losses kept as tensors, a list returned."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed.utils import groups

    engine, *_ = deepspeed.initialize(model=model, config={
        "train_batch_size": steps[0][0].shape[0] * dist.get_world_size(), "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0, "torch_adam": True}},
        "gradient_clipping": 0.0, "tensor_parallel": {"autotp_size": autotp_size}, "zero_optimization": {"stage": 1}})
    data_group = groups.get_data_parallel_group()
    layout = {"data_parallel": tuple(dist.get_process_group_ranks(data_group)),
              "tensor_parallel": tuple(dist.get_process_group_ranks(groups.get_tensor_model_parallel_group()))}
    replica = dist.get_rank(group=data_group)
    losses = []
    for batches in steps:
        out = engine(batches[replica], labels=batches[replica])
        engine.backward(out.loss)
        engine.step()
        losses.append(out.loss.detach())
    return [engine, layout, losses]


def _tensor_data_model_parameters(model, autotp_size, steps):
    """model_parameters handed to deepspeed.initialize (it re-points them at AutoTP's slices), AdamW's other settings
    written out, ZeRO-1 with a bucket size, the loop over step indices."""
    import deepspeed
    import torch
    from deepspeed.utils import groups

    rows, world_size = steps[0][0].shape[0], torch.distributed.get_world_size()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config={
        "train_micro_batch_size_per_gpu": rows, "gradient_accumulation_steps": 1, "train_batch_size": rows * world_size,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8,
                                                  "weight_decay": 0.0, "torch_adam": True}},
        "gradient_clipping": 0.0, "bf16": {"enabled": False}, "tensor_parallel": {"autotp_size": autotp_size},
        "zero_optimization": {"stage": 1, "reduce_bucket_size": 50_000_000}})
    engine.train()
    layout = {"tensor_parallel": torch.distributed.get_process_group_ranks(groups.get_tensor_model_parallel_group()),
              "data_parallel": torch.distributed.get_process_group_ranks(groups.get_data_parallel_group())}
    losses = []
    for s in range(len(steps)):
        tokens = steps[s][groups.get_data_parallel_rank()]
        losses.append(_tensor_data_step(engine, tokens))
    return engine, layout, losses


TENSOR_DATA_WRONG = (
    (_tensor_data_steps_set_by_hand, "still holds the weights it started with"),
    (_tensor_data_each_batch_twice, "optimizer steps on rank 0 (engine.global_steps) for the case's"),
    (_tensor_data_typed_losses, "none of the replicas' batches"),
)
TENSOR_DATA_RIGHT = (_tensor_data_derived_micro, _tensor_data_model_parameters)


# ---------------------------------------------------------------------------------------------- 12.zero3_generate

def _greedy(model, prompt, new_tokens, **kwargs):
    return model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                          pad_token_id=0, **kwargs)[0, prompt.shape[1]:]


def _generate_on_a_copy_made_first(model, prompt, new_tokens):
    """The checker's own reference: a plain copy generates; the ZeRO-3 engine is built and left unused."""
    import copy

    import deepspeed

    alone = copy.deepcopy(model)
    deepspeed.initialize(model=model, config={"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}})
    return _greedy(alone, prompt, new_tokens, synced_gpus=True)


def _generate_zero2_with_optimizer(model, prompt, new_tokens):
    import deepspeed

    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config={
        "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}})
    return _greedy(engine.module, prompt, new_tokens)


def _generate_zero1(model, prompt, new_tokens):
    import deepspeed

    engine, *_ = deepspeed.initialize(model=model, config={"train_micro_batch_size_per_gpu": 1,
                                                          "zero_optimization": {"stage": 1}})
    return _greedy(engine.module, prompt, new_tokens, synced_gpus=True)


def _generate_typed_tokens(model, prompt, new_tokens):
    import deepspeed

    engine, *_ = deepspeed.initialize(model=model, config={"train_micro_batch_size_per_gpu": 1,
                                                          "zero_optimization": {"stage": 3}})
    _greedy(engine.module, prompt, new_tokens, synced_gpus=True)
    return [0] * new_tokens


def _generate_hf_deepspeed_config(model, prompt, new_tokens):
    """transformers' HfDeepSpeedConfig kept alive: its generate then syncs the ranks by itself (synced_gpus left out);
    the model itself generates (ZeRO-3 partitioned it in place), lengths as max_length, a list of ints returned."""
    import deepspeed
    from transformers.integrations import HfDeepSpeedConfig

    ds_config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
    keep = HfDeepSpeedConfig(ds_config)   # noqa: F841 (transformers holds only a weak reference)
    deepspeed.initialize(model=model, config=ds_config)
    total = prompt.shape[1] + new_tokens
    out = model.generate(input_ids=prompt, max_length=total, min_length=total, do_sample=False, pad_token_id=0,
                         return_dict_in_generate=True)
    return [int(t) for t in out.sequences[0, prompt.shape[1]:]]


def _generate_nothing_persistent(model, prompt, new_tokens):
    """ZeRO-3 with an optimizer and no persistent parameter (every forward gathers every weight), a GenerationConfig,
    the tail of the output returned."""
    import deepspeed
    from transformers import GenerationConfig

    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config={
        "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})
    settings = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return engine.module.generate(prompt, settings, synced_gpus=True)[0][-new_tokens:]


GENERATE_WRONG = (
    (_generate_on_a_copy_made_first, "holds every weight whole"),
    (_generate_zero2_with_optimizer, "holds every weight whole"),
    (_generate_zero1, "refused ZeRO stage 1 without an optimizer"),
    (_generate_typed_tokens, "are not greedy decoding's"),
)
GENERATE_RIGHT = (_generate_hf_deepspeed_config, _generate_nothing_persistent)


# ---------------------------------------------------------------------------------------------- 07.init_inference

def _inference_mp_size_two(model):
    import deepspeed
    import torch

    return deepspeed.init_inference(model, dtype=torch.float32, mp_size=2, replace_with_kernel_inject=False)


def _inference_tp_size_three(model):
    import deepspeed
    import torch

    return deepspeed.init_inference(model, dtype=torch.float32, tensor_parallel={"tp_size": 3},
                                    replace_with_kernel_inject=False)


def _inference_gpus_or_two(model):
    import deepspeed
    import torch

    return deepspeed.init_inference(model, dtype=torch.float32, replace_with_kernel_inject=False,
                                    tensor_parallel={"tp_size": torch.cuda.device_count() or 2})


def _inference_config_dict(model):
    """Everything in init_inference's config dict, the dtype by name, the size from the launcher's WORLD_SIZE."""
    import os

    import deepspeed

    return deepspeed.init_inference(model, config={"dtype": "fp32", "replace_with_kernel_inject": False,
                                                   "tensor_parallel": {"tp_size": int(os.environ["WORLD_SIZE"])}})


def _inference_mp_size_of_the_job(model):
    """init_inference's older mp_size key (DeepSpeed reads it as tensor_parallel.tp_size), deepspeed.comm's size."""
    import deepspeed
    import deepspeed.comm as dist
    import torch

    return deepspeed.init_inference(model, mp_size=dist.get_world_size(), dtype=torch.float)


INFERENCE_WRONG = (
    (_inference_mp_size_two, "tp_size is 2, but the job has 3 ranks"),
    (_inference_tp_size_three, "tp_size is 3, but the job has 2 ranks"),
    (_inference_gpus_or_two, "tp_size is 2, but the job has 3 ranks"),
)
INFERENCE_RIGHT = (_inference_config_dict, _inference_mp_size_of_the_job)


# ---------------------------------------------------------------------------------------------- the tests

CASES = {   # exercise id: (wrong answers and their words, right answers)
    "11.pipeline": (PIPELINE_WRONG, PIPELINE_RIGHT),
    "11.tensor_data": (TENSOR_DATA_WRONG, TENSOR_DATA_RIGHT),
    "12.zero3_generate": (GENERATE_WRONG, GENERATE_RIGHT),
    "07.init_inference": (INFERENCE_WRONG, INFERENCE_RIGHT),
}

HARD_CODED = {   # of the wrong answers above: those that type the numbers in or take them from the package's own run
    "11.pipeline": (_pipeline_weights_copied_in, _pipeline_typed_losses),
    "11.tensor_data": (_tensor_data_steps_set_by_hand, _tensor_data_typed_losses),
    "12.zero3_generate": (_generate_on_a_copy_made_first, _generate_typed_tokens),
    "07.init_inference": (_inference_mp_size_two, _inference_tp_size_three),
}
# What the tests below check, declared for tests/test_redteam_coverage.py
REDTEAM = {exercise_id: {"wrong": list(wrong), "right": list(right), "hard_coded": list(HARD_CODED[exercise_id])}
           for exercise_id, (wrong, right) in CASES.items()}


def prepare_all_on_ranks():
    """The answers of this file that run on ranks (within support.run_rank_exercises_together)."""
    for exercise_id, (wrong, right) in CASES.items():
        exercises.get(exercise_id).prepare([*right, *(answer for answer, _ in wrong)])


@functools.lru_cache(maxsize=None)
def _ran_on_ranks():
    support.run_rank_exercises_together()
    prepare_all_on_ranks()          # what the shared batch could not run runs now, per exercise


@pytest.mark.parametrize("exercise_id, answer, words",
                         [(e, a, w) for e, (wrong, _) in CASES.items() for a, w in wrong],
                         ids=[a.__name__ for wrong, _ in CASES.values() for a, _ in wrong])
def test_wrong_answers_are_refused_naming_the_mistake(exercise_id, answer, words):
    _ran_on_ranks()
    verdict, text = said(exercise_id, answer)
    assert verdict is False and text.startswith("Not quite: "), text
    assert words in text, f"expected {words!r} in:\n{text}"


@pytest.mark.parametrize("exercise_id, answer", [(e, a) for e, (_, right) in CASES.items() for a in right],
                         ids=[a.__name__ for _, right in CASES.values() for a in right])
def test_right_answers_in_unusual_forms_are_accepted(exercise_id, answer):
    _ran_on_ranks()
    verdict, text = said(exercise_id, answer)
    assert (verdict, text) == (True, "Correct!\n"), text


def test_the_registered_mistakes_of_work_not_done_are_among_the_wrong_answers():
    """Each exercise registers the answer that builds the engine and returns what one process computes (or generates
    without ZeRO-3, or types the chapter's tp_size in): tests/test_exercises.py runs them, refused by these words."""
    registered = {exercise_id: [words for _, words in exercises.get(exercise_id).wrong] for exercise_id in CASES}
    assert "engine.train_batch ran 0 times" in registered["11.pipeline"]
    assert "the engine took 0 optimizer steps" in registered["11.tensor_data"]
    assert {"holds every weight whole", "refused ZeRO stage 2 without an optimizer"} <= set(
        registered["12.zero3_generate"])
    assert "tp_size is 2, but the job has 3 ranks" in registered["07.init_inference"]


def test_what_the_checkers_say_of_transformers_is_in_its_source():
    """transformers' generate syncs the ranks on its own only under its DeepSpeed config (synced_gpus None), as
    12.zero3_generate says. What the checkers rely on in DeepSpeed's private code is read in tests/test_compat.py."""
    import inspect

    from transformers.generation import utils

    assert "(is_deepspeed_zero3_enabled() or is_fsdp_managed_module(self)) and world_size > 1" in \
        inspect.getsource(utils)
