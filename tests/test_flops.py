"""MFU: one definition (megacritic.flops.mfu) for the train loop, the verl adapter and the bench."""

import pytest
import torch
import torch.distributed as dist

from megacritic.flops import mfu, peak_flops


def test_mfu_divides_by_every_devices_peak():
    assert mfu(6e12, 2.0, world_size=1, peak=1e13) == pytest.approx(0.3)
    assert mfu(6e12, 2.0, world_size=4, peak=1e13) == pytest.approx(0.075)  # the same work on 4 devices
    assert mfu(1.0, 1.0, world_size=1) != mfu(1.0, 1.0, world_size=1)  # CPU: no known peak, NaN
    with pytest.raises(ValueError, match="world_size=0"):
        mfu(1.0, 1.0, world_size=0, peak=1.0)


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H200", 989e12), ("NVIDIA GH200 480GB", 989e12), ("NVIDIA H100 80GB HBM3", 989e12),
    ("NVIDIA H100 PCIe", 756e12), ("NVIDIA H100 NVL", 835e12), ("NVIDIA H20", 148e12),
    ("NVIDIA A100-SXM4-80GB", 312e12), ("NVIDIA B200", 2.25e15), ("Tesla T4", None)])
def test_peak_flops_by_device_name(name, peak):
    """The peak by the name torch reports, the longer names first (an H200 is not an H20); NaN where unknown."""
    got = peak_flops(name)
    assert got == peak if peak is not None else got != got


@pytest.fixture
def world_of_two():
    """A torch.distributed world of 2 ranks in this process (torch's fake backend: no peer, no collectives)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield
    dist.destroy_process_group()


def test_train_loop_mfu_counts_every_rank(world_of_two):
    """Every rank of ``megacritic train`` updates on the same global batch: its FLOPs were done by two
    devices, so perf/mfu is half what one device doing them alone would reach."""
    from megacritic.config import TINY_MODEL_OVERRIDES
    from megacritic.config.load import load_config
    from megacritic.data.sources import SyntheticRollouts
    from megacritic.flops import model_forward_flops
    from megacritic.train_loop import _batch_metrics

    config = load_config([*TINY_MODEL_OVERRIDES, "data.rollouts_per_step=8", "ppo_mini_batch_size=4"])
    batch = SyntheticRollouts(config).batch(0)
    r = batch["responses"].shape[1]
    batch["values"] = batch["returns"] = torch.ones(len(batch), r)
    flops = 3 * model_forward_flops(config.model, batch["attention_mask"].sum(1).tolist()) * config.ppo_epochs
    got = _batch_metrics(batch, 0.5, config, peak=1e9)["perf/mfu"]
    assert got == pytest.approx(flops / 0.5 / (2 * 1e9))
