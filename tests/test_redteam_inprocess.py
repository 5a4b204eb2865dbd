"""Red-team tests of the coding exercises checked in this process (02.amp_clip, 03.fix_loop, 03.token_loss,
05.mask_prompt, 06.merge_call, 13.forward_flops, 14.trainer_steps): the answers that the registered wrong ones
(tests/test_exercises.py), its HARD_CODED ones and the red teams of tests/test_exercise_judging.py and
tests/test_redteam_ranks_b.py do not already cover. Wrong answers are refused with their mistake named, among them
answers that hand the work to the chapter's own function; right answers written in unusual but valid forms are
accepted. REDTEAM declares them (tests/test_redteam_coverage.py counts every red team's declaration); the tests
below run exactly what it declares."""
import functools

import pytest
import torch

from dslab.exercises import ch03

from support import accepted, refused

# ---------------------------------------------------------------------------------------------- 02.amp_clip


def _step_under(autocast_dtype, name):
    """The GradScaler step, right in every call, but its forward under autocast to `autocast_dtype` (None: no
    autocast, the forward in fp32) where the exercise asks fp16."""
    def step(model, optimizer, scaler, x, y, max_norm):
        import contextlib

        import torch

        optimizer.zero_grad()
        cast = torch.autocast("cpu", dtype=autocast_dtype) if autocast_dtype else contextlib.nullcontext()
        with cast:
            loss = torch.nn.functional.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        scaler.step(optimizer)
        scaler.update()
        return loss

    step.__name__ = name
    return step


_fp32_step = _step_under(None, "_fp32_step")
_bf16_step = _step_under(torch.bfloat16, "_bf16_step")   # the chapter's other half-precision format


def _clip_by_the_total_norm(model, optimizer, scaler, x, y, max_norm):
    """Right: the gradients set to None by hand, only the model under autocast (the loss in fp32), the norm taken
    with get_total_norm and applied with clip_grads_with_norm_ (clip_grad_norm_ in two calls)."""
    import torch

    params = list(model.parameters())
    for p in params:
        p.grad = None
    with torch.autocast(device_type="cpu", dtype=torch.float16):
        out = model(x)
    loss = torch.nn.functional.mse_loss(out.float(), y)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    total = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    scaler.step(optimizer)
    scaler.update()


class _AmpStep:
    """Right: the step as a callable object whose settings are attributes, the autocast dtype among them."""

    def __init__(self):
        import torch

        self.dtype, self.norm_type = torch.float16, 2.0

    def __call__(self, model, optimizer, scaler, x, y, max_norm):
        import torch

        optimizer.zero_grad(set_to_none=False)
        with torch.amp.autocast("cpu", dtype=self.dtype):
            loss = torch.nn.functional.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type=self.norm_type)
        scaler.step(optimizer)
        scaler.update()
        return loss.item()


# ---------------------------------------------------------------------------------------------- 03.fix_loop

def _the_chapters_loop(model, micro_batches):
    from dslab.training.accumulation import accumulate_backward

    accumulate_backward(model, micro_batches)       # the loop the chapter prints, mode "mean": right, not written


def _the_chapters_loop_summing(model, micro_batches):
    from dslab.training import accumulation

    accumulation.accumulate_backward(model, micro_batches, mode="sum")


def _gradients_divided_after_the_loop(model, micro_batches):
    """Right: each micro-batch's mean loss back-propagated as it is, the summed .grad divided by k afterwards."""
    for micro_batch in micro_batches:
        model(**micro_batch).loss.backward()
    for p in model.parameters():
        if p.grad is not None:
            p.grad.div_(len(micro_batches))


def _backward_with_a_weight(model, micro_batches):
    """Right: torch.autograd.backward with the 1/k weight as the gradient of each loss."""
    import torch

    weight = torch.tensor(1.0 / len(micro_batches))
    for micro_batch in micro_batches:
        torch.autograd.backward(model(**micro_batch).loss, grad_tensors=weight)


# ---------------------------------------------------------------------------------------------- 03.token_loss

def _normalised_by_its_own_targets(model, micro_batch, window_targets):
    """num_items_in_batch given the micro-batch's own count: each micro-batch's mean, k of them added up."""
    import torch

    from dslab.training.accumulation import count_targets

    return model(**micro_batch, num_items_in_batch=torch.tensor(count_targets(micro_batch))).loss


def _mean_over_window_targets(model, micro_batch, window_targets):
    """The micro-batch's mean divided by the window's count: a mean (of means) where a sum belongs."""
    return model(**micro_batch).loss / window_targets


def _token_loss_by_hand(model, micro_batch, window_targets):
    """Right: the shifted cross-entropy summed by hand, divided by the window's count."""
    import torch.nn.functional as F

    logits = model(input_ids=micro_batch["input_ids"]).logits[:, :-1]
    targets = micro_batch["labels"][:, 1:]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1), ignore_index=-100,
                           reduction="sum") / window_targets


