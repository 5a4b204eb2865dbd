"""A spy on a learner's DeepSpeed loop, for the engine-loop checkers (dslab/exercises/engine_loop.py).

While it is entered, `deepspeed.initialize` hands out engines whose backward, step and zero_grad are counted, a forward
hook on the model remembers the mean squared error of each micro-batch it sees and counts every backward pass that
reaches the model's output (engine.backward's, or loss.backward()'s on the engine's output), and every optimizer step
and zero_grad made outside the engine is noted. At each accumulation boundary, before the engine steps, it reads the
whole weights and the whole accumulated gradient the optimizer is about to use (deepspeed.utils.safe_get_full_grad, at
any ZeRO stage; every rank takes part, as in the step itself). What it records says which mistake a loop makes even
where the weights cannot: Adam's update barely changes when every gradient is scaled alike, so a loss divided twice
or left undivided (scale_wrt_gas=False) leaves nearly the right weights, but not the right gradient.
"""


class EngineSpy:
    """Records what the learner's loop does with DeepSpeed: initialize calls, the loss given to engine.backward,
    engine.step calls and boundaries, optimizer steps and zero_grad calls made outside the engine."""

    def __init__(self, model, micro_batches, namespaces=()):
        self.model, self.micro_batches = model, micro_batches
        # the learner's globals: a `from deepspeed import initialize` there holds the function itself, not the module
        self.namespaces = list({id(ns): ns for ns in namespaces}.values())
        self._swapped = []
        self.initialized = self.forwards = self.backwards = self.passes = self.steps = self.boundaries = 0
        self.outside_steps = self.fighting_zero_grads = 0
        self.ratios, self.engine, self.expected, self.pending, self.inside = [], None, None, 0, 0
        self.scale_wrt_gas = []      # the scale_wrt_gas of each engine.backward call
        self.windows = []            # (whole weights, whole gradient) at each accumulation boundary, before the step
        self.capture_failed = None   # why reading them failed, if it did
        self.optimizer_name = self.offload_devices = None

    def __enter__(self):
        import deepspeed
        import torch
        import torch.optim.optimizer as torch_optimizer

        self._initialize = deepspeed.initialize
        deepspeed.initialize = self._spy_initialize
        for namespace in self.namespaces:
            for name, value in list(namespace.items()):
                if value is self._initialize:
                    namespace[name] = self._spy_initialize
                    self._swapped.append((namespace, name))
        self._step_hook = torch_optimizer.register_optimizer_step_pre_hook(self._optimizer_step)
        self._forward_hook = self.model.register_forward_hook(self._forward)
        self._zero_grad = torch.optim.Optimizer.zero_grad
        spy = self

        def zero_grad(optimizer, *args, **kwargs):
            spy._zeroing()
            return spy._zero_grad(optimizer, *args, **kwargs)

        torch.optim.Optimizer.zero_grad = zero_grad
        self._wrap(self.model, "zero_grad", before=self._zeroing)
        return self

    def __exit__(self, *exc):
        import deepspeed
        import torch

        deepspeed.initialize = self._initialize
        for namespace, name in self._swapped:
            namespace[name] = self._initialize
        torch.optim.Optimizer.zero_grad = self._zero_grad
        self._step_hook.remove()
        self._forward_hook.remove()
        self.model.__dict__.pop("zero_grad", None)
        return False

    def _wrap(self, obj, name, before=None, after=None, inside=False):
        real = getattr(obj, name)
        spy = self

        def wrapper(*args, **kwargs):
            state = before(*args, **kwargs) if before else None
            spy.inside += inside
            try:
                out = real(*args, **kwargs)
            finally:
                spy.inside -= inside
            if after:
                after(state)
            return out

        setattr(obj, name, wrapper)

    def _spy_initialize(self, *args, **kwargs):
        self.initialized += 1
        self.inside += 1
        try:
            out = self._initialize(*args, **kwargs)
        finally:
            self.inside -= 1
        engine = out[0]
        self.engine = engine
        self._wrap(engine, "backward", before=self._backward, inside=True)
        self._wrap(engine, "step", before=self._step_before, after=self._step_after, inside=True)
        self._wrap(engine, "zero_grad", before=self._zeroing)
        if out[1] is not None and hasattr(out[1], "zero_grad"):
            self._wrap(out[1], "zero_grad", before=self._zeroing)
            # ZeRO's optimizers are no torch optimizers: their step() outside the engine is counted here
            self._wrap(out[1], "step", before=self._optimizer_step_by_hand, inside=True)
        inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
        self.optimizer_name = type(inner).__name__
        self.offload_devices = {"optimizer": str(getattr(engine.zero_offload_optimizer(), "device", "none")),
                                "param": str(getattr(engine.zero_offload_param(), "device", "none"))}
        return out

    def _forward(self, module, inputs, output):
        import torch

        if not inputs or not torch.is_tensor(inputs[0]) or not torch.is_tensor(output):
            return
        self.forwards += 1
        if output.requires_grad:   # counts the backward passes through the model, whoever starts them
            output.register_hook(self._backward_pass)
        x = inputs[0]
        for xb, yb in self.micro_batches:
            if xb is x or (xb.shape == x.shape and torch.equal(xb, x)):
                self.expected = torch.nn.functional.mse_loss(output.detach().float(), yb.float()).item()
                return
        self.expected = None

    def _backward_pass(self, grad):
        self.passes += 1
        self.pending += 1

    def _backward(self, loss, *args, **kwargs):
        self.backwards += 1
        # engine.backward(loss, retain_graph=False, scale_wrt_gas=True)
        self.scale_wrt_gas.append(bool(kwargs.get("scale_wrt_gas", args[1] if len(args) > 1 else True)))
        try:
            value = float(loss.detach().float().item())
        except (AttributeError, RuntimeError, ValueError):
            value = None
        if value is not None and self.expected:
            self.ratios.append(value / self.expected)

    def _step_before(self, *args, **kwargs):
        self.steps += 1
        boundary = self.engine.is_gradient_accumulation_boundary()
        if boundary and self.capture_failed is None:
            try:
                self.windows.append(self._weights_and_gradient())
            except Exception as exc:   # the checker's reading, not the learner's code: said as such
                self.capture_failed = f"{type(exc).__name__}: {exc}"[:300]
        return boundary

    def _weights_and_gradient(self):
        """The whole weights and the whole accumulated gradient the optimizer is about to step with, flat, on every
        rank (both gathered across the ranks under ZeRO; safe_get_full_grad is a collective at stages 1-3)."""
        import deepspeed
        import torch
        from deepspeed.utils import safe_get_full_grad

        parameters = list(self.engine.module.parameters())
        with deepspeed.zero.GatheredParameters(parameters):
            weights = torch.cat([p.detach().float().flatten().clone() for p in parameters])
        grads = []
        for p in parameters:
            grad = safe_get_full_grad(p)
            size = p.ds_numel if hasattr(p, "ds_numel") else p.numel()
            grads.append(torch.zeros(size) if grad is None else grad.detach().float().flatten().cpu().clone())
        return weights, torch.cat(grads)

    def _step_after(self, boundary):
        if boundary:
            self.boundaries += 1
            self.pending = 0

    def _optimizer_step(self, optimizer, args, kwargs):
        if not self.inside:
            self.outside_steps += 1

    def _optimizer_step_by_hand(self, *args, **kwargs):
        if not self.inside:
            self.outside_steps += 1

    def _zeroing(self, *args, **kwargs):
        if not self.inside and self.pending:
            self.fighting_zero_grads += 1

    def summary(self):
        return {"initialized": self.initialized, "forwards": self.forwards, "backwards": self.backwards,
                "passes": self.passes, "steps": self.steps, "boundaries": self.boundaries,
                "outside_steps": self.outside_steps, "fighting_zero_grads": self.fighting_zero_grads,
                "ratios": self.ratios[:64], "scale_wrt_gas": self.scale_wrt_gas[:64],
                "optimizer": self.optimizer_name, "offload": self.offload_devices,
                "capture_failed": self.capture_failed}
