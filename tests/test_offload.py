"""megacritic.offload.PinnedOffload on CPU tensors (the same storage logic as on the GPU, where the host
buffers are also pinned; tests/test_gpu.py runs the worker's offload end to end)."""

import pytest
import torch

from megacritic.offload import PinnedOffload


def _state():
    torch.manual_seed(0)
    flat = torch.randn(64)
    views = [flat[:16].view(4, 4), flat[16:]]  # two tensors on one storage (a contiguous buffer)
    moment = torch.randn(3, 5, dtype=torch.float64)
    return flat, views, moment


def test_offload_frees_the_storages_and_onload_restores_the_same_objects():
    flat, (a, b), moment = _state()
    before = [t.clone() for t in (a, b, moment)]
    host = PinnedOffload()
    host.offload([a, b, moment])
    assert host.on_host and host.host_bytes == 64 * 4 + 15 * 8  # the shared storage moved once
    assert a.untyped_storage().nbytes() == 0 and moment.untyped_storage().nbytes() == 0
    host.onload()
    assert not host.on_host
    for t, ref in zip((a, b, moment), before):
        assert torch.equal(t, ref)
    assert a.data_ptr() == flat.data_ptr()  # still views of the one storage


def test_offload_refuses_a_second_offload_before_onload():
    _, views, moment = _state()
    host = PinnedOffload()
    host.offload([moment])
    with pytest.raises(RuntimeError, match="not onloaded"):
        host.offload(views)


def test_host_buffers_are_reused_and_follow_changes():
    _, (a, b), moment = _state()
    host = PinnedOffload()
    host.offload([a, b, moment])
    buffers = {id(p) for _, p in host._on_host}
    host.onload()
    moment.add_(1.0)  # changed on the device: the next offload copies it again
    expected = moment.clone()
    host.offload([a, b, moment])
    assert {id(p) for _, p in host._on_host} == buffers
    host.onload()
    assert torch.equal(moment, expected)


def test_release_frees_without_copying_and_keeps_the_host_copy():
    _, (a, b), moment = _state()
    host = PinnedOffload()
    host.offload([moment])
    host.onload()
    ref = moment.clone()
    host.release()  # only read since the onload
    assert moment.untyped_storage().nbytes() == 0 and host.on_host
    host.onload()
    assert torch.equal(moment, ref)
    with pytest.raises(RuntimeError, match="nothing onloaded"):
        PinnedOffload().release()


def test_storages_already_released_are_skipped():
    _, (a, b), moment = _state()
    first, second = PinnedOffload(), PinnedOffload()
    first.offload([moment])
    second.offload([moment, a])  # moment is on the host already: only a's storage moves
    assert second.host_bytes == 64 * 4
    second.onload()
    first.onload()
