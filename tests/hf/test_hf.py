"""Hugging Face checkpoints (megacritic.hf): config mapping and its refusals, the weight layouts
both ways, value-head initialisation, and (slow) parity with transformers under TP / PP layouts.

Every model is a tiny random one built here with transformers and saved into a temporary folder; norms,
biases and heads are perturbed away from their initial 1 / 0 so that a misplaced tensor shows.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers as T
from safetensors import safe_open
from safetensors.torch import save_file

from megacritic import CriticWorker, load_config
from megacritic.config import TINY_MODEL_OVERRIDES, ConfigError, ModelConfig, tiny_model
from megacritic.data.sources import SyntheticRollouts
from megacritic.hf.safetensors_reader import SafetensorsFolder, SafetensorsSource
from megacritic.model.value_model import padded_vocab_size
from megacritic.model.weights import hf_from_megatron, hf_shapes, megatron_tensor, seeded_initializer

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
COMMON = dict(vocab_size=67, hidden_size=48, intermediate_size=80, num_hidden_layers=4, rms_norm_eps=1e-5)

# name: (builder, value_head_init). GQA throughout; odd heads per group (llama, qwen3: 3 per group, 3 per
# TP rank at TP=2) and an odd head count (mistral: 3 heads, 1 group); explicit head_dim != hidden / heads
# (qwen3, mistral); tied (llama) and untied (mistral, with an lm_head to ignore) embeddings; a one-label
# sequence-classification reward model without score bias (qwen2) and a token-classification one (qwen3).
MODELS = {
    "llama": (lambda: T.LlamaForCausalLM(T.LlamaConfig(
        **COMMON, num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=True,
        max_position_embeddings=131072, rope_parameters=LLAMA3_ROPE)), "normal"),
    "qwen2": (lambda: T.Qwen2ForSequenceClassification(T.Qwen2Config(
        **COMMON, num_attention_heads=4, num_key_value_heads=2, num_labels=1, pad_token_id=0)), "from_checkpoint"),
    "qwen3": (lambda: T.Qwen3ForTokenClassification(T.Qwen3Config(
        **COMMON, num_attention_heads=6, num_key_value_heads=2, head_dim=16, num_labels=1)), "from_checkpoint"),
    "mistral": (lambda: T.MistralForCausalLM(T.MistralConfig(
        **{**COMMON, "num_hidden_layers": 2}, num_attention_heads=3, num_key_value_heads=1, head_dim=12,
        sliding_window=None, tie_word_embeddings=False)), "normal"),
}


def _perturbed(model, seed=0):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * noise)
            elif name.endswith(".bias"):
                p.copy_(0.3 * noise)
            else:
                p.copy_(0.08 * noise)
    return model


def _build(name: str, folder: Path) -> Path:
    # qwen3 is saved in many shards (with an index), the others as one file
    shard = "40KB" if name == "qwen3" else "50MB"
    _perturbed(MODELS[name][0]()).save_pretrained(folder, max_shard_size=shard)
    return folder


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_models")
    return {name: _build(name, root / name) for name in MODELS}


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def _config(folder, head="normal", *extra):
    return load_config([f"model.path={folder}", f"model.value_head_init={head}", "model.dtype=float32", *extra])


def _copy_with(folder: Path, dest: Path, **changes) -> Path:
    """A copy of a model folder with config.json keys changed (None deletes)."""
    shutil.copytree(folder, dest)
    raw = json.loads((dest / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            raw.pop(key, None)
        else:
            raw[key] = value
    (dest / "config.json").write_text(json.dumps(raw))
    return dest


# ---------------------------------------------------------------------------------------------- config


def test_config_fields_from_each_family(hf_models):
    llama = _config(hf_models["llama"]).model
    assert (llama.model_type, llama.hidden_size, llama.num_hidden_layers, llama.num_attention_heads,
            llama.num_key_value_heads, llama.head_dim, llama.intermediate_size, llama.vocab_size) == \
        ("llama", 48, 4, 6, 2, 8, 80, 67)
    assert llama.rope_theta == 500000.0 and llama.rms_norm_eps == 1e-5 and llama.max_position_embeddings == 131072
    assert llama.rope_scaling == {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"}
    assert (llama.attention_bias, llama.qk_layernorm, llama.tie_word_embeddings) == (False, False, True)
    qwen2 = _config(hf_models["qwen2"], "from_checkpoint").model
    assert (qwen2.model_type, qwen2.attention_bias, qwen2.qk_layernorm, qwen2.rope_scaling) == ("qwen2", True, False, None)
    assert qwen2.rope_theta == 10000.0 and qwen2.head_dim == 12
    qwen3 = _config(hf_models["qwen3"], "from_checkpoint").model
    assert (qwen3.model_type, qwen3.head_dim, qwen3.attention_bias, qwen3.qk_layernorm) == ("qwen3", 16, False, True)
    mistral = _config(hf_models["mistral"]).model
    assert (mistral.num_attention_heads, mistral.num_key_value_heads, mistral.head_dim, mistral.tie_word_embeddings) \
        == (3, 1, 12, False)


def test_config_revalidates_and_accepts_agreeing_fields(hf_models):
    from megacritic.config import validate
    config = _config(hf_models["qwen3"], "from_checkpoint", "model.hidden_size=48", "model.head_dim=16")
    before = ModelConfig(**vars(config.model))
    validate(config)  # idempotent
    assert config.model == before


def test_resolve_returns_a_new_model_config_and_set_means_set(hf_models):
    from megacritic.hf.config import resolve
    model = ModelConfig(path=str(hf_models["llama"]), hidden_size=48)
    resolved = resolve(model)
    assert model == ModelConfig(path=str(hf_models["llama"]), hidden_size=48)  # not mutated
    assert (resolved.hidden_size, resolved.num_hidden_layers, resolved.attention_bias) == (48, 4, False)
    # values that were the defaults once (a Qwen2-style tiny model's) are settings like any other
    for setting in ("model.attention_bias=true", "model.rms_norm_eps=1e-6", "model.rope_theta=10000"):
        _refusal(hf_models["llama"], setting.split("=")[0], "normal", setting)


def _refusal(folder, key, head="normal", *extra):
    with pytest.raises(ConfigError) as info:
        _config(folder, head, *extra)
    assert key in str(info.value), str(info.value)
    return str(info.value)


@pytest.mark.parametrize("family, changes, key", [
    ("llama", {"model_type": "gpt2"}, "model_type"),
    ("llama", {"hidden_act": "gelu"}, "hidden_act"),
    ("llama", {"attention_bias": True}, "attention_bias"),
    ("llama", {"mlp_bias": True}, "mlp_bias"),
    ("llama", {"attention_dropout": 0.1}, "attention_dropout"),
    ("llama", {"rope_parameters": {**LLAMA3_ROPE, "rope_type": "yarn"}}, "rope_type"),
    ("llama", {"rope_parameters": {**LLAMA3_ROPE, "low_freq_factor": 2.0}}, "low_freq_factor"),
    ("llama", {"rope_parameters": None, "rope_theta": 1e4, "rope_scaling": {"type": "dynamic", "factor": 2.0}},
     "rope_type"),
    ("llama", {"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ("llama", {"quantization_config": {"quant_method": "gptq"}}, "quantization_config"),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2, "layer_types": None},
     "layer_types"),
    ("mistral", {"sliding_window": 16}, "sliding_window"),
])
def test_unsupported_fields_are_refused_by_name(hf_models, tmp_path, family, changes, key):
    folder = _copy_with(hf_models[family], tmp_path / "m", **changes)
    head = MODELS[family][1]
    message = _refusal(folder, key, head)
    assert "model.path" in message


def test_a_family_field_we_do_not_know_is_refused(hf_models, monkeypatch):
    # as if a newer transformers added use_cache to the family's fields: unknown fields are never dropped
    from megacritic.hf import config as hf
    monkeypatch.setattr(hf, "INERT_FIELDS", {k: v for k, v in hf.INERT_FIELDS.items() if k != "use_cache"})
    _refusal(hf_models["llama"], "use_cache")


def test_mistral_window_not_shorter_than_max_positions_is_full_attention(hf_models, tmp_path):
    folder = _copy_with(hf_models["mistral"], tmp_path / "m", sliding_window=131072,
                        max_position_embeddings=131072)
    assert _config(folder).model.max_position_embeddings == 131072


def test_other_refusals(hf_models, tmp_path):
    _refusal(tmp_path / "missing", "model.path")  # no config.json
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    shutil.copy(hf_models["llama"] / "config.json", no_weights)
    _refusal(no_weights, "model.path")
    # an explicitly set architecture field that disagrees with the checkpoint
    _refusal(hf_models["llama"], "model.hidden_size", "normal", "model.hidden_size=32")
    # from_checkpoint: needs a path, a one-label classifier, and a head in the weights
    with pytest.raises(ConfigError, match="model.value_head_init"):
        load_config([*TINY_MODEL_OVERRIDES, "model.value_head_init=from_checkpoint"])
    _refusal(hf_models["llama"], "from_checkpoint", "from_checkpoint")  # an ordinary LM head only
    two = _copy_with(hf_models["qwen3"], tmp_path / "two_labels", id2label={"0": "a", "1": "b"})
    _refusal(two, "num_labels", "from_checkpoint")


def test_unknown_checkpoint_tensor_is_refused(hf_models, tmp_path):
    folder = tmp_path / "m"
    shutil.copytree(hf_models["llama"], folder)
    tensors = _tensors(folder)
    tensors["model.layers.0.mlp.gate_proj.bias"] = torch.zeros(80)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ConfigError, match="model.layers.0.mlp.gate_proj.bias"):
        SafetensorsSource(_config(folder).model, 0)


def test_llama3_rope_scaling_matches_transformers_exactly():
    # Megatron's RoPE scaling (GPTModel rope_scaling=True) against transformers' llama3 inverse frequencies.
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    for hd, factor in ((128, 8.0), (64, 32.0), (8, 8.0)):
        cfg = T.LlamaConfig(hidden_size=4 * hd, num_attention_heads=4, max_position_embeddings=131072,
                            rope_parameters={**LLAMA3_ROPE, "factor": factor})
        hf, attention_scale = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
        ours = RotaryEmbedding(kv_channels=hd, rotary_percent=1.0, rotary_base=500000.0, rope_scaling=True,
                               rope_scaling_factor=factor, use_cpu_initialization=True, cp_group=None).inv_freq
        assert attention_scale == 1.0
        assert torch.equal(hf, ours), hd
        plain = 1.0 / 500000.0 ** (torch.arange(0, hd, 2).float() / hd)
        assert not torch.equal(ours, plain)  # the scaling does something at this size


# ---------------------------------------------------------------------------------------------- weights


def _megatron_names(layer_local: int, model: ModelConfig) -> list[str]:
    p = f"decoder.layers.{layer_local}."
    names = ["embedding.word_embeddings.weight", "decoder.final_layernorm.weight", "output_layer.weight",
             "output_layer.bias"] + [p + n for n in (
                 "input_layernorm.weight", "pre_mlp_layernorm.weight", "self_attention.linear_qkv.weight",
                 "self_attention.linear_proj.weight", "mlp.linear_fc1.weight", "mlp.linear_fc2.weight")]
    if model.attention_bias:
        names.append(p + "self_attention.linear_qkv.bias")
    if model.qk_layernorm:
        names += [p + "self_attention.q_layernorm.weight", p + "self_attention.k_layernorm.weight"]
    return names


@pytest.mark.parametrize("tp", [1, 2, 3])
@pytest.mark.parametrize("bias, qk_norm", [(True, False), (False, True)])
def test_export_layout_inverts_import_layout(tp, bias, qk_norm):
    m = tiny_model(vocab_size=67, hidden_size=24, intermediate_size=30, num_hidden_layers=2,
                    num_attention_heads=12, num_key_value_heads=6, head_dim=4, attention_bias=bias,
                    qk_layernorm=qk_norm)
    full = {n: torch.randn(s, dtype=torch.float64) for n, s in hf_shapes(m).items()}
    padded = padded_vocab_size(m.vocab_size, tp)
    rebuilt = {}
    for name in _megatron_names(0, m):
        pieces = [megatron_tensor(name, 1, full.__getitem__, m, r, tp, padded) for r in range(tp)]
        rebuilt.update(hf_from_megatron(name, 1, pieces, m))
    for name, t in rebuilt.items():
        assert torch.equal(t, full[name]), name
    layer1 = {n for n in full if not n.startswith("model.layers.0.")}
    assert set(rebuilt) == layer1


def test_checkpoint_reads_slices_of_sharded_files(hf_models):
    ckpt = SafetensorsFolder(hf_models["qwen3"])
    assert len(set(ckpt.files.values())) > 1  # really sharded
    whole = _tensors(hf_models["qwen3"])
    name = "model.layers.2.self_attn.o_proj.weight"
    assert torch.equal(ckpt.read(name), whole[name])
    assert torch.equal(ckpt.read(name, 1, 16, 48), whole[name][:, 16:48])
    assert torch.equal(ckpt.read(name, 0, 5, 9), whole[name][5:9])
    # a TP rank's shard of the fused QKV, read by slices, equals the one cut from full tensors
    model = _config(hf_models["qwen3"], "from_checkpoint").model
    source = SafetensorsSource(model, 0)
    for rank in range(2):
        sliced = megatron_tensor("decoder.layers.0.self_attention.linear_qkv.weight", 2, source, model, rank, 2, 68)
        cut = megatron_tensor("decoder.layers.0.self_attention.linear_qkv.weight", 2, lambda n: source(n), model,
                              rank, 2, 68)
        assert torch.equal(sliced, cut)


# ------------------------------------------------------------------------------------- value head init


def _head(folder, head, seed=0):
    return SafetensorsSource(_config(folder, head).model, seed).head


def test_value_head_from_sequence_classification_reward_model(hf_models):
    stored = _tensors(hf_models["qwen2"])
    head = _head(hf_models["qwen2"], "from_checkpoint")
    assert "score.bias" not in stored  # *ForSequenceClassification: no bias, so ours starts at 0
    assert torch.equal(head["score.weight"], stored["score.weight"])
    assert torch.equal(head["score.bias"], torch.zeros(1))


def test_value_head_from_token_classification_reward_model(hf_models):
    stored = _tensors(hf_models["qwen3"])
    head = _head(hf_models["qwen3"], "from_checkpoint")
    assert torch.equal(head["score.weight"], stored["score.weight"])
    assert torch.equal(head["score.bias"], stored["score.bias"]) and stored["score.bias"].abs().item() > 0


def test_value_head_from_one_row_lm_head(hf_models, tmp_path):
    folder = tmp_path / "m"
    shutil.copytree(hf_models["mistral"], folder)
    tensors = _tensors(folder)
    tensors["lm_head.weight"] = torch.randn(1, 48)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    head = _head(folder, "from_checkpoint")
    assert torch.equal(head["score.weight"], tensors["lm_head.weight"])
    assert torch.equal(head["score.bias"], torch.zeros(1))


def test_value_head_normal_and_zeros(hf_models):
    config = _config(hf_models["llama"], "normal", "model.value_head_init_std=0.5")
    head = SafetensorsSource(config.model, 7).head
    assert torch.equal(head["score.weight"], seeded_initializer(config.model, 7)("score.weight"))
    assert 0.3 < head["score.weight"].std().item() < 0.7
    zeros = _head(hf_models["llama"], "zeros")
    assert torch.equal(zeros["score.weight"], torch.zeros(1, 48)) and torch.equal(zeros["score.bias"], torch.zeros(1))


# ------------------------------------------------------------------------ single process: seeded export


def _hf_values(folder, batch, head=None):
    """transformers' AutoModelForTokenClassification values: logits[:, -R-1:-1] on response tokens."""
    model, info = T.AutoModelForTokenClassification.from_pretrained(
        str(folder), dtype=torch.float32, output_loading_info=True)
    if head is not None:
        with torch.no_grad():
            model.score.weight.copy_(head["score.weight"])
            model.score.bias.copy_(head["score.bias"])
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(batch["input_ids"]), attention_mask=torch.tensor(batch["attention_mask"]),
                       position_ids=torch.tensor(batch["position_ids"])).logits[..., 0]
    mask = torch.tensor(batch["attention_mask"])
    r = len(batch["values"][0])
    return logits[:, -r - 1:-1] * mask[:, -r:], info


