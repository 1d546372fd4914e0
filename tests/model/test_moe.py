"""Mixture-of-experts value models: config mapping and refusals for qwen2_moe / qwen3_moe / mixtral, the
expert weight layouts under expert (tensor) parallelism, export, and (slow) parity with transformers and
between expert-parallel layouts.

Every model is a tiny random one built here with transformers, perturbed as in test_hf (norms away from 1,
biases away from 0) so that a misplaced tensor shows. Between them the three cover a shared expert with its
sigmoid gate, both routing normalisations (softmax then top-k; softmax over the top-k), mixed dense / MoE
layers (mlp_only_layers, decoder_sparse_step), the load-balancing loss and a frozen router.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers as T

from megacritic import CriticWorker, load_config
from megacritic.config import TINY_MODEL_OVERRIDES, ConfigError, moe_layer_pattern, tiny_model
from megacritic.parallel import ParallelLayout
from megacritic.data.sources import SyntheticRollouts
from megacritic.hf.config import export_family
from megacritic.model.value_model import padded_vocab_size
from megacritic.model.weights import ExpertRanks, hf_from_megatron, hf_shapes, megatron_tensor

sys.path.insert(0, str(Path(__file__).parents[1] / "hf"))  # test_hf's helpers, also when this file runs alone
from test_hf import _copy_with, _hf_values, _perturbed, _rel, _tensors  # noqa: E402

COMMON = dict(vocab_size=67, hidden_size=48, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              rms_norm_eps=1e-5)

# name: (builder, value_head_init, extra overrides of the parity runs)
MODELS = {
    # shared expert with a sigmoid gate, softmax-then-top-k without renormalisation, layer 2 dense;
    # trained with the load-balancing loss on
    "qwen2_moe": (lambda: T.Qwen2MoeForCausalLM(T.Qwen2MoeConfig(
        **COMMON, intermediate_size=64, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
        shared_expert_intermediate_size=40, norm_topk_prob=False, mlp_only_layers=[2])),
        "normal", ["model.moe_aux_loss_coeff=0.01"]),
    # QK-norm, explicit head_dim, renormalised top-3 of 6, MoE only in layers 1 and 3; a one-label reward model
    "qwen3_moe": (lambda: T.Qwen3MoeForTokenClassification(T.Qwen3MoeConfig(
        **COMMON, head_dim=16, intermediate_size=64, num_experts=6, num_experts_per_tok=3, moe_intermediate_size=32,
        norm_topk_prob=True, decoder_sparse_step=2, num_labels=1)), "from_checkpoint", []),
    # every layer MoE, softmax over the top-2 logits; trained with frozen routers
    "mixtral": (lambda: T.MixtralForCausalLM(T.MixtralConfig(
        **COMMON, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, sliding_window=None)),
        "normal", ["model.freeze_moe_router=true"]),
}


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_models")
    out = {}
    for name, (build, _, _) in MODELS.items():
        _perturbed(build()).save_pretrained(root / name)
        out[name] = root / name
    return out


def _config(folder, head="normal", *extra):
    return load_config([f"model.path={folder}", f"model.value_head_init={head}", "model.dtype=float32", *extra])


def _refusal(key, *overrides):
    with pytest.raises(ConfigError) as info:
        load_config([*TINY_MODEL_OVERRIDES, *overrides])
    assert key in str(info.value), str(info.value)
    return str(info.value)


# ---------------------------------------------------------------------------------------------- config


def test_config_fields_from_each_family(hf_models):
    q2 = _config(hf_models["qwen2_moe"]).model
    assert (q2.model_type, q2.num_experts, q2.num_experts_per_tok, q2.moe_intermediate_size,
            q2.shared_expert_intermediate_size, q2.norm_topk_prob, q2.intermediate_size) == \
        ("qwen2_moe", 4, 2, 24, 40, False, 64)
    assert (q2.attention_bias, q2.qk_layernorm, moe_layer_pattern(q2)) == (True, False, [1, 1, 0, 1])
    q3 = _config(hf_models["qwen3_moe"], "from_checkpoint").model
    assert (q3.model_type, q3.num_experts, q3.num_experts_per_tok, q3.norm_topk_prob, q3.head_dim) == \
        ("qwen3_moe", 6, 3, True, 16)
    assert (q3.attention_bias, q3.qk_layernorm, q3.shared_expert_intermediate_size) == (False, True, None)
    assert moe_layer_pattern(q3) == [0, 1, 0, 1]
    mx = _config(hf_models["mixtral"]).model
    assert (mx.model_type, mx.num_experts, mx.moe_intermediate_size, mx.norm_topk_prob, moe_layer_pattern(mx)) == \
        ("mixtral", 4, 32, True, [1, 1, 1, 1])
    assert mx.moe_aux_loss_coeff == 0.0  # router_aux_loss_coef (0.001 here) is the LM's, not the critic's


@pytest.mark.parametrize("family, changes, key", [
    ("mixtral", {"router_jitter_noise": 0.1}, "router_jitter_noise"),
    ("mixtral", {"sliding_window": 16}, "sliding_window"),
    ("qwen3_moe", {"use_sliding_window": True, "sliding_window": 16}, "sliding_window"),
    ("qwen2_moe", {"shared_expert_intermediate_size": 0}, "shared_expert_intermediate_size"),
    ("qwen3_moe", {"num_experts_per_tok": 1}, "num_experts_per_tok"),  # top-1 renormalised
    ("qwen3_moe", {"attention_bias": True}, "attention_bias"),
    ("qwen2_moe", {"hidden_act": "gelu"}, "hidden_act"),
])
def test_unsupported_fields_are_refused_by_name(hf_models, tmp_path, family, changes, key):
    folder = _copy_with(hf_models[family], tmp_path / "m", **changes)
    with pytest.raises(ConfigError) as info:
        _config(folder, MODELS[family][1])
    assert key in str(info.value) and "model.path" in str(info.value), str(info.value)


def test_experts_cannot_be_added_to_a_dense_checkpoint(tmp_path):
    T.Qwen2ForCausalLM(T.Qwen2Config(**COMMON, intermediate_size=64)).save_pretrained(tmp_path / "dense")
    with pytest.raises(ConfigError, match="model.num_experts=4"):
        _config(tmp_path / "dense", "normal", "model.num_experts=4")


def test_a_moe_field_we_do_not_know_is_refused(hf_models, monkeypatch):
    from megacritic.hf import config as hf
    monkeypatch.setattr(hf, "MAPPED_FIELDS", hf.MAPPED_FIELDS - {"decoder_sparse_step"})
    with pytest.raises(ConfigError, match="decoder_sparse_step"):
        _config(hf_models["qwen2_moe"])


MOE = [*TINY_MODEL_OVERRIDES, "model.num_experts=4", "model.num_experts_per_tok=2", "model.moe_intermediate_size=32"]


def test_moe_settings_are_checked():
    _refusal("model.num_experts_per_tok", *MOE, "model.num_experts_per_tok=5")
    _refusal("model.num_experts_per_tok", *MOE, "model.num_experts_per_tok=1", "model.norm_topk_prob=true")
    _refusal("model.mlp_only_layers", *MOE, "model.mlp_only_layers=[2]")  # only 2 layers
    _refusal("model.decoder_sparse_step", *MOE, "model.decoder_sparse_step=0")
    _refusal("model.moe_aux_loss_coeff", *MOE, "model.moe_aux_loss_coeff=-0.1")
    _refusal("megatron.expert_model_parallel_size", *MOE, "megatron.expert_model_parallel_size=3")
    _refusal("megatron.expert_tensor_parallel_size", *MOE, "megatron.expert_tensor_parallel_size=3")
    _refusal("megatron.tensor_model_parallel_size", *MOE, "model.moe_intermediate_size=30",
             "megatron.tensor_model_parallel_size=4")
    _refusal("megatron.sequence_parallel", *MOE, "megatron.tensor_model_parallel_size=2",
             "megatron.sequence_parallel=false")
    # without EP, megatron-core treats experts as dense parameters: split differently from TP, their
    # gradients would never be reduced over the TP ranks that share them (measured: wrong from step 1)
    _refusal("megatron.expert_tensor_parallel_size", *MOE, "megatron.tensor_model_parallel_size=2",
             "megatron.expert_tensor_parallel_size=1")
    # MoE-only settings on a dense model
    for setting in ("megatron.expert_model_parallel_size=2", "megatron.expert_tensor_parallel_size=1",
                    "model.moe_aux_loss_coeff=0.1", "model.freeze_moe_router=true"):
        _refusal(setting.split("=")[0], setting)
    # mixtral's intermediate_size is unused when every layer is MoE: TP need not divide it
    load_config([*MOE, "model.intermediate_size=30", "megatron.tensor_model_parallel_size=2"])


def test_expert_layout_needs_the_world_size():
    config = load_config([*MOE, "megatron.expert_model_parallel_size=4"])
    with pytest.raises(ConfigError, match="expert"):
        ParallelLayout.from_config(config.megatron, 2)
    assert ParallelLayout.from_config(config.megatron, 4).dp == 4
    # EP taken from the TP ranks: TP=2, EP=2, experts whole (ETP=1) on 2 processes
    config = load_config([*MOE, "megatron.expert_model_parallel_size=2", "megatron.tensor_model_parallel_size=2",
                          "megatron.expert_tensor_parallel_size=1"])
    assert ParallelLayout.from_config(config.megatron, 2).dp == 1


def test_checkpoint_resumes_only_on_the_same_side_of_ep_1(tmp_path):
    from megacritic.checkpoint import MANIFEST, TRAINER_STATE, check_expert_layout, open_checkpoint
    folder = tmp_path / "step_00000002"
    folder.mkdir()
    state = json.dumps({"config": {"megatron": {"expert_model_parallel_size": 2}}})
    (folder / TRAINER_STATE).write_text(state)
    import hashlib
    (folder / MANIFEST).write_text(json.dumps({"step": 2, "files": {TRAINER_STATE: {
        "bytes": len(state), "sha256": hashlib.sha256(state.encode()).hexdigest()}}}))
    opened = open_checkpoint(str(folder))
    check_expert_layout(opened, load_config([*MOE, "megatron.expert_model_parallel_size=4"]))
    with pytest.raises(ConfigError, match="megatron.expert_model_parallel_size"):
        check_expert_layout(opened, load_config(MOE))


def test_export_family_refusals():
    base = dict(vocab_size=67, hidden_size=24, intermediate_size=30, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, num_experts=4, moe_intermediate_size=8)
    assert export_family(tiny_model(**base, shared_expert_intermediate_size=16)) == "qwen2_moe"
    assert export_family(tiny_model(**base, attention_bias=False, qk_layernorm=True)) == "qwen3_moe"
    assert export_family(tiny_model(**base, attention_bias=False, norm_topk_prob=True)) == "mixtral"
    for bad, key in ((dict(model_type="mixtral", attention_bias=False), "norm_topk_prob"),
                     (dict(model_type="mixtral", attention_bias=False, norm_topk_prob=True, mlp_only_layers=[1]),
                      "mlp_only_layers"),
                     (dict(model_type="qwen3_moe", attention_bias=False, qk_layernorm=True,
                           shared_expert_intermediate_size=16), "shared_expert_intermediate_size"),
                     (dict(model_type="qwen2_moe"), "shared_expert_intermediate_size"),
                     (dict(model_type="mixtral", attention_bias=False, norm_topk_prob=True, num_experts=None),
                      "num_experts"),
                     (dict(model_type="qwen2"), "num_experts")):
        with pytest.raises(ConfigError, match=key):
            export_family(tiny_model(**{**base, **bad}))


# ---------------------------------------------------------------------------------------------- weights


@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral"])
@pytest.mark.parametrize("tp, ep, etp", [(1, 1, 1), (2, 1, 2), (1, 2, 1), (2, 2, 1), (1, 4, 2)])
def test_export_layout_inverts_import_layout(family, tp, ep, etp):
    m = tiny_model(model_type=family, vocab_size=67, hidden_size=24, intermediate_size=30, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, num_experts=4, moe_intermediate_size=12,
                    norm_topk_prob=family == "mixtral", attention_bias=family == "qwen2_moe",
                    shared_expert_intermediate_size=16 if family == "qwen2_moe" else None)
    full = {n: torch.randn(s, dtype=torch.float64) for n, s in hf_shapes(m).items()}
    padded, local = padded_vocab_size(m.vocab_size, tp), m.num_experts // ep
    p = "decoder.layers.0.mlp."
    rebuilt = {}
    for name in ["router.weight"] + (["shared_experts.gate_weight"] if family == "qwen2_moe" else []):
        rebuilt.update(hf_from_megatron(p + name, 1, [megatron_tensor(p + name, 1, full.__getitem__, m, 0, tp, padded)],
                                        m))
    if family == "qwen2_moe":
        for fc in ("linear_fc1", "linear_fc2"):
            name = f"{p}shared_experts.{fc}.weight"
            pieces = [megatron_tensor(name, 1, full.__getitem__, m, r, tp, padded) for r in range(tp)]
            rebuilt.update(hf_from_megatron(name, 1, pieces, m))
    for ep_rank in range(ep):
        for j in range(local):
            for fc in ("linear_fc1", "linear_fc2"):
                name = f"{p}experts.local_experts.{j}.{fc}.weight"
                pieces = [megatron_tensor(name, 1, full.__getitem__, m, 0, tp, padded, ExpertRanks(ep_rank, ep, r, etp))
                          for r in range(etp)]
                global_name = name.replace(f"local_experts.{j}.", f"local_experts.{ep_rank * local + j}.")
                rebuilt.update(hf_from_megatron(global_name, 1, pieces, m))
    block = "block_sparse_moe" if family == "mixtral" else "mlp"
    expected = {n for n in full if n.startswith(f"model.layers.1.{block}.") or n.startswith("model.layers.1.mlp.")}
    assert set(rebuilt) == expected
    for name, t in rebuilt.items():
        assert torch.equal(t, full[name]), name


# ------------------------------------------------------------------------ single process: seeded export


def test_seeded_moe_export_loads_in_transformers_and_frozen_routers_stay(tmp_path):
    # No model.path: a seeded Qwen2-MoE-shaped critic with a dense layer; trained with frozen routers, exported.
    config = load_config([*TINY_MODEL_OVERRIDES,
                          "model.dtype=float32", "data.rollouts_per_step=8", "ppo_mini_batch_size=4",
                          "data.response_length=[2,10]", "model.value_head_init_std=0.5", "model.num_experts=4",
                          "model.moe_intermediate_size=32", "model.shared_expert_intermediate_size=48",
                          "model.num_hidden_layers=3", "model.mlp_only_layers=[1]", "model.freeze_moe_router=true"])
    worker = CriticWorker(config)
    worker.init_model()
    try:
        routers = {n: p.detach().clone() for n, p in worker.state.model[0].module.named_parameters()
                   if n.endswith("router.weight")}
        assert len(routers) == 2 and not any(p.requires_grad for n, p in
                                             worker.state.model[0].module.named_parameters() if n in routers)
        batch = SyntheticRollouts(config).batch(0)
        batch["values"] = worker.compute_values(batch)
        worker.update_critic(batch)
        values = worker.compute_values(batch)
        for n, p in worker.state.model[0].module.named_parameters():
            if n in routers:
                assert torch.equal(p, routers[n]), n
        worker.export_hf(str(tmp_path / "out"))
    finally:
        worker.close()
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert exported["architectures"] == ["Qwen2MoeForTokenClassification"]
    assert (exported["num_experts"], exported["mlp_only_layers"], exported["router_aux_loss_coef"]) == (4, [1], 0.0)
    data = {k: batch[k].tolist() for k in ("input_ids", "attention_mask", "position_ids")}
    data["values"] = values.tolist()
    ref, info = _hf_values(tmp_path / "out", data)
    assert not (info["missing_keys"] or info["unexpected_keys"])
    assert _rel(values, ref) < 1e-5


def test_padded_and_packed_micro_batches_agree_with_the_load_balancing_loss(hf_models):
    # Padding goes through the routers too; it must change neither values nor the load-balancing loss.
    out = {}
    for packed in ("true", "false"):
        config = _config(hf_models["qwen2_moe"], "normal", "data.rollouts_per_step=8", "ppo_mini_batch_size=4",
                         "ppo_micro_batch_size_per_gpu=2", "shuffle=false", "model.moe_aux_loss_coeff=0.01",
                         f"model.use_remove_padding={packed}")
        worker = CriticWorker(config)
        worker.init_model()
        try:
            batch = SyntheticRollouts(config).batch(0)
            batch["values"] = values = worker.compute_values(batch)
            out[packed] = values, worker.update_critic(batch)
        finally:
            worker.close()
    assert _rel(out["false"][0], out["true"][0]) < 1e-5
    for key in ("critic/vf_loss", "critic/grad_norm", "critic/moe_aux_loss"):
        assert _rel(out["false"][1][key], out["true"][1][key]) < 1e-5, key


# ------------------------------------------------------------------ slow: parity under (TP, EP) layouts

SCRIPT = Path(__file__).parents[1] / "multiproc" / "moe_run.py"
# name: (processes, overrides). At (2, 1) the experts are split over TP (expert_tensor_parallel_size
# defaults to TP); at (1, 2) the two ranks are also data-parallel for the dense part; the last combines TP,
# PP and EP with whole experts (ETP=1), the EP ranks taken from the TP ranks.
LAYOUTS = {
    "tp1_ep1": (1, []),
    "tp1_ep2": (2, ["megatron.expert_model_parallel_size=2"]),
    "tp2_ep1": (2, ["megatron.tensor_model_parallel_size=2"]),
    "tp2_pp2_ep2_etp1": (4, ["megatron.tensor_model_parallel_size=2", "megatron.pipeline_model_parallel_size=2",
                             "megatron.expert_model_parallel_size=2", "megatron.expert_tensor_parallel_size=1"]),
}
CASES = [pytest.param(layout, name, id=f"{layout}-{name}") for layout in LAYOUTS for name in MODELS]
CHECKPOINTED = "qwen2_moe"  # saved and reloaded under every layout (shared expert, all parameter kinds)


@pytest.fixture(scope="module")
def runs(hf_models, tmp_path_factory):
    out = {}
    for layout, (nproc, overrides) in LAYOUTS.items():
        root = tmp_path_factory.mktemp(layout)
        spec = root / "models.json"
        spec.write_text(json.dumps({n: [str(hf_models[n]), head, extra, n == CHECKPOINTED]
                                    for n, (_, head, extra) in MODELS.items()}))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               str(SCRIPT), str(root), str(spec), *overrides]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
        out[layout] = (root, json.loads((root / "results.json").read_text()))
    return out


def _source_head(name, folder, seed):
    stored = _tensors(folder)
    if MODELS[name][1] == "from_checkpoint":
        return {"score.weight": stored["score.weight"], "score.bias": stored["score.bias"]}
    from megacritic.model.weights import seeded_initializer
    return {"score.weight": seeded_initializer(_config(folder).model, seed)("score.weight"),
            "score.bias": torch.zeros(1)}


@pytest.mark.slow
@pytest.mark.parametrize("layout, name", CASES)
def test_values_match_transformers(runs, hf_models, layout, name):
    _, results = runs[layout]
    got = results[name]
    ref, _ = _hf_values(hf_models[name], got, _source_head(name, hf_models[name], got["seed"]))
    # float32, same weights and routing; only kernels and reduction order differ
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
        assert torch.equal(t, expected[n]), n


@pytest.mark.slow
@pytest.mark.parametrize("layout, name", CASES)
def test_trained_export_computes_our_values(runs, layout, name):
    root, results = runs[layout]
    got = results[name]
    ref, info = _hf_values(root / name / "trained", {**got, "values": got["values_after"]})
    assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"])
    assert _rel(got["values_after"], ref) < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_checkpoint_reloads_the_trained_critic(runs, layout):
    got = runs[layout][1][CHECKPOINTED]
    assert got["reloaded"] == got["values_after"]  # bit for bit: same layout, same weights
    assert got["snapshot_same"] and all(got["snapshot_same"].values()), got["snapshot_same"]  # bit for bit


@pytest.mark.slow
@pytest.mark.parametrize("layout", [layout for layout in LAYOUTS if layout != "tp1_ep1"])
@pytest.mark.parametrize("name", list(MODELS))
def test_training_matches_one_process(runs, layout, name):
    ref, got = runs["tp1_ep1"][1][name], runs[layout][1][name]
    assert _rel(got["values"], ref["values"]) < 1e-5
    keys = ["critic/vf_loss", "critic/grad_norm", "critic/vf_clipfrac", "critic/vpred_mean"]
    if MODELS[name][2] == ["model.moe_aux_loss_coeff=0.01"]:
        keys.append("critic/moe_aux_loss")
    for key in keys:
        assert len(got["metrics"][key]) == 3, key
        assert _rel(got["metrics"][key][:1], ref["metrics"][key][:1]) < 1e-5, key
        assert _rel(got["metrics"][key], ref["metrics"][key]) < 1e-3, key
    assert _rel(got["values_after"], ref["values_after"]) < 1e-3


@pytest.mark.slow
def test_training_moved_the_weights_and_honoured_the_router_settings(runs):
    results = runs["tp1_ep1"][1]
    for name in MODELS:
        got = results[name]
        assert _rel(got["values_after"], got["values"]) > 1e-2, name
        assert got["metrics"]["critic/skipped_steps"] == [0.0, 0.0, 0.0], name
    assert results["mixtral"]["routers"][0] == results["mixtral"]["routers"][1]  # frozen
    assert results["qwen2_moe"]["routers"][0] != results["qwen2_moe"]["routers"][1]
    assert "critic/moe_aux_loss" not in results["qwen3_moe"]["metrics"]  # off by default
    aux = results["qwen2_moe"]["metrics"]["critic/moe_aux_loss"]
    assert all(0.5 < a < 4 for a in aux), aux  # E * sum(f * P): 1 when perfectly balanced
