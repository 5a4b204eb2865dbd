"""Chapter 05 (LoRA SFT): trainable parameters, checkpointing cost, and the prompt mask of a chat.

Solutions: notebooks/solutions/05_solutions.py."""
from dslab.data import IGNORE_INDEX
from dslab.exercises import Mistake, exercise, expect, references
from dslab.training.sft import DEFAULT_AUTHOR, DEFAULT_NAME, load_chats

# A few wrong label-masking functions a learner writes (the checker must name each mistake).
def _reference_parts(tokenizer, messages):
    prompt = tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    return tokenizer.encode(prompt, add_special_tokens=False), tokenizer.encode(full[len(prompt):], add_special_tokens=False)


def _unmasked(tokenizer, messages):
    prompt_ids, answer_ids = _reference_parts(tokenizer, messages)
    return {"input_ids": prompt_ids + answer_ids, "labels": prompt_ids + answer_ids}


def _shifted(tokenizer, messages):
    prompt_ids, answer_ids = _reference_parts(tokenizer, messages)
    ids = prompt_ids + answer_ids
    labels = [IGNORE_INDEX] * len(prompt_ids) + answer_ids
    return {"input_ids": ids, "labels": labels[1:] + [IGNORE_INDEX]}


def _end_masked(tokenizer, messages):
    prompt_ids, answer_ids = _reference_parts(tokenizer, messages)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    labels = [IGNORE_INDEX] * len(prompt_ids) + [IGNORE_INDEX if t == end else t for t in answer_ids]
    return {"input_ids": prompt_ids + answer_ids, "labels": labels}


def _all_masked(tokenizer, messages):
    prompt_ids, answer_ids = _reference_parts(tokenizer, messages)
    return {"input_ids": prompt_ids + answer_ids, "labels": [IGNORE_INDEX] * (len(prompt_ids) + len(answer_ids))}


def _first_tokens_masked(tokenizer, messages):
    """Masks a fixed number of leading tokens: the prompt length of one chat, hard-coded."""
    prompt_ids, answer_ids = _reference_parts(tokenizer, messages)
    ids = prompt_ids + answer_ids
    return {"input_ids": ids, "labels": [IGNORE_INDEX] * 12 + ids[12:]}


def check_mask_prompt(mask_prompt, tokenizer=None):
    """Run the learner's `mask_prompt(tokenizer, messages)` on real chats drawn now (an English and a Chinese one,
    with system prompts or not, as the data has them) and name what is wrong."""
    import random

    from dslab import data
    from dslab.models import loading
    if not callable(mask_prompt):
        raise Mistake("answer with the function itself: answer = mask_prompt")
    tokenizer = tokenizer or loading.load_tokenizer()
    rng = random.SystemRandom()
    chats = [c["messages"] for c in load_chats(None, DEFAULT_NAME, DEFAULT_AUTHOR, mix_general=0)]
    chats = [rng.choice([c for c in chats if c[0]["content"].isascii()]),
             rng.choice([c for c in chats if not c[0]["content"].isascii()])]
    for messages in chats:
        out = mask_prompt(tokenizer, messages)
        if not isinstance(out, dict) or not {"input_ids", "labels"} <= set(out):
            raise Mistake("return a dict {'input_ids': [...], 'labels': [...]}")
        ids, labels = [int(t) for t in out["input_ids"]], [int(t) for t in out["labels"]]
        full = tokenizer.apply_chat_template(messages, tokenize=False)
        prompt = tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
        answer = messages[-1]["content"] + "<|im_end|>"
        if len(ids) != len(labels):
            raise Mistake(f"input_ids has {len(ids)} tokens but labels {len(labels)}: one label per input token")
        if tokenizer.decode(ids) != full:
            raise Mistake("input_ids do not spell the chat as its template renders it: tokenize the text of "
                          "tokenizer.apply_chat_template(messages, tokenize=False)")
        if any(lab not in (data.IGNORE_INDEX, tok) for lab, tok in zip(labels, ids)):
            if all(lab in (data.IGNORE_INDEX, tok) for lab, tok in zip(labels[:-1], ids[1:])):
                raise Mistake("the labels are shifted by one token: give each position its own id; the model "
                              "shifts them itself (the logits at t are scored against the label at t + 1)")
            raise Mistake("a label must be -100 or the input id at the same position")
        learned = tokenizer.decode([tok for tok, lab in zip(ids, labels) if lab != data.IGNORE_INDEX])
        if not learned:
            raise Mistake("no token carries a label, so the loss has nothing to learn: keep the answer's ids")
        prompt_tokens = len(tokenizer.encode(prompt, add_special_tokens=False))
        header = prompt[len(tokenizer.apply_chat_template(messages[:-1], tokenize=False)):]   # the generation prompt
        if header and learned.startswith(header):
            raise Mistake(f"prompt tokens carry labels: the assistant's header {header!r} is the template's, part "
                          "of the prompt, which apply_chat_template(messages[:-1], tokenize=False, "
                          "add_generation_prompt=True) renders with that header at its end; label from the answer on")
        if any(lab != data.IGNORE_INDEX for lab in labels[:prompt_tokens]) or "<|im_start|>" in learned:
            raise Mistake("prompt tokens carry labels: set them to -100 so the model learns to answer, "
                          "not to predict the question and the template")
        if "<|im_end|>" not in learned and learned.strip() == messages[-1]["content"].strip():
            raise Mistake("the end-of-turn token <|im_end|> is masked: label it too, or the model never learns "
                          "to stop after its answer")
        if learned.startswith(answer) and learned != answer:
            raise Mistake("what follows <|im_end|> (the template's newline) carries a label: mask it, it is "
                          "template, not answer")
        if learned != answer:
            raise Mistake(f"the labelled tokens spell {learned!r}; expected the answer and its end token, {answer!r}")
    leaned = references.leaned_on(mask_prompt, (data.sft_example,))
    if leaned:
        raise Mistake(f"your function gets its labels from {leaned}, the chapter's own masking (section 2 runs it): "
                      "write the masking yourself, from the chat template's prompt and full text")
    return True