def _rel(got, ref) -> float:
    got, ref = torch.as_tensor(got, dtype=torch.float64), torch.as_tensor(ref, dtype=torch.float64)
    return float((got - ref).norm() / ref.norm())


def test_export_of_seeded_model_loads_in_transformers(tmp_path):
    # No model.path: the embedded Qwen2-style default with random weights, exported and reloaded.
    config = load_config([*TINY_MODEL_OVERRIDES,
                          "model.dtype=float32", "data.rollouts_per_step=8", "ppo_mini_batch_size=4",
                          "data.response_length=[2,10]", "model.value_head_init_std=0.5"])
    worker = CriticWorker(config)
    worker.init_model()
    try:
        batch = SyntheticRollouts(config).batch(0)
        values = worker.compute_values(batch)
        worker.export_hf(str(tmp_path / "out"))
    finally:
        worker.close()
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert exported["architectures"] == ["Qwen2ForTokenClassification"] and len(exported["id2label"]) == 1
    seeded = seeded_initializer(config.model, config.megatron.seed)
    for name, t in _tensors(tmp_path / "out").items():
        assert torch.equal(t, seeded(name)), name
    data = {k: batch[k].tolist() for k in ("input_ids", "attention_mask", "position_ids")}
    data["values"] = values.tolist()
    ref, info = _hf_values(tmp_path / "out", data)
    assert not (info["missing_keys"] or info["unexpected_keys"])
    # float32, same weights, different kernels (SDPA vs transformers): ~1e-7 relative
    assert _rel(values, ref) < 1e-5


