"""Chapter 11 (pipeline and tensor parallelism): the bubble, a tensor x data parallel config, and the chapter's three
coding exercises, each in a module of its own that registers it: 11.pipeline (dslab/exercises/ch11_pipeline.py),
11.tensor_data (ch11_tensor_data.py), 11.ulysses (ch11_ulysses.py).

Solutions: notebooks/solutions/11_solutions.py."""
from dslab.exercises import (Mistake, ch11_pipeline, ch11_tensor_data, ch11_ulysses, config_problems, exercise,
                             expect, resolved_config)

CODING = (ch11_pipeline, ch11_tensor_data, ch11_ulysses)   # imported for the exercises they register

# 4 stages, 12 micro-batches: (p - 1) / (m + p - 1) = 3 / 15 of every stage's time slots are idle.
expect("11.bubble", 0.2, rel=1e-3,
       wrong=((0.25, "0.25 is (p - 1) / m = 3 / 12: the step takes m + p - 1 = 15 slots, not 12, of which p - 1 idle"),
              (3 / 13, "3 / 13 divides by m + 1: a step takes m + p - 1 = 15 slots per stage"),
              (1 / 12, "1 / 12 counts one idle slot per step: each stage waits p - 1 = 3 slots (filling and "
                       "draining the pipeline)"),
              (0.75, "0.75 is (p - 1) / p, the bubble of a single micro-batch: here m = 12 micro-batches share "
                     "the same p - 1 idle slots")),
       hint="a 1F1B (or GPipe) step takes m + p - 1 slots per stage, of which m compute: the idle share is "
            "(p - 1) / (m + p - 1). Check with dslab.parallel.pipeline.schedule_bubble(12, 4).")
# 8 stages, idle share at most 10 %: 7 / (m + 7) <= 0.1 -> m >= 63.
expect("11.min_micro_batches", 63,
       wrong=((70, "70 solves (p - 1) / m <= 0.1: the idle share is (p - 1) / (m + p - 1), and 63 already gives "
                   "7 / 70 = 10 %"),
              (64, "64 gives 7 / 71, under 10 %, but 63 gives 7 / 70 = 10 %, which is at most 10 %: the smallest m"),
              (56, "56 leaves 7 / 63 = 11 % of the slots idle, above 10 %"),
              (7, "7 is p - 1, the idle slots per step: m micro-batches fill m + 7 slots, and 7 / (m + 7) <= 0.1 "
                  "needs m >= 63"),
              (72, "72 keeps the idle share under 10 %, but it is not the smallest m: 63 gives exactly 10 %")),
       hint="solve (p - 1) / (m + p - 1) <= 0.1 for the smallest whole m with p = 8 stages.")


# 11.tp_dp_config: 8 ranks in tensor-parallel groups of 2 = 4 model replicas (a data-parallel degree of 4; in
# DeepSpeed's sense 2 data-parallel groups of 4 ranks, one rank of each replica), ZeRO-1, micro batch 4, and 32
# distinct samples per optimizer step. The trap: DeepSpeed counts every rank, tensor-parallel ones too, in
# train_batch_size = micro x accumulation x world_size: deepspeed.initialize builds DeepSpeedConfig(config, mpu) with
# the mpu it was given (__init__.py; AutoTP training passes none), and runtime/config.py then takes
# dist.get_world_size(), while only the 4 replicas see different samples. The checker reads the config with
# DeepSpeed's own DeepSpeedConfig on 8 ranks, so every batch form DeepSpeed accepts is judged by what it resolves.
WORLD_SIZE, AUTOTP_SIZE, MICRO_BATCH, SAMPLES_PER_STEP = 8, 2, 4, 32
REPLICAS = WORLD_SIZE // AUTOTP_SIZE
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def _tp_config(**changes):
    """The solution's config with top-level keys replaced (None: removed)."""
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "train_batch_size": 64,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}},
           "tensor_parallel": {"autotp_size": 2}, "zero_optimization": {"stage": 1}}
    cfg.update(changes)
    return {k: v for k, v in cfg.items() if v is not None}


