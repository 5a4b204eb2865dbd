"""Exercise 11.tensor_data: the learner writes train_tensor_data(model, autotp_size, steps), AutoTP training
("tensor_parallel": {"autotp_size": T}, ZeRO-1) as tensor x data parallel, with the grid read from DeepSpeed's groups;
the checker runs it on 4 and 3 launched ranks (dslab.exercises.on_ranks) with a small Qwen2 model and batches drawn at
check time. It judges the work on the ranks, not only the losses returned: the engine must be DeepSpeed's, split in
the asked autotp_size, and must have stepped once per step (engine.global_steps); each replica's losses, and the slices
of the weights each rank holds after training, must be those of one process averaging the replicas' gradients, which
every rank computes itself. Registered when dslab.exercises.ch11 imports it.
"""
from dslab import compat
from dslab.exercises import Mistake, exercise, on_ranks
from dslab.exercises.ch11_pipeline import WEIGHT_TOLERANCE, known_refusal, weight_distances


# 11.tensor_data: train_tensor_data(model, autotp_size, steps): the AutoTP ds_config ("tensor_parallel":
# {"autotp_size": T}, ZeRO-1), the tensor x data grid read from DeepSpeed's groups (returned, and printed), and a loop
# in which each model replica (the ranks of one tensor-parallel group) trains on its own batch. Checked on 4 ranks
# (T = 2: 2 replicas) and on 3 (T = 3: 1 replica), a small Qwen2 model and batches drawn at check time.
TENSOR_DATA_TRIAL = f"{__name__}:tensor_data_trial"
TENSOR_DATA_LR = 1e-3


def draw_tensor_data_case(world_size, rng=None):
    """A small Qwen2 shape that splits over `world_size` ranks, T, and batches for one check, chosen now."""
    import random

    rng = rng or random.SystemRandom()
    autotp = {4: 2, 3: 3, 2: 2}[world_size]
    heads = 6                                   # splits over 2 and 3 ranks, key-value heads too
    head_dim = rng.choice((4, 8))
    return {"world_size": world_size, "autotp_size": autotp,
            "shape": {"hidden_size": heads * head_dim, "num_attention_heads": heads, "num_key_value_heads": heads,
                      "intermediate_size": 6 * rng.choice((8, 12, 16)), "num_hidden_layers": rng.choice((1, 2, 3)),
                      "vocab_size": 6 * rng.choice((40, 50, 64)), "max_position_embeddings": 64},
            "steps": rng.choice((2, 3)), "rows": rng.choice((1, 3)), "seq_len": rng.choice((8, 12)),
            "seed": rng.randrange(1 << 30)}


def tensor_data_model(case):
    """The case's model: a randomly initialised Qwen2 causal LM (fp32), the same weights on every rank."""
    from dslab.models.loading import build_model, tiny_config

    return build_model(tiny_config(**case["shape"]), seed=case["seed"] % 1000)


def tensor_data_steps(case):
    """The case's steps: per step, one token batch [rows, seq_len] per model replica."""
    import torch

    g = torch.Generator().manual_seed(case["seed"])
    replicas = case["world_size"] // case["autotp_size"]
    return [[torch.randint(0, case["shape"]["vocab_size"], (case["rows"], case["seq_len"]), generator=g)
             for _ in range(replicas)] for _ in range(case["steps"])]


TENSOR_DATA_REFUSALS = (
    ("Check batch related parameters", "train_batch_size must count every rank, tensor-parallel ones too: micro "
     "batch x accumulation x world size (DeepSpeed's check takes torch.distributed.get_world_size() when no "
     "parallel-state object is passed, and AutoTP passes none), although each step sees only micro x accumulation x "
     "replicas distinct samples"),
    ("Data inconsistency within the TP group", "the ranks of one tensor-parallel group took different batches "
     "(DeepSpeed compares them on the first forward): they hold slices of one model replica, so they must see the "
     "same batch; pick it with the data-parallel rank (groups.get_data_parallel_rank()), not the global or the "
     "tensor-parallel rank"),
    ("tp_size", "tensor_parallel.tp_size is init_inference's key (chapter 07); for training DeepSpeed reads "
     "tensor_parallel.autotp_size"),
    ("must be divisible", "the tensor-parallel size does not divide the ranks: autotp_size must be the size asked "
     "for (the function's argument), not a number typed in"),
)


