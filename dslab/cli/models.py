"""`dslab build-base`, `dslab infer` (--tp N / --kernel-inject too), `dslab eval` and `dslab merge`: flags and output.

The work is done by dslab.tiny.pretrain, dslab.models.infer / dslab.parallel.tp_infer, dslab.models.evaluate and dslab.models.lora; models load
through dslab.models.loading.load_model. The --dtype flags keep torch's names (float32, bfloat16, float16), which this
file turns into the library's fp32 / bf16 / fp16.
"""
import argparse
import contextlib
import json
import os
import sys

from dslab.models.loading import DEFAULT_MODEL_DIR, DTYPES

DTYPE_FROM_FLAG = {torch_name: name for name, torch_name in DTYPES.items()}  # "bfloat16" -> "bf16"


def add_commands(subparsers):
    """Register `dslab build-base`, `dslab infer`, `dslab eval` and `dslab merge`."""
    add_build_base(subparsers)
    add_infer(subparsers)
    add_eval(subparsers)
    add_merge(subparsers)


# ----------------------------------------------------------------------------------------------------
# `dslab build-base`
# ----------------------------------------------------------------------------------------------------
def add_build_base(subparsers):
    p = subparsers.add_parser("build-base", help="rebuild the tiny base model (tokenizer + DeepSpeed pretraining)",
                              description="Train the tokenizer and pretrain dslab-tiny on the kit's corpus under DeepSpeed.")
    p.add_argument("--output", default=str(DEFAULT_MODEL_DIR), help="where to save (default: data/dslab-tiny)")
    p.add_argument("--steps", type=int, default=650, help="optimizer steps of 16 x 256 tokens (default 650)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--max-docs", type=int, default=None, help=argparse.SUPPRESS)  # smoke tests: a corpus slice
    p.add_argument("--regenerate-corpus", action="store_true", help="rewrite data/corpus from dslab.tiny.corpus first")
    p.set_defaults(func=build_base_command)


def build_base_command(args):
    """Rebuild the base model from the committed corpus and print what the report says."""
    # Idle OpenMP threads sleep instead of spinning: on a CPU shared with other jobs, spinning threads
    # burn the cores the others need (measured here: ~3x less CPU time per step under load).
    # Read once when torch loads, so it only takes effect if torch is not imported yet.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from dslab.tiny import corpus, pretrain
    try:
        pretrain.check_build(args.output, args.steps)
    except (ValueError, PermissionError, NotADirectoryError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.regenerate_corpus:
        for path in corpus.write_all(corpus.CORPUS_DIR.parent):
            print(f"wrote {path}")
    report = pretrain.build_base(args.output, steps=args.steps, seed=args.seed, progress=not args.quiet,
                                 max_docs=args.max_docs)
    print(f"params {report['params']:,}  steps {report['steps']}  tokens seen {report['tokens_seen']:,}")
    print(f"valid perplexity {report['valid_perplexity']:.2f} (vocab {report['vocab_size']}, "
          f"ratio {report['valid_perplexity'] / report['vocab_size']:.5f}; unigram baseline "
          f"{report['unigram_perplexity']:.1f})")
    print(f"built in {report['seconds']:.0f} s ({report['cpu_seconds']:.0f} CPU seconds); saved to {args.output}")
    return 0


# ----------------------------------------------------------------------------------------------------
# `dslab infer` and the model options it shares with `dslab eval`
# ----------------------------------------------------------------------------------------------------
def add_model_arguments(p):
    """The options that say which model to load (read by load_from_args): --model, --adapter, --dtype, ..."""
    p.add_argument("--model", default=None,
                   help="local HF checkpoint directory or hub id (default: $DSLAB_MODEL, else data/dslab-tiny)")
    p.add_argument("--adapter", default=None, help="a LoRA adapter directory (from dslab sft) applied on top of --model")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="allow a hub model to run its own Python code (off by default; only for code you trust)")


