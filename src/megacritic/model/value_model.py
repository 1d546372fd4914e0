"""The value model: Megatron-Core's GPTModel (Llama / Qwen2 / Qwen3 / Mistral family, and their
mixture-of-experts relatives Qwen2-MoE / Qwen3-MoE / Mixtral) with a scalar value head.

``build_value_model`` returns this rank's model chunks (one per virtual pipeline stage), with our
attention and norm plugged in through the layer spec, Megatron's MoELayer on the MoE layers, and the value
head on the last stage.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.attention import SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
from megatron.core.transformer.moe.shared_experts import SharedExpertMLP
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_layer import (TransformerLayer, TransformerLayerSubmodules,
                                                         get_transformer_layer_offset)
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add

from megacritic.compat.kernels import weight_grad_accumulation_available
from megacritic.config.schema import (MegatronConfig, ModelConfig, expert_ffn_size, head_dim, is_moe,
                                      moe_layer_pattern, shared_expert_size)
from megacritic.model import mlp_kernel
from megacritic.model.embedding import lookup_into_main_grad
from megacritic.model.layers import CoreAttention, FusedQKVSelfAttention, GroupedExperts, RMSNorm, ValueHead
from megacritic.parallel import ParallelLayout

log = logging.getLogger(__name__)


def moe_options(model: ModelConfig, ep: int, etp: int | None) -> dict:
    """TransformerConfig fields of the MoE layers, set so that they compute what Hugging Face's Qwen2-MoE /
    Qwen3-MoE / Mixtral blocks compute."""
    if not is_moe(model):
        return {}
    shared = shared_expert_size(model)
    return dict(
        num_moe_experts=model.num_experts,
        moe_layer_freq=moe_layer_pattern(model),
        moe_ffn_hidden_size=expert_ffn_size(model),
        moe_router_topk=model.num_experts_per_tok,
        # HF: softmax over all experts, then top-k (renormalised only with norm_topk_prob). Megatron's
        # pre-softmax routing is exactly the former; without it, it takes the softmax over the top-k logits,
        # which equals the renormalised top-k probabilities (and is what Mixtral computes).
        moe_router_score_function="softmax",
        moe_router_pre_softmax=not model.norm_topk_prob,
        moe_router_topk_scaling_factor=None,
        # Logits and softmax in float32 whatever the parameter dtype (HF also takes the softmax in float32).
        moe_router_dtype="fp32",
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=model.moe_aux_loss_coeff,
        # Nothing HF does not do: no z-loss, no input jitter, no capacity (token dropping), no expert bias.
        moe_z_loss_coeff=None,
        moe_input_jitter_eps=None,
        moe_expert_capacity_factor=None,
        moe_router_enable_expert_bias=False,
        # Qwen2-MoE's shared expert, its output scaled by sigmoid(x . gate)
        moe_shared_expert_intermediate_size=shared or None,
        moe_shared_expert_gate=bool(shared),
        # Megatron's grouped GEMM needs Transformer Engine or nv-grouped-gemm: our GroupedExperts (torch's
        # grouped GEMM) is picked by the layer spec instead. No fused permutation or router kernels (TE).
        moe_grouped_gemm=False,
        moe_permute_fusion=False,
        moe_router_fusion=False,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
    )


def recompute_options(megatron: MegatronConfig | None) -> dict:
    """TransformerConfig fields of Megatron's activation recompute (megatron.recompute_*); {} when off."""
    if megatron is None or megatron.recompute_granularity is None:
        return {}
    if megatron.recompute_granularity == "full":
        return dict(recompute_granularity="full", recompute_method=megatron.recompute_method,
                    recompute_num_layers=megatron.recompute_num_layers)
    # (the modules were checked by megacritic.config.validate: RECOMPUTE_MODULES)
    return dict(recompute_granularity="selective", recompute_modules=list(megatron.recompute_modules))


