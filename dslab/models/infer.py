"""Text generation with Hugging Face `generate` (greedy by default); `dslab infer` is in dslab.cli.models."""
from pathlib import Path

from dslab.messages import say


def prompt_text(tokenizer, prompt, chat=False, system=None):
    """What the model is fed: the raw prompt, or (chat=True) one user turn in the tokenizer's chat template."""
    if not chat:
        return prompt
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this tokenizer has no chat template; run without --chat (a plain base model continues text)")
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def check_generation(max_new_tokens=64, temperature=0.0):
    """Raise ValueError, naming the option and what it must be, for a length or temperature that cannot be."""
    if not max_new_tokens >= 1:
        raise ValueError(say("number.at_least", name="max_new_tokens", least=1, value=max_new_tokens))
    if not temperature >= 0:  # 0: greedy; NaN fails here too
        raise ValueError(say("number.at_least", name="temperature", least=0, value=temperature))


def sequences(model, tokenizer, prompts, max_new_tokens=64, chat=False, temperature=0.0, system=None):
    """For each prompt, (prompt length, token ids of prompt + generated tokens [1, T]); greedy unless temperature > 0.

    Prompts run one at a time: no padding, so a prompt's output never depends on its neighbours.
    Generation stops at the model's eos tokens (for dslab-tiny: <|im_end|> and <|endoftext|>).
    """
    import torch
    check_generation(max_new_tokens, temperature)
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


def read_prompts(prompts=(), prompts_file=None):
    """`prompts` followed by those of `prompts_file` (.jsonl with "prompt"/"query" per line, else one per line)."""
    from dslab import data

    prompts = list(prompts or [])
    if prompts_file:
        path = Path(prompts_file)
        if not path.is_file():
            raise data.DataError(say("data.no_file", path=path))
        if path.suffix == ".jsonl":
            for row in data.load_jsonl(path):
                text = row.get("prompt", row.get("query"))
                if text is None:
                    raise data.DataError(f"{path}: every line needs a \"prompt\" (or \"query\") field")
                prompts.append(text)
        else:
            prompts += [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return prompts
