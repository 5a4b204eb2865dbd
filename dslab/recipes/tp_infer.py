"""Greedy generation with the model split across all ranks by DeepSpeed AutoTP (deepspeed.init_inference)."""
import json
import os

import deepspeed

from dslab import this_rank
from dslab.models import loading
from dslab.parallel import tp_infer

args = this_rank.recipe_args(prompts=[], model=None, adapter=None, dtype="fp32", kernel_inject=False,
                        max_new_tokens=64, chat=False, system=None, temperature=0.0, benchmark_tokens=0, seed=0,
                        logits=False)
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
this_rank.save_result({"rank": rank, "world_size": world_size, "prompts": prompts, "completions": out["completions"],
                  "new_tokens": out["new_tokens"], "logits_file": logits_file, "config": ds_config,
                  "policy": policy, "layers": tp_infer.layer_table(engine.module), "timing": timing})
