"""One parity run: the same weights and global batches under one layout; writes results as JSON.

    torchrun --nproc_per_node N tests/multiproc/parity_run.py OUT.json [--modes=A,B] [--fused-adamw] [dotted.key=value ...]

For each micro-batching mode (default: fixed padded, then dynamic packed) in turn: compute_values on a batch,
then three optimizer steps (one update_critic call over three mini-batches, no shuffle). Rank 0 writes values
and metrics. ``--fused-adamw``: torch's fused AdamW (as on a GPU), whose optimizer steps are taken on the
device (megacritic.optim.step_on_device: grad norm and clipping without a host read).
"""

import json
import sys

import torch
import torch.distributed as dist

from megacritic import CriticWorker, load_config
from megacritic.compat.kernels import use_fused_adamw
from megacritic.config import TINY_MODEL_OVERRIDES
from megacritic.data.sources import SyntheticRollouts
from megacritic.optim import steps_on_device

MODEL = [*TINY_MODEL_OVERRIDES, "model.num_hidden_layers=4", "model.hidden_size=64", "model.intermediate_size=96",
         "model.num_attention_heads=4", "model.num_key_value_heads=2", "model.vocab_size=61",
         "data.rollouts_per_step=24", "data.prompt_length=[3,9]", "data.response_length=[2,15]",
         "ppo_mini_batch_size=8", "shuffle=false", "optim.lr=1e-3", "optim.clip_grad=0.5",
         "cliprange_value=0.2"]
MODES = {
    # fixed-size micro-batches, each rollout padded to the micro-batch's longest
    "fixed": ["use_dynamic_bsz=false", "ppo_micro_batch_size_per_gpu=2", "forward_micro_batch_size_per_gpu=2",
              "model.use_remove_padding=false"],
    # token-budget micro-batches, packed without padding (THD)
    "dynamic": ["use_dynamic_bsz=true", "ppo_max_token_len_per_gpu=40", "forward_max_token_len_per_gpu=30",
                "model.use_remove_padding=true"],
    # fixed-size micro-batches, packed (context parallelism needs packing)
    "fixed_packed": ["use_dynamic_bsz=false", "ppo_micro_batch_size_per_gpu=2", "forward_micro_batch_size_per_gpu=2",
                     "model.use_remove_padding=true"],
}
DEFAULT_MODES = ["fixed", "dynamic"]


def run(overrides, modes=DEFAULT_MODES, fused_adamw=False):
    out = {}
    for mode in modes:
        extra = MODES[mode]
        config = load_config(MODEL + extra + overrides)
        worker = CriticWorker(config)
        worker.init_model()
        if fused_adamw:
            use_fused_adamw(worker.state.optimizer)
            assert steps_on_device(worker.state.optimizer)
        data = SyntheticRollouts(config)
        batch = data.batch(0)
        values = worker.compute_values(batch)
        # old values that differ from the predictions, so the clipping branch is exercised
        batch["values"] = values + 0.3 * torch.sin(torch.arange(values.numel()).reshape(values.shape).float())
        metrics = worker.update_critic(batch)
        after = worker.compute_values(batch)
        out[mode] = {"values": values.tolist(), "values_after": after.tolist(), "metrics": metrics,
                     "cp": worker.layout.cp}
        worker.close()
    return out


if __name__ == "__main__":
    args = sys.argv[2:]
    modes = args.pop(0).split("=", 1)[1].split(",") if args and args[0].startswith("--modes=") else DEFAULT_MODES
    fused = "--fused-adamw" in args
    result = run([a for a in args if a != "--fused-adamw"], modes, fused_adamw=fused)
    if not dist.is_initialized() or dist.get_rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(result, f)
