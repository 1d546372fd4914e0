"""Colocation under torchrun (2 processes, gloo): Megatron's parallel state already initialised in the process
by another model. A critic of the same degrees reuses it (and leaves it in place when closed); a critic of other
degrees is refused with a ConfigError. Writes results as JSON (rank 0)."""

import json
import sys

import torch.distributed as dist
from megatron.core import parallel_state as mpu

from megacritic import CriticWorker, load_config
from megacritic.compat.cpu import enable_cpu_backend
from megacritic.config import TINY_MODEL_OVERRIDES, ConfigError
from megacritic.data.sources import SyntheticRollouts

BASE = [*TINY_MODEL_OVERRIDES, "data.rollouts_per_step=8", "ppo_mini_batch_size=8", "ppo_micro_batch_size_per_gpu=2",
        "model.num_hidden_layers=2", "data.response_length=[2,10]"]
TP2 = BASE + ["megatron.tensor_model_parallel_size=2"]


def values(worker, config):
    worker.init_model()
    return worker.compute_values(SyntheticRollouts(config).batch(0)).tolist()


def main(out: str) -> None:
    dist.init_process_group("gloo")  # the colocated model's world
    enable_cpu_backend()
    mpu.initialize_model_parallel(tensor_model_parallel_size=2)  # ... and its parallel state
    config = load_config(TP2)
    worker = CriticWorker(config)
    reused = values(worker, config)
    worker.close()
    kept = mpu.model_parallel_is_initialized()
    try:
        CriticWorker(load_config(BASE)).init_model()  # TP=1: another layout
        refusal = None
    except ConfigError as exc:
        refusal = str(exc)
    mpu.destroy_model_parallel()
    worker = CriticWorker(config)  # its own parallel state this time
    own = values(worker, config)
    worker.close()
    destroyed = not mpu.model_parallel_is_initialized()
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump({"reused": reused, "own": own, "kept": kept, "refusal": refusal, "destroyed": destroyed}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