def transformer_config(model: ModelConfig, layout: ParallelLayout, *, dtype: torch.dtype, on_cpu: bool,
                       megatron: MegatronConfig | None = None) -> TransformerConfig:
    """Megatron's TransformerConfig for a Llama / Qwen2-shaped decoder (with MoE layers when
    model.num_experts is set) under the parallel ``layout``; ``megatron``: its activation recompute settings.
    Builds a config and changes nothing else (upstream patches are :func:`megacritic.compat.apply`'s)."""
    tp, pp, cp, ep, etp = layout.tp, layout.pp, layout.cp, layout.ep, layout.etp
    fused = model.use_fused_kernels and not on_cpu
    return TransformerConfig(
        num_layers=model.num_hidden_layers,
        hidden_size=model.hidden_size,
        ffn_hidden_size=model.intermediate_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_key_value_heads,
        kv_channels=head_dim(model),
        normalization="RMSNorm",
        layernorm_epsilon=model.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=model.attention_bias,
        # Qwen3's per-head query/key RMSNorm; also makes Megatron sum these norms' gradients over TP ranks
        # (each rank normalises only its own heads).
        qk_layernorm=model.qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=layout.vpp if layout.vpp > 1 else None,
        # Our attention implements it (megacritic.model.layers); Megatron only needs the size for its
        # pipeline shapes and gradient groups.
        context_parallel_size=cp,
        sequence_parallel=layout.sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=on_cpu,
        # (Megatron's embedding then looks rows up by indexing, whose backward has a deterministic kernel)
        deterministic_mode=megatron is not None and megatron.full_determinism,
        # Our weights come from megacritic.model.weights and overwrite these, but Megatron tags its
        # tensor-parallel weights (tensor_model_parallel, partition_dim) only while initialising them;
        # without the tags the grad norm would count every TP shard as a duplicate.
        perform_initialization=True,
        # Loss normalisation is global (megacritic.losses): Megatron must neither divide the loss by the
        # number of micro-batches nor average gradients over data-parallel ranks.
        calculate_per_token_loss=True,
        variable_seq_lengths=layout.variable_seq_lengths,
        # With two stages a rank's previous and next peer are the same rank; batched p2p (one
        # batch_isend_irecv) then lets the two directions' messages match the wrong receives. Plain
        # p2p ops are issued in a fixed even/odd order that pairs them correctly.
        batch_p2p_comm=not layout.fixed_micro_batch_shape,
        # megatron-core 0.16 rejects variable_seq_lengths unless this is set, even for dense models. For MoE
        # models it is the dispatcher that scales with expert parallelism; it runs on gloo too (all-to-all
        # with uneven splits).
        moe_token_dispatcher_type="alltoall",
        **moe_options(model, ep, etp),
        **recompute_options(megatron),
        # Megatron's SwiGLU autograd function (compiled) instead of eager chunk / silu / add / mul.
        bias_activation_fusion=fused,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        # Weight gradients accumulated inside the GEMM, where Megatron's layers can (apex, or the stand-in
        # megacritic.compat.apply installs for fused runs on CUDA).
        gradient_accumulation_fusion=fused and weight_grad_accumulation_available(),
    )


def norm_spec(fused: bool) -> ModuleSpec:
    return ModuleSpec(module=RMSNorm, params={"fused": fused})


def moe_spec(shared_expert: bool, fused: bool = False) -> ModuleSpec:
    """Megatron's MoELayer: top-k router, SequentialMLP experts (one SwiGLU MLP per local expert; ``fused``:
    run as grouped GEMMs on GPU) and, with ``shared_expert``, a shared expert with a sigmoid gate."""
    mlp = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    return ModuleSpec(module=MoELayer, submodules=MoESubmodules(
        experts=ModuleSpec(module=GroupedExperts, params={"grouped": fused}, submodules=mlp),
        shared_experts=ModuleSpec(module=SharedExpertMLP, submodules=mlp) if shared_expert else None))


def layer_spec(qk_layernorm: bool = False, moe: ModuleSpec | None = None, fused: bool = False,
               attention_impl: str = "auto") -> ModuleSpec:
    """A Llama / Qwen2 / Qwen3 decoder layer built from Megatron modules, with our attention and norm
    (also over each query and key head with ``qk_layernorm``); ``moe`` replaces the dense MLP; ``fused``:
    compiled norms and the Triton QKV split / RoPE on GPU; ``attention_impl``: model.attention_impl."""
    norm = norm_spec(fused)
    qk_norm = norm if qk_layernorm else IdentityOp
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=norm,
            self_attention=ModuleSpec(
                module=FusedQKVSelfAttention,
                params={"attn_mask_type": AttnMaskType.causal, "fused": fused},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=ColumnParallelLinear,
                    core_attention=ModuleSpec(module=CoreAttention, params={"attention_impl": attention_impl}),
                    linear_proj=RowParallelLinear,
                    q_layernorm=qk_norm,
                    k_layernorm=qk_norm,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=norm,
            mlp=moe or ModuleSpec(module=MLP, submodules=MLPSubmodules(
                linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)),
            mlp_bda=get_bias_dropout_add,
        ),
    )


