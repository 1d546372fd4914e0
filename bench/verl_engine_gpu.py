"""verl's engine path on one GPU: megacritic's plugin engine, driven the way verl's TrainingWorker drives it
(``BaseEngine.infer_batch`` / ``train_batch`` with verl's ``value_loss``, batches in verl's no-padding
layout), against megacritic's own ``CriticWorker`` on the same rollouts and weights.

    python bench/verl_engine_gpu.py --shape qwen2.5-1.5b --out bench/results/verl-engine-h200.json

Checks: values from the engine equal ``CriticWorker.compute_values`` (bf16, FA2 for determinism: rel. diff
printed, must be 0 up to the bf16 kernels' own noise), and the per-call overhead of the engine path over
``CriticWorker`` alone (median of timed calls, target <= 5%). One process, a world of one; Ray's dispatch is
not part of the measurement (verl's worker group adds the same object-store hop to any engine).
Needs verl 0.9.1 importable and megacritic installed (its ``verl.plugins`` entry point registers the engine):
``bench/verl_gpu_wheels.sh`` fetches what the GPU image lacks and says how to install it. Without a GPU it runs
on CPU (gloo, float32), e.g. ``--shape tiny --rollouts 8 --max-prompt 16 --max-response 32`` to check the path.
"""

import argparse
import json
import os
import statistics
import time
from functools import partial

import torch


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen2.5-1.5b", help="a bench shape (megacritic.bench.SHAPES)")
    ap.add_argument("--calls", type=int, default=3, help="timed calls of each kind (after one untimed)")
    ap.add_argument("--rollouts", type=int, default=32, help="rollouts per call")
    ap.add_argument("--max-prompt", type=int, default=1024, help="longest prompt (tokens)")
    ap.add_argument("--max-response", type=int, default=8192, help="longest response (tokens)")
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    torch.distributed.init_process_group("nccl" if cuda else "gloo")
    if cuda:
        torch.cuda.set_device(0)

    from omegaconf import OmegaConf
    from verl.utils import tensordict_utils as tu
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.engine import EngineRegistry

    # registered by megacritic's verl.plugins entry point when verl imported its engines, as in verl's workers
    if "megacritic" not in EngineRegistry._engines.get("value_model", {}):
        raise SystemExit("verl has no 'megacritic' engine: install megacritic (pip install --no-deps .) so that "
                         "verl finds its verl.plugins entry point")
    from verl.workers.utils.losses import value_loss
    from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

    from megacritic import CriticWorker, load_config
    from megacritic.bench import SHAPES, rollouts
    from megacritic.cli import init_hf

    shape = SHAPES[args.shape]
    model_dir = f"/tmp/verl-engine-{args.shape}-{args.max_prompt + args.max_response}"
    if not os.path.exists(os.path.join(model_dir, "config.json")):
        init_hf(model_dir, [f"model.{k}={v}" for k, v in shape.items()]
                + [f"model.max_position_embeddings={args.max_prompt + args.max_response}"], None)
    # the bench's rollouts (by default 32, prompts 64-1024, responses 16-8192 tokens), in verl's padded layout
    batch = rollouts(args.rollouts, shape["vocab_size"], args.max_prompt, args.max_response)
    batch["prompts"] = batch["input_ids"][:, :args.max_prompt]

    shipped = os.path.join(os.path.dirname(__import__("verl").__file__), "trainer", "config",
                           "_generated_ppo_megatron_trainer.yaml")
    critic = OmegaConf.load(shipped).critic
    critic._target_ = "megacritic.integrations.verl.MegacriticCriticConfig"
    critic.model.path, critic.model.load_tokenizer = model_dir, False
    critic.rollout_n, critic.ppo_mini_batch_size = 1, len(batch)
    critic.use_dynamic_bsz, critic.ppo_max_token_len_per_gpu = True, 16384
    critic.ppo_infer_max_token_len_per_gpu = critic.forward_max_token_len_per_gpu = 16384
    critic.optim.lr = 1e-6
    own = {"model": {"attention_impl": "fa2"}} if cuda else {"model": {"dtype": "float32"}}
    OmegaConf.update(critic, "megacritic", own, force_add=True)
    cfg = omega_conf_to_dataclass(critic)
    engine = EngineRegistry.new("value_model", "megacritic", model_config=cfg.model, engine_config=cfg.engine,
                                optimizer_config=cfg.optim, checkpoint_config=cfg.checkpoint)
    engine.initialize()
    loss_fn = partial(value_loss, config=cfg)

    def engine_values():
        td = left_right_2_no_padding(batch.clone())
        tu.assign_non_tensor(td, compute_loss=False)
        with engine.eval_mode():
            out = engine.infer_batch(td, loss_function=None)
        return no_padding_2_padding(out["model_output"]["values"], td).float()

    def engine_update(values):
        td = batch.clone()
        td["values"] = values
        td = left_right_2_no_padding(td)
        tu.assign_non_tensor(td, global_batch_size=len(batch))
        with engine.train_mode():
            engine.train_batch(td, loss_fn)
        engine.lr_scheduler_step()

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def timed(fn, *a):
        sync()
        start = time.perf_counter()
        fn(*a)
        sync()
        return time.perf_counter() - start

    values = engine_values()
    engine_update(values)
    t_values = [timed(engine_values) for _ in range(args.calls)]
    t_update = [timed(engine_update, values) for _ in range(args.calls)]
    engine_after = engine_values()
    engine.worker.close()

    # megacritic alone: the same settings (the engine's own megacritic config), the same rollouts
    worker = CriticWorker(load_config([*cfg.engine.verl_settings, *cfg.engine.megacritic_settings]))
    worker.init_model()
    reference = worker.compute_values(batch)
    batch_t = batch.clone()
    batch_t["values"] = reference
    worker.update_critic(batch_t)
    w_values = [timed(worker.compute_values, batch) for _ in range(args.calls)]
    w_update = [timed(worker.update_critic, batch_t) for _ in range(args.calls)]
    diff = float((values - reference).abs().max() / reference.abs().max())
    result = {"shape": args.shape, "rollouts": len(batch), "device": torch.cuda.get_device_name() if cuda else "cpu",
              "values_rel_diff": diff,
              "engine_compute_values_s": statistics.median(t_values), "worker_compute_values_s": statistics.median(w_values),
              "engine_update_s": statistics.median(t_update), "worker_update_s": statistics.median(w_update),
              "engine_after_mean": float(engine_after.mean())}
    result["overhead_compute_values"] = result["engine_compute_values_s"] / result["worker_compute_values_s"] - 1
    result["overhead_update"] = result["engine_update_s"] / result["worker_update_s"] - 1
    print(json.dumps(result, indent=1))
    if args.out:
        json.dump(result, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
