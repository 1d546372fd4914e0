"""CriticGroup: a critic's ranks as Ray actors, driven from one process (the single controller of PPO trainers).

    group = CriticGroup(config, num_gpus_per_node=8)     # or placement_group=pg, bundle_indices=[...]
    group.init_model()
    values = group.compute_values(batch)                  # rank 0's result, after every rank has finished
    metrics = group.update_critic(batch)
    future = group.compute_values_async(batch); values = future.get()
    group.shutdown()

One actor per rank wraps a :class:`megacritic.CriticWorker`; the group sets each actor's RANK / WORLD_SIZE /
MASTER_ADDR / MASTER_PORT / LOCAL_RANK, so the worker joins its world exactly as under torchrun. Every call
sends the whole batch (checked in the driver first, put in Ray's object store once) to every rank: the
critic's loss normalisation and shuffle are over the global batch.

Recovery. When a rank fails, the other ranks are left waiting in a collective until ``megatron.nccl_timeout``;
the group does not wait for them. If the failure is one a restart can cure (a rank's process or node died, a
collective or the device failed, a call passed ``call_timeout_s``), it kills every actor, starts new ones (a
fresh placement and rendezvous port), restores the state the ranks held before the failed call and sends the
call again: the caller gets the result it would have got without the failure. The state is restored from a
snapshot (``CriticWorker.save_checkpoint(..., snapshot=True)`` into a folder in host memory, taken before every
``snapshot_every``-th update call) plus a replay of the state-changing calls since (the driver keeps their
batches in the object store); without a snapshot yet, from ``init_model`` plus a replay. Failures that would
happen again on the same input (a BatchError or ConfigError raised by the ranks, running out of memory, an
error in the code) are raised at once, as is a failure past the restart budget: :class:`CriticGroupError`,
naming every failure seen, with the group torn down.

Needs Ray (``pip install 'megacritic[ray]'``). Not thread-safe: drive a group from one thread.
"""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import tempfile
import time
import traceback
import uuid
from collections import Counter
from dataclasses import dataclass, field

try:
    import ray
    from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("megacritic.ray needs Ray: pip install 'megacritic[ray]'") from e

from megacritic.config import ConfigError, CriticConfig, validate
from megacritic.config.load import load_config
from megacritic.data.rollouts import check_batch, to_tensordict
from megacritic.parallel import ParallelLayout, free_port

__all__ = ["CriticFuture", "CriticGroup", "CriticGroupError", "RankFailure", "Recovery"]

log = logging.getLogger(__name__)

# The calls that change what the ranks hold (weights, optimizer state, LR schedule, shuffle position, which
# parts live in host memory): after a restart they are replayed, in order, on top of the last snapshot.
_CHANGES_STATE = frozenset({"init_model", "update_critic", "load_checkpoint", "offload", "onload"})
# After a first failure, how long the other ranks may take to report theirs: a rank killed mid-collective shows
# up as its own death and as "connection closed" on its peers, and the death is the cause to report.
_GRACE_S = 2.0
# Longest wait for killed actors to be reported dead (their processes, and the GPU memory they hold, gone)
# before new ones are started in their place.
_KILL_WAIT_S = 30.0


class CriticGroupError(RuntimeError):
    """A :class:`CriticGroup` failed and was torn down (actors killed, its own placement groups and snapshots
    removed). ``rank`` / ``operation``: the failure taken as the cause (None for failures of the group as a
    whole: placement, rank layout); ``failures``: every :class:`RankFailure` seen since the last call that
    succeeded (empty for placement failures)."""

    def __init__(self, message: str, rank: int | None = None, operation: str | None = None,
                 failures: tuple = ()):
        super().__init__(message)
        self.rank = rank
        self.operation = operation
        self.failures = tuple(failures)


@dataclass(frozen=True)
class RankFailure:
    """One failure a group saw. ``kind``: "died" (the rank's process or node is gone), "timeout" (no answer
    within ``call_timeout_s``), "collective" (a collective or the device failed on the rank) - all three
    retried - or "error" (the rank raised something the same input would raise again: not retried)."""

    rank: int
    node: str            # the rank's node address
    operation: str       # the group's call, and what the rank was doing in it
    kind: str
    cause: str           # "TypeName: message", first line
    detail: str = ""     # the rank's traceback, or Ray's full message
    exception: BaseException | None = field(default=None, compare=False, repr=False)

    @property
    def retried(self) -> bool:
        return self.kind != "error"

    def __str__(self) -> str:
        return f"rank {self.rank} ({self.node}) in {self.operation}: {self.kind}: {self.cause}"


@dataclass(frozen=True)
class Recovery:
    """One restart of a group: what caused it and what it cost."""

    restart: int                          # 1 for the group's first restart
    failures: tuple[RankFailure, ...]     # the failures it answered (several when a restart itself failed)
    seconds: float                        # from the failure seen to the failed calls sent again
    restore_s: float                      # of which restoring the state (model built, snapshot loaded, replays)
    replayed: int                         # state-changing calls replayed on top of the snapshot (with
                                          # no snapshot: since init_model, which counts as one)
    snapshot: str | None                  # the snapshot restored; None: rebuilt by init_model


class _Fault(Exception):
    """Raised inside the group when ranks failed; carries their failures, and the calls they failed in, to the
    recovery."""

    def __init__(self, failures: list[RankFailure], calls: list | None = None):
        super().__init__("; ".join(map(str, failures)))
        self.failures = failures
        self.calls = calls or []


@dataclass
class _Failure:
    """What a rank sends back instead of a result when its call raised."""

    error: str                 # "TypeName: message"
    traceback: str
    step: str                  # what the critic was doing (CriticWorker.operation; "idle" if not yet in a call)
    retried: bool              # a restart can cure it (see _retried)
    exception: BaseException | None  # the exception itself, when it pickles


