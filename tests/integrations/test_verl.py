"""megacritic as verl's critic, through verl's own single-controller path (skipped without verl).

verl's RayResourcePool (CPU bundles), create_colocated_worker_cls and the worker group's spawn run the
adapter's worker class at DP=2 and TP=2 (two Ray actors, gloo); the batches and results go through the
trainer's own pre- and post-processing of both of verl's critic interfaces (RayPPOTrainer._compute_values /
_update_critic of verl 0.9, and the legacy compute_values / update_critic of verl <= 0.8), and must reproduce
a single-process CriticWorker on the same rollouts. The config enumeration checks that every leaf of verl's
shipped megatron critic section is mapped, converted, logged as bookkeeping or refused by name.
"""

import contextlib
import logging
import os
from functools import partial

import numpy as np
import pytest
import torch

verl = pytest.importorskip("verl", reason="verl is not installed (make test-verl builds an environment with it)")
ray = pytest.importorskip("ray")

from omegaconf import OmegaConf  # noqa: E402
from verl import DataProto  # noqa: E402
from verl.single_controller.ray import (  # noqa: E402
    RayClassWithInitArgs, RayResourcePool, RayWorkerGroup, create_colocated_worker_cls)
from verl.utils.metric import reduce_metrics  # noqa: E402  (the trainer's own)
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.utils.config import omega_conf_to_dataclass  # noqa: E402
from verl.utils.py_functional import rename_dict  # noqa: E402
from verl.workers.config import TrainingWorkerConfig  # noqa: E402
from verl.workers.utils.losses import value_loss  # noqa: E402
from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding  # noqa: E402

from megacritic import ConfigError, CriticWorker, load_config  # noqa: E402
from megacritic.cli import init_hf  # noqa: E402
from megacritic.config import TINY_MODEL_OVERRIDES  # noqa: E402
from megacritic.integrations.verl import (  # noqa: E402
    config_from_verl, critic_config_from_verl, critic_worker_cls, verl_leaves, verl_rule)
from verl_ports import master_port_range  # noqa: E402  (tests/integrations/verl_ports.py)

SHIPPED = os.path.join(os.path.dirname(verl.__file__), "trainer", "config", "_generated_ppo_megatron_trainer.yaml")
ROLLOUT_N = 2
PROMPTS_PER_MINI_BATCH = 4          # verl's ppo_mini_batch_size: 8 rollouts per optimizer step
BATCH = 16                          # rollouts per call: two mini-batches, two optimizer steps
OVERRIDES = ("model.dtype=float32",)  # megacritic-only: exact CPU arithmetic


def shipped_config():
    return OmegaConf.load(SHIPPED)


# ---------------------------------------------------------------------------------------------- config


def test_every_shipped_critic_setting_is_accounted_for():
    critic = shipped_config().critic
    leaves = verl_leaves(critic)
    assert len(leaves) > 150  # the whole section, nested model / megatron / optim / profiler blocks included
    kinds = {}
    for key in leaves:
        rule = verl_rule(key)
        assert rule is not None, f"critic.{key} has no rule"
        kinds.setdefault(rule.kind, []).append(key)
    assert set(kinds) == {"mapped", "converted", "bookkeeping", "refused"}
    # Every refused setting passes at its shipped value and is refused, by name, at another one.
    for key in kinds["refused"]:
        rule = verl_rule(key)
        assert leaves[key] in rule.allowed, key
        changed = shipped_config().critic
        changed.ppo_micro_batch_size_per_gpu = 2
        OmegaConf.update(changed, key, _other_value(leaves[key]), force_add=True)
        with pytest.raises(ConfigError, match=f"critic.{key}"):
            config_from_verl(changed)


def _other_value(value):
    if isinstance(value, bool):
        return not value
    if value is None:
        return "something"
    if isinstance(value, (int, float)):
        return value + 1
    if isinstance(value, dict):
        return {"some_option": 1}
    if isinstance(value, list):
        return value[:1]
    return value + "-other"


