"""megacritic.ray.CriticGroup on CPU (gloo): two Ray actors give the single-process results under DP=2, TP=2
and PP=2; bad batches are refused in the driver; checkpoints move between layouts; placement that cannot be
met fails with a message. Recovery: a rank killed in the middle of a call, or hung in a collective, is
restarted and the results of the whole sequence are bit-identical to an uninterrupted run; failures the same
input would repeat are raised at once; a spent restart budget (or recovery turned off) tears the group down.

The single-process reference is tests/multiproc/parity_run.py's own run (model, settings, batch and the
old values that exercise the clipped loss), computed in this process. One Ray cluster for the module. Every
group's ranks are tests/ray_faults.py's rank actors, which read a fault plan the tests write (empty unless a
test injects a fault); processes are killed from here with SIGKILL.
"""

import dataclasses
import importlib.util
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

ray = pytest.importorskip("ray")

from megacritic import BatchError, load_config  # noqa: E402
from megacritic.config import ConfigError  # noqa: E402
from megacritic.data.sources import SyntheticRollouts  # noqa: E402
import megacritic.ray  # noqa: E402
from megacritic.ray import CriticGroup, CriticGroupError, RankPlacement, check_placement, rank_order  # noqa: E402

pytestmark = pytest.mark.ray


def _load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # (Ray pickles ray_faults' classes by value: it looks the module up here)
    spec.loader.exec_module(module)
    return module


parity_run = _load("parity_run", Path(__file__).parent / "multiproc" / "parity_run.py")
ray_faults = _load("ray_faults", Path(__file__).parent / "ray_faults.py")
ray.cloudpickle.register_pickle_by_value(ray_faults)  # the actors' processes do not have tests/ on their path

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
              if a["ActorClassName"].endswith("RankActor") and a["State"] != "DEAD"]
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
def plan(cluster, tmp_path_factory):
    """The fault plan file of tests/ray_faults.py, read by the ranks of every group of the module."""
    path = tmp_path_factory.mktemp("faults") / "plan.json"
    ray_faults.write_plan(path, [])
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(megacritic.ray, "_RankActor", ray_faults.faulty_actor(path))
        yield path


@pytest.fixture(scope="module")
def reference():
    return parity_run.run([], ["fixed"])["fixed"]


@pytest.fixture(scope="module")
def runs(plan, tmp_path_factory):
    """parity_run.py's sequence through a group per layout. The DP=2 group then trains on more and saves a
    checkpoint; the TP=2 group loads it (its own weights differ by then) and the two carry on together."""
    root = tmp_path_factory.mktemp("ray_ckpt")
    ray_faults.write_plan(plan, [])
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
def doomed(plan):
    """A DP=2 group without recovery for the failure tests (the last of them kills it). nccl_timeout is long, so
    a teardown that waited for the stuck rank's collective to time out would take 10 minutes."""
    config = _config("fixed", ["megatron.nccl_timeout=600"])
    ray_faults.write_plan(plan, [])
    group = CriticGroup(config, **CPU_GROUP, max_restarts=0)
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


def test_without_recovery_a_dead_rank_tears_the_group_down(doomed, plan):
    group, config = doomed
    batch = _batch(config, 0, torch.zeros(24, 15))
    ray_faults.write_plan(plan, [ray_faults.fault("doomed", 1, "update_critic", batch, where="step")])
    with _Killer(group, plan, [("doomed", 1)]) as killer:
        with pytest.raises(CriticGroupError, match=r"rank 1 failed in update_critic: ActorDiedError.*\n"
                                                   r"recovery is off \(max_restarts=0\)") as err:
            group.update_critic(batch)  # rank 0 goes on into the next collective and waits there
    assert time.monotonic() - killer.times["doomed"] < 15
    assert (err.value.rank, err.value.operation) == (1, "update_critic")
    assert [(f.rank, f.kind) for f in err.value.failures][0] == (1, "died")
    assert _wait_all_gone() == ([], [])
    assert group.restarts == 0
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


