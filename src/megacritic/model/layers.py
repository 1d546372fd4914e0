"""Our modules that plug into Megatron-Core's GPT layer spec: self attention's query / key / value,
core attention, RMSNorm, value head.

Why our own:
* ``FusedQKVSelfAttention``: Megatron's SelfAttention adds the QKV projection's bias in a broadcast pass
  of its own, copies the queries out of the projection's interleaved layout and rotates them in more
  passes; ours does bias, split and (packed micro-batches) RoPE as one Triton kernel each way on GPU.
* ``CoreAttention``: Megatron's local ``DotProductAttention`` materialises the full score matrix; without
  Transformer Engine it measured 3.8x slower with 4.5x the memory of SDPA on an H200 (design notes).
  Megatron's context parallelism also lives in Transformer Engine's attention, so ours provides it.
* ``RMSNorm``: Megatron's torch-norm wrapper refuses sequence parallelism. Ours marks its weight
  ``sequence_parallel`` so Megatron's grad finalisation all-reduces it across tensor-parallel ranks.
* ``ValueHead``: the scalar head replaces the vocabulary projection; it is replicated (identical) on every
  tensor-parallel rank and computes in float32.
* ``GroupedExperts``: Megatron's grouped-GEMM experts need Transformer Engine or nv-grouped-gemm; ours run
  each projection of all local experts as one ``torch._grouped_mm`` (bf16, CUDA), 3-6x faster than the
  per-expert loop of SequentialMLP (bench/NOTES.md), with SequentialMLP's parameters unchanged.
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.fusions.fused_bias_swiglu import weighted_bias_swiglu_impl
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.module import MegatronModule
from torch import Tensor

from megacritic.config import ConfigError
from megacritic.packing.pack import ContextParallelPack

try:  # PyTorch >= 2.9: FlashAttention-2 for packed sequences (CUDA only)
    from torch.nn.attention.varlen import varlen_attn as _varlen_attn
    # 2.9-2.12 take GQA as is; later releases ask for it by keyword.
    _VARLEN_KWARGS = {"enable_gqa": True} if "enable_gqa" in inspect.signature(_varlen_attn).parameters else {}
except ImportError:  # pragma: no cover - older PyTorch
    _varlen_attn, _VARLEN_KWARGS = None, {}


@functools.cache
def _fa4_varlen() -> tuple[object, str | None]:
    """FlashAttention-4's varlen function (``flash_attn.cute``), or None and why it does not import."""
    try:
        from flash_attn.cute import flash_attn_varlen_func
    except Exception as e:  # noqa: BLE001 - any failure (missing package, CuTe DSL runtime) means "not there"
        return None, f"{type(e).__name__}: {e}"
    return flash_attn_varlen_func, None


