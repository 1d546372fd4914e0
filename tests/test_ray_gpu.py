"""megacritic.ray.CriticGroup on GPUs (NCCL): skipped without CUDA or without ray.

* one GPU (``-m "gpu and ray"``): a one-rank group equals a plain CriticWorker in this process; two groups on
  one GPU (half a GPU each, everything offloaded between calls) give the values of an unshared run;
* several GPUs (``-m "multigpu and ray"``): TP=2 and DP=2 groups equal torchrun's run of the same layout, with
  Ray narrowing CUDA_VISIBLE_DEVICES (default) and with RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1; every
  rank computes on its own GPU.

The model and batches are tests/multiproc/parity_run.py's, in bf16; tolerances are tests/test_multigpu.py's
bf16 ones (values and step-1 loss 1e-2 relative, grad norm 2e-2): the same kernels run in both processes,
but bf16 backward kernels accumulate with atomics, in no fixed order.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ray = pytest.importorskip("ray")

from megacritic import CriticWorker, load_config  # noqa: E402
from megacritic.data.sources import SyntheticRollouts  # noqa: E402
from megacritic.ray import CriticGroup  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SCRIPT = Path(__file__).parent / "multiproc" / "parity_run.py"
_spec = importlib.util.spec_from_file_location("parity_run", SCRIPT)
parity_run = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(parity_run)

MODE = "dynamic"  # the packed default
BF16 = ["model.dtype=bfloat16"]
OFFLOAD = [f"megatron.{part}_offload=true" for part in ("param", "grad", "optimizer")]
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0"}  # NVLink multicast stays off on these machines


def _config(overrides=()):
    return load_config(parity_run.MODEL + parity_run.MODES[MODE] + BF16 + list(overrides))


def _rel(a, b) -> float:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def _sequence(critic, config) -> dict:
    """parity_run.py's calls on a CriticWorker or a CriticGroup (same method names)."""
    batch = SyntheticRollouts(config).batch(0)
    values = critic.compute_values(batch)
    batch["values"] = values + 0.3 * torch.sin(torch.arange(values.numel()).reshape(values.shape).float())
    metrics = critic.update_critic(batch)
    return {"values": values.cpu(), "metrics": metrics, "values_after": critic.compute_values(batch).cpu()}


def _assert_close(got: dict, ref: dict) -> None:
    assert _rel(got["values"], ref["values"]) < 1e-2
    assert _rel(got["metrics"]["critic/vf_loss"][:1], ref["metrics"]["critic/vf_loss"][:1]) < 1e-2
    assert _rel(got["metrics"]["critic/grad_norm"][:1], ref["metrics"]["critic/grad_norm"][:1]) < 2e-2
    assert _rel(got["values_after"], ref["values_after"]) < 1e-2
    assert _rel(ref["values_after"], ref["values"]) > 1e-2  # the update moved the weights


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=max(4, os.cpu_count() // 2), num_gpus=torch.cuda.device_count(), include_dashboard=False,
             runtime_env={"env_vars": NCCL_ENV})
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def plain():
    """The critic without Ray, in this process on GPU 0."""
    config = _config()
    worker = CriticWorker(config)
    worker.init_model()
    try:
        return _sequence(worker, config)
    finally:
        worker.close()
        torch.cuda.empty_cache()


def test_one_rank_group_on_nccl_equals_plain_worker(cluster, plain):
    config = _config()
    with CriticGroup(config, num_gpus_per_node=1, call_timeout_s=600) as group:
        group.init_model()
        got = _sequence(group, config)
        (info,) = group.device_info()
    assert info["device"] == "cuda:0" and info["local_rank"] == "0"
    _assert_close(got, plain)


def test_two_groups_share_one_gpu(cluster, plain):
    """Two critics on one GPU, as colocated roles run: one placement group bundle {GPU: 1} for both, half a
    GPU each, their whole state in host memory between calls; calls interleave."""
    from ray.util.placement_group import placement_group, remove_placement_group

    config = _config(OFFLOAD)
    pg = placement_group([{"GPU": 1, "CPU": 2}])
    ray.get(pg.ready(), timeout=60)
    groups = []
    try:
        for name in ("first", "second"):
            groups.append(CriticGroup(config, placement_group=pg, num_gpus_per_actor=0.5, name=name,
                                      call_timeout_s=600))
        for group in groups:
            group.init_model()
        uuids = {g.device_info()[0]["uuid"] for g in groups}
        assert len(uuids) == 1  # really the same GPU
        batch = SyntheticRollouts(config).batch(0)
        values = [g.compute_values(batch) for g in groups]
        batch["values"] = values[0] + 0.3 * torch.sin(torch.arange(values[0].numel()).reshape(
            values[0].shape).float())
        metrics = [g.update_critic(batch) for g in groups]
        after = [g.compute_values(batch) for g in groups]
        for i in range(2):
            _assert_close({"values": values[i], "metrics": metrics[i], "values_after": after[i]}, plain)
    finally:
        for group in groups:
            group.shutdown()
        remove_placement_group(pg)


# ---------------------------------------------------------------- several GPUs


def _torchrun(nproc: int, overrides: list[str], out: Path) -> dict:
    env = dict(os.environ, **NCCL_ENV)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(SCRIPT), str(out), f"--modes={MODE}", *BF16, *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-6000:]
    result = json.loads(out.read_text())[MODE]
    return {"values": torch.tensor(result["values"]), "metrics": result["metrics"],
            "values_after": torch.tensor(result["values_after"])}


MULTI = {"tp2": ["megatron.tensor_model_parallel_size=2"], "dp2": []}


@pytest.mark.multigpu
@pytest.mark.parametrize("noset", [False, True], ids=["ray-narrows-cvd", "noset-cvd"])
@pytest.mark.parametrize("layout", list(MULTI))
def test_nccl_group_equals_torchrun(cluster, layout, noset, tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    overrides = MULTI[layout]
    ref = _torchrun(2, overrides, tmp_path / "torchrun.json")
    env = dict(NCCL_ENV, **({"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"} if noset else {}))
    config = _config(overrides)
    with CriticGroup(config, num_gpus_per_node=2, runtime_env={"env_vars": env}, call_timeout_s=600) as group:
        group.init_model()
        got = _sequence(group, config)
        infos = group.device_info()
        gpus = [p.gpu_ids for p in group.placements]
    assert len({i["uuid"] for i in infos}) == 2, infos  # each rank on its own GPU
    assert all(len(g) == 1 for g in gpus) and gpus[0] != gpus[1]
    if noset:  # Ray left the node's list alone: the rank's GPU is found in it
        visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d]
        assert [i["local_rank"] for i in infos] == [str(visible.index(g[0]) if visible else int(g[0]))
                                                    for g in gpus], infos
    else:
        assert [(i["cuda_visible_devices"], i["local_rank"]) for i in infos] == [(g[0], "0") for g in gpus]
    _assert_close(got, ref)