def test_which_rank_errors_are_retried():
    from megacritic.ray import RankFailure, _retried, _worth_a_restart

    def raised(exc):  # with a traceback, as a rank's exception has
        try:
            raise exc
        except BaseException as e:
            return e

    gloo = RuntimeError("[third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1")
    assert _retried(raised(gloo)) and _retried(raised(torch.distributed.DistBackendError("NCCL error")))
    assert not _retried(raised(torch.OutOfMemoryError("CUDA out of memory")))  # the same input needs the same memory
    assert not _retried(raised(BatchError("bad"))) and not _retried(raised(ConfigError("bad")))
    assert not _retried(raised(RuntimeError("a bug"))) and not _retried(raised(KeyError("x")))

    def failure(kind, rank=0):
        return RankFailure(rank, "n", "update_critic", kind, "cause")

    assert _worth_a_restart([failure("died", 1), failure("collective")])
    assert _worth_a_restart([failure("collective")]) and _worth_a_restart([failure("timeout")] * 2)
    # a rank's own error is the cause of its peer's failed collective, not the other way round
    assert not _worth_a_restart([failure("error", 1), failure("collective")])
    assert _worth_a_restart([failure("error", 1), failure("died")])  # a death is worth a restart regardless


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


# ---------------------------------------------------------------- recovery


class _Killer:
    """SIGKILLs a rank's process from this process once the rank has stopped at its planned fault (its marker
    file appears); ``times``: when each kill was sent."""

    def __init__(self, group, plan, kills: list[tuple[str, int]], timeout_s: float = 300):
        self.group, self.plan, self.kills, self.timeout_s = group, plan, kills, timeout_s
        self.times: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        deadline = time.monotonic() + self.timeout_s
        for name, rank in self.kills:
            while not ray_faults.fired(self.plan, name):
                if self._stop.wait(0.02) or time.monotonic() > deadline:
                    return
            os.kill(self.group.placements[rank].pid, signal.SIGKILL)
            self.times[name] = time.monotonic()

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=10)


RECOVERY_KEYS = ("critic/restarts", "critic/recovery_s")
PP2_LAYOUT = {"dp2": [], "pp2": [PP2]}


def _reproducible(key: str) -> bool:
    """Metrics that do not measure wall time (nor the recovery itself)."""
    return not (key.startswith("timing_s/") or key == "perf/tokens_per_s" or key in RECOVERY_KEYS)


def _bits(values) -> list[str]:
    return [float(v).hex() for v in values]  # exact, NaN included


def _sequence(group, config) -> dict:
    """Three PPO iterations (values of a batch, then an update on it with old values from them), then the
    values of the first batch again: 4 compute_values and 3 update_critic calls."""
    out = {"values": [], "metrics": []}
    for i in range(3):
        batch = _batch(config, i)
        out["values"].append(group.compute_values(batch))
        batch["values"] = _old_values(out["values"][-1])
        out["metrics"].append(group.update_critic(batch))
    out["values"].append(group.compute_values(_batch(config, 0)))
    return out


def _recovery_config(layout):
    # nccl_timeout long: a hang is caught by the group's call_timeout_s, not by gloo's own timeout
    return _config("fixed", PP2_LAYOUT[layout] + ["megatron.nccl_timeout=600"])


@pytest.fixture(scope="module")
def uninterrupted(plan):
    """Per layout, the sequence on a group nothing disturbs; then a failure the same input would repeat, which
    ends the group: a batch that passes the driver's checks but that no rank can split over DP=2 (dp2), an
    out-of-memory error injected on one rank each time the same batch comes (pp2)."""
    out = {}
    for layout in PP2_LAYOUT:
        config = _recovery_config(layout)
        ray_faults.write_plan(plan, [])
        group = CriticGroup(config, **CPU_GROUP)
        try:
            group.init_model()
            run = _sequence(group, config)
            last = _batch(config, 3, torch.zeros(24, 15))
            if layout == "dp2":
                call = lambda: group.compute_values(last[:23])  # noqa: E731
            else:
                ray_faults.write_plan(plan, [ray_faults.fault("oom", 1, "update_critic", last, action="oom",
                                                              every_time=True)])
                call = lambda: group.update_critic(last)  # noqa: E731
            start = time.monotonic()
            with pytest.raises(CriticGroupError) as err:
                call()
            run.update(error=err.value, error_s=time.monotonic() - start, restarts=group.restarts,
                       oom_fired=ray_faults.fired(plan, "oom"), gone=_wait_all_gone())
        finally:
            group.shutdown()
        out[layout] = run
    return out


