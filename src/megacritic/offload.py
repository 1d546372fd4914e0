"""The critic's state in host memory between calls (``megatron.{param,grad,optimizer}_offload``).

What moves is device *storage*: its bytes go to a pinned host buffer (one asynchronous copy per storage,
at full PCIe speed) and the storage is resized to zero in place, so every tensor and view on it (parameters,
Megatron's contiguous buffers, the optimizer's main parameters and Adam moments) stays the same Python object
and is valid again once the bytes come back. Megatron's own optimizer offload copies tensor by tensor into
pageable memory and re-creates the state tensors (~35 s per call at 3B on an H200, bench/NOTES.md); its
gradient-buffer release (no copy: the buffers are zeroed at every step anyway) is used as is.
"""

from __future__ import annotations

import torch
from torch import Tensor

from megacritic.optim import torch_optimizers
from megacritic.train_state import TrainState


def _as_bytes(storage: torch.UntypedStorage, device: torch.device) -> Tensor:
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


class PinnedOffload:
    """Moves the storages of a set of device tensors to pinned host memory and back.

    Host buffers are pinned where CUDA is (plain host memory otherwise: the same logic runs, and is tested,
    on CPU tensors). They are kept from one offload to the next (pinning is slow; the state's tensors are
    the same objects call after call), and dropped for tensors that are gone (e.g. replaced by a checkpoint
    load).
    """

    def __init__(self):
        self._buffers: dict[int, tuple[Tensor, Tensor]] = {}  # id(tensor) -> (tensor, pinned bytes)
        self._on_host: list[tuple[Tensor, Tensor]] = []
        self._onloaded: list[tuple[Tensor, Tensor]] = []  # what the last onload brought back

    @property
    def on_host(self) -> bool:
        return bool(self._on_host)

    @property
    def host_bytes(self) -> int:
        return sum(pinned.numel() for _, pinned in self._on_host)

    def offload(self, tensors) -> None:
        """Copy the tensors' storages to host memory and free them on the device. A storage shared by
        several tensors moves once; storages already released are skipped."""
        if self._on_host:
            raise RuntimeError("PinnedOffload.offload: the previous offload was not onloaded")
        buffers, seen = {}, set()
        for t in tensors:
            storage = t.untyped_storage()
            if storage.nbytes() == 0 or storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            kept = self._buffers.get(id(t))
            pinned = kept[1] if kept is not None and kept[0] is t and kept[1].numel() == storage.nbytes() \
                else torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=torch.cuda.is_available())
            buffers[id(t)] = (t, pinned)
            pinned.copy_(_as_bytes(storage, t.device), non_blocking=True)
            self._on_host.append((t, pinned))
        self._buffers, self._onloaded = buffers, []
        # The copies must read the bytes before the allocator hands the memory to anyone else (another
        # stream, or the driver through empty_cache).
        if torch.cuda.is_available():
            torch.cuda.current_stream().synchronize()
        for t, _ in self._on_host:
            t.untyped_storage().resize_(0)

    def onload(self) -> None:
        """Re-allocate the storages on the device and copy their bytes back (asynchronously, on the
        current stream: kernels queued after this see them)."""
        for t, pinned in self._on_host:
            storage = t.untyped_storage()
            storage.resize_(pinned.numel())
            _as_bytes(storage, t.device).copy_(pinned, non_blocking=True)
        self._onloaded, self._on_host = self._on_host, []

    def release(self) -> None:
        """Free the storages of the last onload without copying them: for a caller that only read them
        since (the host copies are still theirs)."""
        if self._on_host or not self._onloaded:
            raise RuntimeError("PinnedOffload.release: nothing onloaded to release")
        if torch.cuda.is_available():
            torch.cuda.current_stream().synchronize()  # kernels reading the storages are done
        for t, _ in self._onloaded:
            t.untyped_storage().resize_(0)
        self._on_host, self._onloaded = self._onloaded, []


OFFLOAD_PARTS = ("params", "grads", "optimizer")


def _optimizer_tensors(optimizer):
    """The device tensors a Megatron optimizer keeps: main parameters (float32 copies) and their state."""
    for torch_optimizer in torch_optimizers(optimizer):
        for group in torch_optimizer.param_groups:
            yield from (p for p in group["params"] if p.is_cuda)
        for state in torch_optimizer.state.values():
            yield from (v for v in state.values() if torch.is_tensor(v) and v.is_cuda)


class Offloader:
    """Moves the parts of a :class:`~megacritic.train_state.TrainState` ("params", "grads", "optimizer")
    between the device and pinned host memory. Nothing moves off a CUDA device (on CPU it has nowhere to go).
    """

    def __init__(self, state: TrainState, device: torch.device):
        self.state, self.device = state, device
        self.on_host: set[str] = set()  # parts now in host memory
        self._host = {"params": PinnedOffload(), "optimizer": PinnedOffload()}

    def offload(self, parts, unchanged=()) -> None:
        """Move ``parts`` to host memory (pinned; gradient buffers are released, not copied) and release the
        device memory; parts already on the host stay there. ``unchanged``: parts only read since their
        onload (freed without a copy)."""
        unknown = [part for part in parts if part not in OFFLOAD_PARTS]
        if unknown:
            raise ValueError(f"offload parts {unknown}: choose from {', '.join(OFFLOAD_PARTS)}")
        todo = [part for part in OFFLOAD_PARTS if part in parts and part not in self.on_host]
        if self.device.type != "cuda" or not todo:
            return
        params = list(self.state.parameters())
        # The optimizer first, while the parameters are still on the device: with float32 parameters the
        # optimizer's main parameters are the model's own (or views of them), and those stay.
        if "optimizer" in todo:
            model_storages = {p.untyped_storage().data_ptr() for p in params}
            self._host["optimizer"].offload(t for t in _optimizer_tensors(self.state.optimizer)
                                            if t.untyped_storage().data_ptr() not in model_storages)
        if "grads" in todo:
            for chunk in self.state.model:
                chunk.offload_grad_buffers(synchronize=False, empty_cache=False)
        if "params" in todo:
            if "params" in unchanged:
                self._host["params"].release()
            else:
                self._host["params"].offload(params)
        self.on_host.update(todo)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()

    def onload(self, parts=OFFLOAD_PARTS) -> None:
        """Bring offloaded parts back to the device (gradient buffers come back zeroed)."""
        for part in (p for p in parts if p in self.on_host):
            if part == "grads":
                for chunk in self.state.model:
                    chunk.restore_grad_buffers(synchronize=False)
            else:
                self._host[part].onload()
            self.on_host.discard(part)
