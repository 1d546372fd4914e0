"""Adam with its moments stored in bfloat16 (optim.exp_avg_dtype / optim.exp_avg_sq_dtype) against torch's
AdamW with float32 moments, on CPU."""

import pytest
import torch

from megacritic.config import ConfigError, TINY_MODEL_OVERRIDES
from megacritic.config.load import load_config
from megacritic.optim import AdamWLowPrecisionMoments, torch_optimizers

BF16 = torch.bfloat16
U = 2.0 ** -8  # bf16 keeps 8 significant bits: rounding to nearest moves a value by at most 2^-8 of itself
LR, WD, BETAS, EPS = 1e-3, 0.01, (0.9, 0.999), 1e-8


def _problem(seed=0):
    """Two parameter groups (one without weight decay), gradients spanning several orders of magnitude."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(64, 33), (1000,), (7,)]
    params = [torch.randn(s, generator=gen) for s in shapes]
    grads = [[torch.randn(s, generator=gen) * torch.randn(s, generator=gen).mul(2).exp() for s in shapes]
             for _ in range(6)]
    return params, grads


def _optimizers(params, dtype, chunk):
    ref = [p.clone() for p in params]
    ours = [p.clone() for p in params]
    groups = lambda ps: [{"params": ps[:2]}, {"params": ps[2:], "weight_decay": 0.0}]  # noqa: E731
    a = torch.optim.AdamW(groups(ref), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    b = AdamWLowPrecisionMoments(groups(ours), exp_avg_dtype=dtype, exp_avg_sq_dtype=dtype, chunk_elements=chunk,
                                 lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    return (ref, a), (ours, b)


def _step(params, optimizer, grads):
    for p, g in zip(params, grads):
        p.grad = g.clone()
    optimizer.step()


@pytest.mark.parametrize("chunk", [1 << 26, 500])  # 500: tensors split across chunks
def test_float32_moments_are_torch_adamw_to_the_bit(chunk):
    params, grads = _problem()
    (ref, a), (ours, b) = _optimizers(params, torch.float32, chunk)
    for step, g in enumerate(grads):
        for opt in (a, b):
            for group in opt.param_groups:
                group["lr"] = LR / (step + 1)  # the LR schedule writes the groups between steps
        _step(ref, a, g)
        _step(ours, b, g)
        assert all(torch.equal(x, y) for x, y in zip(ref, ours))


@pytest.mark.parametrize("chunk", [1 << 26, 500])
def test_bf16_moments_are_adamw_with_its_moments_rounded_between_steps(chunk):
    """The whole change of numerics: torch's AdamW whose moments are rounded to bf16 after every step takes
    the same steps to the bit (a step computes with its moments unrounded, then stores them rounded)."""
    params, grads = _problem(1)
    (ref, a), (ours, b) = _optimizers(params, BF16, chunk)
    for g in grads:
        _step(ref, a, g)
        for state in a.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                state[key].copy_(state[key].to(BF16))
        _step(ours, b, g)
        assert all(torch.equal(x, y) for x, y in zip(ref, ours))
        for p, q in zip(ref, ours):
            assert b.state[q]["exp_avg"].dtype == BF16 and b.state[q]["exp_avg_sq"].dtype == BF16
            assert torch.equal(a.state[p]["exp_avg"], b.state[q]["exp_avg"].float())
            assert torch.equal(a.state[p]["exp_avg_sq"], b.state[q]["exp_avg_sq"].float())


def test_bf16_moments_stay_within_the_bound_of_their_rounding():
    """Against float32 moments, elementwise. Step 1 is the same to the bit (its moments are used
    unrounded); it stores m1, v1 rounded: |m1' - m1| <= u|m1|, |v1' - v1| <= u v1 (u = 2^-8). Step 2 then
    sees m2' - m2 = b1 (m1' - m1) and v2' - v2 = b2 (v1' - v1), so with s = lr / (1 - b1^2),
    D = sqrt(v2) / sqrt(1 - b2^2) + eps and D' its bf16 counterpart (D' >= Dmin, from v2 - b2 u v1):
        |p2' - p2| = s |m2'/D' - m2/D| <= s (b1 u |m1| / Dmin + |m2| |D' - D| / (D Dmin)),
        |D' - D| <= b2 u v1 / (sqrt(1 - b2^2) (sqrt(v2) + sqrt(v2 - b2 u v1))),
    plus 8 float32 roundings (2^-21) of |p2| and of the update, for the two runs' own arithmetic."""
    params, grads = _problem(2)
    (ref, a), (ours, b) = _optimizers(params, BF16, 1 << 26)
    _step(ref, a, grads[0])
    _step(ours, b, grads[0])
    assert all(torch.equal(x, y) for x, y in zip(ref, ours))
    m1 = [a.state[p]["exp_avg"].clone() for p in ref]
    v1 = [a.state[p]["exp_avg_sq"].clone() for p in ref]
    for p, q, m, v in zip(ref, ours, m1, v1):
        assert ((b.state[q]["exp_avg"].float() - m).abs() <= U * m.abs()).all()
        assert ((b.state[q]["exp_avg_sq"].float() - v).abs() <= U * v).all()
    _step(ref, a, grads[1])
    _step(ours, b, grads[1])
    (b1, b2), c2 = BETAS, (1 - BETAS[1] ** 2) ** 0.5
    s = LR / (1 - b1 ** 2)
    moved = False
    for p, q, m, v in zip(ref, ours, m1, v1):
        m2, v2 = a.state[p]["exp_avg"].double(), a.state[p]["exp_avg_sq"].double()
        m, v = m.double(), v.double()
        dv = b2 * U * v
        low = (v2 - dv).clamp(min=0).sqrt()
        d, dmin = v2.sqrt() / c2 + EPS, low / c2 + EPS
        d_diff = dv / (c2 * (v2.sqrt() + low))
        bound = s * (b1 * U * m.abs() / dmin + m2.abs() * d_diff / (d * dmin))
        bound += 2.0 ** -21 * (p.double().abs() + s * m2.abs() / dmin)
        diff = (q.double() - p.double()).abs()
        assert (diff <= bound).all(), float((diff - bound).max())
        moved |= bool((diff > 0).any())
    assert moved  # the rounding of the moments did change step 2


