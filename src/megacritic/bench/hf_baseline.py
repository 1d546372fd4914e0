"""The baseline ``hf-sdpa-padded``: what a user runs instead of megacritic. ``transformers``
AutoModelForTokenClassification (num_labels=1, SDPA attention), fused torch AdamW with bf16 state, the same
clipped value loss normalised over each mini-batch, verl-layout padded micro-batches of the largest size that
fits (halved on out-of-memory)."""

from __future__ import annotations

import torch
from tensordict import TensorDict

from megacritic.bench.timing import Timer, peak_gib, reset_memory


def run_hf(shape: dict, batch: TensorDict, repeats: int, cliprange_value: float = 0.5) -> dict:
    """What a user runs instead: HF token classification, SDPA, fused AdamW, padded micro-batches."""
    from transformers import AutoModelForTokenClassification, Qwen2Config

    from megacritic.losses import clipped_value_loss

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    config = Qwen2Config(**shape, num_labels=1, max_position_embeddings=batch["input_ids"].shape[1],
                         rope_theta=1000000.0, tie_word_embeddings=False)
    model = AutoModelForTokenClassification.from_config(config, attn_implementation="sdpa").to(device, dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=cuda)
    n, r = len(batch), batch["responses"].shape[1]
    mini = n // 4
    data = batch.to(device)
    resp_mask = data["attention_mask"][:, -r:].float()

    def values_pass(micro: int):
        with torch.no_grad():
            for start in range(0, n, micro):
                sl = slice(start, start + micro)
                model(input_ids=data["input_ids"][sl], attention_mask=data["attention_mask"][sl],
                      position_ids=data["position_ids"][sl]).logits[:, -r - 1:-1, 0].float()

    def update_pass(micro: int):
        for m0 in range(0, n, mini):
            optimizer.zero_grad(set_to_none=True)
            tokens = resp_mask[m0:m0 + mini].sum()
            for start in range(m0, m0 + mini, micro):
                sl = slice(start, start + micro)
                vpreds = model(input_ids=data["input_ids"][sl], attention_mask=data["attention_mask"][sl],
                               position_ids=data["position_ids"][sl]).logits[:, -r - 1:-1, 0].float()
                loss_mat, _ = clipped_value_loss(vpreds, data["values"][sl], data["returns"][sl], cliprange_value)
                ((loss_mat * resp_mask[sl]).sum() / tokens).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()

    timer, out, micros = Timer(), {}, {}
    # Both phases warm up (and find their micro-batch) before either is timed, as for megacritic: values are
    # then measured with the optimizer state of earlier updates resident, as in an RL loop.
    for phase, fn in (("values", values_pass), ("update", update_pass)):
        micro = mini
        while True:
            try:
                fn(micro)  # warm-up, and the fit test
                break
            except torch.OutOfMemoryError:
                optimizer.zero_grad(set_to_none=True)
                reset_memory()
                if micro == 1:
                    raise
                micro //= 2
        micros[phase] = micro
    for phase, fn in (("values", values_pass), ("update", update_pass)):
        reset_memory()
        t = [timer(lambda: fn(micros[phase]))[1] for _ in range(repeats)]
        out[phase] = (t, peak_gib())
        out[phase + "_micro_batch"] = micros[phase]
    model = optimizer = None  # the closures above hold them too
    reset_memory()
    out["kernels"] = {"attention": "sdpa (padded)", "norm": "eager (Qwen2RMSNorm)", "swiglu": "eager",
                      "recompute": None, "optimizer": "gpu (torch fused AdamW, bf16 state)"}
    return out
