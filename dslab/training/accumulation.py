"""Gradient accumulation: micro-batches vs one big batch, loss normalisation, DeepSpeed windows, activation memory."""
from dslab.data import IGNORE_INDEX  # label value the loss skips (padding, prompt tokens)


# --------------------------------------------------------------------------- model and data

def small_lm(seed=0, **overrides):
    """A random-init dslab-tiny-shaped causal LM, shrunk so a CPU runs it in milliseconds."""
    from dslab.models.loading import build_model, tiny_config
    shape = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, vocab_size=512)
    shape.update(overrides)
    model = build_model(tiny_config(**shape), seed=seed)
    model.config.use_cache = False
    return model


def token_batch(batch_size, seq_len, vocab_size=512, lengths=None, seed=0):
    """{"input_ids", "labels"} of random tokens; `lengths` (one per row) pads the rest with label IGNORE_INDEX."""
    import torch
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, vocab_size, (batch_size, seq_len), generator=g)
    labels = input_ids.clone()
    if lengths is not None:
        for row, n in enumerate(lengths):
            input_ids[row, n:] = 0       # pad token
            labels[row, n:] = IGNORE_INDEX  # no loss on padding
    return {"input_ids": input_ids, "labels": labels}


def split(batch, k):
    """The batch cut into k micro-batches along dim 0 (a list of dicts of separate tensors)."""
    n = batch["input_ids"].shape[0]
    if n % k:
        raise ValueError(f"a batch of {n} does not split into {k} equal micro-batches")
    step = n // k
    # clone: each micro-batch owns its memory, as one from a data loader would (a view would keep
    # the whole big batch alive and the activation meter would count all of it)
    return [{key: t[i * step:(i + 1) * step].clone() for key, t in batch.items()} for i in range(k)]


def count_targets(batch):
    """Tokens the causal-LM loss is computed on: labels shifted by one, minus the ignored ones."""
    return int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())


# --------------------------------------------------------------------------- gradients

def grads(model):
    """{name: copy of .grad} for every parameter that has one."""
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def big_batch_backward(model, batch):
    """Backward of the mean loss over the whole batch (the reference). Returns the loss."""
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    return loss.item()


def accumulate_backward(model, micro_batches, mode="mean"):
    """Backward of every micro-batch in turn, gradients adding up in .grad; returns the summed loss.

    mode "mean":   loss / k per micro-batch (what DeepSpeed's engine.backward does);
    mode "sum":    loss as is: the gradient is k times the big batch's (the common mistake);
    mode "tokens": sum of token losses / tokens in the whole window (HF's num_items_in_batch):
                   exact even when micro-batches hold different numbers of tokens.
    """
    import torch
    model.zero_grad(set_to_none=True)
    k = len(micro_batches)
    total_targets = sum(count_targets(mb) for mb in micro_batches)
    total = 0.0
    for mb in micro_batches:
        if mode == "tokens":
            loss = model(**mb, num_items_in_batch=torch.tensor(total_targets)).loss
        else:
            loss = model(**mb).loss
            if mode == "mean":
                loss = loss / k  # the one line that makes accumulation match the big batch
            elif mode != "sum":
                raise ValueError(f"mode must be 'mean', 'sum' or 'tokens', got {mode!r}")
        loss.backward()  # frees this micro-batch's activations before the next forward
        total += loss.item()
    return total


def compare(a, b):
    """How far two {name: tensor} dicts are apart: max |a-b| and ||a-b|| / ||b|| over all tensors."""
    import torch
    diff = torch.cat([(a[n] - b[n]).flatten() for n in b])
    ref = torch.cat([b[n].flatten() for n in b])
    return {"max_abs_diff": diff.abs().max().item(), "rel_diff": (diff.norm() / ref.norm()).item()}


def equivalent(a, b, rtol=1e-5):
    """True when a and b agree to `rtol` relative to b's norm (float32 summation order differs)."""
    return compare(a, b)["rel_diff"] <= rtol


