"""Exercise 11.pipeline: the learner writes train_pipeline(shape, steps), dslab-tiny's pieces as LayerSpecs in a
PipelineModule of one stage per rank, its ds_config and a train_batch loop; the checker runs it on 2 and 3 launched
ranks (dslab.exercises.on_ranks) with shapes, micro-batch counts and data drawn at check time. It judges the work on
the ranks, not only the losses returned: the PipelineEngine must have stepped once per step (engine.global_steps, the
train_batch calls the trial saw), the losses must be what train_batch returned, and both they and each stage's weights
after training must be those of the same layers trained in one process, which every rank computes itself.
Registered when dslab.exercises.ch11 imports it.
"""
from dslab import compat
from dslab.exercises import Mistake, exercise, on_ranks


def known_refusal(exc, table):
    """A Mistake for an exception whose message holds one of the table's texts (DeepSpeed's words for a usual
    mistake), else None (the learner then sees their own traceback)."""
    said = f"{type(exc).__name__}: {exc}"
    for text, mistake in table:
        if text in said:
            return Mistake(mistake)
    return None


# 11.pipeline: train_pipeline(shape, steps): dslab-tiny's pieces as LayerSpecs in a PipelineModule of one stage per
# rank, its ds_config, one engine.train_batch per step; compared with the same layers trained in one process.
PIPELINE_TRIAL = f"{__name__}:pipeline_trial"
PIPELINE_LR = 1e-3


def draw_pipeline_case(world_size, rng=None):
    """A model shape and steps of micro-batches for one check, chosen now."""
    import random

    rng = rng or random.SystemRandom()
    hidden = rng.choice((16, 24, 32))
    # never the chapter's own values (4 blocks, 4 micro-batches of 2), so that none typed in can pass
    blocks = [b for b in range(max(1, world_size - 1), world_size + 3) if b != 4]
    return {"world_size": world_size,
            "shape": {"vocab": rng.choice((256, 320, 384)), "hidden": hidden,
                      "intermediate": rng.choice((2, 3)) * hidden,
                      "blocks": rng.choice(blocks)},
            "steps": rng.choice((2, 3)), "micro_batches": rng.choice((2, 3, 5)),
            "micro_batch_size": rng.choice((1, 3)), "seq_len": rng.choice((8, 12)), "seed": rng.randrange(1 << 30)}


def pipeline_steps(case):
    """The case's steps: lists of micro-batches, token tensors [micro_batch_size, seq_len], the same on every rank."""
    import torch

    g = torch.Generator().manual_seed(case["seed"])
    return [[torch.randint(0, case["shape"]["vocab"], (case["micro_batch_size"], case["seq_len"]), generator=g)
             for _ in range(case["micro_batches"])] for _ in range(case["steps"])]


def pipeline_specs(case):
    """The case's layers as LayerSpecs, in order: Embed, shape["blocks"] Blocks, Head."""
    from deepspeed.pipe import LayerSpec

    from dslab.parallel import pipeline

    s = case["shape"]
    return [LayerSpec(pipeline.Embed, s["vocab"], s["hidden"]),
            *[LayerSpec(pipeline.Block, s["hidden"], s["intermediate"]) for _ in range(s["blocks"])],
            LayerSpec(pipeline.Head, s["hidden"], s["vocab"])]


def pipeline_reference(case):
    """The case trained in one process, plain PyTorch: the same layers, seeded as PipelineModule(seed_layers=True)
    seeds them, each micro-batch's loss / m backward, one AdamW step per step. (per-step losses, the layers before
    training, the layers after it: torch.nn.Sequential, layer i the pipeline's layer i)."""
    from dslab.parallel import pipeline

    before = pipeline.sequential_twin(pipeline_specs(case))
    twin = pipeline.sequential_twin(pipeline_specs(case))
    steps = [[(tokens, tokens) for tokens in micro] for micro in pipeline_steps(case)]
    return pipeline.train_one_process(twin, steps, lr=PIPELINE_LR), before, twin


