"""verl's critic section as megacritic settings: every verl critic key is mapped, converted, logged as having
no effect on the critic, or refused by name (:func:`config_from_verl`). Pure: imports no verl (it reads
verl's config objects by their fields), so the mapping runs and is tested without verl installed."""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import logging
import os
from typing import Any, Callable, NamedTuple

from megacritic.config import ConfigError, CriticConfig
from megacritic.config.load import load_config

log = logging.getLogger(__name__)

class _Rule(NamedTuple):
    """How one verl critic setting reaches megacritic.

    kind: ``mapped`` (same meaning, value copied to ``target``), ``converted`` (different unit or spelling;
    ``convert`` gives megacritic's value), ``bookkeeping`` (no effect on the critic megacritic trains;
    logged), ``refused`` (megacritic lacks the feature: only the values in ``allowed``, which leave it off,
    are accepted)."""

    kind: str
    target: str | None = None
    convert: Callable[[Any], Any] | None = None
    allowed: tuple = ()
    why: str = ""


def _mapped(target: str) -> _Rule:
    return _Rule("mapped", target)


def _converted(target: str | None, convert: Callable[[Any], Any], why: str) -> _Rule:
    return _Rule("converted", target, convert, why=why)


def _bookkeeping(why: str) -> _Rule:
    return _Rule("bookkeeping", why=why)


def _refused(*allowed, why: str) -> _Rule:
    return _Rule("refused", allowed=allowed, why=why)


def _warmup_steps(value):
    # verl: None, 0 or negative -> use lr_warmup_steps_ratio; megacritic spells that -1 (0 = no warm-up).
    return -1 if value is None or value <= 0 else value


def _dtype(value):
    dtypes = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float32": "float32", "fp32": "float32"}
    if value not in dtypes:
        raise ConfigError(f"critic.megatron.dtype={value!r}: megacritic trains in bfloat16 or float32 "
                          f"(model.dtype); choose one of {sorted(dtypes)}")
    return dtypes[value]


def _attention_backend(value):
    if value not in ("flash", "auto"):
        raise ConfigError(f"critic.megatron.override_transformer_config.attention_backend={value!r}: megacritic's "
                          "attention is FlashAttention (model.attention_impl); use flash or auto")
    return "auto"


def _no_deprecated_micro_batch(value):
    if value is not None:
        raise ConfigError(f"critic.ppo_micro_batch_size={value!r}: the deprecated global micro-batch size is not "
                          "supported; set critic.ppo_micro_batch_size_per_gpu instead")


_INERT = "read only by a feature that is off (its switch is refused when on)"
_DERIVED = "derived by verl from critic.model.path (megacritic reads the folder itself)"
_COPIED = "copied by verl's trainer from the critic section's own batch keys (mapped there)"

