"""Greedy generation with the model split across all ranks by DeepSpeed AutoTP (deepspeed.init_inference)."""
import argparse
import json
import os

import deepspeed

from dslab import this_rank
from dslab.models import loading
from dslab.parallel import tp_infer

parser = argparse.ArgumentParser(description="greedy generation with the model split over all ranks (AutoTP)")
parser.add_argument("--local_rank", type=int, default=-1)  # passed by the deepspeed launcher unless --no_local_rank
parser.add_argument("--prompts", type=json.loads, default=[])  # a JSON list of strings, the same on every rank
parser.add_argument("--model", default=None)  # a HF directory or hub id (default: dslab-tiny)
parser.add_argument("--adapter", default=None)  # a LoRA adapter, merged into the model first
parser.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
parser.add_argument("--kernel_inject", action="store_true")  # DeepSpeed's fused inference kernels (GPU only)
parser.add_argument("--max_new_tokens", type=int, default=64)
parser.add_argument("--chat", action="store_true")  # wrap each prompt in the chat template
parser.add_argument("--system", default=None)  # the chat's system message
parser.add_argument("--temperature", type=float, default=0.0)  # 0: greedy
parser.add_argument("--benchmark_tokens", type=int, default=0)  # also time generating this many tokens
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--logits", action="store_true")  # rank 0 also saves the logits beside its result
args = parser.parse_args()
rank, world_size = this_rank.init()
this_rank.seed_all(args.seed)  # sampling (temperature > 0) then draws the same tokens on every rank
prompts = tp_infer.same_prompts_on_every_rank(args.prompts)  # raises on every rank if any rank differs
# A LoRA adapter is merged first: AutoTP splits plain linear layers, not LoRA wrappers.
model = loading.load_model(args.model, adapter=args.adapter, dtype=args.dtype, merge_adapter=True)
tokenizer = loading.load_tokenizer(args.model, adapter=args.adapter)
policy = tp_infer.autotp_policy(model)  # what AutoTP's parser decided, before it splits anything
if args.kernel_inject:
    tp_infer.check_kernel_inject(model, args.dtype)  # a GPU and a model family with an injection policy

# The whole inference config; every field not named keeps DeepSpeed's default. dtype must be given on a CPU:
# init_inference defaults to float16, which the CPU accelerator refuses.
ds_config = {"tensor_parallel": {"tp_size": world_size}, "dtype": loading.DTYPES[args.dtype],
             "replace_with_kernel_inject": args.kernel_inject}
this_rank.print0(json.dumps(ds_config, indent=2, sort_keys=True))
# Every rank loads the whole model, then keeps only its slice of each linear layer (tp_size = world size).
# init_inference print()s AutoTP's policy on every rank, in an order that varies: kept out of the output.
with tp_infer.captured_output():
    engine = deepspeed.init_inference(model, tensor_parallel={"tp_size": world_size},
                                      dtype=loading.torch_dtype(args.dtype),
                                      replace_with_kernel_inject=args.kernel_inject)
out = tp_infer.generate_with_logits(engine.module, tokenizer, prompts, args.max_new_tokens, chat=args.chat,
                                    temperature=args.temperature, system=args.system)
timing = (tp_infer.timed_generate(engine.module, tokenizer, prompts, args.benchmark_tokens, repeats=3)
          if args.benchmark_tokens else None)
logits_file = None
if args.logits and rank == 0 and os.environ.get(this_rank.RESULT_DIR_ENV):
    import torch

    logits_file = os.path.join(os.environ[this_rank.RESULT_DIR_ENV], "rank0_logits.pt")
    torch.save(out["logits"], logits_file)
this_rank.save_rank_result({"rank": rank, "world_size": world_size, "prompts": prompts,
                            "completions": out["completions"], "new_tokens": out["new_tokens"],
                            "logits_file": logits_file, "config": ds_config, "policy": policy,
                            "layers": tp_infer.layer_table(engine.module), "timing": timing})
