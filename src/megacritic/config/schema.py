"""The configuration schema: one dataclass per section, and the checks a config must pass.

Key names follow verl's critic config (``ppo_mini_batch_size``, ``megatron.tensor_model_parallel_size``,
``optim.lr`` ...) so verl users keep their settings (a verl critic section itself goes through
:func:`megacritic.integrations.verl.config_from_verl`). The library reads the top level and
the ``model``, ``megatron`` and ``optim`` sections; ``data``, ``algorithm`` and ``trainer`` are settings of the
``megacritic train`` job, checked by :mod:`megacritic.train_loop`. :func:`validate` is pure: no I/O,
nothing mutated; the checks that need the world size are made by :class:`~megacritic.parallel.ParallelLayout`,
which also holds what is derived from the degrees. Each failure is a
:class:`ConfigError` naming the dotted key, the value received and the fix. Loading (defaults < base < YAML <
overrides, then the Hugging Face config of ``model.path``) lives in :mod:`megacritic.config.load`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
ATTENTION_IMPLS = ("auto", "fa4", "fa2", "sdpa")
RECOMPUTE_GRANULARITIES = ("selective", "full")
RECOMPUTE_METHODS = ("uniform", "block")
# Megatron's selective-recompute modules that work with our layer spec: our core attention is recomputed
# through Megatron's own checkpoint of core_attn (its inputs are q / k / v, the pack travels by closure).
# Not these: moe_act needs Megatron's grouped GEMM (Transformer Engine), which our GroupedExperts replace;
# layernorm goes through megatron-core 0.16.1's CheckpointWithoutOutput, which calls Transformer Engine's
# FP8 state even without FP8 (its ``fp8 is not None`` is true for the default fp8=False): NameError.
RECOMPUTE_MODULES = ("core_attn", "mlp", "moe", "shared_experts")
SCHEDULE_UNITS = ("step", "call")
LR_DECAY_STYLES = ("constant", "linear", "cosine")
DTYPES = ("auto", "float32", "bfloat16")
MOMENT_DTYPES = ("float32", "bfloat16")  # optim.exp_avg_dtype, optim.exp_avg_sq_dtype
VALUE_HEAD_INITS = ("normal", "zeros", "from_checkpoint")
DENSE_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
MOE_MODEL_TYPES = ("qwen2_moe", "qwen3_moe", "mixtral")
MODEL_TYPES = DENSE_MODEL_TYPES + MOE_MODEL_TYPES
# Megatron-Core's Llama 3 RoPE scaling takes only the factor; these are its fixed constants.
LLAMA3_ROPE_CONSTANTS = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


class ConfigError(ValueError):
    """A setting is invalid or incompatible with another; raised before anything is built."""


@dataclass
class ModelConfig:
    """Architecture of the value model (Llama / Qwen2 / Qwen3 / Mistral family, and the mixture-of-experts
    Qwen2-MoE / Qwen3-MoE / Mixtral; names as in a Hugging Face config.json)."""

    path: Optional[str] = None
    """Local Hugging Face model folder (config.json and safetensors, sharded or not) to start from. Its
    config.json defines the architecture: loading fills every unset field below from it (a field set here
    to a different value is an error, as is anything in it the value model cannot honour) and the weights
    are read from it. Unset: the architecture set below, with seeded random weights."""
    model_type: Optional[str] = None
    """Hugging Face family: llama, qwen2, qwen3, mistral, qwen2_moe, qwen3_moe or mixtral; filled from
    model.path. Without a path it only names the family of an exported checkpoint (unset, dense: qwen3 with
    qk_layernorm, qwen2 with attention_bias, else llama; with experts: qwen2_moe with a shared expert,
    qwen3_moe with qk_layernorm, else mixtral)."""
    # The architecture. Unset (None) means unset: with model.path, config.json's value; without one, the
    # first seven fields must be set (presets.TINY_MODEL is the embedded tiny critic) and the others take
    # the default given in their docstring (ARCHITECTURE_DEFAULTS).
    vocab_size: Optional[int] = None
    """Token ids the embedding holds."""
    hidden_size: Optional[int] = None
    """Width of the residual stream."""
    intermediate_size: Optional[int] = None
    """FFN (SwiGLU) inner size of the dense layers."""
    num_hidden_layers: Optional[int] = None
    """Transformer layers."""
    num_attention_heads: Optional[int] = None
    """Query heads."""
    num_key_value_heads: Optional[int] = None
    """Key/value heads (GQA query groups); equal to num_attention_heads for plain multi-head attention."""
    max_position_embeddings: Optional[int] = None
    """Longest rollout (prompt + response tokens) the model's positions cover."""
    head_dim: Optional[int] = None
    """Per-head size; unset: hidden_size // num_attention_heads."""
    rope_theta: Optional[float] = None
    """RoPE base; unset without model.path: 10000."""
    rope_scaling: Optional[Dict[str, Any]] = None
    """RoPE frequency scaling in Hugging Face's form; unset: none. Supported: Llama 3's {rope_type: llama3,
    factor: F, low_freq_factor: 1, high_freq_factor: 4, original_max_position_embeddings: 8192} (the
    constants Megatron-Core's RoPE scaling implements); anything else is an error."""
    rms_norm_eps: Optional[float] = None
    """Epsilon of every RMSNorm; unset without model.path: 1e-6."""
    attention_bias: Optional[bool] = None
    """Bias on the Q, K and V projections (Qwen2 has it, Llama does not); unset without model.path: true."""
    qk_layernorm: Optional[bool] = None
    """RMSNorm over each query and key head before RoPE (Qwen3); unset without model.path: false."""
    tie_word_embeddings: Optional[bool] = None
    """Whether the language model ties its output projection to the embedding. The critic has no output
    projection, so this does not change values; it is carried into exported checkpoints. Unset without
    model.path: false."""
    init_std: float = 0.02
    """Std of the seeded normal initialisation of every weight matrix (norms start at 1, biases at 0)."""
    value_head_init: str = "normal"
    """How the value head starts: normal (seeded, std value_head_init_std, bias 0), zeros, or
    from_checkpoint (the one-label `score` head of a *ForTokenClassification / *ForSequenceClassification
    reward model at model.path, or an lm_head with a single row)."""
    value_head_init_std: float = 0.02
    """Std of the value head's weight at initialisation (its bias starts at 0)."""
    dtype: str = "auto"
    """Parameter and compute dtype: float32, bfloat16, or auto (bfloat16 on GPU, float32 on CPU)."""
    num_experts: Optional[int] = None
    """Routed experts per mixture-of-experts (MoE) layer (Mixtral's num_local_experts); None or 0: a dense
    model. Each MoE layer is Megatron-Core's MoELayer: a softmax top-k router, the experts (one grouped GEMM
    per projection on GPU with model.use_fused_kernels in bf16, else one GEMM per expert), no token
    dropping, no router jitter or z-loss."""
    num_experts_per_tok: Optional[int] = None
    """Experts each token is routed to (top-k); unset without model.path: 2."""
    moe_intermediate_size: Optional[int] = None
    """FFN inner size of each routed expert; unset: intermediate_size."""
    shared_expert_intermediate_size: Optional[int] = None
    """FFN inner size of the shared expert that every token also goes through, its output scaled by a
    sigmoid gate (Qwen2-MoE); None or 0: none."""
    norm_topk_prob: Optional[bool] = None
    """Renormalise the top-k routing weights to sum to 1. False (Qwen2-MoE / Qwen3-MoE default): softmax
    over all experts, then the top-k of those probabilities. True: softmax over the top-k logits (Mixtral
    always does this). Unset without model.path: false."""
    decoder_sparse_step: Optional[int] = None
    """Layer i (from 0) is an MoE layer when (i + 1) is a multiple of this and i is not in mlp_only_layers;
    the other layers are dense (intermediate_size). Unset without model.path: 1."""
    mlp_only_layers: Optional[list] = None
    """Indices of layers that stay dense whatever decoder_sparse_step says; unset without model.path: none."""
    moe_aux_loss_coeff: float = 0.0
    """Coefficient of the router's load-balancing loss (Switch-Transformer style, per MoE layer and
    micro-batch). 0 (the default) leaves it off, as suits a critic; a nonzero value adds coeff x that loss,
    weighted by each micro-batch's tokens over the mini-batch's real tokens, to the value loss (it trains
    the routers and the layers below them), and critic/moe_aux_loss reports it (mean over MoE layers and
    micro-batches, without the coefficient). Padding is left out of it."""
    freeze_moe_router: bool = False
    """Keep every router's weights fixed (not trained, no optimizer state)."""
    use_remove_padding: bool = True
    """Pack each micro-batch's rollouts into one sequence without padding (THD, varlen attention on GPU).
    False pads every rollout of a micro-batch to the longest one instead."""
    use_fused_kernels: bool = True
    """On GPU: RMSNorm as one Triton kernel each way (megacritic.model.norm_kernel; compiled by torch.compile
    where Triton does not import), the QKV projection's bias, split into heads and RoPE as one Triton kernel
    each way, SwiGLU as one Triton kernel each way (megacritic.model.swiglu_kernel), the fused CUDA AdamW
    kernel and, for mixture-of-experts models in bf16, each expert projection as one grouped GEMM, instead of their
    eager / multi-tensor / per-expert versions (same arithmetic, fewer kernels and passes over memory;
    figures in bench/NOTES.md). No effect on CPU."""
    fused_mlp: bool = True
    """With use_fused_kernels on a Hopper GPU: each dense MLP's SwiGLU inside its GEMMs
    (megacritic.model.mlp_kernel, quack's GEMMs: the ``megacritic[hopper]`` extra): fc1 and the activation as
    one GEMM, the activation's derivative inside fc2's input-gradient GEMM, where the activation is recomputed
    instead of kept (less activation memory). compute_values -10% at 1.5B and 3B, update_critic -2% at 1.5B on
    an H100 (bench/NOTES.md). The activation is taken from fc1's float32 accumulator instead of its bf16
    rounding: outputs agree with Megatron's MLP within bf16 rounding. Megatron's MLP instead with tensor
    parallelism, float32, or where quack or the GPU is not there (logged). Also inside cuda_graphs' captures.
    No effect on CPU."""
    fused_mlp_keep_activation: bool = True
    """With fused_mlp: keep each MLP's activation from the forward (``[tokens, intermediate_size]`` per layer
    and micro-batch, in the compute dtype: ~8 GB at 1.5B and ~13 GB at 3B for a 16,384-token micro-batch)
    for fc2's weight gradient, so that the epilogue of fc2's input-gradient GEMM writes one output instead of
    two: that GEMM -21% at 1.5B (131 -> 103 ms per update on an H100; bench/NOTES.md). False recomputes the
    activation there instead (less activation memory). Kept, fc2's weight gradient uses the activation the
    forward used (from fc1's float32 accumulator); recomputed, one from the bf16 pre-activation. In a
    recomputed layer the activation is kept only until that layer's backward. No effect where fused_mlp
    does not run."""
    attention_impl: str = "auto"
    """Attention kernel of packed micro-batches on GPU: fa4 (FlashAttention-4, ``flash_attn.cute``, Hopper and
    Blackwell; the ``megacritic[hopper]`` extra), fa2 (FlashAttention-2 through torch's ``varlen_attn``), sdpa
    (one ``scaled_dot_product_attention`` call per rollout), or auto (fa4 where it is importable and the GPU
    supports it, else fa2). Padded micro-batches and CPU runs always use SDPA. The choice made is reported
    in the bench rows."""
    cuda_graphs: bool = False
    """Replay the decoder layers as CUDA graphs: every packed micro-batch is padded (a trailing dummy rollout
    that carries no loss) to one of a few lengths (``cuda_graph_pack_multiple``), and the decoder's forward
    (and backward) at that length run as one graph launch each instead of thousands of kernel launches.
    Pays where the host cannot queue kernels as fast as the GPU runs them (bench/NOTES.md); the padding is
    computed but not counted. Needs packed micro-batches with a token budget (use_remove_padding,
    use_dynamic_bsz), one pipeline stage, tensor and context parallel size 1, a dense model, no activation
    recompute and no parameter or gradient offload. A pack of more than ``cuda_graph_max_rollouts`` rollouts runs
    eagerly. Graph memory: the activations of the longest pack, kept for the process. On the CPU (tests) the
    captured calls are re-run instead of replayed."""
    cuda_graph_max_rollouts: int = 64
    """With cuda_graphs: the most rollouts of a pack the graphs take (the attention kernel's boundary table
    has this many slots; the unused ones are empty sequences)."""
    cuda_graph_pack_multiple: int = 1024
    """With cuda_graphs: each pack is padded to the next multiple of this many tokens (at most the token
    budget), and each such length gets its graphs at its first use (all sharing one memory pool: the
    graphs never run at the same time). Smaller: less padding, more graphs to capture (each a few warm-up
    passes, once per process)."""


