"""megacritic as verl's critic engine: verl's own TrainingWorker (no megacritic class in between), spawned by
verl's worker-group code, runs the plugin engine selected by configuration alone (skipped without verl).

The trainer's calls are issued as verl 0.9.1's trainers issue them: V0 (``RayPPOTrainer._compute_values`` /
``_update_critic``: ``left_right_2_no_padding`` TensorDicts) and V1 (``trainer_base.py``: ``KVBatchMeta``
through TransferQueue, ``response_from_nested``). Layouts DP=2, TP=2 and PP=2 (two Ray actors, gloo) must
reproduce one process at the parity suite's tolerances (values 1e-5, first update 1e-5, later ones 1e-3).
"""

import contextlib
import os
import re
import shlex
from functools import partial

import numpy as np
import pytest
import torch

verl = pytest.importorskip("verl", reason="verl is not installed (make test-verl builds an environment with it)")
ray = pytest.importorskip("ray")

from omegaconf import OmegaConf  # noqa: E402
from tensordict import TensorDict  # noqa: E402
from verl import DataProto  # noqa: E402
from verl.single_controller.ray import (  # noqa: E402
    RayClassWithInitArgs, RayResourcePool, RayWorkerGroup, create_colocated_worker_cls)
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.utils.config import omega_conf_to_dataclass  # noqa: E402
from verl.utils.metric import reduce_metrics  # noqa: E402
from verl.utils.py_functional import rename_dict  # noqa: E402
from verl.utils.transferqueue_utils import KVBatchMeta  # noqa: E402
from verl.workers.config import TrainingWorkerConfig  # noqa: E402
from verl.workers.engine_workers import TrainingWorker  # noqa: E402
from verl.workers.utils.losses import value_loss  # noqa: E402
from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding  # noqa: E402

from megacritic.cli import init_hf  # noqa: E402
from verl_ports import master_port_range  # noqa: E402  (tests/integrations/verl_ports.py)

SHIPPED = os.path.join(os.path.dirname(verl.__file__), "trainer", "config", "_generated_ppo_megatron_trainer.yaml")
README = os.path.join(os.path.dirname(__file__), "..", "..", "README.md")
ROLLOUT_N = 2
CALL_TIMEOUT_S = 300  # one call of the worker group on this CPU machine takes seconds; beyond this it hangs
BATCH = 16  # rollouts per call; one mini-batch (ppo_mini_batch_size 8 prompts x 2), one optimizer step
CALLS = 3


def readme_overrides() -> list[str]:
    """The verl command line of README's "Inside verl": the overrides that select megacritic."""
    text = open(README).read()
    section = text[text.index("## Inside verl"):]
    command = re.search(r"```bash\n(python -m verl\.trainer\.main_ppo.*?)\n```", section, re.S).group(1)
    words = shlex.split(command.replace("\\\n", " "))
    return [w for w in words if "megacritic" in w]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("tiny-critic"))
    init_hf(out, ["model.num_hidden_layers=2"], None)
    return out


def trainer_config(model_path: str, tp: int = 1, pp: int = 1):
    """verl's shipped Megatron trainer config with README's overrides applied as verl's CLI would."""
    config = OmegaConf.load(SHIPPED)
    for override in readme_overrides():
        key, value = override.lstrip("+").split("=", 1)
        OmegaConf.update(config, key, value, force_add=override.startswith("+"))
    config.actor_rollout_ref.rollout.n = ROLLOUT_N
    critic = config.critic
    critic.model.path = model_path
    critic.model.load_tokenizer = False  # the tiny folder has no tokenizer; the critic needs none
    critic.ppo_mini_batch_size = BATCH // ROLLOUT_N
    critic.ppo_micro_batch_size_per_gpu = 2
    critic.use_dynamic_bsz = True
    critic.ppo_max_token_len_per_gpu = 24  # several packed micro-batches per rank
    critic.ppo_infer_max_token_len_per_gpu = 1000  # what V1 wrongly hands the engine for training too
    critic.ppo_epochs = 1
    critic.shuffle = False
    critic.data_loader_seed = 3
    critic.optim.lr = 1e-3
    critic.megatron.tensor_model_parallel_size = tp
    critic.megatron.pipeline_model_parallel_size = pp
    # megacritic-only: float32 on CPU, for exact arithmetic
    OmegaConf.update(critic, "megacritic", {"model": {"dtype": "float32"}}, force_add=True)
    return config


