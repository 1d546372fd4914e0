"""Mixture-of-experts models under one (TP, EP) layout: import, values, export, three training steps.

    torchrun --nproc_per_node N tests/multiproc/moe_run.py OUT_DIR MODELS.json [dotted.key=value ...]

MODELS.json maps a name to [model folder, value_head_init, [extra dotted overrides], whether to checkpoint].
For each model: import it (model.path), compute values on a batch, export (OUT_DIR/<name>/import), train
three optimizer steps (three mini-batches of one update_critic call), compute values again, export
(OUT_DIR/<name>/trained) and, if asked, save a checkpoint, which a fresh worker loads and computes the values
from once more, then a snapshot, restored in another fresh worker: the update after it, run on both sides of
the restart, must give the same metrics. Rank 0 writes OUT_DIR/results.json with the batch, the values, the metrics and the routers'
weights before and after training (to check model.freeze_moe_router).
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from megacritic import CriticWorker, load_config
from megacritic.data.sources import SyntheticRollouts

# 12 rollouts: three mini-batches of 4 = three optimizer steps; micro-batches of 2 rollouts, packed.
BASE = ["model.dtype=float32", "data.rollouts_per_step=12", "ppo_mini_batch_size=4",
        "ppo_micro_batch_size_per_gpu=2", "data.prompt_length=[3,9]", "data.response_length=[2,12]",
        "shuffle=false", "optim.lr=1e-2", "optim.clip_grad=1.0", "cliprange_value=0.2"]


def _router_sum(worker) -> float:
    """Sum of every router weight of the model (over pipeline stages, for a freeze check)."""
    total = torch.zeros((), dtype=torch.float64)
    for chunk in worker.state.model:
        for name, param in chunk.module.named_parameters():
            if name.endswith("mlp.router.weight"):
                total += param.detach().double().abs().sum().cpu()
    return float(total)


def _restarted(config, folder: str) -> CriticWorker:
    """A fresh worker with ``folder`` (a checkpoint or a snapshot) loaded."""
    worker = CriticWorker(config)
    worker.init_model()
    worker.load_checkpoint(folder)
    return worker


def run(out: Path, models: dict, overrides: list[str]) -> dict:
    results = {}
    for name, (folder, head_init, extra, with_checkpoint) in models.items():
        config = load_config(BASE + [f"model.path={folder}", f"model.value_head_init={head_init}"] + extra
                             + overrides)
        worker = CriticWorker(config)
        worker.init_model()
        batch = SyntheticRollouts(config).batch(0)
        values = worker.compute_values(batch)
        worker.export_hf(str(out / name / "import"))
        routers_before = _router_sum(worker)
        # old values that differ from the predictions, so the clipped branch of the loss is exercised
        batch["values"] = values + 0.3 * torch.sin(torch.arange(values.numel()).reshape(values.shape).float())
        metrics = worker.update_critic(batch)
        after = worker.compute_values(batch)
        worker.export_hf(str(out / name / "trained"))
        routers_after = _router_sum(worker)
        reloaded = snapshot_same = None
        if with_checkpoint:
            saved = worker.save_checkpoint(str(out / name / "checkpoints"), 1, {})
            worker.close()
            worker = _restarted(config, saved)
            reloaded = worker.compute_values(batch).tolist()
            # a snapshot (CriticGroup's restart format: each rank's optimizer shards as they are, the experts'
            # optimizer of its own under EP > 1) restores the exact state in a fresh worker
            snapshot = worker.save_checkpoint(str(out / name / "snapshots"), 1, {}, snapshot=True)
            before_restart = worker.update_critic(batch)
            worker.close()
            worker = _restarted(config, snapshot)
            after_restart = worker.update_critic(batch)
            snapshot_same = {key: before_restart[key] == after_restart[key] for key in before_restart
                             if not key.startswith(("timing_s/", "perf/"))}
        worker.close()
        results[name] = {key: batch[key].tolist() for key in ("input_ids", "attention_mask", "position_ids")}
        results[name].update(values=values.tolist(), values_after=after.tolist(), reloaded=reloaded,
                             snapshot_same=snapshot_same,
                             metrics=metrics,
                             routers=[routers_before, routers_after], seed=config.megatron.seed)
    return results


if __name__ == "__main__":
    out_dir = Path(sys.argv[1])
    result = run(out_dir, json.loads(Path(sys.argv[2]).read_text()), sys.argv[3:])
    if not dist.is_initialized() or dist.get_rank() == 0:
        (out_dir / "results.json").write_text(json.dumps(result))