def test_shipped_section_converts(caplog):
    critic = shipped_config().critic
    critic.ppo_micro_batch_size_per_gpu = 2
    with caplog.at_level(logging.INFO, logger="megacritic.integrations.verl"):
        overrides = config_from_verl(critic, rollout_n=1)
    settings = dict(o.split("=", 1) for o in overrides)
    assert settings["optim.schedule_unit"] == '"call"'
    assert settings["ppo_mini_batch_size"] == settings["data.rollouts_per_step"] == "256"
    assert settings["model.dtype"] == '"bfloat16"'
    assert settings["model.path"] == '"' + os.path.expanduser("~/models/deepseek-llm-7b-chat") + '"'
    assert "profiler.tool_config.torch.schedule.wait" in caplog.text  # bookkeeping is logged, not silent
    # Everything but the (absent) model folder validates.
    config = load_config([*TINY_MODEL_OVERRIDES, *(o for o in overrides if not o.startswith("model.path"))])
    assert config.optim.lr == 1e-5 and config.shuffle is False and config.megatron.nccl_timeout == 600


def test_units_that_differ_are_converted():
    critic = shipped_config().critic
    critic.ppo_micro_batch_size_per_gpu = 2
    critic.ppo_mini_batch_size = 16
    critic.optim.lr_warmup_steps = 0
    critic.megatron.override_transformer_config.recompute_granularity = "full"
    critic.megatron.override_transformer_config.recompute_method = "uniform"
    critic.megatron.override_transformer_config.recompute_num_layers = 1
    critic.loss_agg_mode = "token-sum"
    critic.loss_scale_factor = 64
    settings = dict(o.split("=", 1) for o in config_from_verl(critic, rollout_n=8))
    assert settings["ppo_mini_batch_size"] == "128"  # prompts x responses per prompt
    assert settings["optim.lr_warmup_steps"] == "-1"  # verl's 0: use the ratio
    assert settings["megatron.recompute_granularity"] == '"full"'
    assert settings["megatron.recompute_method"] == '"uniform"'
    assert settings["megatron.recompute_num_layers"] == "1"
    assert settings["loss_agg_mode"] == '"token-sum"' and settings["loss_scale_factor"] == "64"
    critic.rollout_n = 4  # without the argument, the section's own factor (verl <= 0.8's worker uses it)
    assert "ppo_mini_batch_size=64" in config_from_verl(critic)
    critic.rollout_n = 0
    with pytest.raises(ConfigError, match="rollout_n"):
        config_from_verl(critic)
    critic.rollout_n = 2
    critic.some_new_key = 1
    with pytest.raises(ConfigError, match="critic.some_new_key"):
        config_from_verl(critic)


