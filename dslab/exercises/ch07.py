"""Chapter 07 (inference): AutoTP all-reduces and shards, and an init_inference call checked on 2 and 3 ranks.

Solutions: notebooks/solutions/07_solutions.py."""
from dslab import compat
from dslab.exercises import Mistake, exercise, expect, on_ranks

def _wrong_init_inference(**kwargs):
    """A make_engine that calls init_inference with these arguments (one of the known wrong answers)."""
    import functools

    return functools.partial(init_inference_with, **kwargs)


def init_inference_with(model, **kwargs):
    """deepspeed.init_inference(model, **kwargs), dtype given by name ("float32", ...) so that it can travel."""
    import deepspeed
    import torch

    if "dtype" in kwargs:
        kwargs["dtype"] = getattr(torch, kwargs["dtype"])
    return deepspeed.init_inference(model, **kwargs)


def _whole_model(model):
    return model


WRONG_INIT_INFERENCE = (
    (_wrong_init_inference(), "torch.float16"),                                 # dtype defaults to fp16
    (_wrong_init_inference(dtype="bfloat16", tensor_parallel={"tp_size": 2}), "torch.bfloat16"),
    (_wrong_init_inference(dtype="float32"), "each of the 2 ranks holds the whole model"),       # tp_size 1
    (_wrong_init_inference(dtype="float32", tensor_parallel={"tp_size": 2}), "tp_size is 2, but the job has 3 ranks"),
    (_wrong_init_inference(dtype="float32", tensor_parallel={"tp_size": 2}, replace_with_kernel_inject=True),
     "replace_with_kernel_inject=True"),
    (_whole_model, "return the InferenceEngine"),
)
TRIAL = "dslab.exercises.ch07:init_inference_trial"
# The job's ranks: 2 as in the chapter, then 3, where a tp_size of 2 typed in is refused. On 3, AutoTP splits
# dslab-tiny's 2 key-value heads 1, 1 and 0 (the third rank holds no attention: q_proj [0, 256]), and the engine's
# answer is still Hugging Face's.
WORLD_SIZES = (2, 3)
QUESTIONS = ("Who are you?", "What is the capital of France?", "你是谁？", "Tell me something about the sea.",
             "What can you do?", "今天天气怎么样？")


def draw_case(world_size, rng=None):
    """A question and an answer length, chosen now."""
    import random

    rng = rng or random.SystemRandom()
    return {"question": rng.choice(QUESTIONS), "new_tokens": rng.randint(8, 16)}


def _checked_engine_init(original, world_size):
    """InferenceEngine.__init__ as the trial runs it: a tp_size other than the job's ranks is named on every rank
    before DeepSpeed builds its group. DeepSpeed 0.19.8 (inference/engine.py, where the engine makes its
    model-parallel group) makes the group of ranks 0 .. tp_size - 1: a rank outside it fails to shard the layers
    (tp_size -1, "AutoTP shard sizes [] ... do not sum") while the others wait for it in a collective."""
    import functools

    @functools.wraps(original)
    def __init__(self, model, config):
        tp_size = config.tensor_parallel.tp_size
        if tp_size > 1 and tp_size != world_size and config.tensor_parallel.mpu is None:
            raise Mistake(f"tensor_parallel's tp_size is {tp_size}, but the job has {world_size} ranks: the checker "
                          "runs your function on 2 and then 3 ranks, and AutoTP must split the model over all of them. "
                          "Read the size from the job, tensor_parallel={\"tp_size\": "
                          "torch.distributed.get_world_size()}, not a number typed in")
        original(self, model, config)

    return __init__


