"""Hugging Face config.json <-> :class:`~megacritic.config.ModelConfig`.

transformers' ``AutoConfig`` reads config.json, because it knows each family's defaults and turns every
generation of config.json (``rope_theta`` + ``rope_scaling``, or ``rope_parameters``) into one form.

Families: llama (incl. Llama 3 RoPE scaling), qwen2, qwen3 (QK-norm), mistral, and the mixture-of-experts
qwen2_moe (shared expert), qwen3_moe and mixtral. Every field of their config classes is either mapped onto
:class:`~megacritic.config.ModelConfig`, checked to hold a value the value model computes exactly, or listed
as inert below; any other (a field a newer transformers adds, or a checkpoint feature we cannot honour) is a
:class:`~megacritic.config.ConfigError` naming the field.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
from pathlib import Path

import torch

from megacritic.config.schema import (LLAMA3_ROPE_CONSTANTS, MOE_MODEL_TYPES, ConfigError, ModelConfig,
                                      check_rope_scaling, expert_ffn_size, fail, head_dim, hf_family, is_moe,
                                      moe_layer_pattern, shared_expert_size)
from megacritic.hf.safetensors_reader import SafetensorsFolder, value_head_names

FAMILIES = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral",
            "qwen2_moe": "Qwen2Moe", "qwen3_moe": "Qwen3Moe", "mixtral": "Mixtral"}

# Family config fields that change neither the values nor a training step of the critic, and why.
INERT_FIELDS = {
    "initializer_range": "initialises weights, which come from the checkpoint",
    "use_cache": "generation only",
    "bos_token_id": "tokenizer metadata",
    "eos_token_id": "tokenizer metadata",
    # HF freezes the padding_idx embedding row; padding never reaches our model (it is removed first).
    "pad_token_id": "tokenizer metadata",
    "pretraining_tp": "splits matmuls in older transformers, numerically the same product",
    "max_window_layers": "only places sliding-window layers, which layer_types then lists (and we check)",
    "output_router_logits": "only adds router logits (and their loss) to *ForCausalLM outputs",
    # The language model's training setting. HF's *ForTokenClassification never adds it; the critic's own
    # is model.moe_aux_loss_coeff (default 0), which an export without model.path writes here.
    "router_aux_loss_coef": "the language model's training setting; the critic's is model.moe_aux_loss_coeff",
}
# Family config fields mapped or checked by hf_model_fields.
MAPPED_FIELDS = {
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_parameters",
    "tie_word_embeddings", "attention_bias", "hidden_act", "mlp_bias", "attention_dropout",
    "sliding_window", "use_sliding_window", "layer_types",
    # mixture of experts
    "num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
    "shared_expert_intermediate_size", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "qkv_bias",
    "router_jitter_noise",
}


def _in_file(path: str, field: str) -> str:
    """How a ConfigError names a field of model.path's config.json."""
    return f"model.path={path!r}: config.json {field}"



# ------------------------------------------------------------------------------------------------ config


def read_hf_config(path: str):
    """The transformers config of the folder at ``path`` (local files only)."""
    folder = Path(path)
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ConfigError(f"model.path={path!r}: no config.json there (need a local Hugging Face model folder)")
    raw = json.loads(config_file.read_text())
    model_type = raw.get("model_type")
    if model_type not in FAMILIES:
        fail(_in_file(path, "model_type"), model_type, f"supported families are {', '.join(FAMILIES)}")
    if "quantization_config" in raw:
        fail(_in_file(path, "quantization_config"), raw["quantization_config"],
             "quantized checkpoints are not supported; use a bf16 / fp32 one")
    from transformers import AutoConfig
    try:
        return AutoConfig.from_pretrained(str(folder), local_files_only=True)
    except (ValueError, TypeError) as exc:  # transformers' own validation of the file
        raise ConfigError(f"model.path={path!r}: transformers rejects config.json: {exc}") from None


def _family_fields(cfg) -> set[str]:
    """Fields declared by the family's config class (not by PreTrainedConfig)."""
    from transformers import PreTrainedConfig
    fields: set[str] = set()
    for klass in type(cfg).__mro__:
        if klass is PreTrainedConfig or klass is object:
            break
        fields |= set(inspect.get_annotations(klass))
    return fields