# First match wins (fnmatch patterns over the dotted key inside the critic section).
_RULES: list[tuple[str, _Rule]] = [
    # ---- batches, epochs, loss (top level)
    ("ppo_mini_batch_size", _converted("ppo_mini_batch_size", None,
                                       "verl counts prompts: x rollout_n rollouts (also data.rollouts_per_step)")),
    ("rollout_n", _converted(None, None, "folded into ppo_mini_batch_size")),
    ("ppo_micro_batch_size", _converted(None, _no_deprecated_micro_batch, "deprecated; refused unless null")),
    ("ppo_micro_batch_size_per_gpu", _mapped("ppo_micro_batch_size_per_gpu")),
    ("ppo_infer_micro_batch_size_per_gpu", _mapped("forward_micro_batch_size_per_gpu")),
    ("use_dynamic_bsz", _mapped("use_dynamic_bsz")),
    ("ppo_max_token_len_per_gpu", _mapped("ppo_max_token_len_per_gpu")),
    ("forward_max_token_len_per_gpu", _mapped("forward_max_token_len_per_gpu")),
    # verl 0.9's engine reads this one for the forward pass (it wins over forward_max_token_len_per_gpu).
    ("ppo_infer_max_token_len_per_gpu", _mapped("forward_max_token_len_per_gpu")),
    ("ppo_epochs", _mapped("ppo_epochs")),
    ("shuffle", _mapped("shuffle")),
    ("data_loader_seed", _mapped("data_loader_seed")),
    ("cliprange_value", _mapped("cliprange_value")),
    ("loss_agg_mode", _mapped("loss_agg_mode")),
    ("loss_scale_factor", _mapped("loss_scale_factor")),
    ("nccl_timeout", _mapped("megatron.nccl_timeout")),
    ("load_weight", _refused(True, why="verl <= 0.7's switch for starting from model.path's weights; megacritic "
                                       "always does (its random start is a model without model.path)")),
    ("strategy", _bookkeeping("verl's choice of training engine; megacritic is the engine")),
    ("enable", _bookkeeping("verl's trainer switch for the critic")),
    ("_target_", _bookkeeping("verl's config class")),
    ("*._target_", _bookkeeping("verl's config class")),
    ("engine", _bookkeeping("verl's alias of the megatron section")),
    ("engine.*", _bookkeeping("verl's alias of the megatron section")),
    # ---- optimizer and LR schedule
    ("optim.lr", _mapped("optim.lr")),
    ("optim.min_lr", _mapped("optim.min_lr")),
    ("optim.weight_decay", _mapped("optim.weight_decay")),
    ("optim.betas", _mapped("optim.betas")),
    ("optim.clip_grad", _mapped("optim.clip_grad")),
    ("optim.lr_decay_style", _mapped("optim.lr_decay_style")),
    ("optim.lr_warmup_steps_ratio", _mapped("optim.lr_warmup_steps_ratio")),
    ("optim.lr_warmup_steps", _converted("optim.lr_warmup_steps", _warmup_steps,
                                         "verl's None/0/negative (use the ratio) is megacritic's -1")),
    ("optim.total_training_steps", _converted("optim.total_training_steps", lambda v: -1 if v is None else v,
                                              "counts update calls (optim.schedule_unit=call), as in verl")),
    ("optim.optimizer", _refused("adam", why="megacritic's optimizer is Megatron's Adam")),
    ("optim.grad_clip", _converted("optim.clip_grad", None, "verl's deprecated spelling of clip_grad (null: unset)")),
    ("optim.use_layer_wise_param_layout", _refused(None, False, why="not implemented")),
    ("optim.lr_decay_steps", _refused(None, why="megacritic decays over optim.total_training_steps")),
    ("optim.lr_warmup_init", _refused(0.0, 0, why="megacritic's warm-up starts at lr 0")),
    ("optim.weight_decay_incr_style", _refused("constant", why="megacritic keeps weight decay constant")),
    ("optim.lr_wsd_*", _bookkeeping(_INERT + " (lr_decay_style=WSD)")),
    ("optim.use_checkpoint_opt_param_scheduler", _refused(False, why="megacritic's checkpoints always restore "
                                                                     "the schedule")),
    ("optim.use_precision_aware_optimizer", _refused(False, why="not implemented")),
    ("optim.main_grads_dtype", _refused("fp32", "float32", why="megacritic reduces gradients in float32")),
    ("optim.exp_avg_dtype", _refused("fp32", "float32", why="megacritic keeps Adam state in float32")),
    ("optim.exp_avg_sq_dtype", _refused("fp32", "float32", why="megacritic keeps Adam state in float32")),
    ("optim.use_layer_wise_distributed_optimizer", _refused(False, why="not implemented")),
    ("optim.muon_*", _bookkeeping(_INERT + " (optimizer=muon)")),
    ("optim.override_optimizer_config", _refused({}, None, why="Megatron optimizer overrides are not "
                                                                "implemented")),
    ("optim.override_optimizer_config.*", _refused({}, None, why="Megatron optimizer overrides are not implemented")),
    # ---- Megatron layout and engine
    ("megatron.tensor_model_parallel_size", _mapped("megatron.tensor_model_parallel_size")),
    ("megatron.pipeline_model_parallel_size", _mapped("megatron.pipeline_model_parallel_size")),
    ("megatron.virtual_pipeline_model_parallel_size", _mapped("megatron.virtual_pipeline_model_parallel_size")),
    ("megatron.context_parallel_size", _mapped("megatron.context_parallel_size")),
    ("megatron.expert_model_parallel_size", _mapped("megatron.expert_model_parallel_size")),
    ("megatron.expert_tensor_parallel_size", _mapped("megatron.expert_tensor_parallel_size")),
    ("megatron.sequence_parallel", _mapped("megatron.sequence_parallel")),
    ("megatron.use_distributed_optimizer", _mapped("megatron.use_distributed_optimizer")),
    ("megatron.param_offload", _mapped("megatron.param_offload")),
    ("megatron.optimizer_offload", _mapped("megatron.optimizer_offload")),
    ("megatron.grad_offload", _mapped("megatron.grad_offload")),
    ("megatron.seed", _mapped("megatron.seed")),
    ("megatron.full_determinism", _mapped("megatron.full_determinism")),
    ("megatron.dtype", _converted("model.dtype", _dtype, "megacritic's model.dtype")),
    ("megatron.override_transformer_config.recompute_granularity", _mapped("megatron.recompute_granularity")),
    ("megatron.override_transformer_config.recompute_method", _mapped("megatron.recompute_method")),
    ("megatron.override_transformer_config.recompute_num_layers", _mapped("megatron.recompute_num_layers")),
    ("megatron.override_transformer_config.recompute_modules", _mapped("megatron.recompute_modules")),
    ("megatron.override_transformer_config.attention_backend",
     _converted("model.attention_impl", _attention_backend, "flash/auto: megacritic's FlashAttention (auto)")),
    ("megatron.override_transformer_config", _refused({}, None, why="no other transformer overrides")),
    ("megatron.override_transformer_config.*", _refused({}, None, why="megacritic builds the transformer config from "
                                                            "the model; no other overrides are implemented")),
    ("megatron.override_ddp_config", _refused({}, None, why="DDP overrides are not implemented")),
    ("megatron.override_ddp_config.*", _refused({}, None, why="DDP overrides are not implemented")),
    ("megatron.override_mcore_model_config", _refused({}, None, why="model overrides are not implemented")),
    ("megatron.override_mcore_model_config.*", _refused({}, None, why="model overrides are not implemented")),
    ("megatron.use_dist_checkpointing", _refused(False, why="loading verl's Megatron dist checkpoints is not "
                                                            "implemented (megacritic loads Hugging Face folders "
                                                            "and its own checkpoints)")),
    ("megatron.dist_checkpointing_path", _bookkeeping(_INERT + " (use_dist_checkpointing)")),
    ("megatron.dist_checkpointing_prefix", _bookkeeping(_INERT + " (use_dist_checkpointing)")),
    ("megatron.dist_ckpt_optim_fully_reshardable", _bookkeeping("verl's checkpoint format; megacritic's "
                                                                "checkpoints reshard over any layout")),
    ("megatron.distrib_optim_fully_reshardable_mem_efficient", _bookkeeping("verl's checkpoint format")),
    ("megatron.dynamic_context_parallel", _refused(False, why="not implemented")),
    ("megatron.max_seqlen_per_dp_cp_rank", _bookkeeping(_INERT + " (dynamic_context_parallel)")),
    ("megatron.entropy_from_logits_*", _bookkeeping("actor-only (entropy of the policy)")),
    ("megatron.use_mbridge", _bookkeeping("verl's Hugging Face weight converter; megacritic has its own")),
    ("megatron.vanilla_mbridge", _bookkeeping("verl's Hugging Face weight converter; megacritic has its own")),
    ("megatron.use_remove_padding", _bookkeeping("verl's engine overwrites it with critic.model.use_remove_padding "
                                                 "(mapped there)")),
    ("megatron.pad_bshd_to_minibatch_max", _bookkeeping("padding of verl's own padded micro-batches (speed only)")),
    ("megatron.pad_to_length", _bookkeeping("padding of verl's own micro-batches (speed only)")),
    ("megatron.pad_to_length_bucket", _bookkeeping("padding of verl's own micro-batches (speed only)")),
    ("megatron.use_megatron_fsdp", _refused(False, why="Megatron-FSDP is not implemented")),
    ("megatron.forward_only", _refused(False, why="the critic trains")),
    ("megatron.router_replay.mode", _refused("disabled", why="router replay is not implemented")),
    ("megatron.router_replay.*", _bookkeeping(_INERT + " (router_replay.mode)")),
    ("megatron.qat.enable", _refused(False, why="quantisation-aware training is not implemented")),
    ("megatron.qat.*", _bookkeeping(_INERT + " (qat.enable)")),
    ("megatron.strategy", _bookkeeping("verl's engine name")),
    ("megatron.use_dynamic_bsz", _bookkeeping(_COPIED)),
    ("megatron.max_token_len_per_gpu", _bookkeeping(_COPIED)),
    ("megatron.micro_batch_size_per_gpu", _bookkeeping(_COPIED)),
    ("megatron.infer_max_token_len_per_gpu", _bookkeeping(_COPIED)),
    ("megatron.infer_micro_batch_size_per_gpu", _bookkeeping(_COPIED)),
    ("megatron.use_fused_kernels", _bookkeeping("copied by verl from critic.model.use_fused_kernels")),
    # ---- model
    ("model.path", _converted("model.path", lambda v: os.path.expanduser(v) if isinstance(v, str) else v,
                              "a local Hugging Face folder (~ expanded)")),
    ("model.local_path", _converted("model.path", None, "verl's local copy of model.path wins when set")),
    ("model.use_remove_padding", _mapped("model.use_remove_padding")),
    ("model.hf_config_path", _refused(None, "${model.path}", why="megacritic reads config.json from model.path")),
    ("model.external_lib", _refused(None, why="megacritic builds its own value model (7 Hugging Face families)")),
    ("model.override_config", _refused({}, None, why="Hugging Face config overrides are not implemented")),
    ("model.override_config.moe_config.freeze_moe_router", _mapped("model.freeze_moe_router")),
    ("model.override_config.*", _refused({}, None, why="Hugging Face config overrides are not implemented")),
    ("model.enable_activation_offload", _refused(False, why="activation offload is not implemented")),
    ("model.lora_rank", _refused(0, why="LoRA is not implemented")),
    ("model.lora_adapter_path", _refused(None, why="LoRA is not implemented")),
    ("model.lora_alpha", _bookkeeping(_INERT + " (lora_rank)")),
    ("model.target_modules", _bookkeeping(_INERT + " (lora_rank)")),
    ("model.target_parameters", _bookkeeping(_INERT + " (lora_rank)")),
    ("model.exclude_modules", _bookkeeping(_INERT + " (lora_rank)")),
    ("model.lora.rank", _refused(0, why="LoRA is not implemented")),
    ("model.lora.adapter_path", _refused(None, why="LoRA is not implemented")),
    ("model.lora", _bookkeeping(_INERT + " (lora.rank)")),
    ("model.lora.*", _bookkeeping(_INERT + " (lora.rank)")),
    ("model.use_liger", _refused(False, why="Liger kernels are not implemented")),
    ("model.tiled_mlp.enabled", _refused(False, why="tiled MLP is not implemented")),
    ("model.tiled_mlp.*", _bookkeeping(_INERT + " (tiled_mlp.enabled)")),
    ("model.mtp.enable", _refused(False, why="multi-token prediction is not implemented")),
    ("model.mtp.*", _bookkeeping(_INERT + " (mtp.enable)")),
    ("model.enable_gradient_checkpointing", _bookkeeping("not read by verl's Megatron engine (recompute comes "
                                                         "from megatron.override_transformer_config, mapped)")),
    ("model.use_fused_kernels", _bookkeeping("verl's fused log-prob/entropy kernels (actor-only); megacritic's "
                                             "own model.use_fused_kernels keeps its default")),
    ("model.fused_kernel_options.*", _bookkeeping("verl's fused log-prob/entropy kernels (actor-only)")),
    ("model.fused_kernel_options", _bookkeeping("verl's fused log-prob/entropy kernels (actor-only)")),
    ("model.tokenizer_path", _bookkeeping("the critic reads token ids, not text")),
    ("model.local_tokenizer_path", _bookkeeping("the critic reads token ids, not text")),
    ("model.load_tokenizer", _bookkeeping("the critic reads token ids, not text")),
    ("model.tokenizer", _bookkeeping("the critic reads token ids, not text")),
    ("model.processor", _bookkeeping("the critic reads token ids, not text")),
    ("model.custom_chat_template", _bookkeeping("the critic reads token ids, not text")),
    ("model.trust_remote_code", _bookkeeping("megacritic builds its own model from config.json (no remote code)")),
    ("model.use_shm", _bookkeeping("verl's copy of the model to shared memory (loading speed only)")),
    ("model.local_hf_config_path", _bookkeeping(_DERIVED)),
    ("model.hf_config", _bookkeeping(_DERIVED)),
    ("model.generation_config", _bookkeeping(_DERIVED)),
    ("model.architectures", _bookkeeping(_DERIVED)),
    ("model.model_type", _bookkeeping("verl's role name of the model (value_model)")),
    # ---- checkpoints and profiling
    ("checkpoint.save_contents", _refused(["model", "optimizer", "extra"], why="megacritic's checkpoints always "
                                                                              "hold model, optimizer and state")),
    ("checkpoint.load_contents", _refused(["model", "optimizer", "extra"], why="megacritic's checkpoints always "
                                                                              "restore model, optimizer and state")),
    ("checkpoint.strict", _bookkeeping("validation of verl's Hugging Face weight export")),
    ("checkpoint.save_lora_only", _bookkeeping(_INERT + " (LoRA)")),
    ("checkpoint.async_save", _refused(False, why="asynchronous saving is not implemented")),
    ("checkpoint.mbridge_config", _refused({}, None, why="verl's Hugging Face weight converter options")),
    ("checkpoint.mbridge_config.*", _refused({}, None, why="verl's Hugging Face weight converter options")),
    ("profiler.enable", _refused(False, None, why="verl's profiler does not reach megacritic (start_profile is a "
                                                   "no-op); use overrides trainer.profile_steps")),
    ("profiler", _bookkeeping(_INERT + " (profiler.enable)")),
    ("profiler.*", _bookkeeping(_INERT + " (profiler.enable)")),
]