def _fa4_gpu_problem() -> str | None:
    """Why FlashAttention-4 cannot run on this process' GPU, or None: it has kernels for compute capability
    9.x (Hopper) and 10.x (Blackwell)."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    major, minor = torch.cuda.get_device_capability()
    if major not in (9, 10):
        return f"{torch.cuda.get_device_name()} has compute capability {major}.{minor}, FA4 needs 9.x or 10.x"
    return None


# Head dims whose FA4 kernels (forward, backward, varlen, GQA, bottom-right causal) were checked against a
# float32 reference on an H200 (tests/test_gpu.py); auto takes FA4 only for these.
FA4_CHECKED_HEAD_DIMS = (64, 128)


def resolve_attention_impl(requested: str, dtype: torch.dtype, on_gpu: bool, head_dim: int = 128) -> str:
    """The attention kernel of packed micro-batches, from ``model.attention_impl``: "fa4", "fa2" or "sdpa".

    fa4 is FlashAttention-4, which auto takes where it imports, the GPU is 9.x / 10.x and the head dim is
    one checked (FA4_CHECKED_HEAD_DIMS); fa2 FlashAttention-2 through torch's ``varlen_attn``. Both need
    bf16 / fp16 on a GPU, so float32 and CPU runs use SDPA, except that fa4 asked for by name is then an
    error instead of a silent fallback."""
    half = dtype in (torch.bfloat16, torch.float16)
    if requested == "fa4":
        problem = (_fa4_varlen()[1] or (None if on_gpu else "the critic runs on the CPU") or _fa4_gpu_problem()
                   or (None if half else f"parameters are {dtype}; FA4 computes in bf16 / fp16 (model.dtype)"))
        if problem:
            raise ConfigError(f"model.attention_impl=fa4: FlashAttention-4 cannot run here ({problem}). Install "
                              "it with `pip install megacritic[hopper]` on a Hopper / Blackwell GPU, or set "
                              "model.attention_impl=auto (fa4 where it runs, else fa2)")
        return "fa4"
    if not (on_gpu and half):
        return "sdpa"
    if requested == "auto":
        if head_dim in FA4_CHECKED_HEAD_DIMS and _fa4_varlen()[0] is not None and _fa4_gpu_problem() is None:
            return "fa4"
        return "fa2" if _varlen_attn is not None else "sdpa"
    if requested == "fa2" and _varlen_attn is None:
        raise ConfigError("model.attention_impl=fa2: this PyTorch has no torch.nn.attention.varlen.varlen_attn "
                          f"(torch {torch.__version__}; it needs >= 2.9): upgrade torch or set "
                          "model.attention_impl=sdpa")
    return requested


def attention_impl_of(chunks) -> str | None:
    """The attention kernel of packed micro-batches in these model chunks (e.g. ``CriticWorker.state.model``)."""
    impls = sorted({m.impl for chunk in chunks for m in chunk.modules() if isinstance(m, CoreAttention)})
    return ",".join(impls) or None


def _param_device(config) -> torch.device:
    return torch.device("cpu") if config.use_cpu_initialization else torch.device("cuda", torch.cuda.current_device())


class CoreAttention(MegatronModule):
    """Causal (GQA) attention, for padded micro-batches [s, b, heads, d] and packed ones ([t, 1, heads, d]
    or THD [t, heads, d]).

    Padded: one ``scaled_dot_product_attention`` call; rows are left-aligned and right-padded, so a plain
    causal mask is exact for every real token (padding only follows real tokens). Packed (THD): each
    rollout attends only to itself (its queries and keys arrive rotated), through the kernel ``impl`` names (:func:`resolve_attention_impl`,
    chosen once when the model is built): FlashAttention-4, FlashAttention-2 (torch's ``varlen_attn``) or an
    exact per-rollout SDPA loop.

    Context parallel (a :class:`ContextParallelPack`): each rank gathers the keys and values of the whole
    pack from its context-parallel group (all-gather forward, reduce-scatter of their gradients backward)
    and attends its own query chunks to them, exactly. A ring (p2p) exchange would hold less than the whole
    pack's keys at once; it can replace the all-gather if that memory becomes the limit.
    """

    def __init__(self, config, layer_number, attn_mask_type, attention_type, cp_comm_type=None,
                 softmax_scale=None, pg_collection=None, attention_impl: str = "auto", **unused):
        super().__init__(config=config)
        self.softmax_scale = softmax_scale
        self.cp_group = getattr(pg_collection, "cp", None)
        on_gpu = not config.use_cpu_initialization and torch.cuda.is_available()
        self.impl = resolve_attention_impl(attention_impl, config.params_dtype, on_gpu, config.kv_channels)

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None) -> Tensor:
        if packed_seq_params is not None:
            if query.dim() == 4:  # a pack handed to Megatron as one [t, 1] sequence (megacritic.packing.micro_batches)
                out = self._packed(query.squeeze(1), key.squeeze(1), value.squeeze(1), packed_seq_params)
                return out.unsqueeze(1)
            return self._packed(query, key, value, packed_seq_params)
        # [s, b, heads, d] -> [b, heads, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=self.softmax_scale, enable_gqa=k.shape[1] != q.shape[1])
        b, heads, s, d = out.shape
        return out.permute(2, 0, 1, 3).reshape(s, b, heads * d)  # [s, b, heads * d]

    def _packed(self, q: Tensor, k: Tensor, v: Tensor, params) -> Tensor:
        """q [t, heads, d], k/v [t, groups, d] (queries and keys rotated: FusedQKVSelfAttention) -> [t, heads * d]."""
        if isinstance(params, ContextParallelPack):
            # One all-gather for keys and values together: [cp * t, 2 * groups, d], rank-major.
            kv = gather_from_sequence_parallel_region(torch.cat([k, v], dim=1), group=self.cp_group)
            return self.attend_chunks(q, kv, params)
        cu, max_len = params.cu_seqlens_q, params.max_seqlen_q
        return _varlen_causal(q, k, v, cu, cu, max_len, max_len, self.softmax_scale, self.impl)

    def attend_chunks(self, q: Tensor, kv: Tensor, params: ContextParallelPack) -> Tensor:
        """This rank's query chunks q [t, heads, d] against their key prefixes, taken from ``kv``: every
        context-parallel rank's keys and values ([k | v] on dim 1) in rank order. -> [t, heads * d]."""
        k, v = kv[params.kv_index].chunk(2, dim=1)  # index_select: its backward sums duplicated keys' grads
        return _varlen_causal(q, k, v, params.chunk_cu_q, params.chunk_cu_kv, params.max_chunk_q,
                              params.max_chunk_kv, self.softmax_scale, self.impl)


def _varlen_causal(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int,
                   scale: float | None, impl: str = "sdpa") -> Tensor:
    """Causal attention of query sequence i (rows cu_q[i]:cu_q[i+1] of q) to key sequence i (cu_k), with
    the causal diagonal at the bottom right: when sequence i has fewer queries than keys, its queries are
    the last ones of its keys' span (a chunk attending to its rollout's prefix). ``impl``: the kernel
    (:func:`resolve_attention_impl`). -> [t_q, heads * d]."""
    if impl == "fa4":
        # FA4's causal mask is bottom-right aligned when query and key lengths differ; it returns (out, lse).
        out, _ = _fa4_varlen()[0](q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q,
                                  max_seqlen_k=max_k, softmax_scale=scale, causal=True,
                                  deterministic=torch.are_deterministic_algorithms_enabled())
        return out.reshape(q.shape[0], -1)
    if impl == "fa2":
        # FlashAttention-2 aligns its causal window (-1, 0) to the bottom right when lengths differ:
        # query j may see key i iff i <= j + len_k - len_q. (Its backward is deterministic when torch's
        # deterministic algorithms are on: megatron.full_determinism.)
        out = _varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, window_size=(-1, 0), **_VARLEN_KWARGS)
        return out.reshape(q.shape[0], -1)
    outs = []
    for qa, qe, ka, ke in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(), cu_k[1:].tolist()):
        lq, lk = qe - qa, ke - ka
        if lq == 0:  # an empty slot of a fixed-shape pack (model.cuda_graphs)
            continue
        qs, ks, vs = q[qa:qe].transpose(0, 1), k[ka:ke].transpose(0, 1), v[ka:ke].transpose(0, 1)  # [h, len, d]
        # SDPA's is_causal aligns the diagonal to the top left when lengths differ: give the mask instead.
        mask = None if lq == lk else torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, is_causal=mask is None, scale=scale,
                                           enable_gqa=ks.shape[0] != qs.shape[0])
        outs.append(o.transpose(0, 1).reshape(lq, -1))
    return torch.cat(outs)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary embedding of x [t, heads, d] (halves rotated, as Llama / Qwen2 and Megatron's unfused path)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def _rotate_qk(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate_qk_float(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    q2, k2 = _rotate_qk(q.float(), k.float(), cos.float(), sin.float())
    return q2.to(q.dtype), k2.to(k.dtype)


@functools.cache
def _compiled_rotate_qk():
    # One kernel each way for q and k together, computed in float32 and rounded once; in eager, Megatron's
    # RoPE runs chunk / neg / cat / two muls / add for q and for k, and recomputes cos / sin in every layer
    # (bench/NOTES.md: 5.8 -> 3.8 ms per 1.5B layer over an update's tokens).
    return torch.compile(_rotate_qk_float, dynamic=True)


def apply_rotary(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, fused: bool = False) -> tuple[Tensor, Tensor]:
    """RoPE for a pack: q [t, heads, d], k [t, groups, d], per-token cos / sin [t, 1, d]. Unfused it is
    Megatron's arithmetic exactly (in the activations' dtype); ``fused`` (CUDA) computes in float32."""
    return (_compiled_rotate_qk() if fused else _rotate_qk)(q, k, cos, sin)


def _split_qkv(mixed: Tensor, bias: Tensor | None, groups: int, d: int,
               rotary: tuple[Tensor, Tensor] | None) -> tuple[Tensor, Tensor, Tensor]:
    """The QKV projection's output without its bias, mixed [t, groups * (heads / groups + 2) * d] (per
    group: its queries, its key, its value) -> q [t, heads, d], k / v [t, groups, d]: the bias added, split
    into heads and, given per-token (cos, sin) [t, 1, d], q and k rotated. Megatron's arithmetic exactly
    (add, split, reshape, RoPE, each in the activations' dtype)."""
    if bias is not None:
        mixed = mixed + bias
    x = mixed.view(mixed.shape[0], groups, -1)
    q, k, v = x.split([x.shape[-1] - 2 * d, d, d], dim=-1)
    q = q.reshape(q.shape[0], -1, d)
    if rotary is not None:
        q, k = _rotate_qk(q, k, *rotary)
    return q, k, v


def split_qkv(mixed: Tensor, bias: Tensor | None, groups: int, d: int, rotary: tuple[Tensor, Tensor] | None = None,
              fused: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`_split_qkv`; ``fused`` (CUDA): one Triton kernel each way (:mod:`megacritic.model.qkv_kernel`),
    float32 inside and rounded once, contiguous outputs."""
    if fused:
        from megacritic.model import qkv_kernel  # Triton: imported where it runs

        return qkv_kernel.split_qkv(mixed, bias, groups, d, rotary)
    return _split_qkv(mixed, bias, groups, d, rotary)


class FusedQKVSelfAttention(SelfAttention):
    """Megatron's SelfAttention whose query / key / value come out of the QKV projection in one pass:
    bias added, split into heads and, for a packed micro-batch (its per-token cos / sin on the
    :class:`~megacritic.packing.pack.Pack`), queries and keys rotated (:func:`split_qkv`). Padded
    micro-batches keep Megatron's RoPE, applied after this split.

    The projection then runs without its bias (``skip_bias_add``: the same parameter, added here), and so
    does its bias gradient: the split's backward gives it. Each tensor-parallel rank holds whole query groups
    (config validation: TP divides model.num_key_value_heads), so Megatron's gather of groups split over ranks
    is never needed. Qwen3's query / key norms come before RoPE, so with them the split and RoPE are two passes.
    """

    def __init__(self, config, submodules, layer_number, attn_mask_type, fused: bool = False, **kwargs):
        super().__init__(config, submodules, layer_number, attn_mask_type, **kwargs)
        if config.num_query_groups % self.world_size:
            raise ValueError(f"{config.num_query_groups} query groups do not divide over {self.world_size} "
                             "tensor-parallel ranks")
        self.fused = fused and not config.use_cpu_initialization
        self.qk_norm = not (self.q_layernorm is None or isinstance(self.q_layernorm, IdentityOp))
        self.linear_qkv.skip_bias_add = True
        self._rotary = None  # the running call's (cos, sin): get_query_key_value_tensors is called without it

    def forward(self, *args, packed_seq_params=None, **kwargs):
        self._rotary = getattr(packed_seq_params, "rotary", None)
        try:
            return super().forward(*args, packed_seq_params=packed_seq_params, **kwargs)
        finally:
            self._rotary = None

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None, output_gate=False, **kwargs):
        if output_gate or not kwargs.get("split_qkv", True):
            raise ValueError("FusedQKVSelfAttention: gated attention and TE's fused QKV RoPE are not supported")
        rotary, fused = self._rotary, self.fused and hidden_states.is_cuda
        mixed, bias = self.linear_qkv(hidden_states)  # [s, b, groups * (heads / groups + 2) * d]
        s, b = mixed.shape[:2]
        q, k, v = split_qkv(mixed.view(s * b, -1), bias, self.num_query_groups_per_partition,
                            self.hidden_size_per_attention_head, None if self.qk_norm else rotary, fused)
        q, k, v = (x.view(s, b, *x.shape[1:]) for x in (q, k, v))
        if self.qk_norm:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
            if rotary is not None:
                q, k = (x.unsqueeze(1) for x in apply_rotary(q.squeeze(1), k.squeeze(1), *rotary, fused=fused))
        return q, k, v


def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


@functools.cache
def _compiled_rms_norm():
    # One kernel each way instead of eager's cast / norm / cast / scale passes; dynamic shapes, as packed
    # micro-batches change length every call. Inductor drops a cast that stays in registers unless told to
    # emulate it: without, the normalised value is not rounded before the weight's scale and a quarter of a
    # bf16 output differs from eager's by an ulp. (Launch configs tuned by timing them would pick the
    # reduction's split anew at each compilation: results would then differ between runs.)
    return torch.compile(_rms_norm, dynamic=True, options={"emulate_precision_casts": True})


@functools.cache
def _norm_kernel():
    """megacritic.model.norm_kernel (Triton), or None where Triton does not import (then the compiled norm)."""
    try:
        from megacritic.model import norm_kernel  # Triton: imported where it runs
    except Exception:  # noqa: BLE001 - no Triton, or one that does not import here
        return None
    return norm_kernel


def fused_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """:func:`_rms_norm` of CUDA rows [tokens, hidden] as one kernel each way, the same arithmetic: the
    Triton kernels of :mod:`megacritic.model.norm_kernel`, else (no Triton, or a weight of another dtype than
    the rows) the compiled norm."""
    kernel = _norm_kernel()
    if kernel is None or weight.dtype != x.dtype:
        return _compiled_rms_norm()(x, weight, eps)
    return kernel.rms_norm(x, weight, eps)


class RMSNorm(torch.nn.Module):
    """RMSNorm computed in float32 (as Llama / Qwen2 do), usable under sequence parallelism.

    ``fused``: on CUDA, one Triton kernel each way (:func:`fused_rms_norm`: same arithmetic; bench/NOTES.md
    has the timings); eager elsewhere.
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, fused: bool = False, **unused):
        super().__init__()
        self.eps = eps
        self.fused = fused and not config.use_cpu_initialization
        self.weight = torch.nn.Parameter(
            torch.ones(hidden_size, dtype=config.params_dtype, device=_param_device(config)))
        # Under sequence parallelism each TP rank sees a slice of the sequence, so the weight's gradient
        # is partial: Megatron's finalize_model_grads all-reduces params carrying this flag.
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: Tensor) -> Tensor:
        if self.fused and x.is_cuda:
            # As [tokens, hidden]: guards on the stride of a size-1 batch dimension would recompile per length.
            return fused_rms_norm(x.reshape(-1, x.shape[-1]), self.weight, self.eps).view(x.shape)
        return _rms_norm(x, self.weight, self.eps)


