"""Walking Megatron's optimizer: the per-group optimizers inside it and their torch optimizers."""

from __future__ import annotations

import torch
from torch.optim.adamw import adamw as adamw_functional


def megatron_optimizers(optimizer) -> list:
    """The Megatron optimizers that hold parameters: a ``ChainedOptimizer``'s parts (one per parameter group
    kind, e.g. dense and expert parameters), or ``optimizer`` itself."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def torch_optimizers(optimizer) -> list[torch.optim.Optimizer]:
    """The torch optimizers (param groups and state) inside Megatron's ``optimizer``; a part without one (a
    rank that holds no parameters of its kind) has none."""
    return [inner.optimizer for inner in megatron_optimizers(optimizer)
            if getattr(inner, "optimizer", None) is not None]


MOMENT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class AdamWLowPrecisionMoments(torch.optim.AdamW):
    """torch's AdamW whose two moments are stored in another dtype than the parameters (``exp_avg_dtype``,
    ``exp_avg_sq_dtype``, e.g. bfloat16 beside float32 main parameters: 4 bytes of Adam state per parameter
    instead of 8).

    The arithmetic is torch's own (the functional ``torch.optim.adamw.adamw``: the fused CUDA kernel on a
    GPU with ``use_fused``, else torch's default implementation) on float32 copies of the moments: each
    step reads the stored moments into float32, updates them and the parameters there, and stores the
    moments back, rounded once (to nearest even). So a step uses its own moments unrounded, and the only change from float32 moments is that
    rounding between steps (tests/test_optim.py bounds its effect). torch's AdamW cannot do this itself: its
    fused and foreach kernels need the moments in the parameters' dtype. The float32 copies are made
    ``chunk_elements`` elements at a time (large tensors are split), so the step needs at most
    8 x chunk_elements bytes beside the state. No amsgrad, no maximize.
    """

    def __init__(self, params, *, exp_avg_dtype: torch.dtype, exp_avg_sq_dtype: torch.dtype,
                 use_fused: bool = True, chunk_elements: int = 1 << 26, **adamw_kwargs):
        super().__init__(params, **adamw_kwargs)
        self.moment_dtypes = {"exp_avg": exp_avg_dtype, "exp_avg_sq": exp_avg_sq_dtype}
        self.use_fused = use_fused  # the fused CUDA kernel for parameters on a GPU (else torch's default)
        self.chunk_elements = chunk_elements

    def init_state(self, param: torch.Tensor) -> None:
        """The state of ``param`` before its first step (also Megatron's init_state_fn before a checkpoint
        is loaded into it); a state loaded in other dtypes is converted."""
        state = self.state[param]
        if "step" not in state:
            state["step"] = torch.tensor(0.0)  # on the host: read without waiting for the device
        for key, dtype in self.moment_dtypes.items():
            if key not in state:
                state[key] = torch.zeros_like(param, dtype=dtype, memory_format=torch.contiguous_format)
            elif state[key].dtype != dtype:
                state[key] = state[key].to(dtype)
        if state["step"].device.type != "cpu":
            state["step"] = state["step"].cpu()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["amsgrad"] or group["maximize"]:
                raise ValueError("AdamWLowPrecisionMoments supports neither amsgrad nor maximize")
            params = [p for p in group["params"] if p.grad is not None]
            for p in params:
                self.init_state(p)
                self.state[p]["step"] += 1
            for pieces in self._chunks(params):
                self._step_chunk(group, pieces)
        return loss

    def _chunks(self, params):
        """Lists of flat pieces (param, grad, exp_avg, exp_avg_sq, step) of at most chunk_elements elements
        in all (Adam is elementwise: a piece of a tensor steps as the whole would)."""
        chunk, size = [], 0
        for p in params:
            state = self.state[p]
            flat = [x.view(-1) for x in (p, p.grad, state["exp_avg"], state["exp_avg_sq"])]
            start = 0
            while start < p.numel():
                take = min(p.numel() - start, self.chunk_elements - size)
                chunk.append([x[start:start + take] for x in flat] + [state["step"]])
                start, size = start + take, size + take
                if size == self.chunk_elements:
                    yield chunk
                    chunk, size = [], 0
        if chunk:
            yield chunk

    def _step_chunk(self, group, pieces) -> None:
        params, grads, exp_avgs, exp_avg_sqs, steps = (list(x) for x in zip(*pieces))
        work = []
        for stored in (exp_avgs, exp_avg_sqs):
            if stored[0].dtype == torch.float32:
                work.append(stored)
            else:
                copies = [torch.empty_like(x, dtype=torch.float32) for x in stored]
                torch._foreach_copy_(copies, stored)
                work.append(copies)
        fused = self.use_fused and params[0].is_cuda
        # Each piece gets its own step count (the functional increments each one): the count before this
        # step, on the parameters' device for the fused kernel.
        counts = torch.tensor([float(s) - 1 for s in steps], dtype=torch.float32)
        if fused:
            counts = counts.pin_memory().to(params[0].device, non_blocking=True)
        beta1, beta2 = group["betas"]
        adamw_functional(params, grads, work[0], work[1], [], list(counts.unbind(0)),
                         foreach=False if fused else None, fused=True if fused else None, amsgrad=False,
                         beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
                         eps=group["eps"], maximize=False)
        for stored, copies in zip((exp_avgs, exp_avg_sqs), work):
            if copies is not stored:
                torch._foreach_copy_(stored, copies)


def use_moment_dtypes(optimizer, exp_avg_dtype: torch.dtype, exp_avg_sq_dtype: torch.dtype,
                      use_fused: bool = True) -> None:
    """Replace the torch AdamW inside each part of Megatron's ``optimizer`` (before its first step) with
    :class:`AdamWLowPrecisionMoments` over the same parameter groups, and Megatron's init_state_fn (used
    before a checkpoint loads) with one that creates the state in those dtypes (optim.exp_avg_dtype,
    optim.exp_avg_sq_dtype)."""
    for inner in megatron_optimizers(optimizer):
        old = getattr(inner, "optimizer", None)
        if old is None:
            continue
        if not isinstance(old, torch.optim.AdamW) or old.state:
            raise RuntimeError(f"optimizer moments in {exp_avg_dtype} / {exp_avg_sq_dtype} replace an AdamW "
                               f"before its first step; got {type(old).__name__} with {len(old.state)} states")
        defaults = {k: old.defaults[k] for k in ("lr", "betas", "eps", "weight_decay")}
        new = AdamWLowPrecisionMoments([torch.empty(0, requires_grad=True)], exp_avg_dtype=exp_avg_dtype,
                                       exp_avg_sq_dtype=exp_avg_sq_dtype, use_fused=use_fused, **defaults)
        # The same group dicts (the LR schedule writes them; the distributed optimizer indexes them), given
        # as Megatron gives them: its shards of float32 parameters are views, which add_param_group refuses.
        new.param_groups = old.param_groups
        inner.optimizer = new
        inner.init_state_fn = _init_state


def _init_state(optimizer, config=None) -> None:
    for group in optimizer.param_groups:
        for p in group["params"]:
            optimizer.init_state(p)


def l2_norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of all ``tensors`` together, float32, on their device: two launches, no host read."""
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float32)))