@dataclass
class RankPlacement:
    """Where a rank runs: its node and the GPUs Ray gave its actor."""

    rank: int
    node_ip: str
    node_id: str
    gpu_ids: list[str]
    pid: int


def _retried(exc: BaseException) -> bool:
    """Whether a restart can cure what a rank raised: a collective that failed (its peer died, a connection
    broke, the collective timed out) or a device fault. Everything else would happen again on the same input:
    a BatchError or ConfigError, running out of memory (the same micro-batches need the same memory), an
    error in the code."""
    import torch
    import torch.distributed as dist

    if isinstance(exc, torch.OutOfMemoryError):
        return False
    if isinstance(exc, (dist.DistError, getattr(torch, "AcceleratorError", ()))):  # NCCL's errors; CUDA faults
        return True
    if isinstance(exc, RuntimeError):
        # gloo reports a lost peer ("Connection closed by peer") or a timed-out collective as a plain
        # RuntimeError, raised inside torch.distributed or by a pending work's wait()
        frames = traceback.extract_tb(exc.__traceback__)
        inside = bool(frames) and f"torch{os.sep}distributed{os.sep}" in frames[-1].filename
        return inside or any(word in str(exc) for word in ("gloo", "NCCL", "c10d", "CUDA error"))
    return False


def _device_env(gpu_ids: list[str]) -> dict[str, str]:
    """CUDA_VISIBLE_DEVICES / LOCAL_RANK for an actor given ``gpu_ids`` by Ray.

    By default Ray narrows CUDA_VISIBLE_DEVICES to the actor's GPU, which is then device 0. With
    RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES, or where Ray was started without narrowing (some Slurm
    setups), the process sees the node's GPUs and every rank would pick device 0: the actor's GPU is then
    at the position of its id in the visible list (or, with no list, at its id). LOCAL_RANK is set rather
    than the list narrowed, since CUDA may already have read the list when megacritic was imported."""
    if not gpu_ids:
        return {"CUDA_VISIBLE_DEVICES": "", "LOCAL_RANK": "0"}  # CPU rank: gloo, even on a GPU machine
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d]
    if visible:
        return {"LOCAL_RANK": str(visible.index(gpu_ids[0]))}
    return {"LOCAL_RANK": str(int(gpu_ids[0]))}


def _host_memory_dir() -> str:
    """A folder in host memory on this node: /dev/shm (tmpfs), or the temp folder where there is none or where
    it is too small to hold a critic's state (containers often get 64 MB: not a quarter of the memory, which a
    default tmpfs has)."""
    shm = "/dev/shm"
    try:
        stat, memory = os.statvfs(shm), os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        big_enough = stat.f_frsize * stat.f_blocks >= memory / 4
    except (OSError, ValueError):
        return tempfile.gettempdir()
    return shm if big_enough and os.access(shm, os.W_OK) else tempfile.gettempdir()


def _remove_folder(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


class _RankActor:
    """One rank of the group: a CriticWorker in its own process (made a Ray actor by CriticGroup)."""

    def __init__(self):
        self.worker = None
        self.rank: int | None = None

    def probe(self) -> dict:
        return {"node_ip": ray.util.get_node_ip_address(), "node_id": ray.get_runtime_context().get_node_id(),
                "gpu_ids": [str(g) for g in ray.get_gpu_ids()], "pid": os.getpid(),
                "host_memory_dir": _host_memory_dir()}

    def free_port(self) -> int:
        return free_port("")  # other nodes' ranks connect to it

    def device_info(self) -> dict:
        """The device this rank computes on, as its process sees it (for checks of the GPU assignment)."""
        import torch
        info = {"cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
                "local_rank": os.environ.get("LOCAL_RANK"), "device": None, "uuid": None}
        if torch.cuda.is_available() and self.worker is not None and self.worker.ranks is not None:
            device = self.worker.ranks.device
            info.update(device=str(device), uuid=str(torch.cuda.get_device_properties(device).uuid))
        return info

    def setup(self, config: CriticConfig, rank: int, world_size: int, master_addr: str, master_port: int):
        # Before the worker touches torch.distributed or CUDA: its env:// path reads these.
        os.environ.update(_device_env([str(g) for g in ray.get_gpu_ids()]))
        os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "MASTER_ADDR": master_addr,
                           "MASTER_PORT": str(master_port)})
        os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
        from megacritic.worker import CriticWorker
        self.rank = rank
        self.worker = CriticWorker(config)

    def remove_folder(self, path: str) -> None:
        """Rank 0 removes ``path`` (a superseded snapshot); the other ranks only answer."""
        if self.rank == 0:
            _remove_folder(path)

    def call(self, operation: str, *args):
        """``operation`` of the CriticWorker (or ``remove_folder``); an exception comes back as a _Failure."""
        try:
            target = self if operation == "remove_folder" else self.worker
            return getattr(target, operation)(*args)
        except BaseException as e:  # sent back to the driver, which restarts the group or tears it down
            try:
                pickle.dumps(e)
                exception = e
            except Exception:
                exception = None
            step = getattr(self.worker, "operation", "idle") if self.worker is not None else "idle"
            return _Failure(f"{type(e).__name__}: {e}", traceback.format_exc(), str(step), _retried(e), exception)


class _Call:
    """One call of the group, sent to every rank; done once every rank has answered it. ``kind``: "user" (a
    call of the group's API), "snapshot" (save_checkpoint into the snapshot folder), "replay" (restoring after
    a restart) or "chore" (removing a superseded snapshot)."""

    def __init__(self, operation: str, args: tuple = (), kind: str = "user"):
        self.operation, self.args, self.kind = operation, args, kind
        self.answers: dict[int, object] = {}
        self.done = False
        self.started: float | None = None  # when the ranks began it: the call_timeout_s clock

    @property
    def changes_state(self) -> bool:
        return self.operation in _CHANGES_STATE