# ------------------------------------------------------------------ slow: parity under (TP, PP, DP) layouts

SCRIPT = Path(__file__).parents[1] / "multiproc" / "hf_parity_run.py"
# name: (processes, overrides, models); TP=2 cannot split mistral's 3 heads.
LAYOUTS = {
    "tp1_pp1_dp1": (1, [], list(MODELS)),
    "tp2_pp1_dp1": (2, ["megatron.tensor_model_parallel_size=2"], ["llama", "qwen2", "qwen3"]),
    "tp1_pp2_dp1": (2, ["megatron.pipeline_model_parallel_size=2"], list(MODELS)),
    # beyond the three: interleaved chunks (two per rank) gathered by export
    "tp1_pp2_vpp2": (2, ["megatron.pipeline_model_parallel_size=2", "megatron.virtual_pipeline_model_parallel_size=2"],
                     ["llama", "qwen3"]),
    # context parallelism: every CP rank holds the whole model, export writes it once
    "tp1_pp1_cp2": (2, ["megatron.context_parallel_size=2", "use_dynamic_bsz=true", "ppo_max_token_len_per_gpu=32"],
                    ["qwen2", "qwen3"]),
}
CASES = [pytest.param(layout, name, id=f"{layout}-{name}") for layout, (_, _, names) in LAYOUTS.items()
         for name in names]


