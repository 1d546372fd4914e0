"""Parity on NCCL across GPUs (`pytest -m multigpu`; skipped with fewer GPUs than a layout needs).

Each layout runs tests/multiproc/parity_run.py in bf16 under torchrun and is compared with the same script
on one GPU: values and step-1 loss within 1e-2 (relative), grad norm within 2e-2 — bf16 rounding, not exact.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).parent / "multiproc" / "parity_run.py"
LAYOUTS = {
    "tp2": (2, ["megatron.tensor_model_parallel_size=2", "megatron.sequence_parallel=false"]),
    "tp2_sp": (2, ["megatron.tensor_model_parallel_size=2", "megatron.sequence_parallel=true"]),
    "pp2": (2, ["megatron.pipeline_model_parallel_size=2"]),
    "dp2": (2, []),
    "pp2_vpp2": (2, ["megatron.pipeline_model_parallel_size=2", "megatron.virtual_pipeline_model_parallel_size=2"]),
    "tp2_pp2": (4, ["megatron.tensor_model_parallel_size=2", "megatron.pipeline_model_parallel_size=2"]),
    # context parallelism needs packing: packed modes only
    "cp2": (2, ["megatron.context_parallel_size=2"], ("dynamic", "fixed_packed")),
    "tp2_cp2": (4, ["megatron.context_parallel_size=2", "megatron.tensor_model_parallel_size=2"], ("dynamic",)),
}
pytestmark = pytest.mark.multigpu


def _run(nproc, overrides, out, modes=("fixed", "dynamic", "fixed_packed")):
    env = dict(os.environ, NCCL_NVLS_ENABLE="0")  # NVLink multicast stays off
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(SCRIPT), str(out), f"--modes={','.join(modes)}", "model.dtype=bfloat16", *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads(out.read_text())


def _rel(a, b):
    a, b = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    return float((a - b).norm() / b.norm())


@pytest.fixture(scope="module")
def one_gpu(tmp_path_factory):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs at least 2 GPUs")
    return _run(1, [], tmp_path_factory.mktemp("one") / "ref.json")


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_nccl_layout_matches_one_gpu(one_gpu, layout, tmp_path):
    nproc, overrides, *modes = LAYOUTS[layout]
    modes = modes[0] if modes else ("fixed", "dynamic")
    if torch.cuda.device_count() < nproc:
        pytest.skip(f"needs {nproc} GPUs")
    got = _run(nproc, overrides, tmp_path / "got.json", modes)
    for mode in modes:
        ref, run = one_gpu[mode], got[mode]
        assert _rel(run["values"], ref["values"]) < 1e-2
        assert _rel(run["metrics"]["critic/vf_loss"][:1], ref["metrics"]["critic/vf_loss"][:1]) < 1e-2
        assert _rel(run["metrics"]["critic/grad_norm"][:1], ref["metrics"]["critic/grad_norm"][:1]) < 2e-2