class CriticFuture:
    """The pending result of an ``*_async`` call: ``get(timeout)`` waits for every rank and returns rank 0's."""

    def __init__(self, group: "CriticGroup", call: _Call):
        self._group, self._call = group, call
        self.operation = call.operation
        self._result: tuple | None = None

    def done(self) -> bool:
        """True once every rank has answered (or the group has failed); ``get`` may still have a failure to
        recover from."""
        if self._call.done or self._group._broken is not None:
            return True
        refs = self._group._refs_of(self._call)
        return not refs or len(ray.wait(refs, num_returns=len(refs), timeout=0)[0]) == len(refs)

    def get(self, timeout: float | None = None):
        """Rank 0's result, once every rank has answered, after any recovery on the way. ``timeout``: raise
        TimeoutError after that many seconds (the call goes on; ``get`` again). Raises CriticGroupError when
        the group failed."""
        if self._result is None:
            result = self._group._wait(self._call, timeout)
            if self.operation == "update_critic":
                result = self._group._with_recovery_metrics(result)
            self._result = (result,)
        return self._result[0]


class CriticGroup:
    """A critic whose ranks are Ray actors; see the module docstring.

    Args:
        config: a CriticConfig, or dotted overrides for :func:`megacritic.load_config`.
        num_gpus_per_node: ranks per node, one GPU each (with ``num_gpus_per_actor=0``: CPU ranks on gloo).
            The group creates and owns one STRICT_PACK placement group per node.
        nnodes: number of nodes (with ``num_gpus_per_node``).
        placement_group: an existing placement group to run in instead (not removed by ``shutdown``; a
            restart reuses its bundles, which Ray moves off a dead node); ``bundle_indices``: its bundles to
            use, one rank each (default: all).
        num_gpus_per_actor: GPU share of each rank. Below 1 lets *another* group (or a rollout engine) share
            the GPU (turn the megatron.*_offload switches on); ranks of one group never share a GPU.
        num_cpus_per_actor: CPU share of each rank.
        master_addr, master_port: rendezvous of the ranks' process group; default rank 0's node address and a
            free port chosen there (a new one at each restart). Tests on one machine pass
            ``master_addr="127.0.0.1"``.
        runtime_env: Ray runtime_env of the actors (e.g. env_vars).
        name: used in placement group names, snapshot folders and error messages.
        call_timeout_s: longest time the ranks may spend in one call (``init_model`` included), counted from
            when they begin it; past it the ranks count as hung (restart, or CriticGroupError).
        start_timeout_s: longest wait for the actors to start (their processes import torch and Megatron).
        placement_timeout_s: longest wait for the placement group's resources before failing with a message
            naming them (at a restart too).
        max_restarts: restarts the group may make to complete one call; the count starts again after every
            call that succeeds. 0 turns recovery off: the first failure tears the group down and raises.
        snapshot_every: a snapshot of the critic's state is taken before every ``snapshot_every``-th
            ``update_critic`` call; a restart loads it and replays the state-changing calls since (at most
            ``snapshot_every`` updates), whose batches the driver keeps in the object store until the next
            snapshot. 0: no snapshots (a restart rebuilds the model and replays every call since
            ``init_model``). A snapshot costs a checkpoint's time and the critic's full state in host memory
            (or on the disk of ``snapshot_dir``).
        snapshot_dir: where snapshots go (in a new folder of their own, removed by ``shutdown``). Default
            /dev/shm, i.e. host memory, of rank 0's node (the temp folder where there is none): lost with that
            node, and unreachable from others, so a group on several nodes needs a folder all of them reach
            (a shared filesystem) unless ``snapshot_every=0`` or ``max_restarts=0``.
    """

    def __init__(self, config: CriticConfig | list[str], *, num_gpus_per_node: int | None = None, nnodes: int = 1,
                 placement_group: PlacementGroup | None = None, bundle_indices: list[int] | None = None,
                 num_gpus_per_actor: float = 1.0, num_cpus_per_actor: float = 1.0,
                 master_addr: str | None = None, master_port: int | None = None, runtime_env: dict | None = None,
                 name: str = "critic", call_timeout_s: float = 3600.0, start_timeout_s: float = 600.0,
                 placement_timeout_s: float = 180.0, max_restarts: int = 3, snapshot_every: int = 10,
                 snapshot_dir: str | None = None):
        if isinstance(config, CriticConfig):
            validate(config)  # (load_config validates what it builds)
            self.config = config
        else:
            self.config = load_config(list(config))
        if max_restarts < 0:
            raise ConfigError(f"max_restarts={max_restarts}: give 0 (recovery off) or more")
        if snapshot_every < 0:
            raise ConfigError(f"snapshot_every={snapshot_every}: give 0 (no snapshots) or more")
        self.name, self.call_timeout_s = name, call_timeout_s
        self.max_restarts, self.snapshot_every, self.snapshot_dir = max_restarts, snapshot_every, snapshot_dir
        self._timeouts = {"start": start_timeout_s, "placement": placement_timeout_s}
        self._actor_options = dict(num_gpus=num_gpus_per_actor, num_cpus=num_cpus_per_actor, runtime_env=runtime_env)
        self._rendezvous = (master_addr, master_port)
        self._actors: list = []
        self._owned_pgs: list[PlacementGroup] = []
        self._broken: CriticGroupError | None = None
        self.placements: list[RankPlacement] = []
        # calls: sent and not yet answered by every rank (in order), and the ref of each rank's answer
        self._inflight: list[_Call] = []
        self._refs: dict = {}  # ObjectRef -> (call, rank)
        # what a restart restores: the last snapshot, then the state-changing calls done since
        self._snapshot: str | None = None
        self._journal: list[_Call] = []
        self._snapshot_root: str | None = None
        self._snapshot_node: str | None = None
        self._snapshots_taken = 0
        self._updates_since_snapshot = 0
        self._snapshots_off: str | None = None  # why snapshots stopped (one failed)
        # recovery: failures and restarts since the last call that succeeded; all restarts
        self._failures: list[RankFailure] = []
        self._restarts_for_call = 0
        self.recoveries: list[Recovery] = []
        self._unreported_recovery_s = 0.0

        # Everything that can be refused is refused before a resource is taken.
        self._bundles = self._bundle_request(num_gpus_per_node, nnodes, placement_group, bundle_indices,
                                             num_gpus_per_actor, num_cpus_per_actor)
        self._reservation = None if placement_group is not None else (num_gpus_per_node, nnodes)
        self._placement_group = placement_group
        self.world_size = len(self._bundles)
        ParallelLayout.from_config(self.config.megatron, self.world_size).check_batch_sizes(self.config)
        try:
            self._place_and_start()
        except _Fault as fault:
            self._fail(fault.failures, "the group did not start")
        except BaseException:
            self._teardown()
            raise

    @property
    def restarts(self) -> int:
        """Restarts the group has made since it was built."""
        return len(self.recoveries)

    # ---------------------------------------------------------------- start

    def _bundle_request(self, num_gpus_per_node, nnodes, pg, bundle_indices, num_gpus_per_actor,
                        num_cpus_per_actor) -> list:
        """Checks the placement arguments; returns the (placement group, bundle index) of each rank (for an
        owned placement group, placeholders until it exists)."""
        if not 0 <= num_gpus_per_actor <= 1:
            raise ConfigError(f"num_gpus_per_actor={num_gpus_per_actor}: choose 0 (CPU ranks) up to 1")
        if num_cpus_per_actor < 0 or (num_gpus_per_actor == 0 and num_cpus_per_actor == 0):
            raise ConfigError(f"num_cpus_per_actor={num_cpus_per_actor}: CPU ranks need a positive CPU share")
        if pg is not None:
            if num_gpus_per_node is not None:
                raise ConfigError("give either placement_group or num_gpus_per_node / nnodes, not both")
            indices = list(range(pg.bundle_count)) if bundle_indices is None else list(bundle_indices)
            bad = [i for i in indices if not 0 <= i < pg.bundle_count]
            if not indices or bad or len(set(indices)) != len(indices):
                raise ConfigError(f"bundle_indices={bundle_indices}: need distinct indices of the placement "
                                  f"group's {pg.bundle_count} bundles")
            for i in indices:  # an actor larger than its bundle would wait for it forever
                spec = pg.bundle_specs[i]
                if num_gpus_per_actor > spec.get("GPU", 0) or num_cpus_per_actor > spec.get("CPU", 0):
                    raise ConfigError(f"placement group bundle {i} is {spec}: too small for an actor of "
                                      f"num_gpus_per_actor={num_gpus_per_actor}, "
                                      f"num_cpus_per_actor={num_cpus_per_actor}")
            return [(pg, i) for i in indices]
        if bundle_indices is not None:
            raise ConfigError("bundle_indices needs placement_group")
        if num_gpus_per_node is None or num_gpus_per_node < 1 or nnodes < 1:
            raise ConfigError(f"num_gpus_per_node={num_gpus_per_node}, nnodes={nnodes}: give positive numbers "
                              "(or a placement_group)")
        return [None] * (num_gpus_per_node * nnodes)

    def _place_and_start(self) -> None:
        """Placement (the group's own placement groups, or the given one's bundles), then the actors."""
        timeout_s = self._timeouts["placement"]
        if self._reservation is not None:
            self._bundles = self._reserve(*self._reservation, timeout_s)
        elif not ray.wait([self._placement_group.ready()], timeout=timeout_s)[0]:
            raise CriticGroupError(f"{self.name}: the given placement group ({self._placement_group.bundle_specs}) "
                                   f"is not ready after {timeout_s:g} s (placement_timeout_s); the cluster has "
                                   f"{ray.available_resources()} free", operation="placement")
        self._start(self._bundles)

    def _reserve(self, per_node, nnodes, timeout_s) -> list:
        """One STRICT_PACK placement group per node (its ranks stay on one node), owned by the group."""
        gpus, cpus = self._actor_options["num_gpus"], self._actor_options["num_cpus"]
        bundle = {k: v for k, v in {"CPU": cpus, "GPU": gpus}.items() if v > 0}
        for node in range(nnodes):
            self._owned_pgs.append(placement_group([dict(bundle)] * per_node, strategy="STRICT_PACK",
                                                   name=f"{self.name}_node{node}_{os.getpid()}_{uuid.uuid4().hex[:8]}"))
        ready, _ = ray.wait([pg.ready() for pg in self._owned_pgs], num_returns=nnodes, timeout=timeout_s)
        if len(ready) < nnodes:
            raise CriticGroupError(
                f"{self.name}: placement group of {nnodes} node(s) x {per_node} bundles {bundle} (STRICT_PACK, "
                f"one node each) not ready after {timeout_s:g} s (placement_timeout_s); the cluster has "
                f"{ray.cluster_resources()} in all, {ray.available_resources()} free", operation="placement")
        return [(pg, i) for pg in self._owned_pgs for i in range(per_node)]

    def _start(self, bundles) -> None:
        """Actors in ``bundles``, in rank order, set up to join one process group (not yet joined: that is
        init_model's first step)."""
        actor_cls = ray.remote(_RankActor)
        actors = [actor_cls.options(max_restarts=0, scheduling_strategy=PlacementGroupSchedulingStrategy(
                      pg, placement_group_bundle_index=i), **self._actor_options).remote()
                  for pg, i in bundles]
        self._actors = actors  # (bundle order until the probe: killed by a teardown all the same)
        timeout_s = self._timeouts["start"]
        probes = self._gather([a.probe.remote() for a in actors], timeout_s, "start (actor probe)")
        order = rank_order(probes)
        self._actors = [actors[i] for i in order]
        self.placements = [RankPlacement(rank=r, **{k: probes[i][k] for k in ("node_ip", "node_id", "gpu_ids", "pid")})
                           for r, i in enumerate(order)]
        check_placement(self.placements, self.config.megatron.tensor_model_parallel_size, self.name)
        self._choose_snapshot_root(probes[order[0]]["host_memory_dir"])
        addr = self._rendezvous[0] or self.placements[0].node_ip
        port = self._rendezvous[1] or self._gather([self._actors[0].free_port.remote()], timeout_s,
                                                   "start (free port)")[0]
        self._gather([a.setup.remote(self.config, r, self.world_size, addr, int(port))
                      for r, a in enumerate(self._actors)], timeout_s, "start (setup)")
        self.master_addr, self.master_port = addr, int(port)

    def _choose_snapshot_root(self, host_memory_dir: str) -> None:
        """The folder of this group's snapshots; checked at every (re)start against where the ranks now are."""
        if self.max_restarts == 0 or self.snapshot_every == 0:
            return  # no snapshots
        nodes = sorted({p.node_ip for p in self.placements})
        rank0 = self.placements[0].node_id
        if self.snapshot_dir is None and len(nodes) > 1:
            raise ConfigError(f"{self.name}: the group runs on nodes {nodes}: its snapshots (for recovery) need "
                              "snapshot_dir, a folder every node reaches (a shared filesystem); or pass "
                              "snapshot_every=0 (a restart replays every call since init_model) or max_restarts=0 "
                              "(no recovery)")
        if self._snapshot_root is not None and (self.snapshot_dir is not None or rank0 == self._snapshot_node):
            return
        if self._snapshot is not None:
            raise CriticGroupError(
                f"{self.name}: the snapshot {self._snapshot} is in the host memory of node {self._snapshot_node}, "
                f"and rank 0 now runs on node {rank0} (its old node is gone or full): the state cannot be "
                "restored; pass snapshot_dir on a shared filesystem to survive the loss of a node",
                operation="restore")
        # (at a restart without a snapshot yet, the snapshots follow rank 0 to its new node)
        parent = self.snapshot_dir if self.snapshot_dir is not None else host_memory_dir
        self._snapshot_root = os.path.join(parent, f"megacritic-{self.name}-{uuid.uuid4().hex[:12]}")
        self._snapshot_node = rank0

    # ---------------------------------------------------------------- calls

    def init_model(self) -> None:
        """Build the model on every rank (joins the process group first)."""
        self._call("init_model")

    def compute_values(self, batch):
        """Values of the response tokens, float32 [B, R] (rank 0's copy; every rank holds the same)."""
        return self.compute_values_async(batch).get()

    def compute_values_async(self, batch) -> CriticFuture:
        """compute_values without waiting: the batch is checked and sent now; ``future.get()`` returns it."""
        return CriticFuture(self, self._submit("compute_values", self._put(batch, need_targets=False)))

    def update_critic(self, batch) -> dict[str, list[float]]:
        """PPO value updates over ``batch`` (one batch or a list of them); rank 0's metrics (reduced over ranks),
        with ``critic/restarts`` (the group's restarts so far) and ``critic/recovery_s`` (seconds spent
        recovering since the previous update_critic result), the same value for each step."""
        return self.update_critic_async(batch).get()

    def update_critic_async(self, batch) -> CriticFuture:
        """update_critic without waiting (preceded, every ``snapshot_every`` updates, by a snapshot)."""
        ref = self._put(batch, need_targets=True)
        self._check_alive()
        if (self._snapshot_root is not None and self._snapshots_off is None
                and self._updates_since_snapshot >= self.snapshot_every):
            self._snapshots_taken += 1
            step = self._snapshots_taken
            self._send(_Call("save_checkpoint", (self._snapshot_root, step, {"snapshot": step}, True),
                             kind="snapshot"))
            self._updates_since_snapshot = 0
        self._updates_since_snapshot += 1
        return CriticFuture(self, self._submit("update_critic", ref))

    def save_checkpoint(self, root: str, step: int, trainer_state: dict) -> str:
        """Write ``<root>/step_<step>`` (a folder every rank can reach); returns it."""
        return self._call("save_checkpoint", root, step, trainer_state)

    def load_checkpoint(self, folder: str) -> dict:
        """Restore a checkpoint saved under any layout; returns its trainer_state. (A restart loads it again
        until the next snapshot: keep the folder until then.)"""
        return self._call("load_checkpoint", folder)

    def offload(self, parts=None) -> None:
        """Move ``parts`` (default: what the megatron.*_offload switches name) to host memory (nothing to do
        on CPU); :meth:`megacritic.CriticWorker.offload`."""
        self._call("offload", None if parts is None else tuple(parts))

    def onload(self, parts=("params", "grads", "optimizer")) -> None:
        """Bring offloaded parts back to the GPU."""
        self._call("onload", tuple(parts))

    def export_hf(self, out_dir: str) -> None:
        """Write the critic as a Hugging Face folder (rank 0 writes; ``out_dir`` as seen from rank 0's node)."""
        self._call("export_hf", out_dir)

    def shutdown(self, timeout_s: float = 60.0) -> None:
        """Close every rank's worker, kill the actors, remove the placement groups the group created and its
        snapshots. Safe to call twice, and after a failure."""
        if self._broken is None and self._actors:
            try:
                self._gather([a.call.remote("close") for a in self._actors], timeout_s, "close")
                if self._snapshot_root is not None and self._snapshots_taken:
                    self._gather([self._actors[0].remove_folder.remote(self._snapshot_root)], timeout_s, "close")
                self._snapshot_root = None
            except _Fault:
                pass  # the actors are killed below all the same
        self._teardown()
        if self._broken is None:
            self._broken = CriticGroupError(f"{self.name}: the group was shut down")

    def __enter__(self) -> "CriticGroup":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def device_info(self) -> list[dict]:
        """Per rank: CUDA_VISIBLE_DEVICES, LOCAL_RANK, and (after init_model) its torch device and GPU UUID."""
        self._check_alive()
        try:
            return self._gather([a.device_info.remote() for a in self._actors], self.call_timeout_s, "device_info")
        except _Fault as fault:
            self._fail(fault.failures, "device_info is not retried")

    # ---------------------------------------------------------------- sending and receiving

    def _put(self, batch, need_targets: bool):
        """Check the batch(es) here, so a bad one is refused before anything is sent; then one object in
        the store for all ranks."""
        self._check_alive()
        several = isinstance(batch, (list, tuple))
        model, tds = self.config.model, []
        for one in batch if several else [batch]:
            check_batch(one, need_targets, model.vocab_size, model.max_position_embeddings,
                        mini_batch_size=self.config.ppo_mini_batch_size if need_targets else None)
            td = to_tensordict(one)  # (a verl DataProto's tensors)
            on_cpu = all(t.device.type == "cpu" for t in td.values(include_nested=True, leaves_only=True))
            tds.append(td if on_cpu else td.to("cpu"))
        return ray.put(tds if several else tds[0])

    def _call(self, operation: str, *args):
        return self._wait(self._submit(operation, *args))

    def _submit(self, operation: str, *args) -> _Call:
        self._check_alive()
        call = _Call(operation, args)
        self._send(call)
        return call

    def _send(self, call: _Call) -> None:
        """Send ``call`` to every rank of the group as it is now (after the calls in flight)."""
        call.answers, call.done = {}, False
        refs = [actor.call.remote(call.operation, *call.args) for actor in self._actors]
        self._refs.update({ref: (call, rank) for rank, ref in enumerate(refs)})
        self._inflight.append(call)
        call.started = time.monotonic() if len(self._inflight) == 1 else None

    def _refs_of(self, call: _Call) -> list:
        return [ref for ref, (c, _) in self._refs.items() if c is call]

    def _wait(self, call: _Call, timeout: float | None = None):
        """Rank 0's answer to ``call`` once every rank has answered, recovering from failures on the way."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not call.done:
            self._check_alive()
            try:
                self._poll(deadline)
            except _Fault as fault:
                self._recover(fault.failures, fault.calls)
        return call.answers[0]

    def _poll(self, deadline: float | None) -> None:
        """Receive what the ranks have answered (waiting up to ``deadline`` for one answer); raises _Fault for
        failed or hung ranks, TimeoutError at ``deadline``."""
        self._promote()
        if not self._inflight:
            return
        head = self._inflight[0]
        hung_at = head.started + self.call_timeout_s
        until = hung_at if deadline is None else min(hung_at, deadline)
        refs = list(self._refs)
        ready = ray.wait(refs, num_returns=1, timeout=max(until - time.monotonic(), 0))[0]
        if not ready:
            now = time.monotonic()
            if now >= hung_at:
                late = sorted(rank for c, rank in self._refs.values() if c is head)
                raise _Fault([self._failure(rank, head, "timeout", f"no answer within {self.call_timeout_s:g} s "
                                            f"(call_timeout_s); rank(s) {late} had not answered") for rank in late])
            if deadline is not None and now >= deadline:
                raise TimeoutError(f"{self.name}: {head.operation} has not finished yet (get's timeout); it goes on")
            return
        others = [r for r in refs if r not in ready]
        if others:
            ready += ray.wait(others, num_returns=len(others), timeout=0)[0]
        failures, failed = [], []
        for ref in ready:
            failed.append(self._receive(ref, failures))
        if failures:
            # The other ranks' answers, for a short while: the rank that died comes before its peers'
            # "connection closed", and a failure on every rank (a bad batch) is seen as such.
            rest = list(self._refs)
            for ref in ray.wait(rest, num_returns=len(rest), timeout=_GRACE_S)[0] if rest else []:
                failed.append(self._receive(ref, failures))
        self._promote()  # (calls every rank answered are done, even when a later one failed: a snapshot, say)
        if failures:
            raise _Fault(failures, [c for c in dict.fromkeys(failed) if c is not None])

    def _promote(self) -> None:
        """Finish the calls at the head of the queue that every rank has answered."""
        while self._inflight and len(self._inflight[0].answers) == len(self._actors):
            self._finish(self._inflight.pop(0))
            if self._inflight:
                self._inflight[0].started = time.monotonic()

    def _receive(self, ref, failures: list[RankFailure]) -> _Call | None:
        """Record a rank's answer, or append its failure to ``failures`` and return the call it failed in."""
        call, rank = self._refs.pop(ref)
        try:
            answer = ray.get(ref)
        except ray.exceptions.RayTaskError as e:  # an actor method outside CriticWorker's calls raised
            cause = e.cause if isinstance(e.cause, BaseException) else e
            failures.append(self._failure(rank, call, "collective" if _retried(cause) else "error",
                                          f"{type(cause).__name__}: {cause}", str(e), cause))
            return call
        except ray.exceptions.RayError as e:  # the actor or its node died (or its object was lost with it)
            failures.append(self._failure(rank, call, "died", f"{type(e).__name__}: {e}", str(e), e))
            return call
        if isinstance(answer, _Failure):
            operation = call.operation + (f" ({answer.step})" if answer.step != "idle" else "")
            failures.append(self._failure(rank, call, "collective" if answer.retried else "error", answer.error,
                                          answer.traceback, answer.exception, operation))
            return call
        call.answers[rank] = answer
        return None

    def _failure(self, rank, call, kind, cause, detail="", exception=None, operation=None) -> RankFailure:
        node = self.placements[rank].node_ip if rank < len(self.placements) else "?"
        return RankFailure(rank, node, operation or call.operation, kind, cause.strip().splitlines()[0] if cause
                           else kind, detail, exception)

    def _finish(self, call: _Call) -> None:
        """``call`` is answered by every rank: what a restart must restore changes with it."""
        call.done = True
        if call.kind == "snapshot":
            superseded, self._snapshot = self._snapshot, call.answers[0]
            self._journal.clear()  # (every call before the snapshot is done: the ranks answer in order)
            if superseded is not None:
                self._send(_Call("remove_folder", (superseded,), kind="chore"))
        elif call.kind == "user":
            if call.changes_state:
                self._journal.append(call)
            else:
                call.args = ()  # the batch may leave the object store (the answer stays for its future)
            self._failures.clear()
            self._restarts_for_call = 0

    def _gather(self, refs: list, timeout_s: float, operation: str) -> list:
        """Every rank's answer to actor calls outside the call queue (start, close, device_info); _Fault if
        one fails or ``timeout_s`` passes first."""
        ready, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        call, failures, answers = _Call(operation), [], []
        for rank, ref in enumerate(refs):
            if ref in pending:
                failures.append(self._failure(rank, call, "timeout", f"no answer within {timeout_s:g} s"))
                continue
            self._refs[ref] = (call, rank)
            self._receive(ref, failures)
            answers.append(call.answers.get(rank))
        if failures:
            raise _Fault(failures)
        return answers

    # ---------------------------------------------------------------- recovery

    def _recover(self, failures: list[RankFailure], calls: list[_Call]) -> None:
        """Restart the group and restore its state before the calls in flight, then send them again; or tear
        it down and raise CriticGroupError when the failure would recur or the budget is spent."""
        seen: list[RankFailure] = []
        while True:
            seen += failures
            self._failures += failures
            if not _worth_a_restart(failures):
                if not (calls and all(c.kind == "snapshot" for c in calls)):
                    self._fail(self._failures, "not retried: the same call would fail the same way")
                if not self._stop_snapshots(failures, calls):
                    return  # every rank answered: nothing to restart
            if self._restarts_for_call >= self.max_restarts:
                self._fail(self._failures, "recovery is off (max_restarts=0)" if self.max_restarts == 0 else
                           f"restart budget spent: max_restarts={self.max_restarts} restarts for one call")
            self._restarts_for_call += 1
            start = time.monotonic()
            try:
                replayed, restore_s = self._restart()
            except _Fault as again:
                failures, calls = again.failures, again.calls
                continue
            except BaseException as e:  # no placement for new ranks, the snapshot lost with its node, ...
                self._fail(self._failures, f"the restart failed: {type(e).__name__}: {e}", e)
            seconds = time.monotonic() - start
            recovery = Recovery(len(self.recoveries) + 1, tuple(seen), seconds, restore_s, replayed, self._snapshot)
            self.recoveries.append(recovery)
            self._unreported_recovery_s += seconds
            log.warning("%s: restart %d after %s; state restored from %s + %d replayed call(s); recovered in "
                        "%.1f s (restore %.1f s)", self.name, recovery.restart, "; ".join(map(str, seen)),
                        self._snapshot or "init_model", replayed, seconds, restore_s)
            return

    def _stop_snapshots(self, failures: list[RankFailure], calls: list[_Call]) -> bool:
        """A snapshot failed in a way it would again (a full disk, say): the group goes on without snapshots
        (a restart then replays everything since the last one) rather than end. Returns whether ranks were
        left waiting in the snapshot's collectives (a restart is then needed to free them)."""
        self._snapshots_off = "; ".join(map(str, failures))
        log.warning("%s: a snapshot failed (%s); no more snapshots: a restart will replay every state-changing "
                    "call since %s", self.name, self._snapshots_off, self._snapshot or "init_model")
        stuck = any(owner[0] in calls for owner in self._refs.values())
        self._inflight = [c for c in self._inflight if c not in calls]
        self._refs = {ref: owner for ref, owner in self._refs.items() if owner[0] not in calls}
        if self._inflight:
            self._inflight[0].started = time.monotonic()
        self._promote()
        return stuck

    def _restart(self) -> tuple[int, float]:
        """New actors in a fresh placement, the state restored (the snapshot, then the calls since replayed),
        the calls in flight sent again. Returns the number of calls replayed and the seconds of the restore."""
        pending = self._inflight  # sent again after the restore; their partial answers are dropped
        self._inflight, self._refs = [], {}
        restore = [_Call(c.operation, c.args, kind="replay") for c in self._journal]
        if self._snapshot is not None:
            restore[:0] = [_Call("init_model", kind="replay"),
                           _Call("load_checkpoint", (self._snapshot,), kind="replay")]
        try:
            self._kill_actors(wait=True)
            for pg in self._owned_pgs:
                remove_placement_group(pg)
            self._owned_pgs = []
            self._place_and_start()
            start = time.monotonic()
            for call in restore:
                self._send(call)
                while not call.done:
                    self._poll(None)
        except BaseException:
            self._inflight, self._refs = pending, {}  # still to be sent, by the next restart
            raise
        restore_s = time.monotonic() - start
        for call in pending:
            self._send(call)
        return len(self._journal), restore_s

    def _with_recovery_metrics(self, metrics: dict) -> dict:
        steps = max((len(v) for v in metrics.values()), default=1)
        seconds, self._unreported_recovery_s = self._unreported_recovery_s, 0.0
        return {**metrics, "critic/restarts": [float(self.restarts)] * steps,
                "critic/recovery_s": [seconds] * steps}

    def _fail(self, failures: list[RankFailure], reason: str, exception: BaseException | None = None):
        """Tear the group down and raise CriticGroupError naming ``failures`` (the likeliest cause first) and
        ``reason``; chained to ``exception`` or the cause's own."""
        self._teardown()
        cause = min(failures, key=lambda f: _CAUSE_ORDER.index(f.kind))
        listing = "\n".join(f"  {i}. {f}" for i, f in enumerate(failures, 1))
        detail = f"\n{cause.detail}" if cause.detail and cause.detail.strip() != cause.cause else ""
        self._broken = CriticGroupError(
            f"{self.name}: rank {cause.rank} failed in {cause.operation}: {cause.cause}\n{reason}; the group was "
            f"torn down (all actors killed). Failures seen:\n{listing}{detail}",
            rank=cause.rank, operation=cause.operation, failures=failures)
        raise self._broken from exception or cause.exception

    def _check_alive(self) -> None:
        if self._broken is not None:
            raise self._broken

    def _kill_actors(self, wait: bool) -> None:
        """Kill every actor (a rank blocked in a collective does not return). ``wait``: until Ray reports them
        dead, so that their processes and the GPU memory they hold are gone before new ranks start."""
        actors, self._actors, self.placements = self._actors, [], []
        for actor in actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:
                pass  # already dead
        if actors and wait:
            ray.wait([a.probe.remote() for a in actors], num_returns=len(actors), timeout=_KILL_WAIT_S)

    def _teardown(self) -> None:
        """Kill the actors, remove the placement groups the group created and its snapshots."""
        self._kill_actors(wait=False)
        for pg in self._owned_pgs:
            try:
                remove_placement_group(pg)
            except Exception:
                pass
        self._owned_pgs = []
        self._inflight, self._journal = [], []
        self._refs.clear()
        if self._snapshot_root is not None and self._snapshots_taken:
            _remove_snapshots(self._snapshot_root, self._snapshot_node)
        self._snapshot_root = self._snapshot = None