def verl_batch(seed: int) -> DataProto:
    gen = torch.Generator().manual_seed(seed)
    p_max, r_max, vocab = 6, 9, 64
    p_len = torch.randint(1, p_max + 1, (BATCH,), generator=gen)
    r_len = torch.randint(1, r_max + 1, (BATCH,), generator=gen)
    cols_p, cols_r = torch.arange(p_max), torch.arange(r_max)
    attention_mask = torch.cat([cols_p[None] >= (p_max - p_len)[:, None], cols_r[None] < r_len[:, None]], 1).long()
    input_ids = torch.randint(1, vocab, attention_mask.shape, generator=gen) * attention_mask
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    response_mask = attention_mask[:, p_max:].clone()
    returns = torch.randn(BATCH, r_max, generator=gen) * response_mask
    return DataProto.from_dict(
        tensors={"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
                 "prompts": input_ids[:, :p_max], "responses": input_ids[:, p_max:], "response_mask": response_mask,
                 "returns": returns},
        non_tensors={"uid": np.array([str(i // ROLLOUT_N) for i in range(BATCH)], dtype=object)},
        meta_info={"temperature": 1.0})


CPU_PLATFORM = os.path.join(os.path.dirname(__file__), "verl_cpu")


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray cluster whose workers run verl on a CPU platform (verl_cpu/verl_cpu_platform.py), loaded
    through verl's own VERL_USE_EXTERNAL_MODULES hook; the driver loads it too."""
    env = {"VERL_PLATFORM": "cpu", "VERL_USE_EXTERNAL_MODULES": "verl_cpu_platform",
           "PYTHONPATH": os.pathsep.join([CPU_PLATFORM, os.environ.get("PYTHONPATH", "")])}
    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)
        mp.syspath_prepend(CPU_PLATFORM)
        __import__("verl_cpu_platform")
        # Logical CPUs (Ray schedules by them; the machine may have fewer cores): a worker group takes one per
        # rank, TransferQueue one for its controller and one per storage unit.
        ray.init(num_cpus=6, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": env})
        yield
        ray.shutdown()


@contextlib.contextmanager
def critic_group(config, world_size: int):
    """verl's trainer setup of the critic (V1 ``trainer_base._setup``): the critic section instantiated,
    its TrainingWorkerConfig, verl's TrainingWorker in a colocated worker group, ``reset`` and
    ``set_loss_fn(partial(value_loss, config=critic))``."""
    critic_cfg = omega_conf_to_dataclass(config.critic)
    critic_cfg.engine.infer_max_token_len_per_gpu = critic_cfg.ppo_infer_max_token_len_per_gpu
    critic_cfg.engine.max_token_len_per_gpu = critic_cfg.ppo_infer_max_token_len_per_gpu  # V1's (issue 7462)
    worker_cfg = TrainingWorkerConfig(model_type="value_model", model_config=critic_cfg.model,
                                      engine_config=critic_cfg.engine, optimizer_config=critic_cfg.optim,
                                      checkpoint_config=critic_cfg.checkpoint)
    # verl waits for the pool's placement group without a timeout: a pool that does not fit would hang
    free = ray.available_resources().get("CPU", 0)
    assert free >= world_size, (f"the Ray cluster has {free} free CPUs, a critic group of {world_size} needs "
                                f"{world_size}: {ray.cluster_resources()}")
    pool = RayResourcePool(process_on_nodes=[world_size], use_gpu=False, max_colocate_count=1)
    class_dict = {"critic": RayClassWithInitArgs(cls=ray.remote(TrainingWorker), config=worker_cfg)}
    group = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=create_colocated_worker_cls(class_dict=class_dict),
                           device_name="cpu", master_port_range=master_port_range())
    try:
        critic_wg = group.spawn(prefix_set=class_dict.keys())["critic"]
        critic_wg.reset()
        critic_wg.set_loss_fn(partial(value_loss, config=critic_cfg))
        yield critic_wg
    finally:
        for actor in group._workers:
            ray.kill(actor)
        for pg in pool.pgs or ():
            ray.util.remove_placement_group(pg)


def v0_compute_values(critic_wg, batch: DataProto) -> torch.Tensor:
    """verl 0.9.1's RayPPOTrainer._compute_values."""
    batch_td = left_right_2_no_padding(batch.to_tensordict())
    tu.assign_non_tensor(batch_td, compute_loss=False)
    output = critic_wg.infer_batch(batch_td).get()
    return no_padding_2_padding(tu.get(output, "values"), batch_td).float()


def v0_update_critic(critic_wg, batch: DataProto, config) -> dict:
    """verl 0.9.1's RayPPOTrainer._update_critic, then the trainer's reduce_metrics."""
    batch_td = left_right_2_no_padding(batch.to_tensordict())
    mini = config.critic.ppo_mini_batch_size * config.actor_rollout_ref.rollout.n
    tu.assign_non_tensor(batch_td, global_batch_size=mini, mini_batch_size=mini, epochs=config.critic.ppo_epochs,
                         seed=config.critic.data_loader_seed, dataloader_kwargs={"shuffle": config.critic.shuffle})
    output = rename_dict(tu.get(critic_wg.train_mini_batch(batch_td).get(), "metrics"), "critic/")
    output["perf/mfu/critic"] = output.pop("critic/mfu")
    return reduce_metrics(output)


def run_calls(config, world_size: int, calls: int = CALLS, save_to=None, load_from=None):
    """``calls`` PPO iterations of the critic through verl's V0 calls: values, update. Returns per call the
    values and the update's metrics, and the values after the last update."""
    out = []
    with critic_group(config, world_size) as critic_wg:
        if load_from is not None:
            critic_wg.load_checkpoint(load_from, None, False)
        for call in range(calls):
            batch = verl_batch(seed=call)
            values = v0_compute_values(critic_wg, batch)
            batch.batch["values"] = values
            out.append((values, v0_update_critic(critic_wg, batch, config)))
        after = v0_compute_values(critic_wg, verl_batch(seed=calls))
        if save_to is not None:
            critic_wg.save_checkpoint(save_to, None, calls, None)
    return out, after


def assert_close(actual, expected, rel, what):
    actual, expected = torch.as_tensor(actual, dtype=torch.float64), torch.as_tensor(expected, dtype=torch.float64)
    scale = expected.abs().max().clamp(min=1e-12)
    assert (actual - expected).abs().max() / scale <= rel, f"{what}: {actual} vs {expected}"


@pytest.fixture(scope="module")
def single(tiny_model, ray_cluster):
    return run_calls(trainer_config(tiny_model), world_size=1)


def test_readme_selects_megacritic_with_configuration_only():
    overrides = readme_overrides()
    assert 1 <= len(overrides) <= 2, overrides
    config = trainer_config("/nonexistent")
    assert config.critic._target_ == "megacritic.integrations.verl.MegacriticCriticConfig"


@pytest.mark.parametrize("layout", ["dp2", "tp2", "pp2"])
def test_training_worker_layouts_match_one_process(layout, tiny_model, single):
    tp, pp = {"dp2": (1, 1), "tp2": (2, 1), "pp2": (1, 2)}[layout]
    calls, after = run_calls(trainer_config(tiny_model, tp=tp, pp=pp), world_size=2)
    ref_calls, ref_after = single
    for call, ((values, metrics), (ref_values, ref_metrics)) in enumerate(zip(calls, ref_calls)):
        rel = 1e-5 if call == 0 else 1e-3
        assert_close(values, ref_values, rel, f"values before update {call}")
        # (verl averages vf_clipfrac and vpred_mean per micro-batch: they depend on the layout by definition)
        for key in ("critic/vf_loss", "critic/grad_norm"):
            assert_close(metrics[key], ref_metrics[key], rel, f"{key} of update {call}")
    assert_close(after, ref_after, 1e-3, "values after the updates")
    assert calls[-1][1]["critic/lr"] == pytest.approx(1e-3) and "perf/mfu/critic" in calls[-1][1]


@contextlib.contextmanager
def transfer_queue(config):
    """TransferQueue as verl's V1 TaskRunner starts it (``tq.init(config.transfer_queue)``), closed after.

    Each of its storage units and its controller is a Ray actor asking for one CPU: verl's default of 8
    units needs 9 CPUs besides the workers', so this test runs one unit (``num_data_storage_units``, a key of
    verl's transfer_queue section); with too few CPUs for the worker group verl's placement-group wait never
    returns (critic_group checks first)."""
    tq = pytest.importorskip("transfer_queue")
    config.transfer_queue.enable = True
    config.transfer_queue.backend.SimpleStorage.num_data_storage_units = 1
    tq.init(config.transfer_queue)
    try:
        yield tq
    finally:
        tq.close()


def test_v1_trainer_calls_through_transfer_queue(tiny_model, single):
    """verl 0.9.1's V1 trainer (trainer_base.py: reset and set_loss_fn, then per iteration _compute_values and
    _update_critic): the batch lives in TransferQueue as nested per-rollout fields and travels to the workers
    as a KVBatchMeta; values come back through TransferQueue. 3 iterations at DP=2 equal one process."""
    from verl.workers.utils.padding import response_from_nested, response_to_nested
    config = trainer_config(tiny_model)
    ref_calls, _ = single
    with transfer_queue(config) as tq, critic_group(config, world_size=2) as critic_wg:
        for call in range(CALLS):
            batch = verl_batch(seed=call).batch
            mask = batch["attention_mask"].bool()
            p = batch["prompts"].shape[1]
            rows = [{"prompts": batch["prompts"][i][mask[i, :p]], "responses": batch["responses"][i][mask[i, p:]],
                     "input_ids": batch["input_ids"][i][mask[i]], "position_ids": batch["position_ids"][i][mask[i]],
                     "response_mask": batch["response_mask"][i][mask[i, p:]]} for i in range(BATCH)]
            for row in rows:
                row["loss_mask"] = row["response_mask"]
            keys = [f"{call}_{i}" for i in range(BATCH)]
            tags = [{"status": "success"} for _ in keys]
            tq.kv_batch_put(keys=keys, partition_id="train", fields=tu.list_of_dict_to_tensordict(rows), tags=tags)
            meta = KVBatchMeta(partition_id="train", keys=keys, tags=tags)
            # _compute_values
            meta.extra_info.update({"compute_loss": False, "temperature": 1.0})
            ray.get(critic_wg.infer_batch(meta).futures, timeout=CALL_TIMEOUT_S)
            data = tq.kv_batch_get(keys=keys, partition_id="train", select_fields=["values", "response_mask"])
            values = response_from_nested(data["values"], data["response_mask"])
            tq.kv_batch_put(keys=keys, partition_id="train", fields=TensorDict({"values": values}, batch_size=BATCH))
            assert_close(values.to_padded_tensor(0.0, output_size=(BATCH, batch["responses"].shape[1])),
                         ref_calls[call][0], 1e-5 if call == 0 else 1e-3, f"V1 values of call {call}")
            # _compute_advantage writes the returns, nested
            returns = response_to_nested(batch["returns"], data["response_mask"])
            tq.kv_batch_put(keys=keys, partition_id="train", fields=TensorDict({"returns": returns}, batch_size=BATCH))
            # _update_critic
            mini = config.critic.ppo_mini_batch_size * ROLLOUT_N
            meta.extra_info.update({"global_batch_size": mini, "mini_batch_size": mini,
                                    "epochs": config.critic.ppo_epochs, "seed": config.critic.data_loader_seed,
                                    "dataloader_kwargs": {"shuffle": config.critic.shuffle}, "temperature": 1.0})
            future = critic_wg.train_mini_batch(meta)
            ray.get(future.futures, timeout=CALL_TIMEOUT_S)
            output = rename_dict(future.get()["metrics"], "critic/")
            output["perf/mfu/critic"] = output.pop("critic/mfu")
            metrics = reduce_metrics(output)
            for key in ("critic/vf_loss", "critic/grad_norm"):
                assert_close(metrics[key], ref_calls[call][1][key], 1e-5 if call == 0 else 1e-3, f"V1 {key} {call}")
            tq.kv_clear(keys=keys, partition_id="train")  # as the trainer does after each step


def test_nccl_timeout_reaches_the_critics_process_groups(tiny_model, ray_cluster):
    """verl's critic.nccl_timeout, which verl's TrainingWorker drops (it creates the world group without a
    timeout: verl issue 7815), is the timeout of every process group the critic's collectives use: the
    world group verl created and the groups megacritic creates."""
    def group_timeouts(worker_dict) -> dict:
        # runs in a worker's process (a function of the test: Ray ships it by value)
        import torch.distributed as dist
        engine = worker_dict.worker_dict["critic"].engine
        groups = engine.worker.groups
        named = {"world": dist.group.WORLD, "dp": engine.get_data_parallel_group(), "dp_cp": groups.dp_cp,
                 "dp_gloo": groups.dp_gloo, "tp": groups.tp, "pp": groups.pp, "cp": groups.cp}
        return {name: group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
                for name, group in named.items()}

    config = trainer_config(tiny_model, tp=2)
    config.critic.nccl_timeout = 123  # neither torch's default (1800 s on gloo) nor whole minutes
    with critic_group(config, world_size=2) as critic_wg:
        timeouts = ray.get([w.__ray_call__.remote(group_timeouts) for w in critic_wg.workers],
                           timeout=CALL_TIMEOUT_S)
    for rank, seconds in enumerate(timeouts):
        assert seconds == dict.fromkeys(seconds, 123.0), f"rank {rank}: {seconds}"


def test_checkpoint_resume_equals_the_uninterrupted_run(tiny_model, single, tmp_path):
    """verl's save_checkpoint after 2 calls, a fresh group's load_checkpoint, the third call: as the run of
    3 calls without a pause."""
    config = trainer_config(tiny_model)
    folder = str(tmp_path / "global_step_2" / "critic")
    run_calls(config, world_size=1, calls=2, save_to=folder)
    with critic_group(config, world_size=1) as critic_wg:
        critic_wg.load_checkpoint(folder, None, False)
        batch = verl_batch(seed=2)
        values = v0_compute_values(critic_wg, batch)
        batch.batch["values"] = values
        metrics = v0_update_critic(critic_wg, batch, config)
        after = v0_compute_values(critic_wg, verl_batch(seed=CALLS))
    ref_calls, ref_after = single
    assert torch.equal(values, ref_calls[2][0])
    assert metrics["critic/vf_loss"] == ref_calls[2][1]["critic/vf_loss"]
    assert torch.equal(after, ref_after)


def test_malformed_batch_names_the_key_and_changes_nothing(tiny_model, ray_cluster):
    config = trainer_config(tiny_model)
    with critic_group(config, world_size=2) as critic_wg:
        batch = verl_batch(seed=0)
        before = v0_compute_values(critic_wg, batch)
        batch.batch["values"] = before
        broken = DataProto.from_dict(tensors={k: v for k, v in batch.batch.items() if k != "returns"},
                                     non_tensors=dict(batch.non_tensor_batch))
        with pytest.raises(ray.exceptions.RayTaskError, match=r"missing key\(s\) \['returns'\]"):
            v0_update_critic(critic_wg, broken, config)
        assert torch.equal(v0_compute_values(critic_wg, batch), before)


def test_value_loss_read_once_equals_verls_own_per_micro_batch(tiny_model):
    """In one process: the engine's values equal CriticWorker.compute_values'; verl's value_loss as the engine
    computes it (partial(value_loss, config=critic), as verl's trainer passes it: metrics kept on the device,
    read once after the pass) equals verl's own function called on each micro-batch's rows of verl's
    TensorDict: losses, metrics and gradients bit for bit."""
    from verl.utils.metric import Metric
    from verl.workers.engine import EngineRegistry

    from megacritic.integrations.verl.engine import _ValueLoss

    cfg = omega_conf_to_dataclass(trainer_config(tiny_model).critic)
    engine = EngineRegistry.new("value_model", "megacritic", model_config=cfg.model, engine_config=cfg.engine,
                                optimizer_config=cfg.optim, checkpoint_config=cfg.checkpoint)
    engine.initialize()
    try:
        batch = verl_batch(seed=0).batch
        td = left_right_2_no_padding(batch.clone())
        tu.assign_non_tensor(td, compute_loss=False)
        values = no_padding_2_padding(engine.infer_batch(td)["model_output"]["values"], td).float()
        assert torch.equal(values, engine.worker.compute_values(batch))
        batch["values"] = values

        def verls_own(**kwargs):  # not the partial: the engine calls it on each micro-batch's rows
            return value_loss(config=cfg, **kwargs)

        runs = []
        for loss_fn in (partial(value_loss, config=cfg), verls_own):
            td = left_right_2_no_padding(batch.clone())
            tu.assign_non_tensor(td, global_batch_size=len(batch))
            assert _ValueLoss.applies(loss_fn, td) == (loss_fn is not verls_own)
            engine.optimizer_zero_grad()
            out = engine.forward_backward_batch(td, loss_fn)
            grads = [b.grad_data.clone() for chunk in engine.worker.state.model for b in chunk.buffers]
            runs.append((out, grads))
        (read_once, grads), (own, own_grads) = runs
        assert len(own["loss"]) > 1  # several micro-batches
        assert read_once["loss"] == own["loss"]
        assert read_once["metrics"].keys() == own["metrics"].keys()
        for key, metric in own["metrics"].items():
            if isinstance(metric, Metric):  # vf_loss: one Metric of the micro-batches' values
                assert (read_once["metrics"][key].values, read_once["metrics"][key].aggregation) == \
                    (metric.values, metric.aggregation)
            else:
                assert read_once["metrics"][key] == metric, key
        assert all(torch.equal(a, b) for a, b in zip(grads, own_grads))
    finally:
        engine.worker.close()