def verl_rule(key: str) -> _Rule | None:
    """The rule for a dotted key of verl's critic section (None: unknown to megacritic)."""
    for pattern, rule in _RULES:
        if fnmatch.fnmatchcase(key, pattern):
            return rule
    return None


def _plain(node):
    """verl's config (a DictConfig, a dict, or verl's config dataclasses) as nested plain dicts; objects that
    are neither (a transformers config, a tokenizer) stay leaves."""
    from omegaconf import DictConfig, ListConfig, OmegaConf
    if isinstance(node, (DictConfig, ListConfig)):
        return OmegaConf.to_container(node, resolve=True)
    # verl's own config classes are walked; other dataclasses (transformers' config) are one value.
    if (dataclasses.is_dataclass(node) and not isinstance(node, type)
            and type(node).__module__.startswith(("verl.", "megacritic.integrations.verl"))):
        return {f.name: _plain(getattr(node, f.name)) for f in dataclasses.fields(node)}
    if isinstance(node, dict):
        return {k: _plain(v) for k, v in node.items()}
    if isinstance(node, (list, tuple)):
        return [_plain(v) for v in node]
    return node


def verl_leaves(section) -> dict[str, Any]:
    """Every leaf of a verl critic section by dotted key (an empty mapping is a leaf of its own)."""
    out: dict[str, Any] = {}

    def walk(prefix: str, node):
        if isinstance(node, dict) and node:
            for k, v in node.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        else:
            out[prefix] = node
    walk("", _plain(section))
    return out