# The failure reported as the cause when several are seen: a dead rank or a rank's own error comes before the
# collective errors and time-outs it leaves on its peers.
_CAUSE_ORDER = ("died", "error", "collective", "timeout")


def _worth_a_restart(failures: list[RankFailure]) -> bool:
    """A dead or hung rank is worth a restart; a rank's own error (a bad batch, out of memory, a bug) is not,
    even where its peers then failed in a collective."""
    return any(f.kind in ("died", "timeout") for f in failures) or all(f.retried for f in failures)


def _remove_snapshots(root: str, node_id: str | None) -> None:
    """Remove a torn-down group's snapshot folder, from a task on the node that holds it (its actors are gone);
    if the node is gone too, so is the folder (host memory) or any node can reach it (a shared folder)."""
    try:
        strategy = NodeAffinitySchedulingStrategy(node_id, soft=True) if node_id else "DEFAULT"
        task = ray.remote(_remove_folder).options(num_cpus=0, scheduling_strategy=strategy)
        ray.wait([task.remote(root)], timeout=30)
    except Exception as e:  # best effort: a group's failure is reported, not this
        log.warning("could not remove the snapshot folder %s: %s", root, e)


def _gpu_key(gpu_ids: list[str]) -> tuple:
    if not gpu_ids:
        return (0, 0, "")
    first = gpu_ids[0]
    return (1, int(first), "") if first.isdigit() else (2, 0, first)


