"""The parallel layout of a run: every degree and every setting derived from them, worked out once, and
the process groups that carry it out.

:class:`ParallelLayout` is pure (config + world size, checked); :func:`init_megatron` creates (or joins) the
process group and Megatron's parallel state for it and returns what it set up (:class:`Initialised`): this
process' :class:`Ranks` and the :class:`ProcessGroups` of its collectives, both read from Megatron's
parallel state once. Everything downstream (the critic, the forward-backward runner, the model builder, the
export) receives these objects; this module (and :mod:`megacritic.compat`) alone imports Megatron's
``parallel_state``.
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megacritic.config import ConfigError, CriticConfig, MegatronConfig
from megacritic.model.weights import ExpertRanks


@dataclass(frozen=True)
class ParallelLayout:
    """Degrees of parallelism of a run (world size = tp x pp x cp x dp) and what follows from them."""

    world_size: int
    tp: int
    pp: int
    vpp: int  # model chunks per pipeline rank (1 without interleaving)
    cp: int
    dp: int
    ep: int
    etp: int | None  # tensor parallelism inside each expert; None: Megatron's default (= tp)
    sequence_parallel: bool  # in effect: asked for, and tp > 1

    @classmethod
    def from_config(cls, mg: MegatronConfig, world_size: int) -> "ParallelLayout":
        """The layout of ``mg`` on ``world_size`` processes; ConfigError when the degrees do not fit it."""
        tp, pp, cp = mg.tensor_model_parallel_size, mg.pipeline_model_parallel_size, mg.context_parallel_size
        model_parallel = tp * pp * cp
        if world_size % model_parallel:
            raise ConfigError(
                f"world size {world_size} is not divisible by megatron.tensor_model_parallel_size x "
                f"megatron.pipeline_model_parallel_size x megatron.context_parallel_size ({tp} x {pp} x {cp} = "
                f"{model_parallel}); change them or the number of processes")
        expert_parallel = (mg.expert_tensor_parallel_size or tp) * mg.expert_model_parallel_size * pp
        if world_size % expert_parallel:
            raise ConfigError(
                f"world size {world_size} is not divisible by expert tensor x expert model x pipeline parallel "
                f"sizes ({expert_parallel}); change megatron.expert_model_parallel_size / "
                "expert_tensor_parallel_size or the number of processes")
        return cls(world_size=world_size, tp=tp, pp=pp, vpp=max(mg.virtual_pipeline_model_parallel_size or 1, 1),
                   cp=cp, dp=world_size // model_parallel, ep=mg.expert_model_parallel_size,
                   etp=mg.expert_tensor_parallel_size, sequence_parallel=mg.sequence_parallel and tp > 1)

    @property
    def fixed_micro_batch_shape(self) -> bool:
        """With two stages the interleaved schedule's previous and next peer are the same rank, and
        megatron-core 0.16 mismatches the shape messages of the two directions (and batched p2p ops pair the
        wrong receives): every micro-batch of a call must then have the same shape, and p2p ops go unbatched."""
        return self.pp == 2 and self.vpp > 1

    @property
    def variable_seq_lengths(self) -> bool:
        """Micro-batches of a call may differ in shape (Megatron's pipeline then sends shapes first)."""
        return self.pp > 1 and not self.fixed_micro_batch_shape

    @property
    def micro_batch_multiple(self) -> int:
        """The interleaved schedule runs micro-batches in groups of pp."""
        return self.pp if self.vpp > 1 else 1

    @property
    def seq_multiple(self) -> int:
        """Sequence parallelism splits every sequence (or this rank's pack) over the TP ranks."""
        return self.tp if self.sequence_parallel else 1

    def check_batch_sizes(self, config: CriticConfig) -> None:
        """The batch sizes of ``config`` on this layout (ConfigError naming the setting)."""
        mini = config.ppo_mini_batch_size
        if mini % self.dp:
            raise ConfigError(f"ppo_mini_batch_size={mini}: must be a multiple of the data-parallel size ({self.dp})")
        if config.use_dynamic_bsz:
            return
        per_rank, micro = mini // self.dp, config.ppo_micro_batch_size_per_gpu
        if per_rank % micro:
            raise ConfigError(f"ppo_micro_batch_size_per_gpu={micro}: must divide the mini-batch per data-parallel "
                              f"rank (ppo_mini_batch_size {mini} / {self.dp} ranks = {per_rank})")
        if self.vpp > 1 and (per_rank // micro) % self.pp:
            raise ConfigError(f"ppo_micro_batch_size_per_gpu={micro}: the interleaved pipeline needs a multiple of "
                              f"pipeline_model_parallel_size ({self.pp}) micro-batches per mini-batch; got "
                              f"{per_rank // micro}")


@dataclass(frozen=True)
class Ranks:
    """This process' ranks, read from Megatron's parallel state once, right after it is initialised."""

    rank: int
    dp_rank: int
    cp_rank: int
    tp_rank: int
    pp_rank: int
    is_last_stage: bool
    experts: ExpertRanks
    device: torch.device
    expert_dp_rank: int = 0  # this rank's replica among the ranks holding the same experts
    # Per model chunk (virtual pipeline stage): (holds the embedding, holds the value head).
    chunk_roles: tuple[tuple[bool, bool], ...] = ((True, True),)

    @classmethod
    def read(cls, device: torch.device, vpp: int = 1) -> "Ranks":
        from megatron.core import parallel_state as mpu
        stages = [stage if vpp > 1 else None for stage in range(vpp)]
        return cls(rank=dist.get_rank(), dp_rank=mpu.get_data_parallel_rank(), cp_rank=mpu.get_context_parallel_rank(),
                   tp_rank=mpu.get_tensor_model_parallel_rank(), pp_rank=mpu.get_pipeline_model_parallel_rank(),
                   is_last_stage=mpu.is_pipeline_last_stage(ignore_virtual=True),
                   experts=ExpertRanks(mpu.get_expert_model_parallel_rank(),
                                       mpu.get_expert_model_parallel_world_size(),
                                       mpu.get_expert_tensor_parallel_rank(),
                                       mpu.get_expert_tensor_parallel_world_size()),
                   device=device, expert_dp_rank=mpu.get_expert_data_parallel_rank(),
                   chunk_roles=tuple((mpu.is_pipeline_first_stage(ignore_virtual=False, vp_stage=s),
                                      mpu.is_pipeline_last_stage(ignore_virtual=False, vp_stage=s)) for s in stages))


@dataclass(frozen=True)
class ProcessGroups:
    """The process groups of the critic's collectives, taken from Megatron's parallel state once. A world of
    one (or a test without a Megatron world) passes ``ProcessGroups()``: every group None, no collective run."""

    dp: object = None  # data parallel
    dp_cp: object = None  # data x context parallel (loss statistics, gradients)
    dp_gloo: object = None  # data parallel on gloo (host-side maxima)
    cp: object = None  # context parallel
    tp: object = None  # tensor parallel
    pp: object = None  # pipeline parallel
    pp_last_rank: int = 0  # global rank of this pipeline's last stage
    expert_tp: object = None  # expert tensor parallel
    expert_ep: object = None  # expert model parallel

    @classmethod
    def read(cls) -> "ProcessGroups":
        from megatron.core import parallel_state as mpu
        return cls(dp=mpu.get_data_parallel_group(), dp_cp=mpu.get_data_parallel_group(with_context_parallel=True),
                   dp_gloo=mpu.get_data_parallel_group_gloo(), cp=mpu.get_context_parallel_group(),
                   tp=mpu.get_tensor_model_parallel_group(), pp=mpu.get_pipeline_model_parallel_group(),
                   pp_last_rank=mpu.get_pipeline_model_parallel_last_rank(),
                   expert_tp=mpu.get_expert_tensor_parallel_group(), expert_ep=mpu.get_expert_model_parallel_group())


@dataclass(frozen=True)
class Initialised:
    """What :func:`init_megatron` set up, and so what :func:`teardown` takes down."""

    ranks: Ranks
    groups: ProcessGroups
    owns_process_group: bool  # this call created a world of one
    owns_parallel_state: bool  # False: Megatron's parallel state of another model in this process, reused


def world_size() -> int:
    """The world this process is in (or will join): the process group's, else torchrun's, else 1."""
    return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now on ``host`` ("" = every interface, for peers on other nodes)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _attempt_store(timeout: datetime.timedelta) -> dist.Store:
    """torchrun's store, under a prefix of this restart attempt.

    With TORCHELASTIC_USE_AGENT_STORE=True the store at MASTER_ADDR:MASTER_PORT belongs to torchrun's agent
    (the c10d rendezvous' shared TCPStore, or the static rendezvous' one) and outlives the workers: after a
    ``--max-restarts`` restart it still holds every key the dead workers wrote. Process groups name their
    keys deterministically (the same group names in every attempt), so the new workers would read the old
    ones' addresses (gloo: connectFullMesh to a port nobody listens on) or pass barriers on old counts.
    A prefix per attempt gives each one fresh keys. TORCHELASTIC_RESTART_COUNT is the same for all workers
    of one agent (one node); across nodes the agents count separately, so a multi-node elastic job should
    run torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (a fresh store each round; no prefix then)."""
    store, _, _ = next(dist.rendezvous("env://", timeout=timeout))
    store.set_timeout(timeout)
    return dist.PrefixStore(f"megacritic/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def init_distributed(timeout_s: int = 600) -> bool:
    """Join the process group already there (e.g. a colocated FSDP actor's), the torchrun world, or create a
    world of one. Returns True if this call created a world of one (its owner tears it down; a torchrun world
    stays up for the process)."""
    if dist.is_initialized():
        return False
    cuda = torch.cuda.is_available()
    backend = "nccl" if cuda else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            dist.init_process_group(backend, store=_attempt_store(timeout), rank=int(os.environ["RANK"]),
                                    world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)
        else:
            dist.init_process_group(backend, timeout=timeout)
        return False
    if cuda:
        torch.cuda.set_device(0)
    # A world of one needs no rendezvous: an in-process store (a TCP store on a port found free a moment
    # before can lose it to another process, EADDRINUSE).
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return True


def _existing_degrees() -> dict[str, int]:
    from megatron.core import parallel_state as mpu
    return {"tensor_model_parallel_size": mpu.get_tensor_model_parallel_world_size(),
            "pipeline_model_parallel_size": mpu.get_pipeline_model_parallel_world_size(),
            "virtual_pipeline_model_parallel_size": mpu.get_virtual_pipeline_model_parallel_world_size() or 1,
            "context_parallel_size": mpu.get_context_parallel_world_size(),
            "expert_model_parallel_size": mpu.get_expert_model_parallel_world_size(),
            "expert_tensor_parallel_size": mpu.get_expert_tensor_parallel_world_size()}


def _check_reusable(layout: ParallelLayout) -> None:
    """Megatron's parallel state is process-global: a colocated model's can serve the critic only when every
    degree is the same."""
    wanted = {"tensor_model_parallel_size": layout.tp, "pipeline_model_parallel_size": layout.pp,
              "virtual_pipeline_model_parallel_size": layout.vpp, "context_parallel_size": layout.cp,
              "expert_model_parallel_size": layout.ep, "expert_tensor_parallel_size": layout.etp or layout.tp}
    have = _existing_degrees()
    differ = [f"megatron.{key}={wanted[key]} (initialised: {have[key]})" for key in wanted if wanted[key] != have[key]]
    if differ:
        raise ConfigError(
            "Megatron's parallel state is already initialised in this process (another model colocated with the "
            f"critic) with other degrees: {', '.join(differ)}. Megatron keeps one parallel state per process: use "
            "the same degrees, or give the critic its own resource pool (its own processes)")


def init_megatron(layout: ParallelLayout, seed: int, timeout_s: int) -> Initialised:
    """The process group and Megatron's parallel state for ``layout``; this process' ranks.

    Colocation: with torch.distributed already initialised (another role of the same process), its process
    group is used. With Megatron's parallel state already initialised (a colocated Megatron model) it is
    reused when its degrees match ``layout`` (ConfigError otherwise, before anything changes) and then never
    destroyed by the critic; its model-parallel RNG states are left as they are.
    """
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel.random import (
        get_cuda_rng_tracker,
        model_parallel_cuda_manual_seed,
    )

    if mpu.model_parallel_is_initialized():
        # (a parallel state implies a process group, whose size the layout was planned for: world_size())
        _check_reusable(layout)
        owns_group, owns_state = False, False
        if not get_cuda_rng_tracker().get_states():
            model_parallel_cuda_manual_seed(seed)
    else:
        owns_group, owns_state = init_distributed(timeout_s), True
        mpu.initialize_model_parallel(layout.tp, layout.pp,
                                      virtual_pipeline_model_parallel_size=layout.vpp if layout.vpp > 1 else None,
                                      expert_model_parallel_size=layout.ep,
                                      expert_tensor_parallel_size=layout.etp,
                                      context_parallel_size=layout.cp,
                                      # Megatron takes minutes (timedelta(minutes=...)): a fraction keeps
                                      # the seconds of megatron.nccl_timeout exact
                                      distributed_timeout_minutes=timeout_s / 60)
        model_parallel_cuda_manual_seed(seed)
    on_cpu = not torch.cuda.is_available()
    device = torch.device("cpu") if on_cpu else torch.device("cuda", torch.cuda.current_device())
    return Initialised(Ranks.read(device, layout.vpp), ProcessGroups.read(), owns_group, owns_state)


def use_deterministic_algorithms() -> None:
    """megatron.full_determinism, for this process (torch's switch is process-global, so a role colocated
    with the critic computes deterministically too). Before the process group and the first cuBLAS handle:
    both read their environment once."""
    # cuBLAS reduces in a fixed order only with a fixed workspace; torch refuses its GEMMs without one.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    # NCCL picks its algorithm per message size and topology; ring is the same every run.
    os.environ.setdefault("NCCL_ALGO", "Ring")
    torch.use_deterministic_algorithms(True)


def set_world_timeout(timeout_s: int) -> None:
    """Give the world process group, created by someone else without megatron.nccl_timeout (verl's
    TrainingWorker: torch's default then, 30 min on gloo and 10 min on NCCL), a timeout of ``timeout_s``
    for the collectives that follow. torch's setter is private; Megatron's ``update_pg_timeout`` calls it too."""
    dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=timeout_s), dist.group.WORLD)


def teardown(initialised: Initialised) -> None:
    """Undo what :func:`init_megatron` set up: Megatron's parallel state unless it was a colocated model's
    (reused), and the process group if it created a world of one."""
    if initialised.owns_parallel_state:
        from megatron.core import parallel_state as mpu
        mpu.destroy_model_parallel()
    if initialised.owns_process_group and dist.is_initialized():
        dist.destroy_process_group()
