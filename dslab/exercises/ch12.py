"""Chapter 12 (jobs that hang): read a hang report, then fix the job so that it finishes with the right answer.

Solutions: notebooks/solutions/12_solutions.py."""
import contextlib
import io
import re
import tempfile
from pathlib import Path

from dslab.exercises import Mistake, exercise, on_ranks

# The job of both exercises: 5 samples shared out between 2 ranks, one collective per sample. Rank 0 has three
# samples and rank 1 two, so rank 0 calls all_reduce once more than rank 1: the job hangs.
UNEVEN_SCRIPT = '''\
"""The mean of 5 samples, computed by 2 ranks that take every other sample, one step per sample (as a training
loop takes one step per batch). Run: deepspeed --num_gpus 2 uneven.py"""
import deepspeed
import torch
import torch.distributed as dist

deepspeed.init_distributed(dist_backend="gloo")
rank, world_size = dist.get_rank(), dist.get_world_size()
samples = torch.arange(1.0, 6.0)              # 1, 2, 3, 4, 5: their mean is 3
shard = samples[rank::world_size]             # rank 0: 1, 3, 5; rank 1: 2, 4
total = torch.zeros(2)                        # [sum of the samples, how many], over every rank
for x in shard:                               # one step per sample of this rank's shard
    step = torch.stack([x, torch.tensor(1.0)])
    dist.all_reduce(step)                     # this step's sum and count, over the ranks
    total += step
dist.barrier()
if rank == 0:
    print(f"mean {total[0].item() / total[1].item():.4f} over {total[1].item():.0f} samples", flush=True)
'''
HANG_TIMEOUT_S = 10      # the checker's hang watch: well above any silent wait of this tiny job
RIGHT_MEAN, RIGHT_COUNT = 3.0, 5


def _line(text):
    return next(i for i, line in enumerate(UNEVEN_SCRIPT.splitlines(), 1) if text in line)


# 12.read_report: where each rank of UNEVEN_SCRIPT waits, as the hang report says it.
WHERE_EACH_RANK_WAITS = {0: ("all_reduce", _line("dist.all_reduce(step)")), 1: ("barrier", _line("dist.barrier()"))}


def _normal(answer):
    """{rank: (collective, line)} from a learner's dict; ValueError if it is not one."""
    if not isinstance(answer, dict):
        raise TypeError("not a dict")
    found = {}
    for rank, value in answer.items():
        collective, line = value
        found[int(str(rank).replace("rank", "").strip())] = (str(collective).strip().lower().replace("-", "_"),
                                                             int(line))
    return found


def check_read_report(answer):
    """The learner's {rank: (collective, line)} must name, for both ranks, what the hang report names."""
    try:
        given = _normal(answer)
    except (TypeError, ValueError):
        raise Mistake("answer with a dict {rank: (collective, line)}, e.g. {0: (\"all_reduce\", 12), 1: ...}") \
            from None
    if set(given) != set(WHERE_EACH_RANK_WAITS):
        raise Mistake(f"name both ranks of the job (0 and 1), not {sorted(given)}")
    for rank, (collective, line) in sorted(given.items()):
        wanted_collective, wanted_line = WHERE_EACH_RANK_WAITS[rank]
        if collective != wanted_collective:
            other = next(r for r in WHERE_EACH_RANK_WAITS if r != rank)
            swapped = collective == WHERE_EACH_RANK_WAITS[other][0]
            raise Mistake(f"rank {rank} does not wait in {collective}" + (": ranks swapped? The report lists each "
                          "rank's own line, `rank N (pid ...): blocked in ...`" if swapped else
                          ": read the `blocked in ...` part of its line in the report"))
        if line != wanted_line:
            raise Mistake(f"rank {rank} waits in {collective}, but not at line {line}: the line is the one after "
                          "`called from uneven.py:` in the report (the job's own call, not torch's)")
    return True