def config_from_verl(section, rollout_n: int | None = None) -> list[str]:
    """megacritic overrides (``dotted.key=value``) equivalent to verl's ``critic`` section.

    ``section``: the critic section as verl has it (an OmegaConf DictConfig, a dict, or verl's
    ``McoreCriticConfig``). ``rollout_n``: responses per prompt (``actor_rollout_ref.rollout.n``, verl 0.9's
    factor); defaults to the section's own ``rollout_n`` (verl <= 0.8's). verl's ``ppo_mini_batch_size``
    counts prompts and becomes x rollout_n rollouts; the LR schedule advances once per update call
    (``optim.schedule_unit=call``), as in verl.
    Settings without effect on the critic are logged; a setting whose effect megacritic lacks raises
    :class:`ConfigError` naming it. Put megacritic-only settings after these overrides."""
    leaves = verl_leaves(section)
    n = leaves.get("rollout_n", 1) if rollout_n is None else rollout_n
    if rollout_n is not None and leaves.get("rollout_n", rollout_n) != rollout_n:
        # verl 0.9's trainer multiplies by actor_rollout_ref.rollout.n, which the caller passes here.
        log.warning("critic.rollout_n=%s differs from rollout_n=%s; using %s", leaves["rollout_n"], rollout_n,
                    rollout_n)
    if not isinstance(n, int) or n < 1:
        raise ConfigError(f"critic.rollout_n={n!r}: must be a positive integer (responses per prompt)")
    out: dict[str, Any] = {"optim.schedule_unit": "call"}
    bookkeeping, unknown = [], []
    # The forward budget of verl 0.9's engine is ppo_infer_max_token_len_per_gpu when the section has it.
    ordered = sorted(leaves, key=lambda k: k in ("ppo_infer_max_token_len_per_gpu", "model.local_path",
                                                  "optim.grad_clip"))
    for key in ordered:
        value, rule = leaves[key], verl_rule(key)
        if rule is None:
            unknown.append(key)
        elif rule.kind == "bookkeeping":
            bookkeeping.append(key)
        elif rule.kind == "refused":
            # "${model.path}": the value verl's own config class fills in from model.path
            if value not in [leaves.get("model.path") if a == "${model.path}" else a for a in rule.allowed]:
                accepted = " or ".join(json.dumps(a) for a in rule.allowed) or "nothing"
                raise ConfigError(f"critic.{key}={value!r}: {rule.why}; megacritic accepts only {accepted} here")
        elif key == "ppo_mini_batch_size":
            out["ppo_mini_batch_size"] = out["data.rollouts_per_step"] = value * n
        elif key == "model.local_path" and value is None:
            continue
        elif key in ("ppo_infer_micro_batch_size_per_gpu", "optim.grad_clip") and value is None:
            continue
        else:
            value = rule.convert(value) if rule.convert else value
            if rule.target is not None:
                out[rule.target] = value
    if unknown:
        raise ConfigError(f"critic.{unknown[0]}: a verl critic setting megacritic does not know (all unknown: "
                          f"{', '.join(unknown)}); remove it, or pass its megacritic counterpart as an override")
    if bookkeeping:
        log.info("verl critic settings with no effect on megacritic's critic, ignored: %s", ", ".join(bookkeeping))
    return [f"{k}={json.dumps(v)}" for k, v in out.items()]


def dotted(settings, prefix: str = "") -> list[str]:
    """A nested mapping of megacritic settings (``{"model": {"attention_impl": "fa2"}}``, as hydra builds it
    from ``+critic.megacritic.model.attention_impl=fa2``) as ``dotted.key=value`` overrides."""
    out = []
    for key, value in _plain(settings).items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out += dotted(value, f"{name}.")
        else:
            out.append(f"{name}={json.dumps(value)}")
    return out


def critic_config_from_verl(section, rollout_n: int | None = None, overrides=()) -> CriticConfig:
    """:func:`config_from_verl`'s overrides, then ``overrides`` (megacritic's own keys), loaded and validated."""
    return load_config(config_from_verl(section, rollout_n) + list(overrides))