def one_step(model_fn, batch, k=1, mode="mean", optimizer="sgd", lr=0.1):
    """Fresh model, one optimizer step on `batch` (as k micro-batches when k > 1).

    Returns {"grads", "weights", "update"}: the gradients used, the weights after the step and the
    step itself (weights after - before), each a {name: tensor} dict.
    """
    import torch
    model = model_fn()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    if k == 1:
        big_batch_backward(model, batch)
    else:
        accumulate_backward(model, split(batch, k), mode)
    g = grads(model)
    opt = (torch.optim.SGD(model.parameters(), lr=lr) if optimizer == "sgd"
           else torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0))
    opt.step()
    after = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"grads": g, "weights": after, "update": {n: after[n] - before[n] for n in after}}


def norm(tensors):
    """Global L2 norm of a {name: tensor} dict (what gradient clipping looks at)."""
    import torch
    return torch.cat([t.flatten() for t in tensors.values()]).norm().item()


# --------------------------------------------------------------------------- activation memory

class _Saved:
    """What autograd keeps instead of a saved tensor while the meter runs; its death frees the bytes."""

    __slots__ = ("tensor", "meter", "key")

    def __init__(self, tensor, meter, key):
        self.tensor, self.meter, self.key = tensor, meter, key

    def __del__(self):
        self.meter._release(self.key)


class ActivationMeter:
    """Counts the bytes autograd holds for backward (activations), live and at peak.

    Every tensor saved for backward passes through torch.autograd.graph.saved_tensors_hooks; the
    meter counts its storage once (views share storage) while any graph still holds it, and skips
    the model's own parameters (they are weights, not activations). When backward frees the graph,
    the count drops. Usage: `with ActivationMeter(model) as m: ...; m.peak_bytes`.
    """

    def __init__(self, model=None):
        self.skip = set()
        if model is not None:
            self.skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.live, self.current_bytes, self.peak_bytes = {}, 0, 0
        self._hooks = None

    def _pack(self, tensor):
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self.skip or storage.nbytes() == 0:
            return tensor
        if key in self.live:
            self.live[key][0] += 1
        else:
            self.live[key] = [1, storage.nbytes()]
            self.current_bytes += storage.nbytes()
            self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        return _Saved(tensor, self, key)

    @staticmethod
    def _unpack(saved):
        return saved.tensor if isinstance(saved, _Saved) else saved

    def _release(self, key):
        entry = self.live.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            self.current_bytes -= entry[1]
            del self.live[key]

    def __enter__(self):
        import torch
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        return False


def activation_peak(model, micro_batch_size, k, seq_len=64, mode="mean", seed=0):
    """Peak activation bytes of one accumulation window of k micro-batches of micro_batch_size rows.

    mode "mean" is the right loop (backward after each micro-batch); mode "one_backward" adds the k
    losses up and calls backward once at the end, which keeps all k graphs alive (a memory mistake).
    """
    batch = token_batch(micro_batch_size * k, seq_len, model.config.vocab_size, seed=seed)
    micro_batches = split(batch, k)
    model.zero_grad(set_to_none=True)
    with ActivationMeter(model) as meter:
        if mode == "one_backward":
            total = sum(model(**mb).loss for mb in micro_batches) / k
            total.backward()
        else:
            accumulate_backward(model, micro_batches, mode)
    model.zero_grad(set_to_none=True)
    return meter.peak_bytes


def activation_sweep(model, micro_batch_sizes=(1, 2, 4, 8), accum_steps=(1, 2, 4, 8), base_micro=2,
                     base_k=1, seq_len=64):
    """Peak activation bytes vs micro batch (at base_k) and vs accumulation steps (at base_micro).

    Returns {"micro": [(m, bytes)], "accum": [(k, bytes)], "accum_one_backward": [(k, bytes)]}.
    """
    return {
        "micro": [(m, activation_peak(model, m, base_k, seq_len)) for m in micro_batch_sizes],
        "accum": [(k, activation_peak(model, base_micro, k, seq_len)) for k in accum_steps],
        "accum_one_backward": [(k, activation_peak(model, base_micro, k, seq_len, mode="one_backward"))
                               for k in accum_steps],
    }


# --------------------------------------------------------------------------- batch size bookkeeping

BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def batch_triples(total, micro_batch_size, grad_accum_steps):
    """What DeepSpeed makes of each pair of the three batch numbers, and of a wrong triple.

    Runs DeepSpeed's own config parser, which takes the world size from the running process group
    (call it on every rank of a job). Returns {"given": [...], "derived": [...], "refused": message}.
    """
    from deepspeed.runtime.config import DeepSpeedConfig
    values = dict(zip(BATCH_KEYS, (total, micro_batch_size, grad_accum_steps)))
    given = [{k: values[k] for k in BATCH_KEYS if k != left_out} for left_out in BATCH_KEYS]
    derived = []
    for config in given:
        parsed = DeepSpeedConfig(dict(config))
        derived.append({k: getattr(parsed, k) for k in BATCH_KEYS})
    wrong = dict(values, gradient_accumulation_steps=grad_accum_steps + 1)
    try:
        DeepSpeedConfig(wrong)
        refused = None
    except AssertionError as exc:  # DeepSpeed checks the product with an assert
        refused = str(exc)
    return {"given": given, "derived": derived, "wrong": wrong, "refused": refused}


def hf_auto_batch(micro_batch_size, grad_accum_steps):
    """The batch numbers transformers' Trainer writes over "auto" (HfTrainerDeepSpeedConfig), and its world size."""
    from transformers import TrainingArguments
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig
    config = HfTrainerDeepSpeedConfig({k: "auto" for k in BATCH_KEYS})
    args = TrainingArguments(output_dir="runs/hf_auto", per_device_train_batch_size=micro_batch_size,
                             gradient_accumulation_steps=grad_accum_steps, use_cpu=True, report_to=[])
    config.trainer_config_process(args)   # where the Trainer replaces each "auto" by a number
    return {"world_size": args.world_size, **{k: config.config[k] for k in BATCH_KEYS}}


# --------------------------------------------------------------------------- DeepSpeed: one window on a live rank

def weights(model):
    """{name: copy of the weight} for every parameter (on the CPU)."""
    return {n: p.detach().cpu().clone() for n, p in model.named_parameters()}


def grad_norm(model):
    """Global L2 norm of the gradients in p.grad."""
    import torch
    return torch.cat([p.grad.cpu().flatten() for p in model.parameters() if p.grad is not None]).norm().item()


def window_config(zero_stage, micro_batch_size, accum, world_size):
    """The ds_config of engine_window: fp32, no clipping, no optimizer section (the SGD is passed to initialize)."""
    from dslab.config.build import make_config
    # optimizer=None removes make_config's AdamW; ZeRO only vouches for Adam-like optimizers, hence the "untested".
    return make_config(zero_stage=zero_stage, precision="fp32", micro_batch_size=micro_batch_size,
                       grad_accum_steps=accum, world_size=world_size, gradient_clipping=0.0, optimizer=None,
                       zero_allow_untested_optimizer=zero_stage > 0)