@dataclass
class MegatronConfig:
    """Parallel layout and Megatron-Core options (verl's ``critic.megatron`` section)."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: Optional[int] = None
    """Model chunks per pipeline rank (interleaved schedule); None or 1 for none."""
    context_parallel_size: int = 1
    """Context parallelism: each packed rollout is split over this many ranks (2 x CP chunks, rank r
    holding chunks r and 2 x CP - 1 - r), for long sequences whose activations do not fit one GPU. Needs
    model.use_remove_padding=true. Each attention layer all-gathers the keys and values of the whole
    micro-batch from its CP group. Token budgets stay per GPU: a micro-batch holds up to CP x
    ppo_max_token_len_per_gpu (forward_max_token_len_per_gpu) tokens, as in verl. World size = TP x PP x
    CP x DP."""
    sequence_parallel: bool = True
    """Sequence parallelism; takes effect whenever tensor_model_parallel_size > 1."""
    use_distributed_optimizer: bool = True
    """Shard optimizer state over data-parallel ranks (ZeRO-1)."""
    param_offload: bool = False
    """Keep parameters in pinned host memory between calls (GPU only), so a colocated rollout engine can
    use the device memory; compute_values brings back only these. Host memory: 2 bytes per parameter of
    this rank (bf16), 4 in float32."""
    grad_offload: bool = False
    """Release the gradient buffers between calls (they are re-created, zeroed, at the next update)."""
    optimizer_offload: bool = False
    """Keep optimizer state (fp32 main parameters and Adam moments) in pinned host memory between calls;
    only update_critic brings it back. With float32 parameters the main parameters are the model's own,
    and move with param_offload. Host memory: 12 bytes per parameter of this rank's optimizer shard
    (8 with float32 parameters), pinned."""
    expert_model_parallel_size: int = 1
    """Expert parallelism (MoE models): the routed experts of each layer are split over this many ranks,
    taken from the data-parallel ranks (it must divide world size / (tensor x pipeline parallel)); tokens
    reach their experts through Megatron's all-to-all token dispatcher."""
    expert_tensor_parallel_size: Optional[int] = None
    """Tensor parallelism inside each routed expert; None: the same as tensor_model_parallel_size
    (Megatron's default). 1 keeps experts whole, so with TP > 1 the TP ranks act as expert data-parallel
    replicas."""
    seed: int = 42
    """Seed of the weight initialisation (identical for every parallel layout)."""
    full_determinism: bool = False
    """Bit-identical results from run to run on the same machine and layout (verl's key): torch's deterministic
    algorithms only (an operation that has none is an error naming it; cuBLAS gets the fixed workspace it
    needs), deterministic FlashAttention backward passes (a fixed order of the query-gradient accumulation),
    Megatron's deterministic_mode (its embedding lookup by indexing) and, when NCCL_ALGO is unset, NCCL's ring
    algorithm. Slower (the attention backward most); for debugging, parity runs and the recovery checks."""
    nccl_timeout: int = 600
    """Seconds a collective may wait before the job fails with an error instead of hanging (every process
    group, gloo included)."""
    timing_level: int = 0
    """Megatron's timers behind the timing_s/* metrics beyond step and data: 0 off (the default: no metric
    timing_s/forward_backward, grad_reduce or optimizer); 1 the schedule (forward_backward), gradient
    reduction (grad_reduce) and optimizer step (optimizer), each timer synchronising the device at its
    start and stop (18 waits per step: 55 ms of waiting per 1.5B update_critic on an H200, bench/NOTES.md);
    2 also forward / backward compute and pipeline transfer waits (pipeline_wait), synchronising around
    every micro-batch."""
    recompute_granularity: Optional[str] = None
    """Megatron's activation recompute (verl's override_transformer_config.recompute_granularity): None (off),
    selective (recompute recompute_modules inside each layer in the backward pass) or full (recompute whole
    layers, per recompute_method / recompute_num_layers). Trades compute for activation memory; values and
    gradients are unchanged."""
    recompute_method: Optional[str] = None
    """With recompute_granularity=full: uniform (groups of recompute_num_layers layers, only each group's input
    kept) or block (the first recompute_num_layers layers of each pipeline stage recomputed)."""
    recompute_num_layers: Optional[int] = None
    """With recompute_granularity=full: layers per group (uniform) or per stage (block)."""
    recompute_modules: list = field(default_factory=lambda: ["core_attn"])
    """With recompute_granularity=selective: the submodules recomputed (Megatron's names: core_attn, mlp,
    layernorm, moe_act, shared_experts, moe)."""
    optimizer_cpu_offload: bool = False
    """Megatron's CPU optimizer (hybrid device optimizer): the fp32 main parameters and Adam state of
    optimizer_offload_fraction of the parameters live and are stepped in host memory, so bigger critics fit
    one GPU (each step copies gradients to the host and parameters back). Different from optimizer_offload,
    which only parks the state on the host between calls."""
    optimizer_offload_fraction: float = 1.0
    """Share of the parameters whose optimizer runs on the host with optimizer_cpu_offload (0 to 1]."""
    expandable_segments: bool = False
    """GPU only: PyTorch's caching allocator grows its memory segments in place (``expandable_segments``)
    instead of reserving new fixed-size ones, so micro-batches of changing lengths do not fragment device
    memory into reserved blocks no allocation fits. Set when the critic is built, for the whole process (a
    model colocated in it too); off, PYTORCH_CUDA_ALLOC_CONF decides. A 7B critic on one H200 runs out of
    memory without it (bench/NOTES.md)."""