# layout: (faults as (name, rank, operation, iteration of the batch, where, killed by the test), group options)
RECOVERY_RUNS = {
    # killed after the first optimizer step of the 2nd update (a step already applied by then on rank 0), then
    # hung inside an all-reduce of the 3rd update; no snapshots: each restart rebuilds the model and replays
    # every update since (call_timeout_s is short for the hang, so the run takes no long calls: no snapshots)
    "dp2": ([("kill_update", 1, "update_critic", 1, "step", True),
             ("hang", 1, "update_critic", 2, "collective", False)],
            dict(snapshot_every=0, max_restarts=1, call_timeout_s=20)),
    # the first stage killed in the 2nd update, the last stage in the forward of the 3rd compute_values; a
    # snapshot before every update (from the 2nd on)
    "pp2": ([("kill_update", 0, "update_critic", 1, "step", True),
             ("kill_values", 1, "compute_values", 2, "forward", True)],
            dict(snapshot_every=1)),
}


@pytest.fixture(scope="module")
def recovered(plan, uninterrupted):
    """The same sequences with the faults of RECOVERY_RUNS; then (dp2) a rank that dies each time one batch
    comes, past the budget of one restart per call."""
    out = {}
    for layout, (faults, options) in RECOVERY_RUNS.items():
        config = _recovery_config(layout)
        group = CriticGroup(config, **dict(CPU_GROUP, **options))
        try:
            group.init_model()
            ray_faults.write_plan(plan, [ray_faults.fault(f"{layout}_{name}", rank, op, _batch(config, i), where)
                                         for name, rank, op, i, where, _ in faults])
            kills = [(f"{layout}_{name}", rank) for name, rank, *_, killed in faults if killed]
            with _Killer(group, plan, kills) as killer:
                run = _sequence(group, config)
            run.update(recoveries=list(group.recoveries), killed=sorted(killer.times),
                       fired={name: ray_faults.fired(plan, f"{layout}_{name}") for name, *_ in faults})
            if layout == "dp2":
                last = _batch(config, 3, torch.zeros(24, 15))
                ray_faults.write_plan(plan, [ray_faults.fault("die", 1, "update_critic", last, action="die",
                                                              every_time=True)])
                with pytest.raises(CriticGroupError) as err:
                    group.update_critic(last)
                run.update(budget_error=err.value, die_fired=ray_faults.fired(plan, "die"), gone=_wait_all_gone())
            else:  # a snapshot that fails (out of memory on rank 1, each time): the group goes on without them
                last = _batch(config, 3, torch.zeros(24, 15))
                ray_faults.write_plan(plan, [ray_faults.fault("snapshot", 1, "save_checkpoint", None, action="oom",
                                                              every_time=True)])
                run["after_failed_snapshot"] = [group.update_critic(last), group.update_critic(last)]
                run.update(snapshot_fired=ray_faults.fired(plan, "snapshot"),
                           snapshot_recoveries=group.recoveries[len(run["recoveries"]):])
        finally:
            group.shutdown()
        for r in run["recoveries"]:
            print(f"\n{layout}: restart {r.restart} recovered in {r.seconds:.1f} s ({r.replayed} call(s) replayed "
                  f"on {'a snapshot' if r.snapshot else 'init_model'}) after: " + "; ".join(map(str, r.failures)))
        out[layout] = run
    return out


@pytest.mark.parametrize("layout", list(PP2_LAYOUT))
def test_recovered_run_is_bit_identical_to_an_uninterrupted_one(uninterrupted, recovered, layout):
    ref, got = uninterrupted[layout], recovered[layout]
    assert got["killed"] == sorted(f"{layout}_{name}" for name, *_, killed in RECOVERY_RUNS[layout][0] if killed)
    assert set(got["fired"].values()) == {1}  # each fault struck once: in the original call, not in its retry
    assert len(got["recoveries"]) == 2
    for want, have in zip(ref["values"], got["values"], strict=True):
        assert torch.equal(want, have)
    for want, have in zip(ref["metrics"], got["metrics"], strict=True):
        assert {k for k in want if _reproducible(k)} == {k for k in have if _reproducible(k)}
        for key in filter(_reproducible, want):
            assert _bits(want[key]) == _bits(have[key]), key
    # the recovery's own metrics: restarts so far, and the seconds spent recovering during the call
    restarts = [m["critic/restarts"][0] for m in got["metrics"]]
    assert restarts == [0.0, 1.0, 2.0]
    assert [m["critic/restarts"][0] for m in ref["metrics"]] == [0.0, 0.0, 0.0]
    seconds = [m["critic/recovery_s"] for m in got["metrics"]]
    assert seconds[1][0] == pytest.approx(got["recoveries"][0].seconds) and len(set(seconds[1])) == 1


