"""Chapter 07 (inference): AutoTP all-reduces and shards, and an init_inference call.

Solutions: notebooks/solutions/07_solutions.py."""
from dslab.exercises import Mistake, exercise, expect

def _wrong_init_inference(**kwargs):
    def make_engine(model):
        import deepspeed

        return deepspeed.init_inference(model, **kwargs)
    return make_engine


def _wrong_kwargs():
    import torch

    return ({}, {"dtype": torch.bfloat16}, {"dtype": torch.float32, "tensor_parallel": {"tp_size": 2}},
            {"dtype": torch.float32, "replace_with_kernel_inject": True})


WRONG_INIT_INFERENCE = tuple(_wrong_init_inference(**kw) for kw in _wrong_kwargs()) + (lambda model: model,)


def check_init_inference(make_engine):
    """Run the learner's `make_engine(model)` in this process (a world of 1) on dslab-tiny and compare its greedy
    answer and logits with plain Hugging Face generation in float32; name what is wrong."""
    import copy

    import torch
    from deepspeed.inference.engine import InferenceEngine

    from dslab import infer, models, train
    train.init_single_process(quiet=True)
    tokenizer, model = models.load_tokenizer(), models.load_model().eval()
    ids = tokenizer(infer.prompt_text(tokenizer, "Who are you?", chat=True), return_tensors="pt")
    with torch.no_grad():
        expected = model.generate(**ids, max_new_tokens=16, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        expected_logits = model(**ids).logits
    try:
        engine = make_engine(copy.deepcopy(model))
    except ValueError as err:
        if "float16" in str(err):
            raise Mistake(f"DeepSpeed says: {err}. init_inference's dtype defaults to torch.float16, which the CPU "
                          "accelerator refuses: pass dtype=torch.float32") from None
        if "world size" in str(err):
            raise Mistake(f"DeepSpeed says: {err}. tensor_parallel={{'tp_size': 2}} needs 2 ranks and this is one "
                          "process: tp_size 1 here (tp=2 runs on 2 ranks through the launcher)") from None
        raise
    if not isinstance(engine, InferenceEngine):
        raise Mistake(f"that returned a {type(engine).__name__}: return the InferenceEngine that "
                      "deepspeed.init_inference(model, ...) gives back")
    if engine._config.replace_with_kernel_inject:
        raise Mistake("replace_with_kernel_inject=True asks for DeepSpeed's fused GPU kernels; there are none for "
                      "Qwen2 and no GPU here, so DeepSpeed leaves the model's layers as they were. Use "
                      "replace_with_kernel_inject=False (AutoTP: the model's own layers)")
    dtype = next(engine.module.parameters()).dtype
    with torch.no_grad():
        logits = engine(**ids).logits
        output = engine.module.generate(**ids, max_new_tokens=16, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    diff = (logits.float() - expected_logits).abs().max().item()
    if dtype != torch.float32:
        raise Mistake(f"the engine converted the weights to {dtype}: its logits differ from float32 Hugging Face by "
                      f"{diff:.2g}. Pass dtype=torch.float32 to compare with plain generation")
    if not torch.equal(output, expected) or diff > 1e-5:
        raise Mistake(f"the engine's greedy answer or logits differ from Hugging Face's (max |logit diff| {diff:.2g})")
    return True


# dslab-tiny: 4 blocks, each with one all-reduce after o_proj and one after down_proj (AutoTP).
expect("07.allreduces_per_token", 8, wrong=(4, 2, 16, 7),
       hint="AutoTP puts an all-reduce after each row-split layer: o_proj and down_proj in every block. "
            "Count the blocks (model.config.num_hidden_layers).")
# v_proj of dslab-tiny is 256 -> 128 (2 KV heads x 64); split by output features over tp=2.
expect("07.v_proj_shard", [64, 256], wrong=([128, 128], [128, 256], [64, 128], [256, 64]),
       hint="a torch Linear's weight is [out_features, in_features]; AutoTP splits v_proj by output features, "
            "so each of the 2 ranks keeps half of the rows.")
exercise("07.init_inference", hint="make_engine(model) must return deepspeed.init_inference(model, ...)",
         wrong=WRONG_INIT_INFERENCE)(check_init_inference)