@dataclass
class OptimConfig:
    """Optimizer (Megatron's Adam) and LR schedule (Megatron's OptimizerParamScheduler)."""

    lr: float = 2e-3
    """Peak learning rate. The default suits the embedded tiny model; billion-parameter critics use ~1e-5."""
    min_lr: float = 0.0
    """Final LR of linear / cosine decay."""
    weight_decay: float = 0.01
    betas: list = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    clip_grad: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    lr_warmup_steps: int = -1
    """Warm-up optimizer steps; -1 means use lr_warmup_steps_ratio."""
    lr_warmup_steps_ratio: float = 0.0
    """Warm-up as a fraction of total_training_steps (used when lr_warmup_steps is -1)."""
    lr_decay_style: str = "constant"
    """constant, linear or cosine (decay from lr to min_lr over total_training_steps)."""
    total_training_steps: int = -1
    """Steps (in schedule_unit) the schedule spans. -1 (unset) serves only a constant schedule without
    warm-up; ``megacritic train`` sets it from trainer.steps when it is -1."""
    schedule_unit: str = "step"
    """What advances the LR schedule: step (every optimizer step; total_training_steps and lr_warmup_steps
    count optimizer steps) or call (every update_critic call, as verl's critic does; they count calls)."""
    exp_avg_dtype: str = "float32"
    """Dtype in which Adam's first moment is kept between steps (verl's optim.exp_avg_dtype): float32, or
    bfloat16 (2 bytes per parameter less; opt-in, it changes the numerics). A step still computes in float32
    and rounds the moment once when storing it (megacritic.optim.AdamWLowPrecisionMoments); the main
    parameters stay float32. Both moments in bfloat16 take a bf16 critic under the distributed optimizer
    from 18 to 14 bytes of training state per parameter (a 7B critic with its optimizer on one H200:
    bench/NOTES.md)."""
    exp_avg_sq_dtype: str = "float32"
    """Dtype in which Adam's second moment is kept between steps (verl's optim.exp_avg_sq_dtype): float32 or
    bfloat16, as exp_avg_dtype."""