def _script_text(answer):
    if not isinstance(answer, str):
        raise Mistake("answer with the fixed script: its path (\"runs/12/uneven_fixed.py\") or its text")
    if answer.strip().endswith(".py") and "\n" not in answer.strip():
        path = Path(answer.strip())
        if not path.is_file():
            raise Mistake(f"there is no file {path}: write it first (a %%writefile cell), or answer with its text")
        return path.read_text(encoding="utf-8")
    if "\n" not in answer.strip():
        raise Mistake("that is not the script: answer with its path (\"runs/12/uneven_fixed.py\") or its whole text")
    return answer


SAMPLES_LINE = re.compile(r"^samples\s*=.*$", re.M)


def _draw_samples(world_size, rng):
    """Samples drawn now: a count the world size does not divide (so the shards are uneven), values in quarters."""
    count = rng.choice([n for n in range(6, 11) if n % world_size])
    return [rng.randrange(-16, 40) / 4 for _ in range(count)]


def _with_samples(source, samples):
    """The learner's script with its `samples = ...` line replaced by the checker's samples, each rank seeing only
    the values of its own shard (every world_size-th from its rank); the others are nan, as a real job's data would
    be on other machines."""
    if len(SAMPLES_LINE.findall(source)) != 1:
        raise Mistake("keep the script's one line `samples = torch.arange(1.0, 6.0)`: the checker replaces it with "
                      "samples of its own to check that the mean comes through the all_reduce")
    mine = ("samples = torch.tensor(" + repr(samples) + "); samples[[i for i in range(len(samples)) if i % "
            "torch.distributed.get_world_size() != torch.distributed.get_rank()]] = float('nan')  # the checker's: "
            "one line, so the script keeps its line numbers")
    # and, at the end, leave the process group: a gloo group torn down with the process can abort it after the job
    # printed its answer ("terminate called without an active exception"), which would fail a right fix
    leave = ("\nif torch.distributed.is_initialized():  # added by the checker\n"
             "    torch.distributed.destroy_process_group()\n")
    return SAMPLES_LINE.sub(lambda _: mine, source).rstrip("\n") + "\n" + leave


def _run_fixed(source, world_size):
    """The log of the script run on `world_size` ranks under the hang watch; a Mistake if it hangs or fails."""
    from dslab import launch
    from dslab.hangs import diagnoses

    with tempfile.TemporaryDirectory(prefix="dslab-12-") as tmp:
        script = Path(tmp) / "uneven_fixed.py"
        script.write_text(source, encoding="utf-8")
        try:
            with contextlib.redirect_stdout(io.StringIO()):   # the launch prints its command line: not the verdict
                return launch.run(str(script), world_size=world_size, run_dir=Path(tmp) / "runs", stream=False,
                                  timeout=300, hang_timeout=HANG_TIMEOUT_S).log
        except launch.LaunchError as err:
            report = str(err)
            where = diagnoses.blocked(report)
            if where:
                said = "; ".join(f"rank {r} waits in {w['collective']} at line {w['line']}" for r, w in where.items())
                raise Mistake(f"it still hangs on {world_size} ranks ({said}): every rank must call all_reduce the "
                              "same number of times, so the ranks must agree on the number of steps") from None
            last = [line for line in report.splitlines() if line.strip()][-1]
            raise Mistake(f"the script failed on {world_size} ranks: {last.strip()}") from None


_FINISHED = {}   # (script, world size) -> (samples, log) of a run that finished: the same script is not run twice