def replica_against_one_process(module, before, after):
    """weight_distances of the weights this rank holds of the learner's AutoTP model, against the same slices of one
    process's model: a split weight is compared with the slice DeepSpeed's layer keeps (its partition sizes, at its
    tp_index). None where a weight has no counterpart."""
    trained, initial = dict(after.named_parameters()), dict(before.named_parameters())
    triples = []
    for name, weight in module.named_parameters():
        if name not in trained:
            return None
        pair = []
        for whole in (trained[name], initial[name]):
            if whole.shape != weight.shape:
                owner = module.get_submodule(name.rpartition(".")[0])
                sizes, index = compat.autotp_partition_sizes(owner), getattr(owner, "tp_index", None)
                dims = [d for d in range(whole.dim()) if whole.shape[d] != weight.shape[d]]
                if sizes is None or index is None or len(dims) != 1 or sum(sizes) != whole.shape[dims[0]]:
                    return None
                whole = whole.split(list(sizes), dim=dims[0])[index]
                if whole.shape != weight.shape:
                    return None
            pair.append(whole)
        triples.append((weight, *pair))
    return weight_distances(triples)


def tensor_data_trial(train_tensor_data, case):
    """On every rank: the learner's train_tensor_data on the case; the grid, the shards and the losses it gave."""
    import copy

    import torch
    import torch.distributed as torch_dist
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.utils import groups

    from dslab.parallel import tensor_parallel

    model = tensor_data_model(case)
    steps = tensor_data_steps(case)
    tensor_parallel.forget_groups()
    try:
        out = train_tensor_data(copy.deepcopy(model).train(), case["autotp_size"], steps)
    except Exception as exc:
        mistake = known_refusal(exc, TENSOR_DATA_REFUSALS)
        if mistake is None:
            raise
        raise mistake from None
    if not (isinstance(out, (tuple, list)) and len(out) == 3):
        raise Mistake(f"return (engine, layout, losses); your function returned {type(out).__name__}")
    engine, layout, losses = out
    if not isinstance(engine, DeepSpeedEngine):
        raise Mistake(f"the engine is a {type(engine).__name__}: return the engine deepspeed.initialize gives back")
    tp = engine.autotp_size()
    if tp != case["autotp_size"]:   # the grid below would not be the one asked for: said at once, on every rank
        raise Mistake(f"the engine's autotp_size is {tp}, the check asked for {case['autotp_size']} on "
                      f"{case['world_size']} ranks: \"tensor_parallel\": {{\"autotp_size\": autotp_size}}, the "
                      "function's argument, not a number typed in")
    group = engine.optimizer.param_groups[0] if engine.optimizer is not None else {}
    found = {"autotp_size": tp, "zero_stage": engine.zero_optimization_stage(),
             "micro": engine.train_micro_batch_size_per_gpu(),
             "accumulation": engine.gradient_accumulation_steps(), "clipping": engine.gradient_clipping(),
             "lr": group.get("lr"), "weight_decay": group.get("weight_decay"),
             "layout": {str(k): [int(r) for r in v] for k, v in layout.items()} if isinstance(layout, dict) else
             repr(layout)[:80],
             "losses": [float(x) for x in losses] if isinstance(losses, (list, tuple)) else repr(losses)[:80],
             "global_steps": engine.global_steps}
    if tp > 1:
        found["deepspeed"] = {"tensor_parallel": sorted(torch_dist.get_process_group_ranks(
                                  groups.get_tensor_model_parallel_group())),
                              "data_parallel": sorted(torch_dist.get_process_group_ranks(
                                  groups.get_data_parallel_group())),
                              "dp_rank": groups.get_data_parallel_rank()}
        census = tensor_parallel.shard_census(engine.module)
        found["census"] = {k: v for k, v in census.items() if k != "layers"}
    alone = copy.deepcopy(model)   # on every rank: each compares the slices it holds
    reference = tensor_parallel.train_one_process(alone, steps, lr=TENSOR_DATA_LR)
    found["weights"] = replica_against_one_process(engine.module, model, alone)
    if torch.distributed.get_rank() == 0:
        found["reference"] = reference
    tensor_parallel.forget_groups()
    return found