@dataclass
class DataConfig:
    """Rollouts of ``megacritic train``: a Parquet / JSONL file, or the embedded synthetic task (see
    megacritic.data.sources and the README's schema). Read and checked by the CLI only."""

    path: Optional[str] = None
    """Rollout file (.parquet or .jsonl; rows of prompt_ids, response_ids, token_rewards or score, optional
    values). Unset: the embedded synthetic task, whose returns are given directly."""
    rollouts_per_step: int = 64
    """Rollouts per PPO iteration (the train batch); a file is read in seeded shuffled passes of such
    batches (data_loader_seed), the remainder of each pass left out."""
    prompt_length: list = field(default_factory=lambda: [4, 16])
    """Inclusive range of real prompt lengths; prompts are left-padded to the upper bound."""
    response_length: list = field(default_factory=lambda: [4, 32])
    """Inclusive range of real response lengths; responses are right-padded to the upper bound."""


@dataclass
class AlgorithmConfig:
    """Advantage estimation for rollout files (verl's ``algorithm`` section); read by the CLI only."""

    gamma: float = 1.0
    """Discount of GAE."""
    lam: float = 1.0
    """GAE lambda; returns = advantages + values (with lam = gamma = 1: the reward-to-go)."""


@dataclass
class TrainerConfig:
    """The ``megacritic train`` job: its length, outputs, checkpoints; read and checked by the CLI only."""

    steps: int = 60
    """PPO iterations: each draws a rollout batch, computes values, then updates the critic."""
    output_dir: str = "outputs/default"
    """Where metrics.jsonl is written."""
    save_every: int = 0
    """Save a checkpoint to <output_dir>/checkpoints every this many iterations, and at the end; 0: never."""
    resume: bool = False
    """Continue from the newest intact checkpoint in <output_dir>/checkpoints (if there is one)."""
    progress: bool = True
    """Show a progress bar (rank 0 only)."""
    max_consecutive_skips: int = 10
    """Stop with an error after this many optimizer steps in a row were skipped for non-finite loss or
    gradients (each skip keeps the weights and is counted in critic/skipped_steps)."""
    tensorboard: bool = True
    """Also write the metrics as TensorBoard events to <output_dir>/tensorboard (rank 0 only)."""
    profile_steps: list = field(default_factory=list)
    """Iterations (1-based, as counted by steps) to record with the PyTorch profiler: one Chrome trace per
    iteration and rank in <output_dir>/profile (open in Perfetto or chrome://tracing)."""