def check_uneven_fix(answer):
    """Run the learner's fixed script on 2, then 3 ranks under a hang watch, with samples drawn now in place of its
    own (each rank holding only its shard's values): it must finish, and rank 0 must print their mean and count. A
    script that finished on a world size before (the same text, from a path or not) is judged on that run again, as
    dslab.exercises.on_ranks does: checking it twice starts no rank."""
    import random

    source = _script_text(answer)
    rng = random.SystemRandom()
    for world_size in (2, 3):
        if (source, world_size) not in _FINISHED:
            samples = _draw_samples(world_size, rng)
            _FINISHED[source, world_size] = samples, _run_fixed(_with_samples(source, samples), world_size)
        samples, log = _FINISHED[source, world_size]
        found = re.search(r"mean ([-\d.na]+) over (\d+) samples", log)
        if not found:
            raise Mistake("the job finished, but rank 0 printed no `mean M over N samples` line: keep the last print")
        mean, count = float(found.group(1)), int(found.group(2))
        right = sum(samples) / len(samples)
        if mean != mean:   # nan: rank 0 read values only other ranks hold
            raise Mistake("rank 0 printed mean nan: its mean used samples it does not hold. The checker gives each "
                          "rank only its own shard's values (the others are nan, as data on other machines would "
                          "be): the sum and the count must come through the all_reduce")
        if count == len(samples) and abs(mean - right) <= 1e-3:
            continue
        said = (f"the job finished on {world_size} ranks, but with mean {mean:.4f} over {count} samples; the checker's "
                f"{len(samples)} samples (in place of the script's 5) have mean {right:.4f}")
        if (mean, count) == (RIGHT_MEAN, RIGHT_COUNT):
            raise Mistake(f"{said}: 3.0000 over 5 is the chapter's answer, not one computed from the samples")
        raise Mistake(f"{said}: a rank with no sample left still joins the step, adding 0 to the sum and 0 to the "
                      "count")
    return True


# Wrong fixes a learner might write: each must be refused (tests/test_exercises.py runs them).
_DROPS_THE_LAST_SAMPLE = UNEVEN_SCRIPT.replace(
    "for x in shard:                               # one step per sample of this rank's shard",
    "for x in shard[:len(samples) // world_size]:  # the same number of steps on every rank")
assert _DROPS_THE_LAST_SAMPLE != UNEVEN_SCRIPT

exercise("12.read_report", wrong=(({0: ("barrier", WHERE_EACH_RANK_WAITS[1][1]),
                                    1: ("all_reduce", WHERE_EACH_RANK_WAITS[0][1])}, "ranks swapped?"),
                                  ({0: ("all_reduce", WHERE_EACH_RANK_WAITS[0][1] - 2),
                                    1: ("barrier", WHERE_EACH_RANK_WAITS[1][1])}, "but not at line"),
                                  ({0: ("all_reduce", WHERE_EACH_RANK_WAITS[0][1])}, "name both ranks")),
         hint="run it: launch.run(\"runs/12/uneven.py\", world_size=2, hang_timeout=10); each `rank N ...: blocked "
              "in COLLECTIVE (...), called from uneven.py:LINE` line of the report gives rank N's answer"
         )(check_read_report)
_PRINTS_THE_ANSWER = UNEVEN_SCRIPT[:UNEVEN_SCRIPT.index("total = torch.zeros(2)")] + \
    'if rank == 0:\n    print("mean 3.0000 over 5 samples", flush=True)\n'
_MEAN_WITHOUT_A_COLLECTIVE = _PRINTS_THE_ANSWER.replace(
    'print("mean 3.0000 over 5 samples", flush=True)',
    'print(f"mean {samples.mean().item():.4f} over {len(samples)} samples", flush=True)  # dist.all_reduce: unused')
exercise("12.uneven_fix", wrong=((UNEVEN_SCRIPT, "it still hangs"),
                                 (_DROPS_THE_LAST_SAMPLE, "a rank with no sample left still joins the step"),
                                 (_PRINTS_THE_ANSWER, "the chapter's answer, not one computed from the samples"),
                                 (_MEAN_WITHOUT_A_COLLECTIVE, "rank 0 printed mean nan")),
         hint="run the same number of steps on every rank (the longest shard's); a rank out of samples adds "
              "[0, 0] to the step's all_reduce")(check_uneven_fix)