def _mean_weighted_by_its_targets(model, micro_batch, window_targets):
    """Right: the mean over the micro-batch's targets times their count is their sum."""
    from dslab.training.accumulation import count_targets

    return model(**micro_batch).loss * (count_targets(micro_batch) / window_targets)


def _count_as_a_plain_int(model, micro_batch, window_targets):
    """Right: num_items_in_batch as a Python int (transformers divides by it as it is)."""
    return model(**micro_batch, num_items_in_batch=int(window_targets)).loss


# ---------------------------------------------------------------------------------------------- 05.mask_prompt

def _parts(tokenizer, messages, generation_prompt=True):
    prompt = tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=generation_prompt)
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    return tokenizer.encode(prompt, add_special_tokens=False), tokenizer.encode(full[len(prompt):],
                                                                                add_special_tokens=False)


def _the_chapters_masking(tokenizer, messages):
    from dslab import data

    return data.sft_example(tokenizer, messages)     # section 2's function: right labels, nothing written


def _the_chapters_tokenize(tokenizer, messages):
    from dslab.training import sft

    return sft.tokenize(tokenizer, [{"messages": messages}])[0]


def _header_labelled(tokenizer, messages):
    """The prompt rendered without add_generation_prompt: the "<|im_start|>assistant\\n" header is labelled."""
    prompt_ids, answer_ids = _parts(tokenizer, messages, generation_prompt=False)
    end = answer_ids.index(tokenizer.convert_tokens_to_ids("<|im_end|>")) + 1
    labels = [-100] * len(prompt_ids) + answer_ids[:end] + [-100] * (len(answer_ids) - end)
    return {"input_ids": prompt_ids + answer_ids, "labels": labels}


def _newline_labelled(tokenizer, messages):
    """Everything after the prompt labelled, the template's newline after <|im_end|> too."""
    prompt_ids, answer_ids = _parts(tokenizer, messages)
    return {"input_ids": prompt_ids + answer_ids, "labels": [-100] * len(prompt_ids) + answer_ids}


def _labels_by_character_offsets(tokenizer, messages):
    """Right: the whole chat tokenized once; a token is labelled when its characters lie in the answer and its
    <|im_end|> (the fast tokenizer's offset mapping)."""
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    start = len(tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True))
    stop = full.index("<|im_end|>", start) + len("<|im_end|>")
    encoded = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    labels = [tok if start <= a and b <= stop else -100
              for tok, (a, b) in zip(encoded["input_ids"], encoded["offset_mapping"])]
    return {"input_ids": encoded["input_ids"], "labels": labels}


def _pieces_as_tensors(tokenizer, messages):
    """Right: the ids put together from the prompt, the answer's text, the end token and the template's newline,
    returned as tensors with an attention mask beside them."""
    import torch

    prompt = tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    content, end = messages[-1]["content"], "<|im_end|>"
    tail = full[len(prompt) + len(content) + len(end):]
    pieces = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in (prompt, content, end, tail)]
    ids = [t for piece in pieces for t in piece]
    labels = [-100] * len(pieces[0]) + pieces[1] + pieces[2] + [-100] * len(pieces[3])
    return {"input_ids": torch.tensor(ids), "labels": torch.tensor(labels),
            "attention_mask": torch.ones(len(ids), dtype=torch.long)}


# ---------------------------------------------------------------------------------------------- 06.merge_call

def _lora_layers(peft_model):
    from peft.tuners.lora import LoraLayer

    return [m for m in peft_model.modules() if isinstance(m, LoraLayer) and "default" in m.lora_A]


def _merged_with_alpha(peft_model):
    """B A scaled by lora_alpha, without dividing by r."""
    import torch

    alpha = peft_model.peft_config["default"].lora_alpha
    with torch.no_grad():
        for layer in _lora_layers(peft_model):
            layer.base_layer.weight += alpha * layer.lora_B["default"].weight @ layer.lora_A["default"].weight
    return peft_model.unload()


def _merged_then_base_model(peft_model):
    peft_model.merge_adapter()                       # merged in place, but the LoRA layers stay
    return peft_model.get_base_model()


def _merge_adapter_then_unload(peft_model):
    """Right: merge_adapter() folds B A into each base weight in place; unload() then drops the LoRA layers (peft
    0.21: _unload_and_optionally_merge(merge=False) puts each base layer, already merged, back in its place)."""
    peft_model.merge_adapter()
    return peft_model.unload()