def weight_distances(triples):
    """How far a rank's weights are from one process's after training ("off") and from where they started ("moved"),
    over (weight, the same weight trained in one process, it before training) triples: the largest |difference| and
    its mean over every element."""
    import torch

    off = moved = off_sum = moved_sum = 0.0
    count = 0
    with torch.no_grad():
        for weight, trained, initial in triples:
            to_trained = (weight.detach().float() - trained.float()).abs()
            to_initial = (weight.detach().float() - initial.float()).abs()
            off, moved = max(off, to_trained.max().item()), max(moved, to_initial.max().item())
            off_sum, moved_sum = off_sum + to_trained.sum().item(), moved_sum + to_initial.sum().item()
            count += weight.numel()
    count = max(count, 1)
    return {"off": off, "off_mean": off_sum / count, "moved": moved, "moved_mean": moved_sum / count}


def stage_against_twin(net, before, after):
    """weight_distances of the layers this rank's stage of the learner's PipelineModule holds, against the same layers
    of the one-process twin (layer i of the stage is the twin's layer compat.pipeline_local_start(net) + i); None where
    the stage's layers are not the twin's."""
    import torch

    triples, start = [], compat.pipeline_local_start(net)
    for i, layer in enumerate(net.forward_funcs):
        index = start + i
        if not isinstance(layer, torch.nn.Module) or index >= len(after):
            return None
        mine, trained, initial = (dict(m.named_parameters()) for m in (layer, after[index], before[index]))
        if set(mine) != set(trained) or any(mine[k].shape != trained[k].shape for k in mine):
            return None
        triples += [(weight, trained[name], initial[name]) for name, weight in mine.items()]
    return weight_distances(triples)


PIPELINE_REFUSALS = (  # DeepSpeed's words for the usual mistakes, and what the mistake is
    ("must divide distributed world size", "num_stages does not divide the ranks: one stage per rank is "
     "num_stages=torch.distributed.get_world_size(), not a number typed in"),
    ("The only supported seed types", "partition_method is left at its default \"parameters\" with seed_layers=True: "
     "its stage boundaries are numpy integers, which random.seed refuses (section 3); pass "
     "partition_method=\"uniform\""),
    ("Check batch related parameters", "train_batch_size counts the data-parallel copies of the pipeline, not the "
     "ranks: micro batch x micro-batches x 1 here, every rank being one stage (deepspeed.initialize refused it)"),
    ("Only train_batch() is accessible", "a PipelineEngine trains only through engine.train_batch(data_iter=...): "
     "engine(...), engine.backward and engine.step are refused"),
    ("incompatible with pipeline parallelism", "ZeRO-2 and ZeRO-3 are refused on a pipeline (its engine reduces the "
     "gradients itself, at the end of the batch): leave zero_optimization out, or stage 0 or 1"),
)


def _checked_train_batch(original, ran):
    """engine.train_batch as the trial runs it: it takes the step's micro-batches from the learner's iterator first
    and checks them on every rank, so that a mistake there is named on all ranks at once instead of stopping one
    stage while the others wait for its activations (which would hang). Each call that ran appends the loss it
    returned to `ran`: what the engine itself computed, to hold the learner's losses against."""
    import functools
    import itertools

    @functools.wraps(original)
    def train_batch(self, data_iter=None, *args, **kwargs):
        if self.module.loss_fn is None:
            raise Mistake("no loss_fn: the last stage would hand back the logits instead of a loss (DeepSpeed asserts "
                          "\"loss must be a scalar tensor\" there while the other stages wait); pass "
                          "loss_fn=pipeline.lm_loss to PipelineModule")
        if data_iter is None:
            raise Mistake("train_batch(data_iter=...) needs an iterator over the step's (inputs, labels) pairs")
        wanted = self.gradient_accumulation_steps()
        taken = list(itertools.islice(data_iter, wanted))
        if len(taken) < wanted:
            raise Mistake(f"train_batch pulls gradient_accumulation_steps = {wanted} micro-batches from its iterator, "
                          f"but it held {len(taken)}: in a pipeline, gradient_accumulation_steps is the number of "
                          "micro-batches per step (the first stage would raise StopIteration while the others wait)")
        if not all(isinstance(item, (tuple, list)) and len(item) == 2 for item in taken):
            raise Mistake("train_batch's iterator must yield (inputs, labels) pairs, here (tokens, tokens): the first "
                          "stage reads the inputs, the last one the labels")
        loss = original(self, iter(taken), *args, **kwargs)
        ran.append(float(loss))
        return loss

    return train_batch


