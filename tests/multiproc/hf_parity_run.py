"""Hugging Face import / export under one layout; writes results as JSON.

    torchrun --nproc_per_node N tests/multiproc/hf_parity_run.py OUT_DIR MODELS.json [dotted.key=value ...]

MODELS.json maps a name to [model folder, value_head_init]. For each model: import it (model.path), compute
values on a batch, export (OUT_DIR/<name>/import), train two optimizer steps, compute values again and
export (OUT_DIR/<name>/trained). Rank 0 writes OUT_DIR/results.json with the batch and both values.
"""

import json
import sys
from pathlib import Path

import torch.distributed as dist

from megacritic import CriticWorker, load_config
from megacritic.data.sources import SyntheticRollouts

# 8 rollouts, left-padded prompts and right-padded responses; two mini-batches of 4 = two optimizer steps.
BASE = ["model.dtype=float32", "data.rollouts_per_step=8", "ppo_mini_batch_size=4",
        "ppo_micro_batch_size_per_gpu=2", "data.prompt_length=[3,9]", "data.response_length=[2,12]",
        "shuffle=false", "optim.lr=1e-2", "optim.clip_grad=0"]


def run(out: Path, models: dict, overrides: list[str]) -> dict:
    results = {}
    for name, (folder, head_init) in models.items():
        config = load_config(BASE + [f"model.path={folder}", f"model.value_head_init={head_init}"] + overrides)
        worker = CriticWorker(config)
        worker.init_model()
        batch = SyntheticRollouts(config).batch(0)
        values = worker.compute_values(batch)
        worker.export_hf(str(out / name / "import"))
        batch["values"] = values
        metrics = worker.update_critic(batch)
        after = worker.compute_values(batch)
        worker.export_hf(str(out / name / "trained"))
        worker.close()
        results[name] = {key: batch[key].tolist() for key in ("input_ids", "attention_mask", "position_ids")}
        results[name].update(values=values.tolist(), values_after=after.tolist(),
                             steps=len(metrics["critic/vf_loss"]), seed=config.megatron.seed)
    return results


if __name__ == "__main__":
    out_dir = Path(sys.argv[1])
    result = run(out_dir, json.loads(Path(sys.argv[2]).read_text()), sys.argv[3:])
    if not dist.is_initialized() or dist.get_rank() == 0:
        (out_dir / "results.json").write_text(json.dumps(result))
