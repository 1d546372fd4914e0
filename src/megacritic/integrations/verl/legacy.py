"""megacritic as the critic of verl's ``RayPPOTrainer`` through a worker class of its own (verl <= 0.8's
interface, and 0.9's TrainingWorker calls without the engine plugin).

:func:`critic_worker_cls` returns a ``verl.single_controller.base.Worker`` subclass that runs
:class:`~megacritic.CriticWorker` on each rank, for both interfaces verl has shipped:

- verl <= 0.8 (``megatron_workers.CriticWorker``): ``init_model``, ``compute_values(DataProto) ->
  DataProto{"values"}``, ``update_critic(DataProto) -> DataProto(meta_info={"metrics"})``;
- verl 0.9 (``engine_workers.TrainingWorker`` as the critic): ``reset``, ``set_loss_fn``, ``infer_batch`` /
  ``train_mini_batch`` on the no-padding TensorDict (non-blocking: the trainer calls ``.get()``), ``to``.

Both take checkpoints (``save_checkpoint`` / ``load_checkpoint``). Every call sends the whole batch to every
rank (one ``ray.put``, the same reference to each), because megacritic normalises the loss and shuffles
over the whole mini-batch itself; the result is rank 0's, once every rank has finished. A verl 0.9 trainer
selects megacritic more simply through the engine plugin (:mod:`megacritic.integrations.verl.engine`),
with configuration only; this worker is for verl <= 0.8, which has no engine seam.

This module imports verl only when :func:`critic_worker_cls` is called; megacritic itself never needs it.
"""

from __future__ import annotations

import time

from megacritic.config import ConfigError
from megacritic.integrations.verl.checkpoints import load_latest, save_and_prune
from megacritic.integrations.verl.config import critic_config_from_verl

VERL_INSTALL_HINT = ("pip install 'verl==0.9.1' (megacritic's tested verl; the adapter also drives verl <= 0.8's "
                     "legacy critic interface)")


# ---------------------------------------------------------------------------------------------- verl worker


def _import_verl():
    try:
        import ray
        import verl
        from verl.single_controller.base import Worker
        from verl.single_controller.base.decorator import Dispatch, Execute, register
    except ImportError as exc:
        raise ImportError(f"megacritic.integrations.verl needs verl and ray ({exc}); install them: "
                          f"{VERL_INSTALL_HINT}") from exc
    return ray, verl, Worker, Dispatch, Execute, register


class RankZeroFuture:
    """The result of a non-blocking call: rank 0's output once every rank has finished. verl's trainer calls
    ``.get()``; ``futures`` holds every rank's Ray reference."""

    def __init__(self, futures):
        self.futures = futures

    def get(self):
        import ray
        return ray.get(self.futures)[0]


def dispatch_whole_batch(worker_group, *args, **kwargs):
    """Every rank gets the whole batch: each batch argument is put in Ray's object store once and the same
    reference goes to every rank (megacritic's global normalisation and shuffle need the whole batch)."""
    import ray
    from tensordict import TensorDict

    def share(value):
        is_batch = isinstance(value, TensorDict) or hasattr(value, "batch") and hasattr(value, "meta_info")
        return [ray.put(value) if is_batch else value] * worker_group.world_size
    return tuple(share(a) for a in args), {k: share(v) for k, v in kwargs.items()}


def collect_rank_zero(worker_group, output):
    """Rank 0's result after all ranks finished (a :class:`RankZeroFuture` for a non-blocking call)."""
    import ray
    if output and isinstance(output[0], ray.ObjectRef):
        return RankZeroFuture(list(output))
    return output[0]


_WHOLE_BATCH = {"dispatch_fn": dispatch_whole_batch, "collect_fn": collect_rank_zero}

_CLASSES: dict[tuple, type] = {}