# ---------------------------------------------------------------------------------------------- verl's path


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A tiny Qwen2-style Hugging Face folder (megacritic's seeded model), for verl's HFModelConfig and ours."""
    out = str(tmp_path_factory.mktemp("tiny-critic"))
    init_hf(out, ["model.num_hidden_layers=2"], None)
    return out


def critic_section(model_path: str, tp: int = 1):
    config = shipped_config()
    config.actor_rollout_ref.rollout.n = ROLLOUT_N
    critic = config.critic
    critic.model.path = model_path
    critic.model.load_tokenizer = False  # the tiny folder has no tokenizer; the critic needs none
    critic.ppo_mini_batch_size = PROMPTS_PER_MINI_BATCH
    critic.ppo_micro_batch_size_per_gpu = 2
    critic.ppo_epochs = 1
    critic.shuffle = True
    critic.data_loader_seed = 3
    critic.optim.lr = 1e-3
    critic.megatron.tensor_model_parallel_size = tp
    return config, critic


def verl_batch(seed: int = 0) -> DataProto:
    """Rollouts as verl's rollout and trainer hand them to the critic: left-padded prompts, right-padded
    responses, positions counting on through the response padding, a response_mask with a hole (a tool
    token), returns from the reward, a non-tensor uid."""
    gen = torch.Generator().manual_seed(seed)
    p_max, r_max, vocab = 6, 9, 64
    p_len = torch.randint(1, p_max + 1, (BATCH,), generator=gen)
    r_len = torch.randint(1, r_max + 1, (BATCH,), generator=gen)
    cols_p, cols_r = torch.arange(p_max), torch.arange(r_max)
    attention_mask = torch.cat([cols_p[None] >= (p_max - p_len)[:, None], cols_r[None] < r_len[:, None]], 1).long()
    input_ids = torch.randint(1, vocab, attention_mask.shape, generator=gen) * attention_mask
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    response_mask = attention_mask[:, p_max:].clone()
    response_mask[0, 0] = 0 if r_len[0] > 1 else 1
    returns = torch.randn(BATCH, r_max, generator=gen) * response_mask
    return DataProto.from_dict(
        tensors={"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
                 "prompts": input_ids[:, :p_max], "responses": input_ids[:, p_max:], "response_mask": response_mask,
                 "returns": returns},
        non_tensors={"uid": np.array([str(i // ROLLOUT_N) for i in range(BATCH)], dtype=object)},
        meta_info={"temperature": 1.0})


@pytest.fixture(scope="module")
def reference(tiny_model):
    """One process: values, then one update call (metrics), then values again."""
    _, critic = critic_section(tiny_model)
    worker = CriticWorker(critic_config_from_verl(critic, overrides=OVERRIDES))
    worker.init_model()
    try:
        batch = verl_batch()
        values = worker.compute_values(batch)
        batch.batch["values"] = values
        metrics = worker.update_critic(batch)
        after = worker.compute_values(batch)
    finally:
        worker.close()
    return batch, values, metrics, after


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@contextlib.contextmanager
def critic_group(worker_cls, init_config, world_size: int = 2):
    """verl's RayPPOTrainer.init_workers for the critic role: a CPU resource pool, the colocated WorkerDict
    class, the worker group, spawn. Its actors and placement group are removed afterwards."""
    pool = RayResourcePool(process_on_nodes=[world_size], use_gpu=False, max_colocate_count=1)
    class_dict = {"critic": RayClassWithInitArgs(cls=ray.remote(worker_cls), config=init_config)}
    group = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=create_colocated_worker_cls(class_dict=class_dict),
                           device_name="cpu", master_port_range=master_port_range())
    try:
        yield group.spawn(prefix_set=class_dict.keys())["critic"]
    finally:
        for actor in group._workers:
            ray.kill(actor)
        for pg in pool.pgs or ():
            ray.util.remove_placement_group(pg)


def engine_compute_values(critic_wg, batch: DataProto) -> torch.Tensor:
    """verl 0.9's RayPPOTrainer._compute_values."""
    batch_td = left_right_2_no_padding(batch.to_tensordict())
    tu.assign_non_tensor(batch_td, compute_loss=False)
    output = critic_wg.infer_batch(batch_td).get()
    values = no_padding_2_padding(tu.get(output, "values"), batch_td)
    return DataProto.from_tensordict(tu.get_tensordict({"values": values.float()})).batch["values"]


def engine_update_critic(critic_wg, batch: DataProto, config) -> dict:
    """verl 0.9's RayPPOTrainer._update_critic, then the trainer's reduce_metrics."""
    batch_td = left_right_2_no_padding(batch.to_tensordict())
    mini = config.critic.ppo_mini_batch_size * config.actor_rollout_ref.rollout.n
    tu.assign_non_tensor(batch_td, global_batch_size=mini, mini_batch_size=mini, epochs=config.critic.ppo_epochs,
                         seed=config.critic.data_loader_seed, dataloader_kwargs={"shuffle": config.critic.shuffle})
    output = tu.get(critic_wg.train_mini_batch(batch_td).get(), "metrics")
    output = rename_dict(output, "critic/")
    output["perf/mfu/critic"] = output.pop("critic/mfu")
    return reduce_metrics(DataProto.from_single_dict(data={}, meta_info={"metrics": output}).meta_info["metrics"])


def assert_close(actual, expected, rel=1e-5, what=""):
    actual, expected = torch.as_tensor(actual, dtype=torch.float64), torch.as_tensor(expected, dtype=torch.float64)
    scale = expected.abs().max().clamp(min=1e-12)
    assert (actual - expected).abs().max() / scale <= rel, f"{what}: {actual} vs {expected}"


def _mean(values):
    return sum(values) / len(values)


@pytest.mark.parametrize("layout", ["dp2", "tp2"])
def test_verl_single_controller_path(layout, tiny_model, reference, ray_cluster, tmp_path):
    config, critic = critic_section(tiny_model, tp=2 if layout == "tp2" else 1)
    ref_batch, ref_values, ref_metrics, ref_after = reference
    worker_cls = critic_worker_cls(overrides=OVERRIDES)

    # verl 0.9: the trainer builds a TrainingWorkerConfig from the critic section, then reset + set_loss_fn.
    critic_cfg = omega_conf_to_dataclass(critic)
    training_cfg = TrainingWorkerConfig(model_type="value_model", model_config=critic_cfg.model,
                                        engine_config=critic_cfg.engine, optimizer_config=critic_cfg.optim,
                                        checkpoint_config=critic_cfg.checkpoint)
    with critic_group(worker_cls, training_cfg) as critic_wg:
        critic_wg.reset()
        critic_wg.set_loss_fn(partial(value_loss, config=critic_cfg))
        critic_wg.to("cpu")  # the trainer's manual offload / onload and profiler hooks are accepted
        critic_wg.to("device")
        critic_wg.start_profile(profile_step=1)
        critic_wg.stop_profile(run_command=True)
        batch = verl_batch()
        values = engine_compute_values(critic_wg, batch)
        assert values.shape == ref_values.shape and values.dtype == torch.float32
        assert_close(values, ref_values, what="values (0.9)")
        batch = batch.union(DataProto.from_dict(tensors={"values": values}))
        metrics = engine_update_critic(critic_wg, batch, config)
        after = engine_compute_values(critic_wg, batch)
        # a per-call setting that disagrees with the critic's config is refused by name, before any step
        wrong = left_right_2_no_padding(batch.to_tensordict())
        tu.assign_non_tensor(wrong, mini_batch_size=BATCH, epochs=1, seed=3, dataloader_kwargs={"shuffle": True})
        with pytest.raises(ray.exceptions.RayTaskError, match="ppo_mini_batch_size=16"):
            critic_wg.train_mini_batch(wrong).get()
        assert torch.equal(engine_compute_values(critic_wg, batch), after)
        # the trainer's save: <global_step folder>/critic, local only
        critic_wg.save_checkpoint(str(tmp_path / "global_step_1" / "critic"), None, 1, max_ckpt_to_keep=None)
    for key in ("critic/vf_loss", "critic/grad_norm", "critic/vf_clipfrac", "critic/vpred_mean", "critic/lr"):
        assert_close(metrics[key], _mean(ref_metrics[key]), what=key)
    assert "perf/mfu/critic" in metrics
    assert_close(after, ref_after, rel=1e-3, what="values after the update (0.9)")

    # verl <= 0.8's interface: the critic section itself is the worker's config, init_model builds it.
    with critic_group(critic_worker_cls(overrides=OVERRIDES, api="legacy"), critic) as legacy_wg:
        legacy_wg.init_model()
        batch = verl_batch()
        values = legacy_wg.compute_values(batch)
        batch = batch.union(values)  # the legacy trainer's own line
        output = legacy_wg.update_critic(batch)
        # the 0.9 interface's checkpoint restores into the legacy one (checkpoint_path, del_local_after_load)
        legacy_wg.load_checkpoint(str(tmp_path / "global_step_1" / "critic"), del_local_after_load=False)
        restored = legacy_wg.compute_values(batch).batch["values"]
    assert torch.equal(restored, after)
    assert_close(values.batch["values"], ref_values, what="values (legacy)")
    for key in ("critic/vf_loss", "critic/grad_norm"):
        assert_close(output.meta_info["metrics"][key], ref_metrics[key], what=key)
    reduced = reduce_metrics(output.meta_info["metrics"])
    assert_close(reduced["critic/vf_loss"], _mean(ref_metrics["critic/vf_loss"]), what="reduced vf_loss")
    assert "perf/mfu/critic" in reduced
    assert not any(k.startswith(("timing_s/", "perf/real")) for k in reduced)  # no clash with verl's own keys