@dataclass
class CriticConfig:
    """Everything one critic run needs. Batch sizes count sequences (rollouts), not tokens."""

    ppo_mini_batch_size: int = 16
    """Sequences per optimizer step, over all data-parallel ranks."""
    ppo_micro_batch_size_per_gpu: Optional[int] = 4
    """Sequences per micro-batch per GPU when use_dynamic_bsz is false."""
    forward_micro_batch_size_per_gpu: Optional[int] = None
    """Sequences per micro-batch in compute_values; defaults to ppo_micro_batch_size_per_gpu."""
    use_dynamic_bsz: bool = False
    """Form micro-batches by a token budget (Karmarkar-Karp balanced) instead of a fixed count."""
    ppo_max_token_len_per_gpu: Optional[int] = None
    """Token budget of a training micro-batch per GPU (use_dynamic_bsz); with context parallelism a
    micro-batch holds up to megatron.context_parallel_size times as many, 1/CP of them on each GPU."""
    forward_max_token_len_per_gpu: Optional[int] = None
    """Token budget of a compute_values micro-batch; defaults to ppo_max_token_len_per_gpu."""
    ppo_epochs: int = 1
    """Passes over each rollout batch in update_critic."""
    shuffle: bool = True
    """Shuffle the rollout batch (with data_loader_seed) before splitting it into mini-batches."""
    data_loader_seed: Optional[int] = 1
    """Seed of the mini-batch shuffle and of the embedded synthetic data."""
    cliprange_value: float = 0.5
    """Predicted values are clipped to old_values +- cliprange_value in the value loss."""
    loss_agg_mode: str = "token-mean"
    """token-mean | token-sum | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm, aggregated
    over the whole mini-batch (all micro-batches and data-parallel ranks)."""
    loss_scale_factor: Optional[float] = None
    """verl's divisor of seq-mean-token-sum-norm (each rollout's token sum / this); None: the batch's response
    width. Only that mode reads it."""
    model: ModelConfig = field(default_factory=ModelConfig)
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


# Without model.path these must be set: they are the model's size, with no default that could be right.
REQUIRED_ARCHITECTURE = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                         "num_attention_heads", "num_key_value_heads", "max_position_embeddings")
# What the other architecture fields mean when left unset without model.path (with a path: config.json).
ARCHITECTURE_DEFAULTS = {
    "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "attention_bias": True, "qk_layernorm": False,
    "tie_word_embeddings": False, "num_experts_per_tok": 2, "norm_topk_prob": False, "decoder_sparse_step": 1,
    "mlp_only_layers": [],
}


def with_defaults(model: ModelConfig) -> ModelConfig:
    """A new ModelConfig whose unset fields of ARCHITECTURE_DEFAULTS hold their defaults."""
    unset = {key: (list(value) if isinstance(value, list) else value)
             for key, value in ARCHITECTURE_DEFAULTS.items() if getattr(model, key) is None}
    return dataclasses.replace(model, **unset)


def to_dict(config: CriticConfig) -> dict:
    return dataclasses.asdict(config)


def fail(key: str, value, fix: str):
    """Raise the ConfigError of setting ``key`` (which may name where it was read) holding ``value``."""
    raise ConfigError(f"{key}={value!r}: {fix}")


def positive(key: str, value):
    if value is None or value < 1:
        fail(key, value, "must be a positive integer")


def head_dim(model: ModelConfig) -> int:
    return model.head_dim or model.hidden_size // model.num_attention_heads


def is_moe(model: ModelConfig) -> bool:
    return bool(model.num_experts)


def moe_layer_pattern(model: ModelConfig) -> list[int]:
    """1 for each MoE layer, 0 for each dense one (Hugging Face's decoder_sparse_step / mlp_only_layers rule;
    Megatron's moe_layer_freq list)."""
    if not is_moe(model):
        return [0] * model.num_hidden_layers
    dense = set(model.mlp_only_layers or ())
    return [int(i not in dense and (i + 1) % model.decoder_sparse_step == 0) for i in range(model.num_hidden_layers)]


def expert_ffn_size(model: ModelConfig) -> int:
    return model.moe_intermediate_size or model.intermediate_size


def shared_expert_size(model: ModelConfig) -> int:
    """FFN size of the shared expert; 0 for none."""
    return model.shared_expert_intermediate_size or 0


def hf_family(model: ModelConfig) -> str:
    """The Hugging Face family whose tensor names the model uses (model.model_type, else inferred)."""
    if model.model_type:
        return model.model_type
    if is_moe(model):
        return "qwen2_moe" if shared_expert_size(model) else "qwen3_moe" if model.qk_layernorm else "mixtral"
    return "qwen3" if model.qk_layernorm else "qwen2" if model.attention_bias else "llama"


