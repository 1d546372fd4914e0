"""megacritic.ray.CriticGroup on CPU (gloo): two Ray actors give the single-process results under DP=2, TP=2
and PP=2; bad batches are refused in the driver; a failing rank tears the group down at once; checkpoints
move between layouts; placement that cannot be met fails with a message.

The single-process reference is tests/multiproc/parity_run.py's own run (model, settings, batch and the
old values that exercise the clipped loss), computed in this process. One Ray cluster for the module.
"""

import dataclasses
import importlib.util
import time
from pathlib import Path

import pytest
import torch

ray = pytest.importorskip("ray")

from megacritic import BatchError, load_config  # noqa: E402
from megacritic.config import ConfigError  # noqa: E402
from megacritic.data.sources import SyntheticRollouts  # noqa: E402
from megacritic.ray import CriticGroup, CriticGroupError, RankPlacement, check_placement, rank_order  # noqa: E402

pytestmark = pytest.mark.ray

_spec = importlib.util.spec_from_file_location("parity_run", Path(__file__).parent / "multiproc" / "parity_run.py")
parity_run = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(parity_run)

TP2, PP2 = "megatron.tensor_model_parallel_size=2", "megatron.pipeline_model_parallel_size=2"
# name: (mode, overrides); one micro-batching mode per layout keeps the module short, and both modes are
# covered (each is compared with the single-process fixed-mode run, as in test_parity.py).
LAYOUTS = {"dp2": ("fixed", []), "tp2": ("dynamic", [TP2]), "pp2": ("fixed", [PP2])}
# Two CPU ranks on one machine; half a CPU each, so that two groups fit the module's cluster of 2 CPUs.
CPU_GROUP = dict(num_gpus_per_node=2, num_gpus_per_actor=0, num_cpus_per_actor=0.5, master_addr="127.0.0.1",
                 call_timeout_s=300)


def _config(mode, overrides):
    return load_config(parity_run.MODEL + parity_run.MODES[mode] + overrides)


def _old_values(values):
    # parity_run.py's old values: different from the predictions, so the clipped branch is exercised
    return values + 0.3 * torch.sin(torch.arange(values.numel()).reshape(values.shape).float())


def _rel(a, b) -> float:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def _batch(config, iteration, values=None):
    batch = SyntheticRollouts(config).batch(iteration)
    if values is not None:
        batch["values"] = _old_values(values)
    return batch


def _ours():
    """Actors of this process's groups that Ray still lists as alive, and placement groups not removed."""
    import ray._private.state as state  # the GCS tables (ray.util.state needs the dashboard)
    actors = [a for a in state.actors().values()
              if a["ActorClassName"].endswith("_RankActor") and a["State"] != "DEAD"]
    pgs = [p for p in ray.util.placement_group_table().values() if p["state"] != "REMOVED"]
    return actors, pgs