def init_inference_trial(make_engine, case):
    """On each rank: the learner's `make_engine(model)` on dslab-tiny, its greedy answer and logits against plain
    Hugging Face generation in float32, and whether AutoTP split the layers over the ranks."""
    import copy

    import torch
    import torch.distributed as torch_dist
    from deepspeed.inference.engine import InferenceEngine
    from deepspeed.module_inject.layers import set_autotp_mode

    from dslab.models import infer, loading

    world_size = torch_dist.get_world_size()
    # What an earlier exercise's engine left in this process (the checks of a test session share their ranks): DeepSpeed
    # keeps the first inference engine's tensor-parallel group and gives it to every later one
    # (compat.forget_inference_group), and an AutoTP training engine switches AutoTP to training mode for good
    # (module_inject/layers.py, set_autotp_mode), in which init_inference takes the training groups instead of making
    # its own.
    compat.forget_inference_group()
    set_autotp_mode(training=False)
    tokenizer, model = loading.load_tokenizer(), loading.load_model().eval()
    ids = tokenizer(infer.prompt_text(tokenizer, case["question"], chat=True), return_tensors="pt")
    settings = dict(max_new_tokens=case["new_tokens"], do_sample=False, pad_token_id=tokenizer.pad_token_id)
    with torch.no_grad():
        expected = model.generate(**ids, **settings)
        expected_logits = model(**ids).logits
    whole = tuple(model.model.layers[0].self_attn.q_proj.weight.shape)
    original = InferenceEngine.__init__
    InferenceEngine.__init__ = _checked_engine_init(original, world_size)
    try:
        engine = make_engine(copy.deepcopy(model))
    except ValueError as err:
        if "float16" in str(err) or "fp16" in str(err):
            raise Mistake(f"DeepSpeed says: {err}. init_inference's dtype defaults to torch.float16, which the CPU "
                          "accelerator refuses: pass dtype=torch.float32") from None
        raise
    finally:
        InferenceEngine.__init__ = original
    if not isinstance(engine, InferenceEngine):
        raise Mistake(f"that returned a {type(engine).__name__}: return the InferenceEngine that "
                      "deepspeed.init_inference(model, ...) gives back")
    if compat.inference_config(engine).replace_with_kernel_inject:
        raise Mistake("replace_with_kernel_inject=True asks for DeepSpeed's fused GPU kernels; there are none for "
                      "Qwen2 and no GPU here, so DeepSpeed leaves the model's layers as they were. Use "
                      "replace_with_kernel_inject=False (AutoTP: the model's own layers)")
    dtype = next(engine.module.parameters()).dtype
    held = tuple(engine.module.model.layers[0].self_attn.q_proj.weight.shape)
    with torch.no_grad():
        logits = engine(**ids).logits
        output = engine.module.generate(**ids, **settings)
    diff = (logits.float() - expected_logits).abs().max().item()
    if dtype != torch.float32:
        raise Mistake(f"the engine converted the weights to {dtype}: its logits differ from float32 Hugging Face by "
                      f"{diff:.2g}. Pass dtype=torch.float32 to compare with plain generation")
    if held == whole:
        raise Mistake(f"each of the {world_size} ranks holds the whole model (q_proj {list(held)} on every rank): "
                      f"tensor_parallel's tp_size is 1. Split the layers over the job's ranks: "
                      "tensor_parallel={\"tp_size\": world size} (torch.distributed.get_world_size())")
    if not torch.equal(output, expected) or diff > 1e-4:
        raise Mistake(f"the engine's greedy answer or logits differ from Hugging Face's (max |logit diff| {diff:.2g})")
    return {"held": list(held), "whole": list(whole), "diff": diff}


def _nothing_more(case, results):
    """The trial itself names every mistake; a rank that returned has passed."""


def check_init_inference(make_engine):
    """Run the learner's `make_engine(model)` on 2, then 3 launched ranks (a question drawn now) and compare the
    engine's greedy answer and logits with plain Hugging Face generation in float32; name what is wrong."""
    if not callable(make_engine):
        raise Mistake("answer with the function itself: answer = make_engine")
    return on_ranks.check(TRIAL, make_engine, draw_case, _nothing_more, world_sizes=WORLD_SIZES)


# dslab-tiny: 4 blocks, each with one all-reduce after o_proj and one after down_proj (AutoTP).
expect("07.allreduces_per_token", 8,
       wrong=((4, "4 is one all-reduce per block: each block has two, after o_proj (attention) and after down_proj "
                  "(MLP)"),
              (2, "2 is one block's all-reduces: dslab-tiny has 4 blocks"),
              (16, "16 counts 4 per block: the column-split layers (q, k, v, gate, up) need no all-reduce; only the "
                   "row-split o_proj and down_proj end with one"),
              (9, "9 counts the output head too: the question leaves it out")),
       hint="AutoTP puts an all-reduce after each row-split layer: o_proj and down_proj in every block. "
            "Count the blocks (model.config.num_hidden_layers).")
# v_proj of dslab-tiny is 256 -> 128 (2 KV heads x 64); split by output features over tp=2.
expect("07.v_proj_shard", [64, 256],
       wrong=(([128, 128], "[128, 128] splits v_proj by its input features: AutoTP splits it by output features (its "
                           "rows), as it does q_proj and k_proj"),
              ([128, 256], "[128, 256] is the whole v_proj: tp=2 leaves each rank half of its output features"),
              ([64, 128], "[64, 128] halves both dimensions: only the output features are split"),
              ([256, 64], "[256, 64] is [in, out]: a torch Linear's weight is [out_features, in_features]")),
       hint="a torch Linear's weight is [out_features, in_features]; AutoTP splits v_proj by output features, "
            "so each of the 2 ranks keeps half of the rows.")
exercise("07.init_inference", hint="make_engine(model) must return deepspeed.init_inference(model, ...)",
         wrong=WRONG_INIT_INFERENCE,
         prepare=on_ranks.preparer(TRIAL, draw_case, WORLD_SIZES, _nothing_more))(check_init_inference)
