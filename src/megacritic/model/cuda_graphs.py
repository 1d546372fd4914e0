"""The decoder replayed as CUDA graphs (``model.cuda_graphs``).

A small critic is bound by the host: at 0.5B one update queues ~8,400 kernels, and the host takes ~1 s to
queue what the GPU runs in ~0.46 s (bench/NOTES.md). With every pack padded to one of a few lengths
(:meth:`megacritic.packing.micro_batches.MicroBatchPolicy.graph_length`) the decoder sees few shapes, so
its forward and backward are captured once per length and replayed as one launch each.

What a replay reads and writes is fixed at capture: the static input (the embedding's output), the pack's
boundaries and rotary cos / sin (copied in before each replay), the parameters and their gradient buffers
(which stay where they are: parameter offload is refused by config validation), and the graph's own memory
pool for activations. Gradients reach the parameters two ways, as in eager mode: the weights whose
gradients Megatron's linear layers accumulate inside the GEMM (``gradient_accumulation_fusion``) get them
inside the backward graph, into their fixed ``main_grad``; every other parameter (norms, biases) gets its
gradient from the graph's output, handed to autograd, whose hooks (Megatron's DDP) add it to ``main_grad``.

Two details of capturing a module that Megatron's DDP has wrapped:
* the warm-up and capture run over fresh parameter objects (same storage and attributes): autograd runs a
  leaf's gradient accumulation on the stream where its accumulator was made, and DDP made the parameters'
  accumulators on the default stream when it wrapped the model, which a capture on another stream cannot
  wait for (bench/NOTES.md, "Launch-bound steps");
* the warm-up runs the real backward, whose fused weight gradients land in ``main_grad``: they are saved
  before and put back after.

On the CPU (tests) a "graph" re-runs the captured function instead of replaying it, so the whole path (fixed
shapes, static buffers, gradient routing) runs in the CPU parity suite; capture itself is GPU-tested.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from torch import Tensor

from megacritic.config import ConfigError
from megacritic.model.layers import CoreAttention
from megacritic.packing.pack import Pack

log = logging.getLogger(__name__)

WARMUP_ITERATIONS = 2  # lazy initialisation (compiled kernels for the shape, cuBLAS / FA4 set-up) before capture


class _CudaGraph:
    """One captured CUDA graph."""

    def __init__(self, pool, stream: torch.cuda.Stream):
        self.pool, self.stream, self.graph = pool, stream, torch.cuda.CUDAGraph()

    def capture(self, fn):
        with torch.cuda.graph(self.graph, pool=self.pool, stream=self.stream):
            return fn()

    def replay(self) -> None:
        self.graph.replay()


class _Rerun:
    """The CPU stand-in: capture runs ``fn`` and keeps its outputs; replay runs it again and copies the new
    outputs into them (as a replay rewrites a graph's output memory)."""

    def __init__(self, grad: bool):
        self.grad = grad

    def capture(self, fn):
        self.fn = fn
        self.outputs = fn()
        return self.outputs

    def replay(self) -> None:
        with torch.set_grad_enabled(self.grad):
            new = self.fn()
        for old, fresh in zip(_flat(self.outputs), _flat(new)):
            if old is not None:
                old.detach().copy_(fresh)


def _flat(x) -> list:
    return list(x) if isinstance(x, (tuple, list)) else [x]


@dataclass
class _Static:
    """The fixed-address inputs of one captured shape."""

    hidden: Tensor      # [tokens, 1, hidden]
    cu_seqlens: Tensor  # [slots + 1] int32
    cos: Tensor         # [tokens, 1, head_dim]
    sin: Tensor
    tokens: int

    def pack(self) -> Pack:
        return Pack(qkv_format="sbhd", cu_seqlens_q=self.cu_seqlens, cu_seqlens_kv=self.cu_seqlens,
                    max_seqlen_q=self.tokens, max_seqlen_kv=self.tokens, rotary=(self.cos, self.sin))

    def fill(self, hidden: Tensor, pack: Pack) -> None:
        self.hidden.detach().copy_(hidden)
        self.cu_seqlens.copy_(pack.cu_seqlens_q)
        self.cos.copy_(pack.rotary[0])
        self.sin.copy_(pack.rotary[1])

    @classmethod
    def like(cls, hidden: Tensor, pack: Pack, buffers: dict[str, Tensor], requires_grad: bool) -> "_Static":
        """Static inputs shaped as ``hidden`` and ``pack``, over the start of the mode's shared ``buffers``."""
        n = hidden.shape[0]
        static = cls(hidden=buffers["hidden"][:n].detach().requires_grad_(requires_grad),
                     cu_seqlens=torch.empty_like(pack.cu_seqlens_q), cos=buffers["cos"][:n], sin=buffers["sin"][:n],
                     tokens=n)
        static.fill(hidden, pack)
        return static


class _TrainGraphs:
    """Forward and backward of the decoder at one shape, for training."""

    def __init__(self, owner: "DecoderGraphs", hidden: Tensor, pack: Pack, kwargs: dict):
        self.owner = owner
        buffers = owner.buffers(True, hidden, pack)
        n = hidden.shape[0]
        self.static = _Static.like(hidden, pack, buffers, requires_grad=True)
        self.grad_out = buffers["grad_out"][:n]
        # what leaves the graphs is written to the mode's shared buffers, not kept in the pool per length
        out, grad_in = buffers["out"][:n], buffers["grad_in"][:n]
        params = [p for p in owner.decoder.parameters() if p.requires_grad]
        fused = owner.fused_weights()
        # The parameters whose gradients leave the graph (the fused weights' stay inside it, in main_grad).
        self.params = [p for p in params if id(p) not in fused]
        self.fwd, self.bwd = owner.new_graph(grad=True), owner.new_graph(grad=True)
        self.out = None
        fresh = owner.fresh_leaves()
        leaves = [fresh[id(p)] for p in self.params]
        pack = self.static.pack()

        def forward():
            with owner.using(fresh):
                self.out = owner.eager(hidden_states=self.static.hidden, attention_mask=None,
                                       packed_seq_params=pack, **kwargs)
            return out.copy_(self.out.detach())

        def backward():
            grads = torch.autograd.grad(self.out, [self.static.hidden, *leaves], grad_outputs=self.grad_out,
                                        allow_unused=True)
            return (grad_in.copy_(grads[0]), *grads[1:])

        self._forward, self._backward = forward, backward

    def warm_up(self) -> None:
        """Eager runs at this shape on the side stream (the caller keeps main_grad, which their backwards add to)."""
        with self.owner.on_side_stream():
            for _ in range(WARMUP_ITERATIONS):
                self._forward()
                self.grad_out.normal_()
                self._backward()
            self.out = None

    def capture(self) -> None:
        self.static_out = self.fwd.capture(self._forward)
        self.grads = self.bwd.capture(self._backward)
        self.out = None  # the forward's own output and what autograd saved: pool memory the next capture reuses

    def __call__(self, hidden: Tensor, pack: Pack) -> Tensor:
        self.static.fill(hidden, pack)
        return _Replay.apply(self, hidden, *self.params)


class _Replay(torch.autograd.Function):
    """Autograd's view of a training replay: input -> output, with the non-fused parameters as inputs so
    that their gradients (the backward graph's outputs) go through their accumulators and DDP's hooks."""

    @staticmethod
    def forward(ctx, graphs: _TrainGraphs, hidden: Tensor, *params: Tensor) -> Tensor:
        ctx.graphs, ctx.replay = graphs, graphs.owner.replays
        graphs.fwd.replay()
        # a copy: what autograd saves of the output (the value head's input) must outlive the next replay
        return graphs.static_out.detach().clone()

    @staticmethod
    def backward(ctx, grad: Tensor):
        graphs = ctx.graphs
        if graphs.owner.replays != ctx.replay:
            # the graphs share one memory pool: another replay may have overwritten this forward's activations
            raise RuntimeError("model.cuda_graphs: another graph replayed between a pack's forward and its "
                               "backward; the graphs take one micro-batch in flight at a time")
        graphs.grad_out.copy_(grad)
        graphs.bwd.replay()
        return (None, *graphs.grads)


class _ForwardGraph:
    """The decoder's forward at one shape, without autograd (compute_values)."""

    def __init__(self, owner: "DecoderGraphs", hidden: Tensor, pack: Pack, kwargs: dict):
        buffers = owner.buffers(False, hidden, pack)
        self.static = _Static.like(hidden, pack, buffers, requires_grad=False)
        self.graph = owner.new_graph(grad=False)
        static_pack = self.static.pack()
        out = buffers["out"][: hidden.shape[0]]

        def forward():
            return out.copy_(owner.eager(hidden_states=self.static.hidden, attention_mask=None,
                                         packed_seq_params=static_pack, **kwargs))

        self.owner, self._forward = owner, forward

    def warm_up(self) -> None:
        with torch.no_grad(), self.owner.on_side_stream():
            for _ in range(WARMUP_ITERATIONS):
                self._forward()

    def capture(self) -> None:
        with torch.no_grad():
            self.out = self.graph.capture(self._forward)

    def __call__(self, hidden: Tensor, pack: Pack) -> Tensor:
        self.static.fill(hidden, pack)
        self.graph.replay()
        return self.out


class DecoderGraphs:
    """Stands in for a model chunk's ``decoder.forward``: packs of the fixed shape (``slots`` + 1 boundaries,
    rotary cos / sin attached: :class:`~megacritic.model.value_model.ValueModel`) replay the graphs captured
    for their length and mode (training with autograd, or forward only); anything else runs eagerly."""

    def __init__(self, decoder: torch.nn.Module, slots: int, lengths: dict[bool, list[int]] | None = None):
        self.decoder, self.slots = decoder, slots
        self.lengths = lengths or {}  # per mode (training?), the pack lengths captured together at its first use
        self.eager = type(decoder).forward.__get__(decoder)
        self.cuda = next(decoder.parameters()).is_cuda
        self.graphs: dict[tuple[bool, int], object] = {}
        self._buffers: dict[bool, dict[str, Tensor]] = {}
        self._addresses_at_capture: tuple = ()
        self.replays = 0  # decoder calls that replayed graphs
        self._reported: set[str] = set()  # what was logged once
        if self.cuda:
            self._check_capturable()
            # One pool for every graph: they never run at the same time (a pack's forward and backward run
            # before the next pack's, PP=1), and what lives from one replay to the next (static outputs and
            # gradients) stays referenced, so a later capture cannot take its memory.
            self.stream, self.pool = torch.cuda.Stream(), torch.cuda.graph_pool_handle()

    @classmethod
    def install(cls, decoder: torch.nn.Module, slots: int,
                lengths: dict[bool, list[int]] | None = None) -> "DecoderGraphs":
        """Route ``decoder``'s calls through a new DecoderGraphs (its parameters and state dict unchanged).
        ``lengths``: per mode (True: training), every pack length the micro-batching can make, all captured
        at the mode's first use (other lengths are captured at their own first use)."""
        graphs = cls(decoder, slots, lengths)
        decoder.forward = graphs
        return graphs

    def __call__(self, hidden_states, attention_mask=None, packed_seq_params=None, **kwargs):
        train = torch.is_grad_enabled() and self.decoder.training
        if not self._fits(hidden_states, attention_mask, packed_seq_params, kwargs, train):
            return self.eager(hidden_states=hidden_states, attention_mask=attention_mask,
                              packed_seq_params=packed_seq_params, **kwargs)
        key = (train, hidden_states.shape[0])
        if self.graphs and self._addresses() != self._addresses_at_capture:
            # offloaded and brought back (CriticWorker.offload, verl's engine.to): new device addresses
            log.info("model.cuda_graphs: the decoder's parameters or gradient buffers moved; capturing again")
            self.reset()
        if key not in self.graphs:
            self._capture(train, key[1], hidden_states, packed_seq_params, kwargs)
        self.replays += 1
        return self.graphs[key](hidden_states, packed_seq_params)

    def _capture(self, train: bool, tokens: int, hidden_states: Tensor, pack: Pack, kwargs: dict) -> None:
        """Capture the graphs of a new length; at a mode's first use, of every length it can make."""
        first = not any(mode == train for mode, _ in self.graphs)
        # longest first: each shorter capture then fits in the pool's blocks (a longer one would need new ones)
        lengths = sorted(set(self.lengths.get(train, [])) | {tokens}, reverse=True) if first else [tokens]
        what = "forward and backward" if train else "forward"
        log.info("model.cuda_graphs: capturing the decoder's %s at %d pack length(s) up to %d tokens", what,
                 len(lengths), lengths[0])
        start = time.perf_counter()
        reserved = torch.cuda.memory_reserved() if self.cuda else 0
        made = {}
        with self.main_grads_kept() if train else contextlib.nullcontext():
            for n in lengths:
                hidden, example = (hidden_states, pack) if n == tokens else self._example(hidden_states, n)
                made[n] = (_TrainGraphs if train else _ForwardGraph)(self, hidden, example, kwargs)
            # Every warm-up before any capture: a warm-up's activations are cached on the side stream, which the
            # pool cannot use; each capture starts by emptying that cache, so a warm-up after a capture would
            # hold a second copy of the activations beside the pool's (out of memory at 1.5B on an 80 GiB GPU).
            for graphs in made.values():
                graphs.warm_up()
            for n, graphs in made.items():
                graphs.capture()
                self.graphs[(train, n)] = graphs
        grown = ((torch.cuda.memory_reserved() - reserved) / 2**30) if self.cuda else 0.0
        log.info("model.cuda_graphs: captured in %.1f s; device memory reserved %+.1f GiB", time.perf_counter() - start,
                 grown)
        self._addresses_at_capture = self._addresses()

    def reset(self) -> None:
        """Drop every graph (and their memory): the next calls capture again."""
        self.graphs.clear()
        self._buffers.clear()
        if self.cuda:
            self.pool = torch.cuda.graph_pool_handle()

    def _addresses(self) -> tuple:
        """Where the decoder's parameters and gradient buffers are: what the graphs read and write."""
        return tuple((p.data_ptr(), p.main_grad.data_ptr() if hasattr(p, "main_grad") else 0)
                     for p in self.decoder.parameters())

    def _check_capturable(self) -> None:
        """What a capture cannot take, refused when the model is built."""
        linears = [m for m in self.decoder.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
        if not all(m.gradient_accumulation_fusion for m in linears):
            raise ConfigError("model.cuda_graphs=true needs the weight gradients accumulated inside the GEMM "
                              "(each captured length would otherwise keep its own copy of every gradient): set "
                              "model.use_fused_kernels=true (with torch >= 2.9 or apex)")
        impls = {m.impl for m in self.decoder.modules() if isinstance(m, CoreAttention)}
        if "sdpa" in impls:
            raise ConfigError("model.cuda_graphs=true needs FlashAttention on the GPU (model.attention_impl fa4 or "
                              "fa2, bf16 / fp16 parameters); the per-rollout SDPA loop reads the pack's boundaries "
                              "on the host, which a capture cannot")

    def buffers(self, train: bool, hidden: Tensor, pack: Pack) -> dict[str, Tensor]:
        """The static inputs of a mode, at its longest pack: each length's graphs read the start of them (the
        graphs never run at the same time)."""
        n = hidden.shape[0]
        kept = self._buffers.get(train)
        if kept is None or kept["hidden"].shape[0] < n:
            longest = max([n, *self.lengths.get(train, [])])
            cos = pack.rotary[0]
            like = hidden.new_empty(longest, *hidden.shape[1:])
            kept = self._buffers[train] = {
                "hidden": like, "out": torch.empty_like(like),
                **({"grad_out": torch.empty_like(like), "grad_in": torch.empty_like(like)} if train else {}),
                "cos": cos.new_empty(longest, *cos.shape[1:]), "sin": cos.new_empty(longest, *cos.shape[1:])}
        return kept

    def _example(self, like: Tensor, tokens: int) -> tuple[Tensor, Pack]:
        """Inputs of ``tokens`` tokens to capture with (a replay overwrites them): one sequence, no rotation."""
        hidden = like.new_zeros(tokens, *like.shape[1:]).requires_grad_(like.requires_grad)
        cu = torch.full((self.slots + 1,), tokens, dtype=torch.int32, device=like.device)
        cu[0] = 0
        d = self.decoder.config.kv_channels
        cos = torch.ones(tokens, 1, d, dtype=like.dtype, device=like.device)
        return hidden, Pack(qkv_format="sbhd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=tokens,
                            max_seqlen_kv=tokens, rotary=(cos, torch.zeros_like(cos)))

    def _fits(self, hidden, attention_mask, pack, kwargs, train: bool) -> bool:
        """Whether this call is one the graphs replay: a pack of the fixed shape, training with autograd or a
        forward without it (a forward in eval mode that records autograd runs eagerly)."""
        fits = (type(pack) is Pack and pack.rotary is not None
                and attention_mask is None and all(v is None for v in kwargs.values())
                and isinstance(hidden, Tensor) and hidden.dim() == 3 and hidden.shape[1] == 1
                and pack.cu_seqlens_q is pack.cu_seqlens_kv and pack.cu_seqlens_q.numel() == self.slots + 1
                and (train not in self.lengths or hidden.shape[0] in self.lengths[train])
                and (hidden.requires_grad if train else not torch.is_grad_enabled()))
        if not fits and type(pack) is Pack:
            rollouts = pack.cu_seqlens_q.numel() - 1  # an unpadded pack: its rollouts
            if rollouts >= self.slots and "slots" not in self._reported:
                self._reported.add("slots")
                log.warning("model.cuda_graphs: a pack of %d rollouts (more than model.cuda_graph_max_rollouts=%d) "
                            "runs eagerly; raise the setting if this is common", rollouts, self.slots - 1)
            elif rollouts < self.slots and "other" not in self._reported:
                self._reported.add("other")
                log.info("model.cuda_graphs: a decoder call the graphs do not take runs eagerly")
        return fits

    # ------------------------------------------------------------ what a capture needs

    def new_graph(self, grad: bool):
        return _CudaGraph(self.pool, self.stream) if self.cuda else _Rerun(grad)

    @contextlib.contextmanager
    def on_side_stream(self):
        if not self.cuda:
            yield
            return
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            yield
        torch.cuda.current_stream().wait_stream(self.stream)

    def fused_weights(self) -> set[int]:
        """ids of the weights whose gradients Megatron's linear layers accumulate in the GEMM (main_grad)."""
        return {id(m.weight) for m in self.decoder.modules()
                if isinstance(m, (ColumnParallelLinear, RowParallelLinear)) and m.gradient_accumulation_fusion
                and hasattr(m.weight, "main_grad")}

    def fresh_leaves(self) -> dict[int, torch.nn.Parameter]:
        """id of each decoder parameter -> a new leaf over the same storage, with the same attributes
        (main_grad ...)."""
        fresh = {}
        for p in self.decoder.parameters():
            leaf = torch.nn.Parameter(p.data, requires_grad=p.requires_grad)
            leaf.__dict__.update(p.__dict__)
            fresh[id(p)] = leaf
        return fresh

    @contextlib.contextmanager
    def using(self, fresh: dict[int, torch.nn.Parameter]):
        """The decoder's modules hold the ``fresh`` leaves instead of their parameters inside."""
        slots = [(module, name, p) for module in self.decoder.modules() for name, p in module._parameters.items()
                 if p is not None]
        try:
            for module, name, p in slots:
                module._parameters[name] = fresh[id(p)]
            yield
        finally:
            for module, name, p in slots:
                module._parameters[name] = p

    @contextlib.contextmanager
    def main_grads_kept(self):
        """The fused weights' main_grad as it was before the warm-up's backwards added to it."""
        fused = self.fused_weights()
        kept = [(p.main_grad, p.main_grad.clone()) for p in self.decoder.parameters() if id(p) in fused]
        try:
            yield
        finally:
            for grad, copy in kept:
                grad.copy_(copy)
