"""Where a critic call would make the host wait for the GPU, counted on the CPU (no GPU needed).

    python bench/host_syncs.py [--rollouts 32] [--token-budget 16384] [--phase update|values] [KEY=VALUE ...]

On a GPU, ``bench/profile_phase.py --sync-sites`` lists the synchronisations CUDA's sync-debug mode sees.
This runs the same call on the CPU (the tiny model, on the bench's seeded rollouts of the GPU shapes: the
same lengths, so the same micro-batches and steps) and counts, by code site, what would synchronise if the
critic's tensors were on a GPU. A tensor counts as on the device when it existed before the call (the
model, gradient buffers, optimizer state: all on the GPU there), except the batch's, or when it comes from
a factory given ``device=`` a torch.device, from ``.to(<torch.device>)``, or from an operation on such a
tensor. Counted (as CUDA would synchronise):

* a host read of a device tensor: ``.item()``, ``.tolist()``, ``bool`` / ``int`` / ``float`` of it,
  ``.cpu()``, ``.numpy()``, and operations whose output size depends on its values (``nonzero``,
  ``masked_select``, ``unique``, ``repeat_interleave`` without ``output_size``, indexing by a boolean tensor);
* a blocking copy of a host tensor to the device (``.to(device)`` without ``non_blocking=True``: CUDA copies
  from pageable memory and waits for it; ``packing.micro_batches.to_device`` is counted as on a GPU, where
  it copies from pinned memory without waiting);
* ``torch.cuda.synchronize()`` in Megatron's modules (its timers at ``megatron.timing_level`` >= 1).

Two kinds of site are the CPU's own and are counted apart: the per-rollout SDPA loop of
``model/layers.py``'s ``_varlen_causal`` (the GPU runs FA2 / FA4, which read the boundaries on the device),
and torch's foreach Adam inside Megatron's ``step_with_ready_grads`` (it reads its step counts on the
host; the GPU runs the fused AdamW, whose step counts stay on the device).
"""

import argparse
import collections
import traceback

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from megacritic import CriticWorker, load_config
from megacritic.bench import SHAPES, megacritic_overrides, rollouts

_MARK = "_would_be_on_device"
_HOST_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__int__,
               torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.cpu, torch.Tensor.numpy,
               torch.Tensor.nonzero, torch.nonzero, torch.Tensor.masked_select, torch.masked_select,
               torch.unique, torch.Tensor.unique}
_REPEAT = {torch.repeat_interleave, torch.Tensor.repeat_interleave}
_INDEX = {torch.Tensor.__getitem__, torch.Tensor.__setitem__, torch.Tensor.index_put_}
_TRANSFERS = {torch.Tensor.to, torch.Tensor.cuda}
CPU_ONLY = ("_varlen_causal", "step_with_ready_grads")  # the innermost project function of the CPU's own sites


def _on_device(x) -> bool:
    return isinstance(x, torch.nn.Parameter) or getattr(x, _MARK, False)


def _mark(out) -> None:
    for t in tree_leaves(out):
        if isinstance(t, torch.Tensor):
            try:
                setattr(t, _MARK, True)
            except (AttributeError, RuntimeError):  # e.g. a tensor type without attributes
                pass


def _target_device(args, kwargs):
    for a in list(args[1:]) + [kwargs.get("device")]:
        if isinstance(a, (torch.device, int)) and not isinstance(a, bool):
            return a
    return None