def pipeline_trial(train_pipeline, case):
    """On every rank: the learner's train_pipeline on the case; what its engine holds and reports."""
    import torch
    from deepspeed.pipe import LayerSpec, PipelineModule
    from deepspeed.runtime.pipe.engine import PipelineEngine

    from dslab.parallel import pipeline

    from dslab.parallel import tensor_parallel

    tensor_parallel.forget_groups()   # an earlier answer's grid (this process ran it) is not this one's
    original, ran = PipelineEngine.train_batch, []
    PipelineEngine.train_batch = _checked_train_batch(original, ran)
    try:
        out = train_pipeline(dict(case["shape"]), pipeline_steps(case))
    except Exception as exc:   # DeepSpeed's refusals of the usual mistakes are named; the rest is the learner's error
        mistake = known_refusal(exc, PIPELINE_REFUSALS)
        if mistake is None:
            raise
        raise mistake from None
    finally:
        PipelineEngine.train_batch = original
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
        raise Mistake(f"return (engine, losses); your function returned {type(out).__name__}")
    engine, losses = out
    if not isinstance(engine, PipelineEngine):
        raise Mistake(f"the engine is a {type(engine).__name__}: deepspeed.initialize(model=net, ...) with the "
                      "PipelineModule gives a PipelineEngine")
    net = engine.module
    group = engine.optimizer.param_groups[0]
    held, specs = pipeline.stage_parameters(net), compat.pipeline_layer_specs(net)
    found = {"losses": [float(x) for x in losses] if isinstance(losses, (list, tuple)) else repr(losses)[:80],
             "stage": net.stage_id, "num_stages": net.num_stages, "layers": held["layers"], "params": held["params"],
             "all_layers": len(specs), "specs": all(isinstance(s, LayerSpec) for s in specs),
             "accumulation": engine.gradient_accumulation_steps(), "micro": engine.train_micro_batch_size_per_gpu(),
             "clipping": engine.gradient_clipping(), "lr": group.get("lr"), "weight_decay": group.get("weight_decay"),
             "loss_fn": getattr(net.loss_fn, "__name__", type(net.loss_fn).__name__),
             "global_steps": engine.global_steps, "train_batch": ran}
    assert isinstance(net, PipelineModule)
    reference, before, after = pipeline_reference(case)   # on every rank: each compares the layers it holds
    found["weights"] = stage_against_twin(net, before, after)
    if torch.distributed.get_rank() == 0:
        found["reference"], found["whole"] = reference, sum(p.numel() for p in after.parameters())
    return found


# The mean |difference| allowed between a rank's weights after training and one process's: lr / 100. AdamW moves
# every weight that has a gradient by about lr per step whatever its size, so training that differs (other data, an
# update more or less) is off by a good part of lr on average (one optimizer step too many: 3e-4 measured); the same
# training is off by nothing (the pipeline: the same operations in the same order, measured 0.0) or by rounding
# (AutoTP: measured under 1e-9 on average, 1e-6 at most).
# The mean, not the largest: a weight whose gradient is nearly 0 can take AdamW's step either way on rounding alone.
WEIGHT_TOLERANCE = 1e-5


