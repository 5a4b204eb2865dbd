"""The course's GPU claims, checked on a GPU: an fp16 DeepSpeed engine with dynamic loss scaling, nccl across two
ranks, kernel injection through init_inference. On a CPU machine each test skips (see conftest.py)."""
import math

import pytest


@pytest.fixture(scope="module")
def single_process_world():
    """This process as rank 0 of a world of one on GPU 0 (what a notebook kernel does in chapter 02)."""
    import torch

    from dslab import this_rank

    torch.cuda.set_device(0)
    this_rank.init_single_process(quiet=True)


@pytest.mark.gpus(1)
def test_fp16_engine_skips_overflowing_steps_and_halves_the_loss_scale(single_process_world):
    """Chapter 02 on a GPU: start with a loss scale far too big; each overflowing step is skipped (weights
    untouched) and halves the scale, until the scaled gradients fit in fp16; then the steps train."""
    import deepspeed
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))
    config = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1,
              "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 30, "hysteresis": 1,
                       "loss_scale_window": 1000, "min_loss_scale": 1},
              # torch's AdamW: no JIT-built fused optimizer, so no CUDA compiler is needed for this check
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    assert engine.fp16_enabled() and next(engine.module.parameters()).dtype == torch.float16
    x = torch.randn(8, 32, device=engine.device, dtype=torch.float16)
    y = torch.randn(8, 1, device=engine.device, dtype=torch.float16)
    scales, skipped, losses = [], [], []
    for _ in range(40):
        before = [p.detach().clone() for p in engine.module.parameters()]
        scale = engine.optimizer.cur_scale
        loss = (engine(x).float() - y.float()).pow(2).mean()
        engine.backward(loss)
        engine.step()
        moved = any(not torch.equal(b, p) for b, p in zip(before, engine.module.parameters()))
        scales.append(scale)
        skipped.append(not moved)
        losses.append(loss.item())
    first_step = skipped.index(False)
    assert first_step >= 1, "a 2**30 loss scale must overflow fp16 gradients at first"
    assert all(skipped[:first_step]) and not any(skipped[first_step:]), skipped
    for i in range(first_step):  # each skipped step halved the scale
        assert scales[i + 1] == scales[i] / 2, scales[: first_step + 2]
    assert engine.skipped_steps == first_step
    assert all(math.isfinite(v) for v in losses[first_step:]) and losses[-1] < losses[first_step]


@pytest.mark.gpus(2)
def test_nccl_all_reduce_across_two_ranks():
    """Chapter 01's collectives recipe through the deepspeed launcher: one GPU per rank, nccl, exact sums."""
    from dslab import launch

    run = launch.run("collectives", world_size=2, stream=False, timeout=600)
    by_rank = {r["rank"]: r for r in run.results}
    assert sorted(by_rank) == [0, 1]
    for r in by_rank.values():
        assert r["backend"] == "nccl"
        assert r["all_reduce"] == [a + b for a, b in zip(by_rank[0]["input"], by_rank[1]["input"])]
        assert r["broadcast"] == by_rank[0]["input"]
    assert by_rank[0]["reduce_scatter"] + by_rank[1]["reduce_scatter"] == by_rank[0]["all_reduce"]


@pytest.fixture(scope="module")
def inference_kernels_build():
    """Kernel injection JIT-compiles DeepSpeed's inference ops: that needs the CUDA toolkit (nvcc), not just a GPU."""
    from deepspeed.ops.op_builder import InferenceBuilder

    if not InferenceBuilder().is_compatible(verbose=False):
        pytest.skip("this GPU machine cannot build DeepSpeed's inference kernels (no CUDA toolkit / nvcc?)")


@pytest.mark.gpus(1)
def test_kernel_injection_replaces_the_blocks_and_keeps_the_logits(single_process_world, inference_kernels_build):
    """Chapter 07's kernel injection: init_inference(replace_with_kernel_inject=True) swaps every block of a model
    family with a policy (a tiny Llama, built here, nothing downloaded) for DeepSpeed's fused block; same logits.
    dslab-tiny (Qwen2) has no policy: the kit says so instead of failing inside DeepSpeed."""
    import deepspeed
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from dslab.models import loading
    from dslab.parallel import tp_infer

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128)
    model = LlamaForCausalLM(cfg).half().cuda().eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 16), device="cuda")
    with torch.no_grad():
        reference = model(input_ids=ids).logits.float()
    assert tp_infer.kernel_inject_problem(model, "fp16") is None
    engine = deepspeed.init_inference(model, tensor_parallel={"tp_size": 1}, dtype=torch.float16,
                                      replace_with_kernel_inject=True)
    injected = [m for m in engine.module.modules() if type(m).__name__ == "DeepSpeedTransformerInference"]
    assert len(injected) == cfg.num_hidden_layers
    with torch.no_grad():
        logits = engine.module(input_ids=ids).logits.float()
    assert (logits - reference).abs().max().item() < 5e-2 * reference.abs().max().item()
    problem = tp_infer.kernel_inject_problem(loading.load_model(dtype="fp16"), "fp16")
    assert problem and "no kernel-injection policy" in problem and "Qwen2DecoderLayer" in problem


@pytest.mark.gpus(1)
@pytest.mark.slow
def test_every_notebook_runs_on_a_gpu(tmp_path):
    """The notebooks "scale to GPUs without edits": each runs top to bottom on this machine without an error, its
    asserts included. Outputs differ from the stored CPU ones (devices, nccl, timings), so this executes rather than
    compares (nbval compares on CPU); the executed copies go to a temporary folder, the chapters are left alone."""
    from tools import record

    notebooks = record.chapters([])
    assert notebooks
    failed = {}
    for path in notebooks:
        try:
            record.record(path, out_dir=tmp_path, timeout=600)
        except Exception as exc:  # CellExecutionError names the cell and carries its traceback
            failed[path.name] = str(exc)[-3000:]
    assert not failed, "\n\n".join(f"{name}:\n{why}" for name, why in failed.items())