def test_killed_rank_is_found_and_restored(recovered):
    dp2, pp2 = recovered["dp2"]["recoveries"], recovered["pp2"]["recoveries"]
    # the dead rank is the cause; its peer's "connection closed" in the same collective is listed too
    assert (dp2[0].failures[0].rank, dp2[0].failures[0].kind, dp2[0].failures[0].operation) == (
        1, "died", "update_critic")
    assert {(f.rank, f.kind) for f in dp2[0].failures} <= {(1, "died"), (0, "collective")}
    assert (dp2[0].snapshot, dp2[0].replayed) == (None, 2)  # init_model and the 1st update, replayed
    # pp2: a snapshot before every update; the 2nd update is retried on the snapshot taken just before it
    assert [(f.rank, f.kind) for f in pp2[0].failures if f.kind == "died"] == [(0, "died")]
    assert pp2[0].snapshot.endswith("step_00000001") and pp2[0].replayed == 0
    # the kill in compute_values: the update since the snapshot is replayed, then the values computed again
    assert [(f.rank, f.operation) for f in pp2[1].failures if f.kind == "died"] == [(1, "compute_values")]
    assert pp2[1].snapshot == pp2[0].snapshot and pp2[1].replayed == 1
    for r in dp2 + pp2:
        assert 0 < r.seconds < 120


def test_hung_rank_is_restarted_after_the_call_timeout(recovered):
    hang = recovered["dp2"]["recoveries"][1]
    assert {(f.rank, f.kind) for f in hang.failures} == {(0, "timeout"), (1, "timeout")}
    assert "no answer within 20 s (call_timeout_s)" in hang.failures[0].cause
    assert (hang.snapshot, hang.replayed) == (None, 3)  # init_model and the first two updates, replayed


def test_failure_the_same_input_would_repeat_is_raised_once(uninterrupted):
    dp2, pp2 = uninterrupted["dp2"], uninterrupted["pp2"]
    # a batch every rank refuses (23 rollouts over DP=2): raised with its cause, no restart
    assert dp2["restarts"] == 0 and dp2["error_s"] < 15
    assert "cannot be split evenly over 2 data-parallel ranks" in str(dp2["error"])
    assert "not retried" in str(dp2["error"]) and {f.kind for f in dp2["error"].failures} == {"error"}
    assert type(dp2["error"].__cause__).__name__ == "BatchError"
    # out of memory on rank 1 each time this batch comes: raised the first time
    assert pp2["restarts"] == 0 and pp2["oom_fired"] == 1 and pp2["error_s"] < 15
    assert (pp2["error"].rank, pp2["error"].failures[0].kind) == (1, "error")
    assert isinstance(pp2["error"].__cause__, torch.OutOfMemoryError)
    assert dp2["gone"] == pp2["gone"] == ([], [])


def test_failed_snapshot_does_not_end_the_group(recovered):
    pp2 = recovered["pp2"]
    assert pp2["snapshot_fired"] == 1  # the snapshot before the 1st update failed; none was tried again
    (recovery,) = pp2["snapshot_recoveries"]  # rank 0 was left in the snapshot's barrier: one restart
    assert [(f.rank, f.kind, f.operation) for f in recovery.failures] == [(1, "error", "save_checkpoint")]
    assert recovery.snapshot.endswith("step_00000002") and recovery.replayed == 1  # the last good one
    first, second = pp2["after_failed_snapshot"]
    assert len(first["critic/vf_loss"]) == len(second["critic/vf_loss"]) == 3
    assert first["critic/restarts"][0] == 3.0 and second["critic/recovery_s"] == [0.0] * 3


def test_spent_restart_budget_lists_every_failure(recovered):
    dp2 = recovered["dp2"]
    err = dp2["budget_error"]
    assert dp2["die_fired"] == 2  # the call, and its one retry (max_restarts=1)
    assert [(f.rank, f.kind, f.operation) for f in err.failures if f.rank == 1] == [(1, "died", "update_critic")] * 2
    assert "restart budget spent: max_restarts=1" in str(err)
    listed = [line for line in str(err).splitlines() if line.startswith("  ")]  # one line per failure
    assert [line.split(". ")[0].strip() for line in listed] == [str(i) for i in range(1, len(err.failures) + 1)]
    assert sum(": died: ActorDiedError" in line and line.split(". ")[1].startswith("rank 1 ") for line in listed) == 2
    assert dp2["gone"] == ([], [])  # no actor, no placement group left