def _close(a, b, rel=1e-6):
    return abs(a - b) <= rel * max(1.0, abs(b))


def diagnose_pipeline(case, results):
    """A Mistake naming what the learner's train_pipeline did wrong on this case, if anything."""
    s, n = case["shape"], case["world_size"]
    what = (f"{n} ranks, {s['blocks']} blocks of hidden {s['hidden']}, vocabulary {s['vocab']}, {case['steps']} "
            f"steps of {case['micro_batches']} micro-batches of {case['micro_batch_size']} x {case['seq_len']} tokens")
    first = results[0]
    if first["num_stages"] != n:
        raise Mistake(f"num_stages is {first['num_stages']} on {n} ranks ({what}): one stage per rank is "
                      "num_stages=torch.distributed.get_world_size(), not a number typed in")
    if not first["specs"]:
        raise Mistake("the layers were built before PipelineModule saw them, so every rank built the whole model: "
                      "pass LayerSpec(cls, *args), which each stage builds for its own layers only")
    blocks = sum(layer == "Block" for r in results for layer in r["layers"])
    if first["all_layers"] != s["blocks"] + 2 or blocks != s["blocks"]:
        raise Mistake(f"the pipeline has {first['all_layers']} layers, {blocks} of them Blocks; the case ({what}) asks "
                      f"for Embed, shape[\"blocks\"] = {s['blocks']} Blocks and Head")
    if first["loss_fn"] != "lm_loss":
        raise Mistake(f"loss_fn is {first['loss_fn']}: train with pipeline.lm_loss, the next-token loss")
    if first["micro"] != case["micro_batch_size"]:
        raise Mistake(f"train_micro_batch_size_per_gpu is {first['micro']}, but each micro-batch holds "
                      f"{case['micro_batch_size']} sequences ({what}): read it from the data")
    if first["accumulation"] != case["micro_batches"]:
        raise Mistake(f"gradient_accumulation_steps is {first['accumulation']}, but each step has "
                      f"{case['micro_batches']} micro-batches ({what}): in a pipeline it is the number of "
                      "micro-batches each train_batch pulls")
    if first["clipping"] != 0.0:
        raise Mistake(f"the gradients are clipped at {first['clipping']} (DeepSpeed's default is 1.0): set "
                      "\"gradient_clipping\": 0.0 to train as plain PyTorch does")
    if first["lr"] != PIPELINE_LR or first["weight_decay"] != 0.0:
        raise Mistake(f"the optimizer runs with lr {first['lr']} and weight_decay {first['weight_decay']}: AdamW "
                      f"with lr {PIPELINE_LR} and weight_decay 0.0 (torch's AdamW defaults to 0.01)")
    for rank, r in enumerate(results):
        if r["global_steps"] != case["steps"] or len(r["train_batch"]) != case["steps"]:
            raise Mistake(f"engine.train_batch ran {len(r['train_batch'])} times on rank {rank} (engine.global_steps: "
                          f"{r['global_steps']}), but the case has {case['steps']} steps ({what}): train the engine, "
                          "one engine.train_batch per step. Losses computed beside it (a one-process copy, "
                          "pipeline.train_one_process) are not what the engine did")
    for rank, r in enumerate(results):
        if not isinstance(r["losses"], list) or len(r["losses"]) != case["steps"]:
            raise Mistake(f"rank {rank} returned {r['losses']!r} as the losses: one number per step, "
                          f"{case['steps']} steps here (what each train_batch returns, .item())")
        if not all(_close(a, b) for a, b in zip(r["losses"], r["train_batch"])):
            raise Mistake(f"rank {rank} returned the losses {[round(x, 6) for x in r['losses']]}, but its "
                          f"engine.train_batch calls returned {[round(x, 6) for x in r['train_batch']]}: return what "
                          "train_batch returns, one .item() per step")
    got, reference = first["losses"], first["reference"]
    if any(r["losses"] != got for r in results):
        raise Mistake("the stages returned different losses: return what train_batch returns, the step's mean loss, "
                      "which every stage receives from the last one")
    if not all(_close(a, b) for a, b in zip(got, reference)):
        why = ("the first step differs already, so the weights differ: seed_layers=True with "
               "base_seed=pipeline.BASE_SEED seeds layer i as the one-process twin is seeded"
               if not _close(got[0], reference[0]) else
               "the first step agrees, so the update differs")
        raise Mistake(f"losses {[round(x, 6) for x in got]}, but the same layers trained in one process give "
                      f"{[round(x, 6) for x in reference]} ({what}): {why}")
    held = sum(r["params"] for r in results)
    if held != first["whole"]:
        raise Mistake(f"the stages hold {held:,} parameters together; the model has {first['whole']:,}")
    for rank, r in enumerate(results):
        w = r["weights"]
        if w is None:
            raise Mistake(f"rank {rank}'s stage holds layers that are not the case's Embed, Blocks and Head, built "
                          f"from LayerSpecs ({what})")
        if w["moved"] == 0.0:
            raise Mistake(f"rank {rank}'s stage still holds the weights it was built with ({what}): the engine's "
                          "optimizer never updated them")
        if w["off_mean"] > WEIGHT_TOLERANCE:
            raise Mistake(f"after training, rank {rank}'s weights differ from the same layers trained in one process "
                          f"by up to {w['off']:.2g} (mean {w['off_mean']:.2g}; training moved them by up to "
                          f"{w['moved']:.2g}) ({what}): the losses agree, so the update differs (the optimizer, its "
                          "settings or the number of steps)")