def diagnose_tensor_data(case, results):
    """A Mistake naming what the learner's train_tensor_data did wrong on this case, if anything."""
    n, t = case["world_size"], case["autotp_size"]
    replicas = n // t
    what = f"{n} ranks, autotp_size {t}: {replicas} model replica{'s' if replicas > 1 else ''}"
    first = results[0]
    if first["zero_stage"] != 1:
        raise Mistake(f"zero_optimization.stage is {first['zero_stage']}: the task asks for ZeRO-1, the optimizer "
                      "states sharded over each data-parallel group")
    if first["micro"] != case["rows"] or first["accumulation"] != 1:
        raise Mistake(f"the engine takes micro-batches of {first['micro']} with {first['accumulation']} accumulation "
                      f"steps; each replica's batch holds {case['rows']} sequences and every step is one optimizer "
                      "step: read the micro batch from the data, gradient_accumulation_steps 1")
    if first["clipping"] != 0.0 or first["lr"] != TENSOR_DATA_LR or first["weight_decay"] != 0.0:
        raise Mistake(f"the optimizer runs with lr {first['lr']}, weight_decay {first['weight_decay']}, gradients "
                      f"clipped at {first['clipping']}: AdamW with lr {TENSOR_DATA_LR} and weight_decay 0.0, and "
                      "\"gradient_clipping\": 0.0 (DeepSpeed clips at 1.0 by default), to train as plain PyTorch does")
    for rank, r in enumerate(results):
        ds = r["deepspeed"]
        if not isinstance(r["layout"], dict) or set(r["layout"]) != {"tensor_parallel", "data_parallel"}:
            raise Mistake(f"rank {rank}'s layout is {r['layout']!r}: a dict {{\"tensor_parallel\": [ranks], "
                          "\"data_parallel\": [ranks]}, this rank's two groups as DeepSpeed made them")
        for kind in ("tensor_parallel", "data_parallel"):
            if sorted(r["layout"][kind]) != ds[kind]:
                raise Mistake(f"rank {rank} says its {kind.replace('_', '-')} group is {r['layout'][kind]}, but "
                              f"DeepSpeed put it in {ds[kind]} ({what}): read the groups from deepspeed.utils.groups "
                              "(get_tensor_model_parallel_group, get_data_parallel_group) with "
                              "torch.distributed.get_process_group_ranks")
    for rank, r in enumerate(results):
        if r["global_steps"] != case["steps"]:
            raise Mistake(f"the engine took {r['global_steps']} optimizer steps on rank {rank} (engine.global_steps) "
                          f"for the case's {case['steps']} steps ({what}): train the engine, engine.backward and "
                          "engine.step once per step. Losses computed beside it (a one-process copy, "
                          "tensor_parallel.train_one_process) are not what the engine did")
    reference = first["reference"]
    for rank, r in enumerate(results):
        if not isinstance(r["losses"], list) or len(r["losses"]) != case["steps"]:
            raise Mistake(f"rank {rank} returned {r['losses']!r} as the losses: one number per step, "
                          f"{case['steps']} steps here")
        replica = r["deepspeed"]["dp_rank"]
        if abs(r["losses"][0] - reference[0][replica]) >= 1e-4:   # the first step: the same weights everywhere
            other = next((d for d in range(replicas) if abs(r["losses"][0] - reference[0][d]) < 1e-4), None)
            said = f"replica {other}'s batch" if other is not None else "none of the replicas' batches"
            raise Mistake(f"rank {rank} belongs to replica {replica} (data-parallel rank {replica}), but its first "
                          f"loss is that of {said} ({what}): each replica trains on steps[s][data-parallel rank]")
    for rank, r in enumerate(results):
        replica = r["deepspeed"]["dp_rank"]
        want = [step[replica] for step in reference]
        if not all(abs(a - b) < 1e-4 for a, b in zip(r["losses"], want)):
            why = ("each replica trains on its own batch, steps[s][data-parallel rank], one optimizer step per step, "
                   "and the gradients are averaged over the replicas")
            raise Mistake(f"rank {rank} (replica {replica}) has losses {[round(x, 5) for x in r['losses']]}; one "
                          f"process averaging the replicas' gradients gives {[round(x, 5) for x in want]} for that "
                          f"replica ({what}): {why}")
    for rank, r in enumerate(results):
        w = r["weights"]
        if w is None:
            raise Mistake(f"rank {rank}'s engine holds weights the case's model does not have ({what}): train the "
                          "model the function is given")
        if w["moved"] == 0.0:
            raise Mistake(f"rank {rank}'s engine still holds the weights it started with ({what}): the optimizer "
                          "never updated them")
        if w["off_mean"] > WEIGHT_TOLERANCE:
            raise Mistake(f"after training, the slices rank {rank} holds differ from the same slices of one "
                          f"process's model by {w['off_mean']:.2g} on average (up to {w['off']:.2g}; training moved "
                          f"them by up to {w['moved']:.2g}) ({what}): the losses agree, so the update differs")


