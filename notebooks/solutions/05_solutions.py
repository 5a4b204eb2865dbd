"""Instructor solutions for notebooks/05_lora_sft.ipynb (checked by tests/test_exercises.py)."""
from dslab.models import loading, lora

# 05.lora_params: attach r=8 adapters to q_proj and v_proj of a model of the dslab-tiny shape and count.
model = lora.attach_lora(loading.build_model(loading.tiny_config()), r=8, alpha=16, target_modules=["q_proj", "v_proj"])
lora_params = lora.trainable_summary(model)["trainable"]
# The same by hand: r (d_in + d_out) per adapted layer, v_proj maps 256 -> 2 KV heads x 64.
assert lora_params == 4 * (8 * (256 + 256) + 8 * (256 + 128))

# 05.ckpt_forwards: every layer runs once in forward and once more when backward recomputes it.
layers = 24
ckpt_forwards = 2 * layers


# 05.mask_prompt: the prompt (everything the template puts before the answer) is -100; the answer's ids and its
# <|im_end|> are their own labels; the newline the template adds after <|im_end|> is -100 again.
def mask_prompt(tokenizer, messages):
    prompt = tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    answer_ids = tokenizer.encode(full[len(prompt):], add_special_tokens=False)
    end = answer_ids.index(tokenizer.convert_tokens_to_ids("<|im_end|>")) + 1
    labels = [-100] * len(prompt_ids) + answer_ids[:end] + [-100] * (len(answer_ids) - end)
    return {"input_ids": prompt_ids + answer_ids, "labels": labels}

SOLUTIONS = {
    "05.lora_params": lora_params,
    "05.ckpt_forwards": ckpt_forwards,
    "05.mask_prompt": mask_prompt,
}