def _pipeline_answer(shape, steps, num_stages=None, batch_ranks=False, accumulation=None, pairs=True, built=False,
                     loss=True, partition="uniform", blocks=None, trained=True):
    """train_pipeline as the solution writes it, with one of the usual mistakes switched on (the wrong answers)."""
    import deepspeed
    import torch
    from deepspeed.pipe import LayerSpec, PipelineModule

    from dslab.parallel import pipeline

    world_size = torch.distributed.get_world_size()
    specs = [LayerSpec(pipeline.Embed, shape["vocab"], shape["hidden"]),
             *[LayerSpec(pipeline.Block, shape["hidden"], shape["intermediate"])
               for _ in range(shape["blocks"] if blocks is None else blocks)],
             LayerSpec(pipeline.Head, shape["hidden"], shape["vocab"])]
    if built:
        specs = [spec.build() for spec in specs]
    net = PipelineModule(layers=specs, num_stages=num_stages or world_size,
                         loss_fn=pipeline.lm_loss if loss else None, partition_method=partition, seed_layers=True,
                         base_seed=pipeline.BASE_SEED)
    micro, count = steps[0][0].shape[0], len(steps[0])
    accumulation = accumulation or count
    ds_config = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": accumulation,
                 "train_batch_size": micro * accumulation * (world_size if batch_ranks else 1),
                 "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0, "torch_adam": True}},
                 "gradient_clipping": 0.0, "steps_per_print": 10**6}
    engine, *_ = deepspeed.initialize(model=net, config=ds_config)
    if not trained:   # the same layers trained in one process: the numbers the engine would give, not its work
        twin = pipeline.sequential_twin(specs)
        return engine, pipeline.train_one_process(twin, [[(t, t) for t in micro] for micro in steps], lr=1e-3)
    losses = []
    for micro_batches in steps:
        data = [(t, t) for t in micro_batches] if pairs else list(micro_batches)
        losses.append(engine.train_batch(data_iter=iter(data)).item())
    return engine, losses


def _pipeline_two_stages(shape, steps):
    return _pipeline_answer(shape, steps, num_stages=2)       # the chapter's 2 stages, typed in


def _pipeline_batch_counts_ranks(shape, steps):
    return _pipeline_answer(shape, steps, batch_ranks=True)   # train_batch_size = micro x m x world size