def test_state_takes_half_the_bytes_and_loads_from_float32():
    params, grads = _problem()
    (_, _), (ours, b) = _optimizers(params, BF16, 1 << 26)
    _step(ours, b, grads[0])
    numel = sum(p.numel() for p in ours)
    moments = [t for s in b.state.values() for k, t in s.items() if k != "step"]
    assert sum(t.numel() * t.element_size() for t in moments) == 4 * numel
    state = b.state_dict()
    fresh = AdamWLowPrecisionMoments([{"params": ours[:2]}, {"params": ours[2:]}], exp_avg_dtype=BF16,
                                     exp_avg_sq_dtype=BF16)
    state["state"] = {i: {k: v.float() if k != "step" else v for k, v in s.items()}
                      for i, s in state["state"].items()}  # a checkpoint of float32 moments
    fresh.load_state_dict(state)
    _step(ours, fresh, grads[1])
    assert all(s["exp_avg"].dtype == BF16 and s["exp_avg_sq"].dtype == BF16 for s in fresh.state.values())


def test_moment_dtypes_are_checked():
    with pytest.raises(ConfigError, match="optim.exp_avg_dtype.*float16.*choose one of float32, bfloat16"):
        load_config([*TINY_MODEL_OVERRIDES, "optim.exp_avg_dtype=float16"])
    with pytest.raises(ConfigError, match="optim.exp_avg_sq_dtype.*optimizer_cpu_offload"):
        load_config([*TINY_MODEL_OVERRIDES, "optim.exp_avg_sq_dtype=bfloat16", "megatron.optimizer_cpu_offload=true"])


def test_critic_with_bf16_moments_takes_the_same_first_step():
    """The worker puts the option in place: its first step (one per call here) equals the float32-moment
    critic's to the bit, the moments are bf16 (4 bytes per parameter), and the second step differs."""
    from megacritic import CriticWorker
    from megacritic.data.sources import SyntheticRollouts

    runs = {}
    for dtype in ("float32", "bfloat16"):
        worker = CriticWorker(load_config([*TINY_MODEL_OVERRIDES, "data.rollouts_per_step=8", "ppo_mini_batch_size=8",
                                           "shuffle=false", f"optim.exp_avg_dtype={dtype}",
                                           f"optim.exp_avg_sq_dtype={dtype}"]))
        worker.init_model()
        batch = SyntheticRollouts(worker.config).batch(0)
        batch["values"] = worker.compute_values(batch)
        first = worker.update_critic(batch)
        after_one = worker.compute_values(batch)
        worker.update_critic(batch)
        after_two = worker.compute_values(batch)
        inner = torch_optimizers(worker.state.optimizer)
        moments = [t for opt in inner for s in opt.state.values() for k, t in s.items() if k != "step"]
        numel = sum(p.numel() for chunk in worker.state.model for p in chunk.parameters())
        runs[dtype] = first, after_one, after_two, inner, sum(t.numel() * t.element_size() for t in moments), numel
        worker.close()
    (f32, one32, two32, _, bytes32, n), (f16, one16, two16, inner, bytes16, _) = runs["float32"], runs["bfloat16"]
    assert all(isinstance(opt, AdamWLowPrecisionMoments) for opt in inner)
    assert f32["critic/vf_loss"] == f16["critic/vf_loss"] and f32["critic/grad_norm"] == f16["critic/grad_norm"]
    assert torch.equal(one32, one16)
    assert not torch.equal(two32, two16)
    assert (bytes32, bytes16) == (8 * n, 4 * n)


def test_critic_with_bf16_moments_resumes_from_a_checkpoint(tmp_path):
    """The bf16 moments go through Megatron's distributed checkpoint and continue exactly like the
    uninterrupted run."""
    from megacritic import CriticWorker
    from megacritic.data.sources import SyntheticRollouts

    config = load_config([*TINY_MODEL_OVERRIDES, "data.rollouts_per_step=8", "ppo_mini_batch_size=4", "shuffle=false",
                          "optim.exp_avg_dtype=bfloat16", "optim.exp_avg_sq_dtype=bfloat16"])
    worker = CriticWorker(config)
    worker.init_model()
    batch = SyntheticRollouts(worker.config).batch(0)
    batch["values"] = worker.compute_values(batch)
    worker.update_critic(batch)
    folder = worker.save_checkpoint(str(tmp_path), 1, {})
    straight = worker.update_critic(batch)
    worker.close()

    resumed = CriticWorker(config)
    resumed.init_model()
    resumed.load_checkpoint(folder)
    again = resumed.update_critic(batch)
    states = [s for opt in torch_optimizers(resumed.state.optimizer) for s in opt.state.values()]
    resumed.close()
    assert states and all(s["exp_avg"].dtype == BF16 and s["exp_avg_sq"].dtype == BF16 for s in states)
    for key in ("critic/vf_loss", "critic/grad_norm"):
        assert again[key] == straight[key], key