def _check_moe(m: ModelConfig, mg: "MegatronConfig") -> None:
    ep, etp, tp = mg.expert_model_parallel_size, mg.expert_tensor_parallel_size, mg.tensor_model_parallel_size
    positive("megatron.expert_model_parallel_size", ep)
    if etp is not None:
        positive("megatron.expert_tensor_parallel_size", etp)
    if not is_moe(m):
        if m.num_experts is not None and m.num_experts < 0:
            fail("model.num_experts", m.num_experts,
                 "must be a positive number of experts, or null/0 for a dense model")
        for key, value, off in (("megatron.expert_model_parallel_size", ep, 1),
                                ("megatron.expert_tensor_parallel_size", etp, None),
                                ("model.moe_aux_loss_coeff", m.moe_aux_loss_coeff, 0.0),
                                ("model.freeze_moe_router", m.freeze_moe_router, False)):
            if value != off:
                fail(key, value, "applies only to mixture-of-experts models (set model.num_experts)")
        return
    positive("model.num_experts", m.num_experts)
    if not 1 <= m.num_experts_per_tok <= m.num_experts:
        fail("model.num_experts_per_tok", m.num_experts_per_tok, f"must lie in [1, model.num_experts={m.num_experts}]")
    if m.num_experts_per_tok == 1 and m.norm_topk_prob:
        fail("model.num_experts_per_tok", 1, "with norm_topk_prob=true every token's weight is exactly 1, which "
             "Megatron-Core's top-1 router cannot express (it needs the softmax over all experts); use top-k >= 2")
    if m.moe_intermediate_size is not None:
        positive("model.moe_intermediate_size", m.moe_intermediate_size)
    if m.shared_expert_intermediate_size is not None and m.shared_expert_intermediate_size < 0:
        fail("model.shared_expert_intermediate_size", m.shared_expert_intermediate_size,
             "must be positive, or null/0 for none")
    positive("model.decoder_sparse_step", m.decoder_sparse_step)
    for i in m.mlp_only_layers or ():
        if not isinstance(i, int) or not 0 <= i < m.num_hidden_layers:
            fail("model.mlp_only_layers", list(m.mlp_only_layers),
                 f"must list layer indices in [0, model.num_hidden_layers={m.num_hidden_layers})")
    if not m.moe_aux_loss_coeff >= 0:
        fail("model.moe_aux_loss_coeff", m.moe_aux_loss_coeff, "must be non-negative (0 leaves it off)")
    if m.num_experts % ep:
        fail("megatron.expert_model_parallel_size", ep, f"must divide model.num_experts ({m.num_experts})")
    if expert_ffn_size(m) % (etp or tp):
        key = "megatron.expert_tensor_parallel_size" if etp else "megatron.tensor_model_parallel_size"
        fail(key, etp or tp, f"must divide the experts' FFN size (model.moe_intermediate_size, {expert_ffn_size(m)}); "
             "megatron.expert_tensor_parallel_size sets the experts' own split")
    if shared_expert_size(m) % tp:
        fail("megatron.tensor_model_parallel_size", tp,
             f"must divide model.shared_expert_intermediate_size ({shared_expert_size(m)})")
    if tp > 1 and not mg.sequence_parallel:
        fail("megatron.sequence_parallel", False, "Megatron-Core's MoE layers need sequence parallelism whenever "
             "tensor_model_parallel_size > 1; set it to true")
    if ep == 1 and etp is not None and etp != tp:
        fail("megatron.expert_tensor_parallel_size", etp,
             f"differs from tensor_model_parallel_size ({tp}) without expert parallelism: megatron-core then "
             "treats the experts as dense parameters and never reduces their gradients over the ranks that "
             "share them; leave it null (= TP) or set megatron.expert_model_parallel_size > 1")


def check_rope_scaling(rope_scaling, key: str = "model.rope_scaling") -> None:
    """Megatron-Core's RoPE scaling is Llama 3's with fixed constants: the one rule for model.rope_scaling
    and for a config.json's rope_parameters (``key`` names where the dict was read)."""
    if rope_scaling is None:
        return
    kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
    if kind != "llama3":
        fail(f"{key}.rope_type", kind, "only llama3 RoPE scaling is supported (or none)")
    known = {"rope_type", "type", "factor", *LLAMA3_ROPE_CONSTANTS}
    for name in rope_scaling:
        if name not in known:
            fail(f"{key}.{name}", rope_scaling[name], "is not part of llama3 RoPE scaling; remove it")
    factor = rope_scaling.get("factor")
    if not isinstance(factor, (int, float)) or factor < 1:
        fail(f"{key}.factor", factor, "must be a number >= 1")
    for name, value in LLAMA3_ROPE_CONSTANTS.items():
        if rope_scaling.get(name) != value:
            fail(f"{key}.{name}", rope_scaling.get(name),
                 f"Megatron-Core's llama3 RoPE scaling fixes it at {value} (as in Llama 3.1-3.3)")


def _check_architecture(m: ModelConfig) -> None:
    missing = [f"model.{key}" for key in REQUIRED_ARCHITECTURE if getattr(m, key) is None]
    if missing:
        raise ConfigError(f"{', '.join(missing)}: unset; set model.path (a Hugging Face model folder) or the whole "
                          "architecture (megacritic.config.presets.TINY_MODEL is the embedded tiny critic)")
    unset = [f"model.{key}" for key in ARCHITECTURE_DEFAULTS if getattr(m, key) is None]
    if unset:
        raise ConfigError(f"{', '.join(unset)}: unset; set them, or build the config with load_config (which "
                          "fills them from model.path or their documented defaults)")
    for key in REQUIRED_ARCHITECTURE:
        positive(f"model.{key}", getattr(m, key))


def _check_lr_schedule(o: "OptimConfig") -> None:
    if o.schedule_unit not in SCHEDULE_UNITS:
        fail("optim.schedule_unit", o.schedule_unit, f"choose one of {', '.join(SCHEDULE_UNITS)}")
    if o.lr_decay_style not in LR_DECAY_STYLES:
        fail("optim.lr_decay_style", o.lr_decay_style, f"choose one of {', '.join(LR_DECAY_STYLES)}")
    if not 0 <= o.lr_warmup_steps_ratio <= 1:
        fail("optim.lr_warmup_steps_ratio", o.lr_warmup_steps_ratio, "must lie in [0, 1]")
    if o.lr_warmup_steps < -1:
        fail("optim.lr_warmup_steps", o.lr_warmup_steps, "must be -1 (use the ratio) or non-negative")
    total = o.total_training_steps
    if total == 0 or total < -1:
        fail("optim.total_training_steps", total, "must be a positive number of steps, or -1 (unset)")
    warms_up = o.lr_warmup_steps > 0 or (o.lr_warmup_steps == -1 and o.lr_warmup_steps_ratio > 0)
    if total == -1 and (warms_up or o.lr_decay_style != "constant"):
        fail("optim.total_training_steps", total,
             f"a {o.lr_decay_style} schedule{' with warm-up' if warms_up else ''} needs its length: set the "
             f"{o.schedule_unit}s it spans (megacritic train sets it from trainer.steps)")
    warmup = o.lr_warmup_steps if o.lr_warmup_steps >= 0 else int(o.lr_warmup_steps_ratio * total)
    if total > 0 and warmup >= total:
        fail("optim.lr_warmup_steps", warmup,
             f"the warm-up must be shorter than the schedule (optim.total_training_steps={total} "
             f"{'update_critic calls' if o.schedule_unit == 'call' else 'optimizer steps'})")