def _delta_weights_by_hand(peft_model):
    """Right: each layer's own delta, get_delta_weight (B A x alpha / r), added to its base weight, then unload()."""
    import torch

    with torch.no_grad():
        for layer in _lora_layers(peft_model):
            layer.get_base_layer().weight.add_(layer.get_delta_weight("default"))
    return peft_model.unload()


def _lora_model_merge(peft_model):
    """Right: the inner LoraModel's merge_and_unload, with safe_merge (NaN-checked copies) and the adapter named."""
    return peft_model.base_model.merge_and_unload(safe_merge=True, adapter_names=["default"])


# ---------------------------------------------------------------------------------------------- 13.forward_flops

def _flops(config, batch_size, seq_len, k_v_features=None, causal=False):
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    h, inter, tokens = config.hidden_size, config.intermediate_size, batch_size * seq_len
    kv = k_v_features or kv_heads * head_dim
    linear = 2 * h * heads * head_dim + 2 * h * kv + 3 * h * inter
    attention = 4 * batch_size * heads * seq_len * seq_len * head_dim // (2 if causal else 1)
    return config.num_hidden_layers * (2 * tokens * linear + attention + tokens * inter) + 2 * tokens * h * \
        config.vocab_size


def _causal_half_of_attention(config, batch_size, seq_len):
    return _flops(config, batch_size, seq_len, causal=True)       # the mask skips half: the profiler does not


def _k_v_as_wide_as_q(config, batch_size, seq_len):
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return _flops(config, batch_size, seq_len, k_v_features=heads * head_dim)   # grouped-query attention missed


def _flops_in_numpy(config, batch_size, seq_len):
    """Right: the matmuls as an array of (in, out) shapes, the count a numpy integer."""
    import numpy as np

    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    d = getattr(config, "head_dim", None) or config.hidden_size // heads
    h, inter = config.hidden_size, config.intermediate_size
    shapes = np.array([(h, heads * d), (h, kv_heads * d), (h, kv_heads * d), (heads * d, h), (h, inter), (h, inter),
                       (inter, h)], dtype=np.int64)
    tokens = np.int64(batch_size * seq_len)
    per_layer = 2 * tokens * (shapes[:, 0] * shapes[:, 1]).sum() + 4 * batch_size * heads * seq_len ** 2 * d \
        + tokens * inter
    return config.num_hidden_layers * per_layer + 2 * tokens * h * config.vocab_size


def _flops_from_the_module_tree(config, batch_size, seq_len):
    """Right: the linear layers read off the model itself, built on the meta device (no memory), every
    nn.Linear 2 x tokens x in x out, the output head among them; attention and SiLU added per layer."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    tokens = batch_size * seq_len
    linear = sum(2 * tokens * m.in_features * m.out_features for m in model.modules()
                 if isinstance(m, torch.nn.Linear))
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    per_layer = 4 * batch_size * heads * seq_len * seq_len * head_dim + tokens * config.intermediate_size
    return linear + config.num_hidden_layers * per_layer


# ---------------------------------------------------------------------------------------------- 14.trainer_steps

def _steps_of_dslabs_own_loop(n_examples, per_device, world_size, grad_accum_steps, epochs):
    from dslab.training import sft

    return sft.total_steps(n_examples, world_size, per_device, grad_accum_steps, epochs)   # drops short batches


def _steps_without_padding(n_examples, per_device, world_size, grad_accum_steps, epochs):
    import math

    per_rank = n_examples // world_size              # the left-over examples dropped
    return epochs * max(1, math.ceil(math.ceil(per_rank / per_device) / grad_accum_steps))


def _steps_in_numpy(n_examples, per_device, world_size, grad_accum_steps, epochs):
    """Right: one ceiling over the whole step's examples, the count a numpy float."""
    import numpy as np

    return epochs * np.ceil(n_examples / (per_device * world_size * grad_accum_steps))