def _tensor_data_answer(model, autotp_size, steps, pick="data", batch="world", key="autotp_size", zero=1,
                        layout_by_hand=False, size=None, trained=True):
    """train_tensor_data as the solution writes it, with one of the usual mistakes switched on (the wrong answers)."""
    import copy

    import deepspeed
    import torch
    from deepspeed.utils import groups

    from dslab.parallel import tensor_parallel

    world_size, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    alone = None if trained else copy.deepcopy(model)   # before deepspeed.initialize splits the model
    rows = steps[0][0].shape[0]
    replicas = world_size // autotp_size
    ds_config = {"train_micro_batch_size_per_gpu": rows, "gradient_accumulation_steps": 1,
                 "train_batch_size": rows * (world_size if batch == "world" else replicas),
                 "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0, "torch_adam": True}},
                 "gradient_clipping": 0.0, "tensor_parallel": {key: size or autotp_size},
                 "zero_optimization": {"stage": zero}, "steps_per_print": 10**6}
    engine, *_ = deepspeed.initialize(model=model, config=ds_config)
    if layout_by_hand:   # consecutive ranks for both groups
        first = rank - rank % autotp_size
        layout = {"tensor_parallel": list(range(first, first + autotp_size)),
                  "data_parallel": list(range(rank - rank % replicas, rank - rank % replicas + replicas))}
    else:
        layout = {kind: torch.distributed.get_process_group_ranks(group()) for kind, group in
                  (("tensor_parallel", groups.get_tensor_model_parallel_group),
                   ("data_parallel", groups.get_data_parallel_group))}
    replica = {"data": groups.get_data_parallel_rank(), "global": rank % len(steps[0]),
               "tensor": groups.get_tensor_model_parallel_rank() % len(steps[0]), "first": 0}[pick]

    def train_step(tokens):
        out = engine(input_ids=tokens, labels=tokens)
        engine.backward(out.loss)
        engine.step()
        return out.loss.item()

    if not trained:   # one process's losses for this replica: the numbers the engine would give, not its work
        return engine, layout, [losses[replica] for losses in tensor_parallel.train_one_process(alone, steps)]
    return engine, layout, [train_step(batches[replica]) for batches in steps]


def _tensor_data_by_global_rank(model, autotp_size, steps):
    return _tensor_data_answer(model, autotp_size, steps, pick="global")


def _tensor_data_by_tensor_rank(model, autotp_size, steps):
    return _tensor_data_answer(model, autotp_size, steps, pick="tensor")


def _tensor_data_one_batch(model, autotp_size, steps):
    return _tensor_data_answer(model, autotp_size, steps, pick="first")        # every replica on batch 0


def _tensor_data_batch_counts_replicas(model, autotp_size, steps):
    return _tensor_data_answer(model, autotp_size, steps, batch="replicas")


def _tensor_data_inference_key(model, autotp_size, steps):
    return _tensor_data_answer(model, autotp_size, steps, key="tp_size")        # init_inference's key


def _tensor_data_two(model, autotp_size, steps):
    return _tensor_data_answer(model, autotp_size, steps, size=2)              # the chapter's 2, typed in


def _tensor_data_no_zero(model, autotp_size, steps):
    return _tensor_data_answer(model, autotp_size, steps, zero=0)


def _tensor_data_layout_by_hand(model, autotp_size, steps):
    return _tensor_data_answer(model, autotp_size, steps, layout_by_hand=True)


def _tensor_data_one_process_losses(model, autotp_size, steps):
    return _tensor_data_answer(model, autotp_size, steps, trained=False)


TENSOR_DATA_WORLD_SIZES = (4, 3)   # 2 replicas of 2 ranks; 1 replica of 3


@exercise("11.tensor_data",
          wrong=((_tensor_data_by_global_rank, "took different batches"),
                 (_tensor_data_by_tensor_rank, "took different batches"),
                 (_tensor_data_one_batch, "loss is that of replica 0's batch"),
                 (_tensor_data_batch_counts_replicas, "must count every rank"),
                 (_tensor_data_inference_key, "init_inference's key"),
                 (_tensor_data_two, "autotp_size is 2, the check asked for 3"),
                 (_tensor_data_no_zero, "zero_optimization.stage is 0"),
                 (_tensor_data_layout_by_hand, "but DeepSpeed put it in"),
                 (_tensor_data_one_process_losses, "the engine took 0 optimizer steps")),
          prepare=on_ranks.preparer(TENSOR_DATA_TRIAL, draw_tensor_data_case, TENSOR_DATA_WORLD_SIZES,
                                    diagnose_tensor_data),
          hint="complete train_tensor_data(model, autotp_size, steps): a ds_config with \"tensor_parallel\": "
               "{\"autotp_size\": autotp_size}, ZeRO-1, the micro batch of the data and a train_batch_size that counts "
               "every rank; the two groups from deepspeed.utils.groups as lists of ranks; each replica trains on "
               "steps[s][groups.get_data_parallel_rank()]; return (engine, layout, losses).")
def _check_tensor_data(train_tensor_data):
    return on_ranks.check(TENSOR_DATA_TRIAL, train_tensor_data, draw_tensor_data_case, diagnose_tensor_data,
                          TENSOR_DATA_WORLD_SIZES)