def _check_cuda_graphs(config: CriticConfig) -> None:
    """model.cuda_graphs replays one fixed-shape micro-batch at a time through one model chunk."""
    m, mg = config.model, config.megatron
    positive("model.cuda_graph_max_rollouts", m.cuda_graph_max_rollouts)
    positive("model.cuda_graph_pack_multiple", m.cuda_graph_pack_multiple)
    why = None
    if not m.use_remove_padding:
        why = "needs packed micro-batches: set model.use_remove_padding=true"
    elif not config.use_dynamic_bsz:
        why = ("pads every pack to the token budget: set use_dynamic_bsz=true with ppo_max_token_len_per_gpu "
               "(and forward_max_token_len_per_gpu)")
    elif mg.pipeline_model_parallel_size > 1 or (mg.virtual_pipeline_model_parallel_size or 1) > 1:
        why = "needs megatron.pipeline_model_parallel_size=1 (a pipeline keeps several micro-batches in flight)"
    elif mg.tensor_model_parallel_size > 1 or mg.context_parallel_size > 1:
        why = "needs megatron.tensor_model_parallel_size=1 and megatron.context_parallel_size=1"
    elif is_moe(m):
        why = "needs a dense model (mixture-of-experts layers route a varying number of tokens to each expert)"
    elif mg.recompute_granularity is not None:
        why = "cannot be combined with activation recompute (megatron.recompute_granularity)"
    elif mg.param_offload or mg.grad_offload:
        why = ("cannot be combined with megatron.param_offload or megatron.grad_offload (the graphs read the "
               "parameters and write the gradient buffers at the device addresses they had at capture)")
    if why:
        fail("model.cuda_graphs", True, why)