@pytest.fixture(scope="module")
def runs(hf_models, tmp_path_factory):
    out = {}
    for layout, (nproc, overrides, names) in LAYOUTS.items():
        root = tmp_path_factory.mktemp(layout)
        spec = root / "models.json"
        spec.write_text(json.dumps({n: [str(hf_models[n]), MODELS[n][1]] for n in names}))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               str(SCRIPT), str(root), str(spec), *overrides]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
        out[layout] = (root, json.loads((root / "results.json").read_text()))
    return out


def _source_head(name, folder, seed):
    """The value head megacritic must start from, derived independently of SafetensorsSource."""
    stored = _tensors(folder)
    if MODELS[name][1] == "from_checkpoint":
        return {"score.weight": stored["score.weight"], "score.bias": stored.get("score.bias", torch.zeros(1))}
    model = _config(folder).model
    return {"score.weight": seeded_initializer(model, seed)("score.weight"), "score.bias": torch.zeros(1)}


@pytest.mark.slow
@pytest.mark.parametrize("layout, name", CASES)
def test_import_matches_transformers(runs, hf_models, layout, name):
    _, results = runs[layout]
    got = results[name]
    ref, _ = _hf_values(hf_models[name], got, _source_head(name, hf_models[name], got["seed"]))
    # float32 with the same weights; only kernels and reduction order differ (measured ~3e-7)
    assert _rel(got["values"], ref) < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("layout, name", CASES)
def test_import_then_export_is_bit_for_bit(runs, hf_models, layout, name):
    root, results = runs[layout]
    source = _tensors(hf_models[name])
    expected = {n: t for n, t in source.items() if n.startswith("model.")}
    expected.update(_source_head(name, hf_models[name], results[name]["seed"]))
    exported = _tensors(root / name / "import")
    assert set(exported) == set(expected)
    for n, t in exported.items():
        assert t.dtype == expected[n].dtype and torch.equal(t, expected[n]), n


@pytest.mark.slow
@pytest.mark.parametrize("layout, name", CASES)
def test_trained_export_computes_our_values(runs, layout, name):
    root, results = runs[layout]
    got = results[name]
    assert got["steps"] == 2
    assert _rel(got["values_after"], got["values"]) > 1e-2  # training moved the weights
    ref, info = _hf_values(root / name / "trained", {**got, "values": got["values_after"]})
    assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"])
    assert _rel(got["values_after"], ref) < 1e-4