def engine_window(base, mine, zero_stage, micro_batch_size, accum, mode="engine", lr=0.1):
    """One optimizer step of a DeepSpeed engine over this rank's share `mine`; a row per micro-step, and the weights.

    Runs on every rank of a job (a collective). fp32, no clipping, SGD, so the step can be compared exactly
    with plain PyTorch. mode "engine": engine.backward(loss), the normal way (DeepSpeed divides the loss by
    accum); "divided_twice": engine.backward(loss / accum), a loop ported from plain PyTorch that already
    divides; "no_gas_scaling": engine.backward(loss, scale_wrt_gas=False), what transformers' Trainer passes.
    """
    import copy

    import deepspeed
    import torch
    from deepspeed.utils import safe_get_full_grad

    world_size = torch.distributed.get_world_size()
    model = copy.deepcopy(base)
    cfg = window_config(zero_stage, micro_batch_size, accum, world_size)
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=lr), config=cfg)
    rows = []
    for i in range(accum):
        mb = {k: v[i * micro_batch_size:(i + 1) * micro_batch_size] for k, v in mine.items()}
        on_device = {k: v.to(engine.device) for k, v in mb.items()}     # cpu here, cuda:N on a GPU
        boundary = engine.is_gradient_accumulation_boundary()     # True on the last micro-step only
        loss = engine(**on_device).loss
        before = weights(engine.module)
        if mode == "divided_twice":
            engine.backward(loss / accum)
        else:
            engine.backward(loss, scale_wrt_gas=(mode == "engine"))
        row = {"micro_step": i, "boundary": boundary, "loss": loss.item()}
        if i == 0 and zero_stage == 0 and accum > 1:
            # the gradient this backward left in .grad, over the same micro-batch's plain gradient
            twin = copy.deepcopy(base)
            twin(**mb).loss.backward()
            row["grad_over_plain_grad"] = grad_norm(engine.module) / grad_norm(twin)
        if boundary:   # gradients are summed over micro-steps and averaged over ranks; read before step()
            full = [safe_get_full_grad(p).cpu().flatten() for p in engine.module.parameters()]
            row["grad_norm"] = torch.cat(full).norm().item()
        engine.step()                                             # updates only at the boundary
        row["weights_changed"] = any(not torch.equal(before[n], p.cpu()) for n, p in engine.module.named_parameters())
        row["global_steps"] = engine.global_steps
        rows.append(row)
    info = {"zero_stage": zero_stage, "mode": mode, "train_batch_size": engine.train_batch_size(),
            "micro_batch_size": engine.train_micro_batch_size_per_gpu(),
            "grad_accum_steps": engine.gradient_accumulation_steps(), "world_size": world_size}
    result = (rows, weights(engine.module), info)
    engine.destroy()
    return result


def window_setups(micro=2, accum=4):
    """Chapter 03's DeepSpeed setups: name -> (zero_stage, micro batch, accumulation steps, backward mode)."""
    return {"accumulate": (0, micro, accum, "engine"),
            "big_micro_batch": (0, micro * accum, 1, "engine"),         # the same global batch, no accumulation
            "accumulate_zero1": (1, micro, accum, "engine"),
            "divided_twice": (0, micro, accum, "divided_twice"),
            "no_gas_scaling_zero0": (0, micro, accum, "no_gas_scaling"),
            "no_gas_scaling_zero1": (1, micro, accum, "no_gas_scaling")}


def reference_step(base, global_batch, lr=0.1):
    """One process, the whole global batch, mean loss, one SGD step: (weights after, gradient norm).

    SGD, not Adam: Adam's first step is about lr * sign(gradient), so it would hide a gradient k times too large.
    """
    import copy

    import torch
    ref = copy.deepcopy(base)
    ref(**global_batch).loss.backward()
    torch.optim.SGD(ref.parameters(), lr=lr).step()
    return weights(ref), grad_norm(ref)


def window_runs(base, mine, global_batch, setups=None, lr=0.1):
    """Every setup's window on this rank, compared with the one-process reference step: {name: run}."""
    import torch
    ref_weights, _ = reference_step(base, global_batch, lr)
    start = weights(base)
    ref_step = torch.cat([(ref_weights[n] - start[n]).flatten() for n in start]).norm()
    runs = {}
    for name, setup in (setups or window_setups()).items():
        rows, w, info = engine_window(base, mine, *setup, lr=lr)
        step = torch.cat([(w[n] - start[n]).flatten() for n in w]).norm()
        runs[name] = {"micro_steps": rows, "vs_reference": compare(w, ref_weights),
                      "step_ratio": (step / ref_step).item(), **info}
    return runs


def logged_gradient_reductions(comms_dict, min_bytes=1024):
    """Gradient reductions in DeepSpeed's comms log (comms_logger.get_raw_data()): (calls, bytes).

    Counts all-reduce and reduce-scatter messages of at least `min_bytes`: the smaller ones are the
    scalars DeepSpeed reduces to check for overflow and to sum the gradient norm, not gradients.
    """
    calls = total = 0
    for op, sizes in comms_dict.items():
        if op in ("all_reduce", "reduce_scatter_tensor", "reduce_scatter", "reduce"):
            for size, record in sizes.items():
                if int(size) >= min_bytes:
                    calls += record[0]
                    total += int(size) * record[0]
    return calls, total