def critic_worker_cls(overrides=(), api: str = "auto") -> type:
    """A verl ``Worker`` subclass running megacritic as verl's critic.

    ``overrides``: megacritic settings (``dotted.key=value``) applied after the ones converted from verl's
    critic section, e.g. megacritic-only keys (verl's config classes refuse unknown keys); they travel with
    the class to every actor. ``api``: ``legacy`` (verl <= 0.8: init_model / compute_values /
    update_critic), ``engine`` (verl 0.9: reset / set_loss_fn / infer_batch / train_mini_batch / to), or
    ``auto`` (both). Raises ImportError naming the fix when verl is not installed."""
    if api not in ("auto", "legacy", "engine"):
        raise ConfigError(f"api={api!r}: choose auto, legacy or engine")
    key = (tuple(overrides), api)
    if key not in _CLASSES:
        _CLASSES[key] = _build_class(tuple(overrides), api)
    return _CLASSES[key]


def _build_class(overrides: tuple, api: str) -> type:
    ray, verl, Worker, Dispatch, Execute, register = _import_verl()
    from megacritic import CriticWorker
    from megacritic.data.rollouts import nested_token_values, rollouts_from_batch

    class _Base(Worker):
        megacritic_overrides = overrides

        def __init__(self, config):
            Worker.__init__(self)
            self.verl_config = config
            self.critic: CriticWorker | None = None
            self._saved: list[str] = []  # checkpoint folders written, oldest first (max_ckpt_to_keep)

        def _build(self, section) -> None:
            config = critic_config_from_verl(section, overrides=self.megacritic_overrides)
            if self.critic is not None:
                self.critic.close()
            self.critic = CriticWorker(config)
            self.critic.init_model()

        def _require(self) -> CriticWorker:
            if self.critic is None:
                raise RuntimeError("the megacritic critic is not built yet: verl calls init_model() (<= 0.8) or "
                                   "reset() then set_loss_fn(...) (0.9) first")
            return self.critic

        def _mfu(self, batch, seconds: float, epochs: int) -> float:
            """Model FLOPs utilisation of an update on the real tokens (verl's perf/mfu/critic), against the
            device's dense bf16 peak over all ranks; NaN where the peak is unknown (CPU)."""
            from megacritic.flops import mfu, model_forward_flops
            critic = self._require()
            rollouts = rollouts_from_batch(batch, need_targets=False)
            flops = 3 * model_forward_flops(critic.config.model, rollouts.seq_lens.tolist()) * epochs  # backward 2x
            return mfu(flops, seconds, critic.layout.world_size)

        def _update(self, batch) -> tuple[dict[str, list[float]], float]:
            critic = self._require()
            start = time.perf_counter()
            metrics = critic.update_critic(batch)
            return metrics, self._mfu(batch, time.perf_counter() - start, critic.config.ppo_epochs)

        # ------------------------------------------------------------ checkpoints (both interfaces)

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def save_checkpoint(self, local_path=None, hdfs_path=None, global_step=0, max_ckpt_to_keep=None,
                            checkpoint_path=None, global_steps=None):
            """verl's signature (0.9: local_path, global_step; <= 0.8: checkpoint_path, global_steps): write
            ``<local_path>/step_<global_step>``; keep the newest ``max_ckpt_to_keep`` written here."""
            local_path = local_path if local_path is not None else checkpoint_path
            step = global_steps if global_steps is not None else global_step
            return save_and_prune(self._require(), local_path, hdfs_path, step, max_ckpt_to_keep, self._saved,
                                  self.rank)

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def load_checkpoint(self, local_path=None, hdfs_path=None, del_local_after_load=False,
                            checkpoint_path=None):
            """Restore the newest intact checkpoint under ``local_path`` (saved under any layout)."""
            local_path = local_path if local_path is not None else checkpoint_path
            return load_latest(self._require(), local_path, hdfs_path)

    class _Legacy:
        """verl <= 0.8's CriticWorker interface."""

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def init_model(self):
            self._build(self.verl_config)

        @register(dispatch_mode=_WHOLE_BATCH)
        def compute_values(self, data):
            from verl import DataProto
            values = self._require().compute_values(data)
            return DataProto.from_dict(tensors={"values": values}) if self.rank == 0 else None

        @register(dispatch_mode=_WHOLE_BATCH)
        def update_critic(self, data):
            from verl import DataProto
            metrics, mfu = self._update(data)
            out = {(k if k.startswith("critic/") else f"critic/{k}"): v for k, v in metrics.items()}
            out["perf/mfu/critic"] = mfu
            return DataProto(batch=None, meta_info={"metrics": out}) if self.rank == 0 else None

    class _Engine:
        """verl 0.9's TrainingWorker interface, as its trainer drives the critic."""

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def reset(self):
            """Back to the initial state. The model is built by set_loss_fn, which brings the whole critic
            section (reset's TrainingWorkerConfig lacks the loss and batch settings)."""
            if self.critic is not None:
                self.critic.close()
                self.critic = None

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def set_loss_fn(self, loss_fn):
            """verl passes ``partial(value_loss, config=critic_config)``. megacritic computes the same clipped
            value loss itself (normalised over the whole mini-batch), so only the config is read."""
            section = getattr(loss_fn, "keywords", {}).get("config")
            if section is None:
                raise ConfigError("set_loss_fn: megacritic computes verl's value loss itself and needs its "
                                  "settings: pass functools.partial(value_loss, config=<critic config>) as verl's "
                                  "trainer does")
            self._build(section)

        def _check_call(self, data) -> None:
            from verl.utils import tensordict_utils as tu
            cfg = self._require().config
            mini = tu.get(data, "mini_batch_size", default=None)
            num_mini = tu.get(data, "num_mini_batch", default=None)
            if mini is None and num_mini is not None:
                mini = len(data) // num_mini
            shuffle = (tu.get(data, "dataloader_kwargs", default={}) or {}).get("shuffle", cfg.shuffle)
            sent = {"ppo_mini_batch_size": mini, "ppo_epochs": tu.get(data, "epochs", default=None),
                    "shuffle": shuffle}
            if cfg.shuffle:
                sent["data_loader_seed"] = tu.get(data, "seed", default=None)
            for key, value in sent.items():
                if value is not None and value != getattr(cfg, key):
                    raise ConfigError(f"train_mini_batch was sent {key}={value!r} but the critic was built with "
                                      f"{getattr(cfg, key)!r} (from the critic section and overrides); they must "
                                      "agree")

        @register(dispatch_mode=_WHOLE_BATCH, blocking=False)
        def infer_batch(self, data):
            from verl.utils import tensordict_utils as tu
            values = self._require().compute_values(data)
            if self.rank != 0:
                return tu.get_tensordict(tensor_dict={}, non_tensor_dict={})
            nested = nested_token_values(values, rollouts_from_batch(data, need_targets=False))
            return tu.get_tensordict(tensor_dict={"values": nested}, non_tensor_dict={"metrics": {}})

        @register(dispatch_mode=_WHOLE_BATCH, blocking=False)
        def train_mini_batch(self, data):
            from verl.utils import tensordict_utils as tu
            self._check_call(data)
            metrics, mfu = self._update(data)
            if self.rank != 0:
                return tu.get_tensordict(tensor_dict={}, non_tensor_dict={})
            # verl's trainer prefixes critic/ itself and reads mfu as perf/mfu/critic.
            out = {k.removeprefix("critic/"): v for k, v in metrics.items()}
            out["mfu"] = mfu
            return tu.get_tensordict(tensor_dict={}, non_tensor_dict={"metrics": out})

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def to(self, device, model=True, optimizer=True, grad=True):
            """verl's manual offload: ``cpu`` moves the named parts to host memory, ``device`` brings them back."""
            if device not in ("cpu", "device"):
                raise ConfigError(f"to(device={device!r}): verl's values are cpu or device")
            critic = self._require()
            parts = [p for p, on in (("params", model), ("optimizer", optimizer), ("grads", grad)) if on]
            if device == "cpu":
                critic.offload(parts)
            else:
                critic.onload(parts)

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def start_profile(self, **kwargs):
            """verl's profiler hooks: megacritic profiles through its own trainer.profile_steps."""

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def stop_profile(self, run_command=True, **kwargs):
            """verl's profiler hooks: megacritic profiles through its own trainer.profile_steps."""

    mixins = {"auto": (_Legacy, _Engine), "legacy": (_Legacy,), "engine": (_Engine,)}[api]
    cls = type("MegacriticCriticWorker", (*mixins, _Base), {
        "__doc__": "megacritic's CriticWorker as verl's critic (see megacritic.integrations.verl).",
        "__module__": __name__})
    return cls