_TP_DP_WRONG = (
    (_tp_config(train_batch_size=32), "counts the 4 model replicas"),                    # counted the replicas only
    (_tp_config(gradient_accumulation_steps=1, train_batch_size=32), "= 16 distinct samples"),   # 4 x 1 x 4 = 16
    (_tp_config(gradient_accumulation_steps=None, train_batch_size=32),   # DeepSpeed derives 32 // (4 x 8) = 1
     "= 16 distinct samples"),
    (_tp_config(gradient_accumulation_steps=1, train_batch_size=16), "train_batch_size 16 counts"),  # 4 x 1 x 4 ranks
    (_tp_config(tensor_parallel={"tp_size": 2}), "tp_size is init_inference's key"),    # unknown to training
    (_tp_config(tensor_parallel={"autotp_size": 4}), "autotp_size is 4"),               # 2 replicas, not 4
    (_tp_config(zero_optimization={"stage": 3}), "zero_optimization.stage is 3"),       # ZeRO-1 was asked for
    (_tp_config(tensor_parallel=None), "no tensor_parallel.autotp_size"),
)


@exercise("11.tp_dp_config", wrong=_TP_DP_WRONG,
          hint="a dict with tensor_parallel.autotp_size, zero_optimization.stage 1, a micro batch of 4 and the "
               "accumulation that makes 32 distinct samples per step; DeepSpeed's batch check counts all 8 ranks.")
def _check_tp_dp_config(cfg):
    if not isinstance(cfg, dict):
        raise Mistake(f"a ds_config is a dict (the JSON object DeepSpeed reads), got {type(cfg).__name__}")
    if isinstance(cfg.get("tensor_parallel"), dict) and "tp_size" in cfg["tensor_parallel"]:
        raise Mistake("tensor_parallel.tp_size is init_inference's key (chapter 07); for training DeepSpeed reads "
                      "tensor_parallel.autotp_size, and refuses tp_size there (its pydantic model, TPTrainingConfig, "
                      "forbids unknown fields)")
    micro, accum, total = (cfg.get(k) for k in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                                                "train_batch_size"))
    if all(isinstance(v, int) and not isinstance(v, bool) for v in (micro, accum, total)) \
            and total == micro * accum * REPLICAS and total != micro * accum * WORLD_SIZE:
        raise Mistake(f"train_batch_size {total} counts the {REPLICAS} model replicas (the data-parallel degree), but "
                      f"DeepSpeed's check counts every rank (micro x accumulation x 8 = {micro * accum * WORLD_SIZE}) "
                      "and refuses the config at deepspeed.initialize; give that product, or leave train_batch_size "
                      "out")
    problems = config_problems(cfg, world_size=WORLD_SIZE, device="cuda")   # the task's 8 GPUs: fp16 is theirs too
    if problems:  # unknown keys (which DeepSpeed ignores), a batch triple DeepSpeed would refuse, wrong types
        raise Mistake("dslab.config.check.check_config finds (world_size 8, as DeepSpeed counts):\n  "
                      + "\n  ".join(str(p) for p in problems[:3]))
    ds = resolved_config(cfg, WORLD_SIZE)
    tp = ds.tensor_parallel_config.autotp_size
    if not tp:
        raise Mistake("no tensor_parallel.autotp_size: without it every rank holds the whole model (8 replicas); "
                      f'AutoTP in groups of {AUTOTP_SIZE} is "tensor_parallel": {{"autotp_size": {AUTOTP_SIZE}}}')
    if tp != AUTOTP_SIZE:
        raise Mistake(f"tensor_parallel.autotp_size is {tp}: 8 ranks in tensor-parallel groups of {tp} make "
                      f"{WORLD_SIZE // tp} model replicas; {REPLICAS} replicas on 8 ranks means groups of {AUTOTP_SIZE}")
    stage = ds.zero_optimization_stage
    if stage != 1:
        raise Mistake(f"zero_optimization.stage is {stage}; the task asks for ZeRO-1 (optimizer states sharded "
                      "over each data-parallel group: the ranks holding the same slices, one per replica)")
    total, micro, accum = ds.train_batch_size, ds.train_micro_batch_size_per_gpu, ds.gradient_accumulation_steps
    left_out = [k for k in BATCH_KEYS if k not in cfg]
    derived = (f" (DeepSpeed derives {' and '.join(left_out)}, which the config leaves out, from the others: "
               f"train_batch_size {total} = {micro} x {accum} x 8 ranks)" if left_out else "")
    if micro != MICRO_BATCH:
        raise Mistake(f"DeepSpeed reads a micro batch of {micro} per rank{derived}; the task fixes it at {MICRO_BATCH}")
    replicas = WORLD_SIZE // tp
    samples = micro * accum * replicas
    if samples != SAMPLES_PER_STEP:
        raise Mistake(f"each step sees {micro} x {accum} x {replicas} model replicas = {samples} distinct samples "
                      f"(the ranks of a tensor-parallel group share theirs), not {SAMPLES_PER_STEP}{derived}: change "
                      "gradient_accumulation_steps")
    return True