# ---- 12.zero3_generate: the learner generates under ZeRO-3 on every rank, each rank its own number of tokens -------
# generate_on_ranks(model, prompt, new_tokens): a ZeRO-3 engine of the model, then greedy generation of exactly
# new_tokens tokens after `prompt` on this rank (the ranks ask for different numbers), without hanging; returns the new
# token ids. Checked on 2 and 3 ranks: a small Qwen2 model, a prompt and per-rank token counts drawn now, against
# Hugging Face's generate in one process, and the work itself: the tokens returned must be those of a generate whose
# model ZeRO-3 partitioned (each parameter's ds_tensor a shard of its ds_numel elements), run in step with the other
# ranks (as many forward passes as the longest generation). A generate under ZeRO-3 that would not keep the ranks in
# step (no synced_gpus=True) is named before it runs (it would hang, as section 6 showed).
GENERATE_TRIAL = f"{__name__}:generate_trial"


def draw_generate_case(world_size, rng=None):
    """A model shape, a prompt and a different number of new tokens per rank (never the chapter's 4 and 16)."""
    import random

    rng = rng or random.SystemRandom()
    heads = rng.choice((2, 4))
    return {"world_size": world_size,
            "shape": {"hidden_size": heads * rng.choice((8, 16)), "num_attention_heads": heads,
                      "num_key_value_heads": heads // 2, "intermediate_size": 8 * rng.choice((6, 10)),
                      "num_hidden_layers": rng.choice((1, 2)), "vocab_size": rng.choice((300, 500)),
                      "max_position_embeddings": 64},
            "prompt_len": rng.randint(3, 8), "new_tokens": rng.sample([2, 3, 5, 6, 7, 9, 11], world_size),
            "seed": rng.randrange(1 << 30)}


def _generate_model(case):
    from dslab.models.loading import build_model, tiny_config

    return build_model(tiny_config(**case["shape"]), seed=case["seed"] % 1000)


def _guarded_generate(original, calls):
    """GenerationMixin.generate as the trial runs it: under ZeRO-3, a call that would not keep the ranks in step
    (synced_gpus False, or None outside a Hugging Face DeepSpeed config, transformers' own default) is named on every
    rank before it starts (the rank that finishes first would leave while the others wait for its shards). Each call
    appends to `calls` what it ran on: whether ZeRO-3 had partitioned the model's parameters (each has ds_id, ds_numel
    the whole weight's size, ds_tensor this rank's shard), the elements of the weights held here and in all, whether
    it ran synced, its forward passes and the ids it gave."""
    import functools
    import inspect

    signature = inspect.signature(original)

    @functools.wraps(original)
    def generate(self, *args, **kwargs):
        import torch
        from transformers.integrations import is_deepspeed_zero3_enabled

        try:
            synced = signature.bind_partial(self, *args, **kwargs).arguments.get("synced_gpus")
        except TypeError:   # arguments generate refuses: it says so itself, below
            synced = kwargs.get("synced_gpus")
        if synced is None:   # transformers' generate: synced when its DeepSpeed config says ZeRO-3, on several ranks
            synced = is_deepspeed_zero3_enabled() and torch.distributed.get_world_size() > 1
        params = list(self.parameters())
        zero3 = bool(params) and all(getattr(p, "ds_tensor", None) is not None for p in params)
        if zero3 and not synced:
            raise Mistake("generate under ZeRO-3 without synced_gpus=True: the ranks ask for different numbers of "
                          "tokens, so the first one done would leave generate while the others wait in an all-gather "
                          "for its shards of the next forward pass (it hangs, section 6); pass synced_gpus=True")
        record = {"zero3": zero3, "synced": bool(synced), "forwards": 0,
                  "held": sum(p.ds_tensor.numel() if zero3 else p.numel() for p in params),
                  "whole": sum(p.ds_numel if zero3 else p.numel() for p in params)}

        def count(*_):
            record["forwards"] += 1

        hook = self.register_forward_pre_hook(count)
        try:
            out = original(self, *args, **kwargs)
        finally:
            hook.remove()
        ids = getattr(out, "sequences", out)
        record["ids"] = ids[0].tolist() if isinstance(ids, torch.Tensor) and ids.dim() == 2 else None
        calls.append(record)
        return out

    return generate