def rank_order(probes: list[dict]) -> list[int]:
    """Actor indices in rank order: sorted by (node address, node, GPU id), so that each node's ranks are
    consecutive (placement groups do not promise their bundles in node order) and TP groups, which take
    consecutive ranks, stay inside a node."""
    return sorted(range(len(probes)), key=lambda i: (probes[i]["node_ip"], probes[i]["node_id"],
                                                     _gpu_key(probes[i]["gpu_ids"]), i))


def check_placement(placements: list[RankPlacement], tp: int, name: str = "critic") -> None:
    """Ranks of one group on one GPU would fail in NCCL ("Duplicate GPU detected") or share its memory, and
    a TP group across nodes would run its per-layer collectives over the network: refuse both."""
    seen = Counter((p.node_id, g) for p in placements for g in p.gpu_ids)
    shared = sorted({(p.node_ip, g) for p in placements for g in p.gpu_ids if seen[(p.node_id, g)] > 1})
    if shared:
        ranks = {f"{ip} GPU {g}": [p.rank for p in placements if p.node_ip == ip and g in p.gpu_ids]
                 for ip, g in shared}
        raise CriticGroupError(f"{name}: ranks of one group share a GPU ({ranks}); fractional "
                               "num_gpus_per_actor is for sharing a GPU with another group: give this group one "
                               "bundle per GPU", operation="placement")
    for start in range(0, len(placements), tp):
        nodes = {p.node_ip for p in placements[start:start + tp]}
        if len(nodes) > 1:
            raise CriticGroupError(f"{name}: tensor-parallel group of ranks {start}..{start + tp - 1} spans nodes "
                                   f"{sorted(nodes)}; give each node a multiple of "
                                   f"megatron.tensor_model_parallel_size={tp} bundles", operation="placement")