def _rope(cfg, path: str) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling in ModelConfig's form) from the normalised ``rope_parameters``."""
    params = dict(getattr(cfg, "rope_parameters", None) or {})
    theta = params.pop("rope_theta", None)
    kind = params.pop("rope_type", None) or params.pop("type", None) or "default"
    if theta is None:
        fail(_in_file(path, "rope_parameters.rope_theta"), None, "the RoPE base is missing")
    partial = params.pop("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        fail(_in_file(path, "partial_rotary_factor"), partial, "partial rotary embeddings are not supported")
    if kind == "default":
        for key, value in params.items():
            fail(_in_file(path, f"rope_parameters.{key}"), value, "not a parameter of plain RoPE; remove it")
        return float(theta), None
    if kind == "llama3":
        scaling = {"rope_type": "llama3", **params}
        check_rope_scaling(scaling, _in_file(path, "rope_parameters"))
        return float(theta), scaling
    fail(_in_file(path, "rope_parameters.rope_type"), kind,
         "supported RoPE types (rope_parameters, or rope_scaling in older files) are default and llama3")


def hf_model_fields(cfg, path: str) -> dict:
    """ModelConfig fields for transformers config ``cfg``; ConfigError for anything we cannot honour."""
    model_type = cfg.model_type
    unknown = _family_fields(cfg) - MAPPED_FIELDS - set(INERT_FIELDS)
    if unknown:
        field = sorted(unknown)[0]
        fail(_in_file(path, field), getattr(cfg, field, None),
             "megacritic does not know whether this field changes the model; it cannot honour it")
    if cfg.hidden_act != "silu":
        fail(_in_file(path, "hidden_act"), cfg.hidden_act, "the value model's MLP is SwiGLU (silu)")
    if getattr(cfg, "mlp_bias", False):
        fail(_in_file(path, "mlp_bias"), True, "MLP biases are not supported")
    if getattr(cfg, "attention_dropout", 0.0):
        fail(_in_file(path, "attention_dropout"), cfg.attention_dropout, "dropout is not supported; set it to 0.0")
    if model_type == "qwen2":
        qkv_bias = True  # Qwen2 always has Q/K/V biases (and no output-projection bias)
    elif model_type == "qwen2_moe":
        qkv_bias = bool(cfg.qkv_bias)  # Q/K/V only, as in Qwen2
    else:
        qkv_bias = False
        if getattr(cfg, "attention_bias", False):
            fail(_in_file(path, "attention_bias"), True,
                 f"in {model_type} it also adds an o_proj bias, which the value model does not have")
    sliding = [t for t in (getattr(cfg, "layer_types", None) or []) if t != "full_attention"]
    if sliding:
        fail(_in_file(path, "layer_types"), sliding[0], "only full attention is supported (sliding window is used)")
    # qwen2(_moe) place sliding windows through layer_types (checked above); these apply theirs to every layer.
    window = getattr(cfg, "sliding_window", None) if model_type in ("mistral", "mixtral", "qwen3_moe") else None
    if window is not None and window < cfg.max_position_embeddings:
        fail(_in_file(path, "sliding_window"), window,
             f"a window shorter than max_position_embeddings ({cfg.max_position_embeddings}) changes "
             "attention; only full attention is supported")
    theta, rope_scaling = _rope(cfg, path)
    fields = dict(
        model_type=model_type,
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads or cfg.num_attention_heads,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_theta=theta,
        rope_scaling=rope_scaling,
        rms_norm_eps=float(cfg.rms_norm_eps),
        attention_bias=qkv_bias,
        qk_layernorm=model_type in ("qwen3", "qwen3_moe"),
        tie_word_embeddings=bool(cfg.tie_word_embeddings),
    )
    fields.update(_moe_fields(cfg, path))
    return fields


def _moe_fields(cfg, path: str) -> dict:
    """ModelConfig's MoE fields for a qwen2_moe / qwen3_moe / mixtral config (no experts for dense families)."""
    model_type = cfg.model_type
    if model_type not in MOE_MODEL_TYPES:
        return {"num_experts": None}
    if model_type == "mixtral":
        if cfg.router_jitter_noise:
            fail(_in_file(path, "router_jitter_noise"), cfg.router_jitter_noise,
                 "router input jitter changes training; only 0.0 is supported")
        # Every layer is MoE, its experts intermediate_size wide; the top-k weights are renormalised.
        fields = dict(num_experts=cfg.num_local_experts, moe_intermediate_size=cfg.intermediate_size,
                      norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                      shared_expert_intermediate_size=None)
    else:
        fields = dict(num_experts=cfg.num_experts or None, moe_intermediate_size=cfg.moe_intermediate_size,
                      norm_topk_prob=bool(cfg.norm_topk_prob), decoder_sparse_step=cfg.decoder_sparse_step,
                      mlp_only_layers=list(cfg.mlp_only_layers or []), shared_expert_intermediate_size=None)
        if model_type == "qwen2_moe":
            if not cfg.shared_expert_intermediate_size and cfg.num_experts:
                fail(_in_file(path, "shared_expert_intermediate_size"), cfg.shared_expert_intermediate_size,
                     "a Qwen2-MoE without a shared expert (size 0) is not supported")
            fields["shared_expert_intermediate_size"] = cfg.shared_expert_intermediate_size
    if fields["num_experts"] and cfg.num_experts_per_tok == 1 and fields["norm_topk_prob"]:
        fail(_in_file(path, "num_experts_per_tok"), 1,
             "top-1 routing with renormalised weights (norm_topk_prob) is not supported by Megatron-Core's router")
    fields["num_experts_per_tok"] = cfg.num_experts_per_tok
    return fields


def resolve(model: ModelConfig) -> ModelConfig:
    """A new ModelConfig with the architecture of config.json at model.path (read once). A field set (not
    None) to a value other than the checkpoint's is an error: the checkpoint defines the architecture. Also
    checks, from file headers only, that there are safetensors and (value_head_init=from_checkpoint) a head."""
    cfg = read_hf_config(model.path)
    fields = hf_model_fields(cfg, model.path)
    for key, value in fields.items():
        current = getattr(model, key)
        if current is not None and current != value:
            raise ConfigError(f"model.{key}={current!r}: the checkpoint at model.path has {key}={value!r}; "
                              f"unset model.{key} (the checkpoint defines the architecture)")
    resolved = dataclasses.replace(model, **fields)
    classifier = any(a.endswith(("ForTokenClassification", "ForSequenceClassification"))
                     for a in cfg.architectures or [])
    ckpt = SafetensorsFolder(model.path)  # no safetensors is refused now, not at init_model (reads the index only)
    if model.value_head_init == "from_checkpoint":
        if classifier and cfg.num_labels != 1:
            fail(_in_file(model.path, "num_labels"), cfg.num_labels,
                 "model.value_head_init=from_checkpoint needs a one-label score head (a scalar reward / value)")
        value_head_names(ckpt, resolved)
    return resolved


# ------------------------------------------------------------------------------------------------ export


def export_family(model: ModelConfig) -> str:
    """The Hugging Face family an exported checkpoint uses; ConfigError if none computes this model."""
    family = hf_family(model)
    if family not in MOE_MODEL_TYPES:
        # What each family's config can express: Q/K/V bias only in qwen2, QK-norm only in qwen3.
        if model.attention_bias != (family == "qwen2") or model.qk_layernorm != (family == "qwen3") or is_moe(model):
            raise ConfigError(f"model.model_type={family!r}: with attention_bias={model.attention_bias}, "
                              f"qk_layernorm={model.qk_layernorm} and num_experts={model.num_experts} no Hugging "
                              f"Face family of {', '.join(FAMILIES)} computes this model; it cannot be exported")
        return family
    # What each MoE family's config can express: (key, whether the model fits, what the family has).
    shared, bias, qk = shared_expert_size(model) > 0, model.attention_bias, model.qk_layernorm
    checks = {
        "qwen2_moe": [("qk_layernorm", not qk, "has no QK-norm"),
                      ("shared_expert_intermediate_size", shared or not is_moe(model), "has a shared expert")],
        "qwen3_moe": [("attention_bias", not bias, "has no Q/K/V bias"), ("qk_layernorm", qk, "has QK-norm"),
                      ("shared_expert_intermediate_size", not shared, "has no shared expert")],
        "mixtral": [("attention_bias", not bias, "has no Q/K/V bias"), ("qk_layernorm", not qk, "has no QK-norm"),
                    ("shared_expert_intermediate_size", not shared, "has no shared expert"),
                    ("num_experts", is_moe(model), "has experts"),
                    ("norm_topk_prob", model.norm_topk_prob, "always renormalises the top-k weights"),
                    ("mlp_only_layers", all(moe_layer_pattern(model)), "has experts in every layer")],
    }[family]
    for key, fits, what in checks:
        if not fits:
            raise ConfigError(f"model.{key}={getattr(model, key)!r}: the {family} family {what}, so this model "
                              f"cannot be exported as {family}; set model.model_type to a family that computes it")
    return family


def _moe_config_fields(model: ModelConfig, family: str) -> dict:
    """The MoE fields of an exported config.json."""
    if family == "mixtral":
        return dict(num_local_experts=model.num_experts, num_experts_per_tok=model.num_experts_per_tok,
                    intermediate_size=expert_ffn_size(model), router_aux_loss_coef=model.moe_aux_loss_coeff,
                    router_jitter_noise=0.0)
    fields = dict(num_experts=model.num_experts or 0, num_experts_per_tok=model.num_experts_per_tok,
                  moe_intermediate_size=expert_ffn_size(model), norm_topk_prob=model.norm_topk_prob,
                  decoder_sparse_step=model.decoder_sparse_step, mlp_only_layers=list(model.mlp_only_layers or []),
                  router_aux_loss_coef=model.moe_aux_loss_coeff)
    if family == "qwen2_moe":
        fields.update(shared_expert_intermediate_size=shared_expert_size(model), qkv_bias=model.attention_bias)
    return fields


def export_config(model: ModelConfig, dtype: torch.dtype):
    """transformers config of the exported ``*ForTokenClassification`` (one label) model."""
    import transformers
    family = export_family(model)
    if model.path is not None:
        cfg = read_hf_config(model.path)  # keeps its token ids and other metadata; the architecture is ours
    else:
        rope = {"rope_type": "default", "rope_theta": model.rope_theta}
        if model.rope_scaling is not None:
            rope.update({"rope_type": "llama3", "factor": float(model.rope_scaling["factor"]),
                         **LLAMA3_ROPE_CONSTANTS})
        fields = dict(
            vocab_size=model.vocab_size, hidden_size=model.hidden_size, intermediate_size=model.intermediate_size,
            num_hidden_layers=model.num_hidden_layers, num_attention_heads=model.num_attention_heads,
            num_key_value_heads=model.num_key_value_heads, max_position_embeddings=model.max_position_embeddings,
            rms_norm_eps=model.rms_norm_eps, tie_word_embeddings=model.tie_word_embeddings, rope_parameters=rope)
        if family in MOE_MODEL_TYPES:
            fields.update(_moe_config_fields(model, family))
        cfg = getattr(transformers, f"{FAMILIES[family]}Config")(**fields)
        if "head_dim" in _family_fields(cfg) or head_dim(model) != model.hidden_size // model.num_attention_heads:
            cfg.head_dim = head_dim(model)
    if not hasattr(transformers, f"{FAMILIES[family]}ForTokenClassification"):
        raise ConfigError(f"model.model_type={family!r}: this transformers ({transformers.__version__}) has no "
                          f"{FAMILIES[family]}ForTokenClassification to load an exported critic; upgrade transformers")
    cfg.architectures = [f"{FAMILIES[family]}ForTokenClassification"]
    cfg.num_labels = 1
    cfg.token_classification_bias = True  # our value head has a bias
    cfg.classifier_dropout = 0.0  # the critic trains without dropout
    cfg.dtype = dtype
    return cfg