ZERO_WITHOUT_OPTIMIZER = re.compile(r"zero stage (\d) requires an optimizer")


def generate_trial(generate_on_ranks, case):
    """On every rank: the learner's generate_on_ranks with this rank's token count; its tokens, one process's, and
    what each generate call it made ran on."""
    import copy

    import torch
    from transformers.generation.utils import GenerationMixin

    rank = torch.distributed.get_rank()
    model = _generate_model(case).eval()
    g = torch.Generator().manual_seed(case["seed"])
    prompt = torch.randint(3, case["shape"]["vocab_size"], (1, case["prompt_len"]), generator=g)
    wanted = case["new_tokens"][rank]
    with torch.no_grad():   # one process, the same weights: what greedy decoding must give
        alone = model.generate(prompt, max_new_tokens=wanted, min_new_tokens=wanted, do_sample=False,
                               pad_token_id=0)[0, prompt.shape[1]:].tolist()
    original, calls = GenerationMixin.generate, []
    GenerationMixin.generate = _guarded_generate(original, calls)
    try:
        out = generate_on_ranks(copy.deepcopy(model), prompt.clone(), wanted)
    except AssertionError as err:   # DeepSpeed's assert for ZeRO-1 or 2 without an optimizer (runtime/engine.py)
        stage = ZERO_WITHOUT_OPTIMIZER.search(str(err))
        if stage is None:
            raise
        raise Mistake(f"deepspeed.initialize refused ZeRO stage {stage.group(1)} without an optimizer (DeepSpeed "
                      f"asserts \"zero stage {stage.group(1)} requires an optimizer\"): stages 1 and 2 split only the "
                      "optimizer states and gradients, so they need an optimizer to split, and every rank still holds "
                      "every weight whole. Generation needs stage 3, which splits the weights themselves and runs "
                      "without an optimizer: \"zero_optimization\": {\"stage\": 3}") from None
    finally:
        GenerationMixin.generate = original
    if hasattr(out, "tolist"):
        out = out.tolist()
    while isinstance(out, list) and len(out) == 1 and isinstance(out[0], list):
        out = out[0]   # a [1, n] batch of one
    return {"rank": rank, "got": out if isinstance(out, list) else repr(out)[:80], "alone": alone,
            "prompt": prompt[0].tolist(), "wanted": wanted, "calls": calls}