class ValueHead(MegatronModule):
    """Scalar value head in place of GPTModel's output layer: hidden [s, b, h] -> values [s, b, 1] (float32).

    Its weight is not tensor-parallel: every TP rank holds the full [1, h] matrix and computes the same
    values from the same (gathered) hidden states, so its gradient is identical on every TP rank and
    needs no TP reduction.
    """

    def __init__(self, config, hidden_size: int):
        super().__init__(config=config)
        device = _param_device(config)
        self.weight = torch.nn.Parameter(torch.empty(1, hidden_size, dtype=config.params_dtype, device=device))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=config.params_dtype, device=device))
        self.sequence_parallel = config.sequence_parallel

    def forward(self, hidden: Tensor, weight=None, runtime_gather_output=None, **unused):
        if self.sequence_parallel:
            # The values are replicated and so is the loss computed from them: in backward each rank keeps
            # its own slice of the (identical) gradient instead of summing copies over TP.
            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
        values = F.linear(hidden.float(), self.weight.float(), self.bias.float())
        return values, None


class GroupedExperts(SequentialMLP):
    """SequentialMLP whose local experts run as two grouped GEMMs (one per projection) instead of a Python
    loop of small matmuls, when that is available: CUDA, bf16, several local experts, SwiGLU without bias
    (every family we import). Elsewhere (CPU, float32) it is SequentialMLP's own loop.

    The experts keep SequentialMLP's per-expert parameters (``local_experts.N.linear_fc{1,2}.weight``), so
    checkpoints, the Hugging Face mapping and expert parallelism are unchanged; each call stacks them
    (one copy of the local expert weights per layer and micro-batch, counted in the probe's timings) and
    autograd hands each expert its slice of the gradient. Under expert tensor parallelism the
    weights are local shards, and the partial fc2 sums are reduced by the token dispatcher, as for the loop.
    """

    def __init__(self, num_local_experts, config, submodules, pg_collection=None, grouped: bool = True):
        super().__init__(num_local_experts, config, submodules, pg_collection=pg_collection)
        self.grouped = (grouped and hasattr(torch, "_grouped_mm") and num_local_experts > 1
                        and config.gated_linear_unit and config.activation_func is F.silu
                        and not config.add_bias_linear and not config.moe_apply_probs_on_input
                        and not (config.fp8 or config.fp4))

    def forward(self, permuted_local_hidden_states: Tensor, tokens_per_expert: Tensor, permuted_probs: Tensor):
        x = permuted_local_hidden_states
        if not (self.grouped and x.is_cuda and x.dtype == torch.bfloat16):
            return super().forward(x, tokens_per_expert, permuted_probs)
        offsets = torch.as_tensor(tokens_per_expert, device=x.device).cumsum(0).to(torch.int32)
        fc1 = torch.stack([e.linear_fc1.weight for e in self.local_experts])  # [E, 2 * ffn, h]
        fc2 = torch.stack([e.linear_fc2.weight for e in self.local_experts])  # [E, h, ffn]
        hidden = torch._grouped_mm(x, fc1.transpose(1, 2), offs=offsets)
        probs = permuted_probs.unsqueeze(-1)
        if self.config.bias_activation_fusion:  # the kernel SequentialMLP's experts use
            hidden = weighted_bias_swiglu_impl(hidden, None, probs, self.config.activation_func_fp8_input_store)
        else:
            gate, up = hidden.chunk(2, dim=-1)
            hidden = (F.silu(gate) * up * probs).to(x.dtype)
        return torch._grouped_mm(hidden, fc2.transpose(1, 2), offs=offsets), None