def _stepping_parts(optimizer) -> list:
    """The parts of Megatron's ``optimizer`` that step parameters on this rank (not its stubs)."""
    return [p for p in megatron_optimizers(optimizer) if not getattr(p, "is_stub_optimizer", False)]


def steps_on_device(optimizer) -> bool:
    """Whether :func:`step_on_device` can take the step of Megatron's ``optimizer``: every part's torch
    optimizer is torch's fused AdamW (the kernel that skips a step on the device when told to, as GradScaler
    uses it), with no loss scaler and the gradients in ``.grad`` (not the precision-aware optimizer's)."""
    parts = _stepping_parts(optimizer)
    inners = [getattr(p, "optimizer", None) for p in parts]
    return bool(parts) and all(
        type(inner) is torch.optim.AdamW and all(g.get("fused") for g in inner.param_groups)
        and getattr(part, "grad_scaler", None) is None
        and not getattr(part.config, "use_precision_aware_optimizer", False)
        for part, inner in zip(parts, inners))


@torch.no_grad()
def step_on_device(optimizer, skip: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Megatron's ``optimizer.step()`` with no host read: the grad norm, the clipping and the decision to skip
    stay on the device. ``skip``: a float32 device scalar, 1.0 to keep the weights (the step is queued and
    does nothing; Adam's step counts are kept), 0.0 to apply the gradients. A grad norm that is not finite
    keeps them too: some gradient is inf or NaN (or so large that the sum of squares overflows float32),
    found by the norm's own pass instead of one more pass over the gradients. Returns the grad norm before
    clipping as a float64 device scalar and the skip taken (float32), to be read with the step's other
    results.

    Upstream reads the norm on the host (``get_grad_norm_fp32``'s ``.item()``) to decide the clip, so each
    step waits for the GPU twice (with the caller's check). The arithmetic is upstream's: each part's
    gradients for the norm (``get_main_grads_for_grad_norm``: no tensor-parallel duplicate, no shared
    parameter twice), squared norms summed over its ``get_grad_stats_parallel_group``, the square root and
    ``max_norm / (norm + 1e-6)`` in float64; the gradients are scaled by that coefficient capped at 1 (a
    scale of exactly 1 where upstream leaves them as they are)."""
    optimizer.prepare_grads()  # model gradients -> main gradients; no loss scaler here, so no inf check
    parts = _stepping_parts(optimizer)
    squares = []
    for part in parts:
        grads = part.get_main_grads_for_grad_norm()
        norm = l2_norm(grads) if grads else torch.zeros((), dtype=torch.float32, device=skip.device)
        square = (norm ** 2).reshape(1)
        torch.distributed.all_reduce(square, group=part.get_grad_stats_parallel_group())
        squares.append(square)
    grad_norm = torch.stack(squares).sum().double().sqrt()
    skip = torch.maximum(skip, (~torch.isfinite(grad_norm)).to(skip.dtype))
    for part in parts:
        grads = [p.grad for p in part.get_parameters() if p.grad is not None]
        if grads:
            scale = (part.config.clip_grad / (grad_norm + 1.0e-6)).clamp(max=1.0)
            torch._foreach_mul_(grads, scale.to(torch.float32))
    inners = [part.optimizer for part in parts]
    for inner in inners:
        inner.found_inf = skip  # read by the fused kernel (torch.optim.adamw's found_inf)
    try:
        optimizer.step_with_ready_grads()
    finally:
        for inner in inners:
            del inner.found_inf
    return grad_norm, skip