class WouldSync(TorchFunctionMode):
    """Counts, by site, the operations that would synchronise the host with a GPU (module doc)."""

    def __init__(self):
        super().__init__()
        self.sites = collections.Counter()
        self.cpu_only = collections.Counter()

    def _count(self, what: str) -> None:
        frames = [f for f in traceback.extract_stack()[:-2]
                  if ("megacritic" in f.filename or "megatron" in f.filename) and "host_syncs" not in f.filename]
        where = " <- ".join(f"{f.filename.split('/')[-1]}:{f.lineno}" for f in reversed(frames[-3:]))
        cpu_only = frames and frames[-1].name in CPU_ONLY
        (self.cpu_only if cpu_only else self.sites)[f"{what:14} {where}"] += 1

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        device_in = any(_on_device(t) for t in tensors)
        host_out = False
        if func in _HOST_READS and args and _on_device(args[0]):
            self._count(f"read {getattr(func, '__name__', func)}")
            host_out = True
        elif func in _REPEAT and device_in and "output_size" not in kwargs:
            self._count("repeat_interleave")
        elif func in _INDEX and any(_on_device(t) and t.dtype == torch.bool for t in tree_leaves(args[1:])
                                    if isinstance(t, torch.Tensor)):
            self._count("bool index")
        out = func(*args, **kwargs)
        if func in _TRANSFERS:
            target = _target_device(args, kwargs) if func is torch.Tensor.to else torch.device("cpu")
            if target is not None and args and isinstance(args[0], torch.Tensor):
                if not _on_device(args[0]) and not kwargs.get("non_blocking", False):
                    self._count("copy to device")
                _mark(out)
                return out
        if host_out:
            if func in (torch.Tensor.cpu, torch.Tensor.numpy) and out is args[0]:
                setattr(out, _MARK, False)  # on the CPU .cpu() returns the tensor itself; on a GPU, a host copy
            return out
        if device_in or _is_device_factory(kwargs):
            _mark(out)
        return out


def _is_device_factory(kwargs) -> bool:
    device = kwargs.get("device")
    return isinstance(device, torch.device) or (isinstance(device, int) and not isinstance(device, bool))


def _count_synchronize(mode: WouldSync):
    """Megatron's modules see compat.cpu's stand-in for torch.cuda: count its synchronize()."""
    from megacritic.compat import cpu

    def synchronize(*args, **kwargs):
        mode._count("synchronize")
    cpu._CpuCuda.synchronize = staticmethod(synchronize)


def _mark_existing(batch) -> None:
    """Every tensor alive now, but the batch's, lives on the GPU in a GPU run (module doc)."""
    import gc
    host = {id(t) for t in batch.values()}
    for obj in gc.get_objects():
        if type(obj) in (torch.Tensor, torch.nn.Parameter) and id(obj) not in host:
            _mark(obj)


def _gpu_copies():
    """micro_batches.to_device copies with a blocking .to() on the CPU, and asynchronously from pinned
    memory on a GPU: count what it does on a GPU."""
    from megacritic import critic
    from megacritic.packing import micro_batches

    def to_device(x, device):
        return x if device is None else x.to(device, non_blocking=True)
    micro_batches.to_device = critic.to_device = to_device


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rollouts", type=int, default=32)
    parser.add_argument("--token-budget", type=int, default=16384)
    parser.add_argument("--phase", default="both", choices=("update", "values", "both"))
    args, extra = parser.parse_known_args()
    if torch.cuda.is_available():
        parser.error("runs on the CPU (use bench/profile_phase.py --sync-sites on a GPU)")
    shape = {**SHAPES["tiny"], "vocab_size": 512}
    batch = rollouts(args.rollouts, shape["vocab_size"], 1024, 8192)  # the GPU shapes' lengths
    config = load_config(megacritic_overrides(shape, batch, True, args.token_budget, micro_batch=1)
                         + ["model.dtype=bfloat16"] + extra)
    _gpu_copies()
    worker = CriticWorker(config)
    worker.init_model()
    worker.compute_values(batch)
    worker.update_critic(batch)  # the optimizer's state exists from here on, as in a steady-state call
    phases = {"values": lambda: worker.compute_values(batch), "update": lambda: worker.update_critic(batch)}
    for name in ("update", "values") if args.phase == "both" else (args.phase,):
        mode = WouldSync()
        _count_synchronize(mode)
        _mark_existing(batch)
        with mode:
            phases[name]()
        print(f"{name}: {sum(mode.sites.values())} host synchronisations on a GPU "
              f"(+{sum(mode.cpu_only.values())} on the CPU only: {', '.join(CPU_ONLY)})")
        for site, n in mode.sites.most_common():
            print(f"{n:6d}  {site}")
    worker.close()


if __name__ == "__main__":
    main()