def _steps_from_torchs_sampler(n_examples, per_device, world_size, grad_accum_steps, epochs):
    """Right: rank 0's DataLoader over a DistributedSampler (it pads, keeps the short last batch), its length
    counted in accumulation windows."""
    from torch.utils.data import DataLoader, DistributedSampler

    examples = range(n_examples)
    sampler = DistributedSampler(examples, num_replicas=world_size, rank=0, shuffle=False)
    batches = len(DataLoader(examples, batch_size=per_device, sampler=sampler))
    return epochs * -(-batches // grad_accum_steps)


# ---------------------------------------------------------------------------------------------- the declaration

REDTEAM = {   # exercise id: wrong answers and words of their mistake, right answers, the hard-coded or copied
    "02.amp_clip": {
        "wrong": [(_fp32_step, "the forward ran in fp32, without autocast"),
                  (_bf16_step, "the forward ran under autocast to torch.bfloat16, not float16")],
        "right": [_clip_by_the_total_norm, _AmpStep()],
        "hard_coded": [],
    },
    "03.fix_loop": {
        "wrong": [(_the_chapters_loop, "hands the work to dslab.training.accumulation.accumulate_backward"),
                  (_the_chapters_loop_summing, "you summed")],
        "right": [_gradients_divided_after_the_loop, _backward_with_a_weight],
        "hard_coded": [_the_chapters_loop, _the_chapters_loop_summing],
    },
    "03.token_loss": {
        "wrong": [(_normalised_by_its_own_targets, "a mean of means"),
                  (_mean_over_window_targets, "a mean of means")],
        "right": [_token_loss_by_hand, _mean_weighted_by_its_targets, _count_as_a_plain_int],
        "hard_coded": [ch03._fixed_window_targets],   # registered: one window's 76 target tokens written in
    },
    "05.mask_prompt": {
        "wrong": [(_the_chapters_masking, "gets its labels from dslab.data.sft_example"),
                  (_the_chapters_tokenize, "gets its labels from dslab.data.sft_example"),
                  (_header_labelled, "prompt tokens carry labels: the assistant's header '<|im_start|>assistant\\n'"),
                  (_newline_labelled, "what follows <|im_end|> (the template's newline) carries a label")],
        "right": [_labels_by_character_offsets, _pieces_as_tensors],
        "hard_coded": [_the_chapters_masking, _the_chapters_tokenize],
    },
    "06.merge_call": {
        "wrong": [(_merged_with_alpha, "another scaling than this adapter's alpha / r"),
                  (_merged_then_base_model, "LoRA layers are still in the model")],
        "right": [_merge_adapter_then_unload, _delta_weights_by_hand, _lora_model_merge],
        "hard_coded": [],
    },
    "13.forward_flops": {
        "wrong": [(_causal_half_of_attention, "the profiler counts attention over the whole seq x seq square"),
                  (_k_v_as_wide_as_q, "k_proj and v_proj produce num_key_value_heads x head_dim features")],
        "right": [_flops_in_numpy, _flops_from_the_module_tree],
        "hard_coded": [],
    },
    "14.trainer_steps": {
        "wrong": [(_steps_of_dslabs_own_loop, "it drops the short last batch of each epoch, as dslab's loop does"),
                  (_steps_without_padding, "it gives each rank n_examples // world_size examples and drops the rest")],
        "right": [_steps_in_numpy, _steps_from_torchs_sampler],
        "hard_coded": [_steps_of_dslabs_own_loop],
    },
}


def _name(answer):
    answer = answer.func if isinstance(answer, functools.partial) else answer
    return getattr(answer, "__name__", type(answer).__name__)


WRONG = [(e, answer, words) for e, team in REDTEAM.items() for answer, words in team["wrong"]]
RIGHT = [(e, answer) for e, team in REDTEAM.items() for answer in team["right"]]


@pytest.mark.parametrize("exercise_id, answer, words", WRONG, ids=[f"{e}-{_name(a)}" for e, a, _ in WRONG])
def test_wrong_answers_are_refused_naming_the_mistake(exercise_id, answer, words):
    refused(exercise_id, answer, words)


@pytest.mark.parametrize("exercise_id, answer", RIGHT, ids=[f"{e}-{_name(a)}" for e, a in RIGHT])
def test_right_answers_in_unusual_forms_are_accepted(exercise_id, answer):
    accepted(exercise_id, answer)


def test_what_the_answers_rely_on_is_in_the_pinned_libraries():
    """peft 0.21's unload() puts back each LoRA layer's base layer as it is (merged in place by merge_adapter, or by
    hand), merge_and_unload() merges first; transformers divides the summed token losses by num_items_in_batch
    whatever its type; torch's clip_grad_norm_ is get_total_norm then clip_grads_with_norm_."""
    import inspect

    import torch
    from peft.tuners import tuners_utils
    from transformers.loss import loss_utils

    unload = inspect.getsource(tuners_utils.BaseTuner._unload_and_optionally_merge)
    assert "target.merge(safe_merge=safe_merge, adapter_names=adapter_names)" in unload
    assert "self._replace_module(parent, target_name, target.get_base_layer(), target)" in unload
    assert "return self._unload_and_optionally_merge(merge=False)" in inspect.getsource(tuners_utils.BaseTuner.unload)
    cross_entropy = inspect.getsource(loss_utils.fixed_cross_entropy)
    assert 'reduction = "sum" if num_items_in_batch is not None else "mean"' in cross_entropy
    assert "loss = loss / num_items_in_batch" in cross_entropy
    clip = inspect.getsource(torch.nn.utils.clip_grad_norm_)
    assert "total_norm = _get_total_norm(" in clip and "_clip_grads_with_norm_(parameters, max_norm, total_norm" in clip
