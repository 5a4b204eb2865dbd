"""Greedy generation with the model split across all ranks by DeepSpeed AutoTP (deepspeed.init_inference)."""
from dslab import dist, infer, tp_infer

args = dist.recipe_args(prompts=[], model=None, adapter=None, dtype="float32", kernel_inject=False,
                        max_new_tokens=64, chat=False, system=None, temperature=0.0, benchmark_tokens=0, seed=0)
rank, world_size = dist.init()
dist.seed_all(args.seed)  # sampling (temperature > 0) then draws the same tokens on every rank
prompts = tp_infer.same_prompts_on_every_rank(args.prompts)  # raises on every rank if any rank differs
model, tokenizer = tp_infer.load_model(args.model, args.adapter, args.dtype)
policy = tp_infer.autotp_policy(model)  # what AutoTP's parser decided, before it splits anything
# Every rank loads the whole model, then keeps only its slice of each linear layer (tp_size = world size).
engine = tp_infer.init_engine(model, tp_size=world_size, dtype=args.dtype, kernel_inject=args.kernel_inject)
completions = infer.generate(engine.module, tokenizer, prompts, args.max_new_tokens, chat=args.chat,
                             temperature=args.temperature, system=args.system)
timing = (tp_infer.timed_generate(engine.module, tokenizer, prompts, args.benchmark_tokens)
          if args.benchmark_tokens else None)
dist.save_result({"rank": rank, "world_size": world_size, "prompts": prompts, "completions": completions,
                  "policy": policy, "layers": tp_infer.layer_table(engine.module), "timing": timing})
