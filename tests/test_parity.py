"""Layout invariance on CPU (gloo): the same weights and global batches under every parallel layout give
the same values, losses and gradient norms as one process. Each layout is one torchrun launch
(tests/multiproc/parity_run.py), run once for the whole module; fixed-size padded micro-batches and
token-budget packed (THD) micro-batches are both compared against the single-process padded run, so the
test also shows packed and padded paths agree. Context-parallel layouts need packing: they run packed
modes only (the rollouts have odd lengths and lengths that 2 x CP does not divide).
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).parent / "multiproc" / "parity_run.py"

MODES = ("fixed", "dynamic")  # parity_run.py's default modes
CP2 = "megatron.context_parallel_size=2"
# name: (processes, overrides[, modes])
LAYOUTS = {
    "tp1_pp1_dp1": (1, []),
    "tp2_pp1_dp1": (2, ["megatron.tensor_model_parallel_size=2"]),
    "tp1_pp2_dp1": (2, ["megatron.pipeline_model_parallel_size=2"]),
    "tp1_pp1_dp2": (2, []),
    "tp2_pp2_dp1": (4, ["megatron.tensor_model_parallel_size=2", "megatron.pipeline_model_parallel_size=2"]),
    "tp1_pp2_vpp2": (2, ["megatron.pipeline_model_parallel_size=2",
                         "megatron.virtual_pipeline_model_parallel_size=2"]),
    "tp2_cp2": (4, [CP2, "megatron.tensor_model_parallel_size=2"], ("dynamic",)),  # with sequence parallel
    "cp2_dp2": (4, [CP2], ("dynamic",)),
    "pp2_vpp2_cp2": (4, [CP2, "megatron.pipeline_model_parallel_size=2",
                         "megatron.virtual_pipeline_model_parallel_size=2"], ("dynamic",)),
    # optimizer steps taken on the device (fused AdamW): the grad norm over the distributed optimizer's
    # shards, and without counting tensor-parallel duplicates twice, across pipeline stages
    "dp2_fused_adamw": (2, ["--fused-adamw"], ("dynamic",)),
    "tp2_pp2_fused_adamw": (4, ["--fused-adamw", "megatron.tensor_model_parallel_size=2",
                                "megatron.pipeline_model_parallel_size=2"], ("dynamic",)),
}
CASES = [pytest.param(layout, mode, id=f"{mode}-{layout}")
         for layout, (_, _, *modes) in LAYOUTS.items() for mode in (modes[0] if modes else MODES)]


def _launch(nproc: int, overrides: list[str], out: Path, modes=MODES) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(SCRIPT), str(out), f"--modes={','.join(modes)}", *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("parity")
    return {name: _launch(n, ov, tmp / f"{name}.json", *modes) for name, (n, ov, *modes) in LAYOUTS.items()}


def _rel(a, b) -> float:
    a, b = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


@pytest.mark.slow
@pytest.mark.parametrize("layout, mode", CASES)
def test_layout_matches_single_process(results, layout, mode):
    ref, got = results["tp1_pp1_dp1"]["fixed"], results[layout][mode]
    assert got["cp"] == (2 if CP2 in LAYOUTS[layout][1] else 1)  # the layout really ran
    # float32 arithmetic with reductions in a different order: ~1e-7 relative; 1e-5 leaves room only for
    # rounding, not for a wrong gradient or normalisation.
    assert _rel(got["values"], ref["values"]) < 1e-5
    for key in ("critic/vf_loss", "critic/grad_norm", "critic/vf_clipfrac", "critic/vpred_mean"):
        assert len(got["metrics"][key]) == 3
        assert _rel(got["metrics"][key][:1], ref["metrics"][key][:1]) < 1e-5, key
        assert _rel(got["metrics"][key], ref["metrics"][key]) < 1e-3, key
    assert _rel(got["values_after"], ref["values_after"]) < 1e-3


@pytest.mark.slow
def test_training_moved_the_weights(results):
    # Guards the parity test against passing trivially (e.g. a zero learning rate or skipped steps).
    ref = results["tp1_pp1_dp1"]["fixed"]
    assert _rel(ref["values_after"], ref["values"]) > 1e-2
    assert ref["metrics"]["critic/skipped_steps"] == [0.0, 0.0, 0.0]
    assert ref["metrics"]["critic/vf_clipfrac"][0] > 0  # the clipped branch of the loss is exercised