def diagnose_generate(case, results):
    """A Mistake naming what the learner's generate_on_ranks did wrong on this case, if anything."""
    what = f"{case['world_size']} ranks asking for {case['new_tokens']} new tokens"
    for r in results:
        if not r["calls"]:
            raise Mistake(f"rank {r['rank']} never called generate ({what}): generate the tokens with "
                          "engine.module.generate(...), under the ZeRO-3 engine")
        if not any(c["zero3"] and c["held"] < c["whole"] for c in r["calls"]):
            held = max(c["held"] for c in r["calls"])
            raise Mistake(f"the model that generated on rank {r['rank']} holds every weight whole ({held:,} "
                          f"elements; no parameter has ZeRO-3's ds_numel and ds_tensor shard), so ZeRO-3 never split "
                          f"it ({what}): wrap the model given in an engine with \"zero_optimization\": {{\"stage\": "
                          "3} and generate with engine.module (a copy made before deepspeed.initialize, or a ZeRO-1 "
                          "or 2 engine, keeps every weight on every rank)")
    for r in results:
        got, alone = r["got"], r["alone"]
        if got == alone:
            continue
        if not isinstance(got, list):
            raise Mistake(f"rank {r['rank']} returned {got}: return the new token ids (a list or a tensor)")
        if got[:len(r["prompt"])] == r["prompt"] and got[len(r["prompt"]):] == alone:
            raise Mistake(f"rank {r['rank']} returned the prompt and the new tokens: return only the "
                          f"{r['wanted']} new ones (generate returns the prompt first)")
        if len(got) != r["wanted"]:
            raise Mistake(f"rank {r['rank']} generated {len(got)} tokens, not the {r['wanted']} it asked for "
                          f"({what}): max_new_tokens=new_tokens and min_new_tokens=new_tokens, the argument")
        raise Mistake(f"rank {r['rank']}'s tokens {got} are not greedy decoding's {alone} ({what}): do_sample=False")
    longest = max(case["new_tokens"])
    for r in results:
        sharded = [c for c in r["calls"] if c["zero3"] and c["held"] < c["whole"]]
        if not any(c["ids"] is not None and c["ids"][len(r["prompt"]):] == r["got"] for c in sharded):
            raise Mistake(f"rank {r['rank']} returned tokens that its generate under ZeRO-3 did not give ({what}): "
                          "return the ids engine.module.generate gives after the prompt")
        if not any(c["forwards"] == longest for c in sharded):
            raise Mistake(f"rank {r['rank']}'s generate under ZeRO-3 ran {[c['forwards'] for c in sharded]} forward "
                          f"passes ({what}): with synced_gpus=True every rank runs {longest}, as many as the longest "
                          "generation needs, so that each joins every all-gather of the others' shards")


def _generate_answer(model, prompt, new_tokens, synced=True, count=None, whole=False, stage=3):
    """generate_on_ranks as the solution writes it, with one of the usual mistakes switched on (the wrong answers);
    stage None: no engine at all."""
    import deepspeed

    if stage is not None:
        ds_config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage}}
        engine, *_ = deepspeed.initialize(model=model, config=ds_config)
        model = engine.module
    count = new_tokens if count is None else count
    kwargs = {"synced_gpus": True} if synced else {}
    out = model.generate(prompt, max_new_tokens=count, min_new_tokens=count, do_sample=False, pad_token_id=0,
                         **kwargs)
    return out[0] if whole else out[0, prompt.shape[1]:]


def _generate_unsynced(model, prompt, new_tokens):
    return _generate_answer(model, prompt, new_tokens, synced=False)


def _generate_four(model, prompt, new_tokens):
    return _generate_answer(model, prompt, new_tokens, count=4)        # a count typed in


def _generate_with_prompt(model, prompt, new_tokens):
    return _generate_answer(model, prompt, new_tokens, whole=True)


def _generate_without_engine(model, prompt, new_tokens):
    return _generate_answer(model, prompt, new_tokens, stage=None)     # plain Hugging Face, synced_gpus=True


def _generate_zero2(model, prompt, new_tokens):
    return _generate_answer(model, prompt, new_tokens, synced=False, stage=2)


def check_generate(generate_on_ranks):
    """Run the learner's generate_on_ranks on 2, then 3 launched ranks (dslab.exercises.on_ranks)."""
    return on_ranks.check(GENERATE_TRIAL, generate_on_ranks, draw_generate_case, diagnose_generate)


exercise("12.zero3_generate",
         wrong=((_generate_unsynced, "without synced_gpus=True"),
                (_generate_four, "generated 4 tokens"),
                (_generate_with_prompt, "returned the prompt and the new tokens"),
                (_generate_without_engine, "holds every weight whole"),
                (_generate_zero2, "refused ZeRO stage 2 without an optimizer")),
         prepare=on_ranks.preparer(GENERATE_TRIAL, draw_generate_case, diagnose=diagnose_generate),
         hint="complete generate_on_ranks(model, prompt, new_tokens): deepspeed.initialize with \"zero_optimization\": "
              "{\"stage\": 3}; engine.module.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, "
              "do_sample=False, synced_gpus=True); return the ids after the prompt.")(check_generate)