def _pipeline_one_micro_batch(shape, steps):
    return _pipeline_answer(shape, steps, accumulation=1)     # gradient_accumulation_steps left at 1


def _pipeline_tensors_not_pairs(shape, steps):
    return _pipeline_answer(shape, steps, pairs=False)        # iter(micro_batches): tensors, no labels


def _pipeline_built_layers(shape, steps):
    return _pipeline_answer(shape, steps, built=True)         # modules built on every rank, not LayerSpecs


def _pipeline_no_loss(shape, steps):
    return _pipeline_answer(shape, steps, loss=False)         # no loss_fn


def _pipeline_default_partition(shape, steps):
    return _pipeline_answer(shape, steps, partition="parameters")   # PipelineModule's default, with seed_layers


def _pipeline_four_blocks(shape, steps):
    return _pipeline_answer(shape, steps, blocks=4)           # the chapter's 4 blocks, typed in


def _pipeline_one_process_losses(shape, steps):
    return _pipeline_answer(shape, steps, trained=False)      # an engine, and pipeline.train_one_process's losses


def _pipeline_engine_loop(shape, steps):
    import deepspeed
    import torch
    from deepspeed.pipe import LayerSpec, PipelineModule

    from dslab.parallel import pipeline

    specs = [LayerSpec(pipeline.Embed, shape["vocab"], shape["hidden"]),
             *[LayerSpec(pipeline.Block, shape["hidden"], shape["intermediate"]) for _ in range(shape["blocks"])],
             LayerSpec(pipeline.Head, shape["hidden"], shape["vocab"])]
    net = PipelineModule(layers=specs, num_stages=torch.distributed.get_world_size(), loss_fn=pipeline.lm_loss,
                         partition_method="uniform", seed_layers=True, base_seed=pipeline.BASE_SEED)
    engine, *_ = deepspeed.initialize(model=net, config={"train_micro_batch_size_per_gpu": 1})
    losses = []
    for micro_batches in steps:
        for tokens in micro_batches:   # the engine loop of chapter 01, which a PipelineEngine refuses
            loss = pipeline.lm_loss(engine(tokens), tokens)
            engine.backward(loss)
            engine.step()
        losses.append(loss.item())
    return engine, losses


@exercise("11.pipeline",
          wrong=((_pipeline_two_stages, "num_stages does not divide the ranks"),
                 (_pipeline_batch_counts_ranks, "counts the data-parallel copies of the pipeline"),
                 (_pipeline_one_micro_batch, "gradient_accumulation_steps is 1"),
                 (_pipeline_tensors_not_pairs, "(inputs, labels) pairs"),
                 (_pipeline_built_layers, "every rank built the whole model"),
                 (_pipeline_no_loss, "no loss_fn"),
                 (_pipeline_default_partition, "partition_method is left at its default"),
                 (_pipeline_four_blocks, "Blocks; the case"),
                 (_pipeline_one_process_losses, "engine.train_batch ran 0 times"),
                 (_pipeline_engine_loop, "trains only through engine.train_batch")),
          prepare=on_ranks.preparer(PIPELINE_TRIAL, draw_pipeline_case, diagnose=diagnose_pipeline),
          hint="complete train_pipeline(shape, steps): LayerSpecs of pipeline.Embed, shape[\"blocks\"] x "
               "pipeline.Block and pipeline.Head; PipelineModule with one stage per rank, loss_fn=pipeline.lm_loss, "
               "partition_method=\"uniform\", seed_layers=True, base_seed=pipeline.BASE_SEED; a ds_config whose micro "
               "batch and gradient_accumulation_steps come from the steps; one engine.train_batch per step; return "
               "(engine, losses).")
def _check_pipeline(train_pipeline):
    return on_ranks.check(PIPELINE_TRIAL, train_pipeline, draw_pipeline_case, diagnose_pipeline)