def fused_mlp_runs(model: ModelConfig, config: TransformerConfig) -> bool:
    """Whether the dense MLPs take megacritic.model.mlp_kernel (model.fused_mlp): with the fused kernels on a
    GPU (use_fused_kernels), tensor-parallel size 1, on a GPU it runs on (with or without CUDA graphs: quack's
    GEMMs take the current stream and allocate their scratch per call, so a capture records them); else
    Megatron's MLP (logged where only the GPU or the install stands in the way)."""
    if not (model.fused_mlp and config.bias_activation_fusion and config.tensor_model_parallel_size == 1
            and not config.sequence_parallel):
        return False
    problem = mlp_kernel.gpu_problem()
    if problem:
        log.info("model.fused_mlp: Megatron's MLP instead (%s)", problem)
    return problem is None


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    """Megatron's vocab-parallel embedding needs a vocabulary divisible by TP; extra rows stay unused."""
    return -(-vocab_size // tp) * tp


class ValueModel(GPTModel):
    """GPTModel whose last stage ends in :class:`ValueHead`; ``forward`` returns values [b, s, 1] float32."""

    def __init__(self, config: TransformerConfig, model: ModelConfig, *, pre_process: bool, post_process: bool,
                 vp_stage: int | None):
        layers = get_num_layers_to_build(config, vp_stage=vp_stage)
        fused = config.bias_activation_fusion  # use_fused_kernels on GPU (transformer_config)
        offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
        impl = model.attention_impl
        dense = layer_spec(model.qk_layernorm, fused=fused, attention_impl=impl)
        moe = layer_spec(model.qk_layernorm, moe_spec(shared_expert_size(model) > 0, fused), fused=fused,
                         attention_impl=impl)
        pattern = moe_layer_pattern(model)[offset:offset + layers]
        spec = TransformerBlockSubmodules(layer_specs=[moe if p else dense for p in pattern],
                                          layer_norm=norm_spec(fused))
        # Llama 3 RoPE scaling: Megatron implements HF's llama3 formula with its constants fixed to
        # Llama 3.1's (config validation accepts no other values); only the factor is passed.
        scaling = model.rope_scaling
        super().__init__(
            config,
            spec,
            vocab_size=padded_vocab_size(model.vocab_size, config.tensor_model_parallel_size),
            max_sequence_length=model.max_position_embeddings,
            pre_process=pre_process,
            post_process=post_process,
            share_embeddings_and_output_weights=False,
            position_embedding_type="rope",
            rotary_base=model.rope_theta,
            rope_scaling=scaling is not None,
            rope_scaling_factor=float(scaling["factor"]) if scaling is not None else 8.0,
            vp_stage=vp_stage,
        )
        if pre_process:  # the embedding's weight gradient goes straight to DDP's buffer (megacritic.compat, 9)
            lookup_into_main_grad(self.embedding.word_embeddings)
        if fused_mlp_runs(model, config):  # the dense MLPs' SwiGLU inside their GEMMs (model.fused_mlp)
            mlp_kernel.use_fused_mlp(self.decoder, keep_activation=model.fused_mlp_keep_activation)
        if post_process:
            # GPTModel always builds a vocabulary projection; the critic swaps it for the value head
            # (the projection's memory is released here, before any optimizer state exists).
            self.output_layer = ValueHead(config, model.hidden_size)

    def forward(self, input_ids, position_ids, attention_mask, *args, packed_seq_params=None, **kwargs):
        """GPTModel's forward; for a packed micro-batch (a :class:`megacritic.packing.pack.Pack`) each
        token's rotary cos / sin, read from the table at its position within its rollout, travel with the
        pack to our self attention, which rotates queries and keys as it splits them out of the QKV
        projection (Megatron then applies no RoPE of its own: see ``_preprocess``)."""
        if packed_seq_params is not None:
            table = self.rotary_pos_emb(max(packed_seq_params.max_seqlen_q, packed_seq_params.max_seqlen_kv),
                                        packed_seq=True)  # [max_len, 1, 1, d] float32
            freqs = table[position_ids.reshape(-1), 0]  # [t, 1, d]
            dtype = self.config.params_dtype
            packed_seq_params = dataclasses.replace(packed_seq_params,
                                                    rotary=(freqs.cos().to(dtype), freqs.sin().to(dtype)))
        return super().forward(input_ids, position_ids, attention_mask, *args,
                               packed_seq_params=packed_seq_params, **kwargs)

    def _preprocess(self, input_ids, position_ids, decoder_input=None, inference_context=None,
                    packed_seq_params=None, padding_mask=None):
        """GPTModel's preprocessing; for a packed micro-batch without Megatron's rotary table (``forward``
        hands RoPE to our attention). A pack reaches Megatron as one [t, 1] sequence (megacritic.packing.micro_batches);
        announced as THD, Megatron neither sizes nor slices its table by context-parallel rank."""
        if packed_seq_params is None:
            return super()._preprocess(input_ids, position_ids, decoder_input=decoder_input,
                                       inference_context=inference_context, padding_mask=padding_mask)
        out = super()._preprocess(input_ids, position_ids, decoder_input=decoder_input,
                                  inference_context=inference_context,
                                  packed_seq_params=dataclasses.replace(packed_seq_params, qkv_format="thd"),
                                  padding_mask=padding_mask)
        return (out[0], None, *out[2:])


def build_value_model(model: ModelConfig, config: TransformerConfig,
                      chunk_roles: tuple[tuple[bool, bool], ...]) -> list[ValueModel]:
    """This rank's model chunks, one per virtual pipeline stage, weights uninitialised. ``chunk_roles``: per
    chunk, whether it holds the embedding and whether it holds the value head (:attr:`Ranks.chunk_roles`)."""
    vpp = config.virtual_pipeline_model_parallel_size or 1
    if len(chunk_roles) != vpp:
        raise ValueError(f"{len(chunk_roles)} chunk roles for {vpp} virtual pipeline stages")
    return [ValueModel(config, model, pre_process=first, post_process=last, vp_stage=stage if vpp > 1 else None)
            for stage, (first, last) in enumerate(chunk_roles)]