def load_from_args(args):
    """(model, tokenizer) for --model / --adapter / --dtype / --trust-remote-code; a bad model or adapter exits with
    why (loading.ModelError: a missing folder, a pickle-only checkpoint, a broken adapter)."""
    from dslab.models import loading
    try:
        model = loading.load_model(args.model, adapter=args.adapter, dtype=DTYPE_FROM_FLAG[args.dtype],
                                  trust_remote_code=args.trust_remote_code)
        tokenizer = loading.load_tokenizer(args.model, adapter=args.adapter, trust_remote_code=args.trust_remote_code)
    except loading.ModelError as exc:
        raise SystemExit(f"error: {exc}") from None
    return model, tokenizer


def add_infer(subparsers):
    p = subparsers.add_parser("infer", help="generate text with a model (greedy by default)",
                              description="Generate completions with a Hugging Face causal LM.")
    add_model_arguments(p)
    p.add_argument("--prompt", action="append", help="a prompt; repeat for several")
    p.add_argument("--prompts-file", help="a .jsonl file with a \"prompt\" field per line, or a text file, one prompt per line")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user turn in the chat template")
    p.add_argument("--system", help="a system message for --chat")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    p.add_argument("--json", action="store_true", help="print a JSON list of {\"prompt\", \"completion\"}")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel ranks: split the model across N processes with DeepSpeed AutoTP")
    p.add_argument("--kernel-inject", action="store_true",
                   help="replace transformer blocks with DeepSpeed's fused CUDA kernels (GPU only)")
    p.set_defaults(func=infer_command)


