"""Text generation with Hugging Face `generate` (greedy by default) and the `dslab infer` command."""
import json
import sys
from pathlib import Path


def prompt_text(tokenizer, prompt, chat=False, system=None):
    """What the model is fed: the raw prompt, or (chat=True) one user turn in the tokenizer's chat template."""
    if not chat:
        return prompt
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this tokenizer has no chat template; run without --chat (a plain base model continues text)")
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def sequences(model, tokenizer, prompts, max_new_tokens=64, chat=False, temperature=0.0, system=None):
    """For each prompt, (prompt length, token ids of prompt + generated tokens [1, T]); greedy unless temperature > 0.

    Prompts run one at a time: no padding, so a prompt's output never depends on its neighbours.
    Generation stops at the model's eos tokens (for dslab-tiny: <|im_end|> and <|endoftext|>).
    """
    import torch
    if isinstance(prompts, str):
        prompts = [prompts]
    device = next(model.parameters()).device
    sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    model.eval()
    for prompt in prompts:
        ids = tokenizer(prompt_text(tokenizer, prompt, chat, system), return_tensors="pt", add_special_tokens=False)
        ids = {k: v.to(device) for k, v in ids.items()}
        with torch.no_grad():
            out = model.generate(**ids, max_new_tokens=max_new_tokens, pad_token_id=pad_id, **sampling)
        yield ids["input_ids"].shape[1], out


def generate(model, tokenizer, prompts, max_new_tokens=64, chat=False, temperature=0.0, system=None):
    """Completions (list of str, without the prompt) for a list of prompts; greedy unless temperature > 0."""
    return [tokenizer.decode(out[0, start:], skip_special_tokens=True).strip()
            for start, out in sequences(model, tokenizer, prompts, max_new_tokens, chat, temperature, system)]


# ----------------------------------------------------------------------------------------------------
# `dslab infer`
# ----------------------------------------------------------------------------------------------------
def read_prompts(args):
    """Prompts from --prompt (repeatable) and --prompts-file (.jsonl with "prompt"/"query", or one per line)."""
    prompts = list(args.prompt or [])
    if args.prompts_file:
        path = Path(args.prompts_file)
        if path.suffix == ".jsonl":
            from dslab import data
            for row in data.load_jsonl(path):
                text = row.get("prompt", row.get("query"))
                if text is None:
                    raise data.DataError(f"{path}: every line needs a \"prompt\" (or \"query\") field")
                prompts.append(text)
        else:
            prompts += [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return prompts


def load_for_inference(args):
    """(model, tokenizer) for the command's arguments; the place to add adapters or tensor parallelism."""
    import torch
    from dslab import models
    from dslab import lora
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    adapter = getattr(args, "adapter", None)  # --adapter: a LoRA adapter on top of the base (dslab.lora checks it)
    try:
        path = args.model or (lora.adapter_base(adapter) if adapter else None)  # the base the adapter was trained on
        model = models.load_model(path, dtype=dtype, trust_remote_code=args.trust_remote_code)
        tokenizer = models.load_tokenizer(path, trust_remote_code=args.trust_remote_code)
        if adapter:
            model = lora.apply_adapter(model, adapter)
    except lora.AdapterError as exc:
        raise SystemExit(f"error: {exc}") from None
    return model, tokenizer


def _cmd_infer(args):
    """Run generation for the prompts and print them (text or JSON)."""
    prompts = read_prompts(args)
    if not prompts:
        print("dslab infer: give at least one --prompt TEXT or a --prompts-file", file=sys.stderr)
        return 2
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()  # keep the output to the completions (stdout stays valid JSON)
    hf_logging.disable_progress_bar()
    model, tokenizer = load_for_inference(args)
    completions = generate(model, tokenizer, prompts, args.max_new_tokens, chat=args.chat,
                           temperature=args.temperature, system=args.system)
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


def add_model_arguments(p):
    """The options that say which model to load (read by load_for_inference): --model, --adapter, --dtype, ..."""
    p.add_argument("--model", default=None,
                   help="local HF checkpoint directory or hub id (default: $DSLAB_MODEL, else data/dslab-tiny)")
    p.add_argument("--adapter", default=None, help="a LoRA adapter directory (from dslab sft) applied on top of --model")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="allow a hub model to run its own Python code (off by default; only for code you trust)")


def add_arguments(p):
    """The options of `dslab infer` (kept apart so other modules can extend the same parser)."""
    add_model_arguments(p)
    p.add_argument("--prompt", action="append", help="a prompt; repeat for several")
    p.add_argument("--prompts-file", help="a .jsonl file with a \"prompt\" field per line, or a text file, one prompt per line")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user turn in the chat template")
    p.add_argument("--system", help="a system message for --chat")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    p.add_argument("--json", action="store_true", help="print a JSON list of {\"prompt\", \"completion\"}")


def add_commands(subparsers):
    """Register `dslab infer`."""
    p = subparsers.add_parser("infer", help="generate text with a model (greedy by default)",
                              description="Generate completions with a Hugging Face causal LM.")
    add_arguments(p)
    p.set_defaults(func=_cmd_infer)
    # --tp N / --kernel-inject: DeepSpeed init_inference on N ranks (dslab/tp_infer.py); other runs stay on _cmd_infer.
    from dslab import tp_infer
    tp_infer.add_arguments(p, fallback=_cmd_infer)