def _wait_all_gone(timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        actors, pgs = _ours()
        if not actors and not pgs:
            return [], []
        time.sleep(0.2)
    return _ours()


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def reference():
    return parity_run.run([], ["fixed"])["fixed"]


@pytest.fixture(scope="module")
def runs(cluster, tmp_path_factory):
    """parity_run.py's sequence through a group per layout. The DP=2 group then trains on more and saves a
    checkpoint; the TP=2 group loads it (its own weights differ by then) and the two carry on together."""
    root = tmp_path_factory.mktemp("ray_ckpt")
    out = {}
    for name, (mode, overrides) in LAYOUTS.items():
        config = _config(mode, overrides)
        with CriticGroup(config, **CPU_GROUP) as group:
            group.init_model()
            batch = _batch(config, 0)
            values = group.compute_values(batch)
            batch["values"] = _old_values(values)
            metrics = group.update_critic(batch)
            after = group.compute_values_async(batch).get(timeout=120)
            run = {"values": values, "metrics": metrics, "values_after": after}
            extra = _batch(config, 2)
            if name == "dp2":
                group.update_critic(_batch(config, 1, group.compute_values(_batch(config, 1))))
                run["folder"] = group.save_checkpoint(str(root), 7, {"iteration": 7})
            elif name == "tp2":
                run["state"] = group.load_checkpoint(out["dp2"]["folder"])
            elif name == "pp2":  # collectives over the pipeline stages
                group.offload()  # nothing to move on CPU, but every rank answers
                group.onload(("params",))
                group.export_hf(str(root / "hf"))
                run["exported"] = sorted(p.name for p in (root / "hf").iterdir())
            if name == "tp2":  # futures read out of order
                first, second = group.compute_values_async(batch), group.compute_values_async(extra)
                run["second"], run["first"] = second.get(timeout=120), first.get(timeout=120)
                run["extra"] = group.compute_values(extra)
            if name in ("dp2", "tp2"):
                run["values_ckpt"] = group.compute_values(batch)
                run["metrics_ckpt"] = group.update_critic(_batch(config, 2, group.compute_values(extra)))
            out[name] = run
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_group_matches_single_process(runs, reference, layout):
    got = runs[layout]
    # the suite's tolerances (tests/test_parity.py): float32 rounding only
    assert _rel(got["values"], torch.tensor(reference["values"])) < 1e-5
    for key in ("critic/vf_loss", "critic/grad_norm", "critic/vf_clipfrac", "critic/vpred_mean"):
        assert len(got["metrics"][key]) == 3, key
        assert _rel(got["metrics"][key][:1], reference["metrics"][key][:1]) < 1e-5, key
        assert _rel(got["metrics"][key], reference["metrics"][key]) < 1e-3, key
    assert _rel(got["values_after"], torch.tensor(reference["values_after"])) < 1e-3
    assert _rel(got["values_after"], got["values"]) > 1e-2  # the update really moved the weights


def test_futures_and_collective_calls(runs):
    tp2, pp2 = runs["tp2"], runs["pp2"]
    assert torch.equal(tp2["first"], tp2["values_ckpt"]) and torch.equal(tp2["second"], tp2["extra"])
    assert "config.json" in pp2["exported"] and any(n.endswith(".safetensors") for n in pp2["exported"])


def test_checkpoint_saved_under_dp2_loads_under_tp2(runs):
    dp2, tp2 = runs["dp2"], runs["tp2"]
    assert Path(dp2["folder"]).name.startswith("step_") and int(Path(dp2["folder"]).name[5:]) == 7
    assert tp2["state"] == {"iteration": 7}
    # before the load the TP=2 group held other weights (one update less)
    assert _rel(tp2["values_after"], dp2["values_ckpt"]) > 1e-3
    assert _rel(tp2["values_ckpt"], dp2["values_ckpt"]) < 1e-5
    # optimizer state and LR schedule came along: the next step is the same step
    for key in ("critic/vf_loss", "critic/grad_norm", "critic/lr"):
        assert _rel(tp2["metrics_ckpt"][key][:1], dp2["metrics_ckpt"][key][:1]) < 1e-5, key


@pytest.fixture(scope="module")
def doomed(cluster):
    """A DP=2 group for the failure tests (the last of them kills it). nccl_timeout is long, so a teardown
    that waited for the stuck rank's collective to time out would take 10 minutes."""
    config = _config("fixed", ["megatron.nccl_timeout=600"])
    group = CriticGroup(config, **CPU_GROUP)
    group.init_model()
    yield group, config
    group.shutdown()


class _NoActor:
    def __getattr__(self, name):
        raise AssertionError(f"actor method {name} called for a batch the driver should have refused")


def _not_sent(*args, **kwargs):
    raise AssertionError("ray.put called for a batch the driver should have refused")


def test_malformed_batch_refused_in_driver(doomed, monkeypatch):
    group, config = doomed
    good = _batch(config, 0)
    short_mask = good.clone()
    short_mask["attention_mask"] = good["attention_mask"][:, :-1].clone()
    bad_token = good.clone()
    bad_token["input_ids"][0, -1] = config.model.vocab_size
    bad_token["responses"][0, -1] = config.model.vocab_size
    actors = group._actors
    monkeypatch.setattr(group, "_actors", [_NoActor() for _ in actors])
    monkeypatch.setattr(ray, "put", _not_sent)  # nothing reaches the object store either
    with pytest.raises(BatchError, match="attention_mask has shape"):
        group.compute_values(short_mask)
    with pytest.raises(BatchError, match="outside the vocabulary"):
        group.compute_values_async(bad_token)
    with pytest.raises(BatchError, match="missing key"):
        group.update_critic(good)  # no values / returns
    targets = _batch(config, 0, torch.zeros(good["responses"].shape))
    with pytest.raises(BatchError, match="not a multiple of ppo_mini_batch_size"):
        group.update_critic(targets[:12])
    with pytest.raises(BatchError, match="TensorDict"):
        group.update_critic([targets, {"input_ids": 1}])
    # longer than the model's positions: refused in the driver too (a check that needs no collective)
    short = dataclasses.replace(config.model, max_position_embeddings=int(good["attention_mask"].sum(1).max()) - 1)
    monkeypatch.setattr(group, "config", dataclasses.replace(config, model=short))
    with pytest.raises(BatchError, match="model.max_position_embeddings"):
        group.compute_values(good)
    monkeypatch.undo()
    assert group.compute_values(good).shape == good["responses"].shape  # the group is still fine


def test_rank_failure_tears_the_group_down(doomed):
    group, config = doomed
    batch = _batch(config, 0, torch.zeros(24, 15))
    group._inject_failure(1, "update_critic")
    start = time.monotonic()
    with pytest.raises(CriticGroupError, match=r"rank 1 failed in update_critic.*failure injected") as err:
        group.update_critic(batch)  # rank 0 goes on into the step's gradient all-reduce and waits there
    assert time.monotonic() - start < 15
    assert (err.value.rank, err.value.operation) == (1, "update_critic")
    assert _wait_all_gone() == ([], [])
    with pytest.raises(CriticGroupError, match="rank 1 failed in update_critic"):
        group.compute_values(batch)  # a dead group says why
    group.shutdown()  # and shutting it down again is harmless


def test_unsatisfiable_placement_fails_with_the_request(cluster):
    config = _config("fixed", [])
    start = time.monotonic()
    with pytest.raises(CriticGroupError, match=r"1 node\(s\) x 2 bundles \{'CPU': 1.0, 'GPU': 1.0\}.*not ready "
                                               r"after 2 s") as err:
        CriticGroup(config, num_gpus_per_node=2, placement_timeout_s=2)  # a CPU-only cluster
    assert time.monotonic() - start < 10
    assert err.value.operation == "placement"
    assert _wait_all_gone() == ([], [])


def test_layout_refused_before_anything_is_reserved(cluster):
    with pytest.raises(ConfigError, match="world size 3 is not divisible"):
        CriticGroup(_config("fixed", [TP2]), num_gpus_per_node=3, num_gpus_per_actor=0)
    with pytest.raises(ConfigError, match="num_gpus_per_actor"):
        CriticGroup(_config("fixed", []), num_gpus_per_node=2, num_gpus_per_actor=2)
    pg = ray.util.placement_group([{"CPU": 0.5}])
    try:
        with pytest.raises(ConfigError, match=r"bundle 0 is \{'CPU': 0.5\}: too small"):
            CriticGroup(_config("fixed", []), placement_group=pg, num_gpus_per_actor=0, num_cpus_per_actor=1)
    finally:
        ray.util.remove_placement_group(pg)
    assert _wait_all_gone() == ([], [])


def _probe(ip, node, gpus):
    return {"node_ip": ip, "node_id": node, "gpu_ids": gpus, "pid": 0}


def test_ranks_follow_nodes_and_gpus():
    # placement groups may hand out bundles interleaved over nodes and GPUs
    probes = [_probe("10.0.0.2", "b", ["1"]), _probe("10.0.0.1", "a", ["3"]), _probe("10.0.0.2", "b", ["0"]),
              _probe("10.0.0.1", "a", ["10"]), _probe("10.0.0.1", "a", ["2"]), _probe("10.0.0.2", "b", ["2"])]
    order = rank_order(probes)
    assert [(probes[i]["node_ip"], probes[i]["gpu_ids"][0]) for i in order] == [
        ("10.0.0.1", "2"), ("10.0.0.1", "3"), ("10.0.0.1", "10"),
        ("10.0.0.2", "0"), ("10.0.0.2", "1"), ("10.0.0.2", "2")]


def test_placement_checks():
    def placements(*where):
        return [RankPlacement(rank=r, node_ip=ip, node_id=ip, gpu_ids=g, pid=0) for r, (ip, g) in enumerate(where)]

    check_placement(placements(("a", ["0"]), ("a", ["1"]), ("b", ["0"]), ("b", ["1"])), tp=2)
    check_placement(placements(("a", []), ("a", [])), tp=2)  # CPU ranks
    with pytest.raises(CriticGroupError, match=r"share a GPU \(\{'a GPU 0': \[0, 1\]\}\)"):
        check_placement(placements(("a", ["0"]), ("a", ["0"])), tp=1)
    with pytest.raises(CriticGroupError, match=r"ranks 4..7 spans nodes \['a', 'b'\]"):
        check_placement(placements(*[("a", [str(i)]) for i in range(6)], ("b", ["0"]), ("b", ["1"])), tp=4)


def test_local_rank_from_the_visible_devices(monkeypatch):
    from megacritic.ray import _device_env

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")  # Ray's default: narrowed to the actor's GPU
    assert _device_env(["3"]) == {"LOCAL_RANK": "0"}
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")  # NOSET, or a wide list left by the launcher
    assert _device_env(["6"]) == {"LOCAL_RANK": "2"}
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert _device_env(["5"]) == {"LOCAL_RANK": "5"}
    assert _device_env([]) == {"CUDA_VISIBLE_DEVICES": "", "LOCAL_RANK": "0"}