def infer_command(args):
    """Plain Hugging Face generation in this process, or on --tp N ranks / with --kernel-inject through DeepSpeed."""
    if args.tp < 1:
        print("error: --tp must be at least 1", file=sys.stderr)
        return 2
    from dslab.models import infer
    try:
        infer.check_generation(args.max_new_tokens, args.temperature)
        prompts = infer.read_prompts(args.prompt, args.prompts_file)  # data.DataError (a ValueError) if unreadable
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not prompts:
        print("dslab infer: give at least one --prompt TEXT or a --prompts-file", file=sys.stderr)
        return 2
    if args.tp == 1 and not args.kernel_inject:
        from transformers.utils import logging as hf_logging
        hf_logging.set_verbosity_error()  # keep the output to the completions (stdout stays valid JSON)
        hf_logging.disable_progress_bar()
        model, tokenizer = load_from_args(args)
        completions = infer.generate(model, tokenizer, prompts, args.max_new_tokens, chat=args.chat,
                                     temperature=args.temperature, system=args.system)
    else:
        from dslab import launch, this_rank
        from dslab.models import loading
        from dslab.parallel import tp_infer
        this_rank.quiet()
        try:
            with contextlib.redirect_stdout(sys.stderr):  # the launcher's command line; stdout keeps only the answers
                result = tp_infer.generate_tensor_parallel(
                    prompts, tp=args.tp, model=args.model, adapter=args.adapter, dtype=DTYPE_FROM_FLAG[args.dtype],
                    kernel_inject=args.kernel_inject, max_new_tokens=args.max_new_tokens, chat=args.chat,
                    system=args.system, temperature=args.temperature)
        except (tp_infer.TPInferenceError, launch.LaunchError, loading.ModelError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1 if isinstance(exc, launch.LaunchError) else 2
        prompts, completions = result["prompts"], result["completions"]
    print_completions(prompts, completions, args.json)
    return 0


def print_completions(prompts, completions, as_json):
    """What `dslab infer` prints: a JSON list of {"prompt", "completion"}, or each prompt and its answer."""
    results = [{"prompt": p, "completion": c} for p, c in zip(prompts, completions)]
    if as_json:
        print(json.dumps(results, ensure_ascii=False, indent=1))
    else:
        for r in results:
            print(f">>> {r['prompt']}\n{r['completion']}\n")


# ----------------------------------------------------------------------------------------------------
# `dslab eval`
# ----------------------------------------------------------------------------------------------------
def add_eval(subparsers):
    p = subparsers.add_parser("eval", help="score identity answers (whole name/author, per language), general answers "
                                           "and the perplexity on held-out text",
                              description="Scoring self-cognition tuning so that it cannot be fooled, and the "
                                          "`dslab eval` command.")
    add_model_arguments(p)
    p.add_argument("--model-name", nargs="+", required=True, help="the name expected: one, or zh then en")
    p.add_argument("--model-author", nargs="+", required=True, help="the author expected: one, or zh then en")
    p.add_argument("--questions", help="a .jsonl of {\"query\", \"lang\", \"asks\": \"name\"|\"author\"} "
                                       "(default: data/identity_eval.jsonl)")
    # Not --lang: that is dslab's own option (`dslab --lang zh eval ...`), which a sub-command's --lang would reset.
    p.add_argument("--question-lang", choices=["en", "zh"], help="score only the identity questions in this language")
    p.add_argument("--system", help="a system message before every question (as a chat template with a default "
                                    "system prompt adds one); default: none")
    p.add_argument("--json", action="store_true", help="print every answer and the scores as JSON")
    p.set_defaults(func=eval_command)


def name_from_flag(values, option):
    """--model-name X, or --model-name ZH EN, as the str or (zh, en) pair the scorers take (data.name_pair)."""
    from dslab import data

    try:
        return data.name_pair(values, option)
    except data.DataError as exc:
        raise SystemExit(f"error: {exc}") from None


def eval_command(args):
    """Score a model (or base + adapter) on held-out identity questions and the general questions."""
    from transformers.utils import logging as hf_logging

    from dslab import data
    from dslab.models import evaluate
    from dslab.training import sft_measure
    hf_logging.set_verbosity_error()
    name = name_from_flag(args.model_name, "--model-name")
    author = name_from_flag(args.model_author, "--model-author")
    try:
        rows = data.identity_eval(args.questions) if args.questions else None
    except data.DataError as exc:
        raise SystemExit(f"error: --questions {exc}") from None
    if args.question_lang:
        rows = [r for r in (rows or data.identity_eval()) if r["lang"] == args.question_lang]
    model, tokenizer = load_from_args(args)
    identity, id_rows = evaluate.identity_accuracy(model, tokenizer, name, author, rows, system=args.system)
    general, gen_rows = evaluate.general_accuracy(model, tokenizer, system=args.system)
    perplexity = sft_measure.text_perplexity(model, tokenizer)   # how much general language survived the tuning
    if args.json:
        print(json.dumps({"identity": identity, "general": general, "perplexity": perplexity, "system": args.system,
                          "identity_rows": id_rows, "general_rows": gen_rows}, ensure_ascii=False, indent=1))
        return 0
    for r in id_rows:
        print(f"[{'ok' if r['hit'] else '--'}] ({r['lang']}, asks {r['asks']}) {r['query']}\n       {r['completion']}")
    per_lang = ", ".join(f"{lang} {h}/{n}" for lang, (h, n) in evaluate.by_language(id_rows).items())
    print(f"identity: {identity:.0%} ({per_lang}); general: {general:.0%} "
          f"({sum(r['hit'] for r in gen_rows)}/{len(gen_rows)}); held-out text perplexity {perplexity:.2f}")
    return 0


# ----------------------------------------------------------------------------------------------------
# `dslab merge`
# ----------------------------------------------------------------------------------------------------
def add_merge(subparsers):
    p = subparsers.add_parser("merge", help="merge a LoRA adapter into its base model (verified, atomic)")
    p.add_argument("--model", default=None, help="base model directory or name (default: the base recorded in the "
                                                 "adapter when it is a local directory, else dslab-tiny)")
    p.add_argument("--adapter", required=True, help="PEFT adapter directory (adapter_config.json + weights)")
    p.add_argument("--output", required=True, help="where the merged HF model is written")
    p.add_argument("--tolerance", type=float, default=1e-4, help="largest allowed |logit difference| (float32)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                   help="dtype of the saved model (default float32: exact; bfloat16 rounds small LoRA updates away)")
    p.set_defaults(func=merge_command)


def merge_command(args):
    """Merge, check and write; a refused adapter or output is one line on stderr and exit status 1."""
    from dslab import this_rank
    this_rank.quiet()  # before DeepSpeed or transformers log anything
    from dslab.models import loading, lora
    try:
        lora.merge(args.model, args.adapter, args.output, tolerance=args.tolerance, dtype=DTYPE_FROM_FLAG[args.dtype])
    except (loading.ModelError, lora.MergeError, PermissionError, NotADirectoryError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0