def validate(config: CriticConfig) -> None:
    """Every check of the library's settings that does not need the world size; pure (no I/O, nothing
    changed). Raises ConfigError on the first problem. The ``megacritic train`` settings (data.*,
    algorithm.*, trainer.*) are the CLI's to check (megacritic.train_loop.job_config)."""
    m, mg, o = config.model, config.megatron, config.optim

    _check_architecture(m)
    if m.num_attention_heads % m.num_key_value_heads:
        fail("model.num_key_value_heads", m.num_key_value_heads,
             f"must divide model.num_attention_heads ({m.num_attention_heads})")
    if m.head_dim is None and m.hidden_size % m.num_attention_heads:
        fail("model.hidden_size", m.hidden_size,
             f"must be a multiple of model.num_attention_heads ({m.num_attention_heads}), or set model.head_dim")
    if m.head_dim is not None and (m.head_dim < 2 or m.head_dim % 2):
        fail("model.head_dim", m.head_dim, "must be an even positive integer (rotary embeddings)")
    if m.dtype not in DTYPES:
        fail("model.dtype", m.dtype, f"choose one of {', '.join(DTYPES)}")
    if m.init_std <= 0 or m.value_head_init_std < 0:
        fail("model.init_std", m.init_std, "must be positive (value_head_init_std non-negative)")
    if m.value_head_init not in VALUE_HEAD_INITS:
        fail("model.value_head_init", m.value_head_init, f"choose one of {', '.join(VALUE_HEAD_INITS)}")
    if m.value_head_init == "from_checkpoint" and m.path is None:
        fail("model.value_head_init", m.value_head_init, "needs model.path (a reward model with a score head)")
    if m.model_type is not None and m.model_type not in MODEL_TYPES:
        fail("model.model_type", m.model_type, f"choose one of {', '.join(MODEL_TYPES)}")
    check_rope_scaling(m.rope_scaling)

    tp, pp, vpp = mg.tensor_model_parallel_size, mg.pipeline_model_parallel_size, mg.virtual_pipeline_model_parallel_size
    positive("megatron.tensor_model_parallel_size", tp)
    positive("megatron.pipeline_model_parallel_size", pp)
    cp = mg.context_parallel_size
    positive("megatron.context_parallel_size", cp)
    if cp > 1 and not m.use_remove_padding:
        fail("megatron.context_parallel_size", cp, "context parallelism splits packed micro-batches: set "
             "model.use_remove_padding=true (or context_parallel_size=1)")
    if cp > 1 and is_moe(m):
        fail("megatron.context_parallel_size", cp, "context parallelism is not supported with mixture-of-experts "
             "models (model.num_experts) yet; use 1")
    if m.num_attention_heads % tp:
        fail("megatron.tensor_model_parallel_size", tp,
             f"must divide model.num_attention_heads ({m.num_attention_heads})")
    if m.num_key_value_heads % tp:
        fail("megatron.tensor_model_parallel_size", tp,
             f"must divide model.num_key_value_heads ({m.num_key_value_heads}), the query groups")
    if m.intermediate_size % tp and 0 in moe_layer_pattern(m):
        fail("megatron.tensor_model_parallel_size", tp,
             f"must divide model.intermediate_size ({m.intermediate_size})")
    _check_moe(m, mg)
    if vpp is not None and vpp > 1:
        if pp < 2:
            fail("megatron.virtual_pipeline_model_parallel_size", vpp,
                 "needs megatron.pipeline_model_parallel_size >= 2; set it to null")
        if m.num_hidden_layers % (pp * vpp):
            fail("megatron.virtual_pipeline_model_parallel_size", vpp,
                 f"pipeline_model_parallel_size x virtual_pipeline_model_parallel_size ({pp} x {vpp}) "
                 f"must divide model.num_hidden_layers ({m.num_hidden_layers})")
    elif vpp is not None and vpp < 1:
        fail("megatron.virtual_pipeline_model_parallel_size", vpp, "must be null or a positive integer")
    if m.num_hidden_layers % pp:
        fail("megatron.pipeline_model_parallel_size", pp,
             f"must divide model.num_hidden_layers ({m.num_hidden_layers})")
    positive("megatron.nccl_timeout", mg.nccl_timeout)
    if mg.timing_level not in (0, 1, 2):
        fail("megatron.timing_level", mg.timing_level, "choose 0 (off), 1 (per step) or 2 (per micro-batch)")

    positive("ppo_mini_batch_size", config.ppo_mini_batch_size)
    positive("ppo_epochs", config.ppo_epochs)
    if config.use_dynamic_bsz:
        if config.ppo_max_token_len_per_gpu is None:
            fail("ppo_max_token_len_per_gpu", None, "use_dynamic_bsz=true needs a token budget per GPU")
        positive("ppo_max_token_len_per_gpu", config.ppo_max_token_len_per_gpu)
        if config.forward_max_token_len_per_gpu is not None:
            positive("forward_max_token_len_per_gpu", config.forward_max_token_len_per_gpu)
    else:
        if config.ppo_micro_batch_size_per_gpu is None:
            fail("ppo_micro_batch_size_per_gpu", None,
                 "set a micro-batch size, or use_dynamic_bsz=true with ppo_max_token_len_per_gpu")
        positive("ppo_micro_batch_size_per_gpu", config.ppo_micro_batch_size_per_gpu)
        if config.forward_micro_batch_size_per_gpu is not None:
            positive("forward_micro_batch_size_per_gpu", config.forward_micro_batch_size_per_gpu)
    if config.shuffle and config.data_loader_seed is None:
        fail("data_loader_seed", None, "shuffle=true needs a seed (or set shuffle=false)")
    if not config.cliprange_value > 0:
        fail("cliprange_value", config.cliprange_value, "must be positive")
    if config.loss_agg_mode not in LOSS_AGG_MODES:
        fail("loss_agg_mode", config.loss_agg_mode, f"choose one of {', '.join(LOSS_AGG_MODES)}")
    if config.loss_scale_factor is not None and not config.loss_scale_factor > 0:
        fail("loss_scale_factor", config.loss_scale_factor, "must be positive, or null (the response width)")
    if m.attention_impl not in ATTENTION_IMPLS:
        fail("model.attention_impl", m.attention_impl, f"choose one of {', '.join(ATTENTION_IMPLS)}")
    if m.cuda_graphs:
        _check_cuda_graphs(config)
    if mg.recompute_granularity is not None:
        if mg.recompute_granularity not in RECOMPUTE_GRANULARITIES:
            fail("megatron.recompute_granularity", mg.recompute_granularity,
                 f"choose one of {', '.join(RECOMPUTE_GRANULARITIES)}, or null (off)")
        if mg.recompute_granularity == "full":
            if mg.recompute_method not in RECOMPUTE_METHODS:
                fail("megatron.recompute_method", mg.recompute_method,
                     f"recompute_granularity=full needs one of {', '.join(RECOMPUTE_METHODS)}")
            positive("megatron.recompute_num_layers", mg.recompute_num_layers)
        else:
            modules = list(mg.recompute_modules)
            if not modules or any(module not in RECOMPUTE_MODULES for module in modules):
                raise ConfigError(
                    f"megatron.recompute_modules={modules}: with recompute_granularity=selective choose from "
                    f"{', '.join(RECOMPUTE_MODULES)} (without Transformer Engine, Megatron cannot recompute "
                    "layernorm or moe_act alone; mlp and moe recompute the blocks they feed)")
    if not 0 < mg.optimizer_offload_fraction <= 1:
        fail("megatron.optimizer_offload_fraction", mg.optimizer_offload_fraction, "must lie in (0, 1]")
    if mg.optimizer_cpu_offload and not mg.use_distributed_optimizer:
        raise ConfigError("megatron.optimizer_cpu_offload=true needs megatron.use_distributed_optimizer=true "
                          "(Megatron's hybrid device optimizer runs inside its distributed optimizer)")
    if mg.optimizer_cpu_offload and mg.optimizer_offload:
        raise ConfigError("megatron.optimizer_offload=true and megatron.optimizer_cpu_offload=true both move the "
                          "optimizer state to the host: choose one (optimizer_cpu_offload keeps it there)")

    if not o.lr > 0:
        fail("optim.lr", o.lr, "must be positive")
    if not 0 <= o.min_lr <= o.lr:
        fail("optim.min_lr", o.min_lr, f"must lie in [0, optim.lr={o.lr}]")
    if o.weight_decay < 0:
        fail("optim.weight_decay", o.weight_decay, "must be non-negative")
    if len(o.betas) != 2 or not all(0 <= b < 1 for b in o.betas):
        fail("optim.betas", o.betas, "must be two numbers in [0, 1)")
    if o.clip_grad < 0:
        fail("optim.clip_grad", o.clip_grad, "must be non-negative (0 disables clipping)")
    for key in ("exp_avg_dtype", "exp_avg_sq_dtype"):
        if getattr(o, key) not in MOMENT_DTYPES:
            fail(f"optim.{key}", getattr(o, key), f"choose one of {', '.join(MOMENT_DTYPES)}")
        if getattr(o, key) != "float32" and mg.optimizer_cpu_offload:
            fail(f"optim.{key}", getattr(o, key), "Megatron's CPU optimizer (megatron.optimizer_cpu_offload) keeps "
                 "its Adam state in float32: set one of them back")
    _check_lr_schedule(o)