# dslab-tiny: 4 layers, hidden 256, 4 heads of 64, 2 KV heads -> q_proj 256->256, v_proj 256->128.
# r=8 on q_proj and v_proj: 4 x (8 x (256 + 256) + 8 x (256 + 128)).
expect("05.lora_params", 28672,
       wrong=((7168, "7168 is one block's adapters: dslab-tiny has 4 blocks"),
              (32768, "32768 takes v_proj as 256 -> 256: with 2 KV heads of 64 it maps 256 -> 128"),
              (16384, "16384 counts the adapters of q_proj only: v_proj has its own"),
              (12288, "12288 counts the adapters of v_proj only: q_proj has its own"),
              (2 * 4 * 256 * 256, "524288 counts frozen 256 x 256 weights: LoRA adds r x (d_in + d_out) parameters "
                                  "to a d_in -> d_out layer, A (r x d_in) and B (d_out x r)")),
       hint="a LoRA on a d_in -> d_out layer adds A (r x d_in) and B (d_out x r): r (d_in + d_out) "
            "parameters. v_proj maps 256 -> 2 KV heads x 64 = 128. Sum over both layers and all 4 blocks.")
# Checkpointing every layer: each runs once in forward and once more (recomputed) in backward.
expect("05.ckpt_forwards", 48,
       wrong=((24, "24 is one forward per layer: with checkpointing, backward runs each layer's forward once more to "
                   "rebuild the activations it did not keep"),
              (25, "25 recomputes one layer: backward recomputes every checkpointed layer, all 24"),
              (72, "72 counts 3 forwards per layer: the forward pass, and one recompute in backward; backward itself "
                   "is not a forward"),
              (96, "96 counts 4 forwards per layer: each layer runs forward twice, once in the forward pass and once "
                   "recomputed in backward")),
       hint="without checkpointing each of the 24 layers runs forward once per step; with it, backward "
            "re-runs each layer's forward to rebuild the activations it did not keep.")
exercise("05.mask_prompt", hint="return {'input_ids': [...], 'labels': [...]} for the chat: -100 on every "
                                "prompt token, the answer's own ids (and its <|im_end|>) as labels.",
         wrong=((_unmasked, "prompt tokens carry labels"), (_shifted, "shifted by one"),
                (_end_masked, "<|im_end|> is masked"), (_all_masked, "no token carries a label"),
                (_first_tokens_masked, "prompt tokens carry labels")))(check_mask_prompt)
