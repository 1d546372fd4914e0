"""CriticGroup: a critic's ranks as Ray actors, driven from one process (the single controller of PPO trainers).

    group = CriticGroup(config, num_gpus_per_node=8)     # or placement_group=pg, bundle_indices=[...]
    group.init_model()
    values = group.compute_values(batch)                  # rank 0's result, after every rank has finished
    metrics = group.update_critic(batch)
    future = group.compute_values_async(batch); values = future.get(timeout=60)
    group.shutdown()

One actor per rank wraps a :class:`megacritic.CriticWorker`; the group sets each actor's RANK / WORLD_SIZE /
MASTER_ADDR / MASTER_PORT / LOCAL_RANK, so the worker joins its world exactly as under torchrun. Every call
sends the whole batch (checked in the driver first, put in Ray's object store once) to every rank: the
critic's loss normalisation and shuffle are over the global batch. When a rank fails, the other ranks are
left waiting in a collective until ``megatron.nccl_timeout``; the group therefore kills every actor at the
first failure and raises :class:`CriticGroupError` naming the rank and the operation.

Needs Ray (``pip install 'megacritic[ray]'``). Not thread-safe: drive a group from one thread.
"""

from __future__ import annotations

import os
import pickle
import time
import traceback
from collections import Counter
from dataclasses import dataclass

try:
    import ray
    from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("megacritic.ray needs Ray: pip install 'megacritic[ray]'") from e

from megacritic.config import ConfigError, CriticConfig, validate
from megacritic.config.load import load_config
from megacritic.data.rollouts import check_batch, mini_batch_indices, to_tensordict
from megacritic.parallel import ParallelLayout, free_port

__all__ = ["CriticFuture", "CriticGroup", "CriticGroupError"]


class CriticGroupError(RuntimeError):
    """A rank of a :class:`CriticGroup` failed (or did not answer in time) during ``operation``; the group has
    been torn down (actors killed, its own placement group removed). ``rank`` is None for failures of the
    group as a whole (placement, rank layout)."""

    def __init__(self, message: str, rank: int | None = None, operation: str | None = None):
        super().__init__(message)
        self.rank = rank
        self.operation = operation


@dataclass
class _Failure:
    """What a rank sends back instead of a result when its call raised."""

    error: str                 # "TypeName: message"
    traceback: str
    step: str                  # what the critic was doing (CriticWorker.operation; "idle" if not yet in a call)
    exception: BaseException | None  # the exception itself, when it pickles


@dataclass
class RankPlacement:
    """Where a rank runs: its node and the GPUs Ray gave its actor."""

    rank: int
    node_ip: str
    node_id: str
    gpu_ids: list[str]
    pid: int


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


class _RankActor:
    """One rank of the group: a CriticWorker in its own process (made a Ray actor by CriticGroup)."""

    def __init__(self):
        self.worker = None
        self.rank: int | None = None
        self._fail_at: str | None = None

    def probe(self) -> dict:
        return {"node_ip": ray.util.get_node_ip_address(), "node_id": ray.get_runtime_context().get_node_id(),
                "gpu_ids": [str(g) for g in ray.get_gpu_ids()], "pid": os.getpid()}

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

    def fail_at(self, operation: str | None) -> None:
        """Test hook (see CriticGroup._inject_failure): raise at the start of the next ``operation`` call."""
        self._fail_at = operation

    def call(self, operation: str, *args):
        try:
            if operation == self._fail_at:
                self._fail_at = None
                raise RuntimeError(f"failure injected at {operation} on rank {self.rank} (test hook)")
            return getattr(self.worker, operation)(*args)
        except BaseException as e:  # sent back to the driver, which tears the group down
            try:
                pickle.dumps(e)
                exception = e
            except Exception:
                exception = None
            step = getattr(self.worker, "operation", "idle") if self.worker is not None else "idle"
            return _Failure(f"{type(e).__name__}: {e}", traceback.format_exc(), str(step), exception)


class CriticFuture:
    """The pending result of an ``*_async`` call: ``get(timeout)`` waits for every rank and returns rank 0's."""

    def __init__(self, group: "CriticGroup", operation: str, refs: list):
        self._group, self.operation, self._refs = group, operation, refs
        self._result: list | None = None

    def done(self) -> bool:
        """True once every rank has answered (or the group has failed)."""
        if self._result is not None or self._group._broken is not None:
            return True
        ready, _ = ray.wait(self._refs, num_returns=len(self._refs), timeout=0)
        return len(ready) == len(self._refs)

    def get(self, timeout: float | None = None):
        """Rank 0's result; raises CriticGroupError if a rank failed or ``timeout`` (default: the group's
        ``call_timeout_s``) passed first, in which case the group is torn down."""
        if self._result is None:
            self._result = self._group._collect(self._refs, timeout)
        return self._result[0]


class CriticGroup:
    """A critic whose ranks are Ray actors; see the module docstring.

    Args:
        config: a CriticConfig, or dotted overrides for :func:`megacritic.load_config`.
        num_gpus_per_node: ranks per node, one GPU each (with ``num_gpus_per_actor=0``: CPU ranks on gloo).
            The group creates and owns one STRICT_PACK placement group per node.
        nnodes: number of nodes (with ``num_gpus_per_node``).
        placement_group: an existing placement group to run in instead (not removed by ``shutdown``);
            ``bundle_indices``: its bundles to use, one rank each (default: all).
        num_gpus_per_actor: GPU share of each rank. Below 1 lets *another* group (or a rollout engine) share
            the GPU (turn the megatron.*_offload switches on); ranks of one group never share a GPU.
        num_cpus_per_actor: CPU share of each rank.
        master_addr, master_port: rendezvous of the ranks' process group; default rank 0's node address and a
            free port chosen there. Tests on one machine pass ``master_addr="127.0.0.1"``.
        runtime_env: Ray runtime_env of the actors (e.g. env_vars).
        name: used in placement group names and error messages.
        call_timeout_s: longest wait for any call (``init_model`` included) before the group is torn down
            with CriticGroupError.
        start_timeout_s: longest wait for the actors to start (their processes import torch and Megatron).
        placement_timeout_s: longest wait for the placement group's resources before failing with a message
            naming them.
    """

    def __init__(self, config: CriticConfig | list[str], *, num_gpus_per_node: int | None = None, nnodes: int = 1,
                 placement_group: PlacementGroup | None = None, bundle_indices: list[int] | None = None,
                 num_gpus_per_actor: float = 1.0, num_cpus_per_actor: float = 1.0,
                 master_addr: str | None = None, master_port: int | None = None, runtime_env: dict | None = None,
                 name: str = "critic", call_timeout_s: float = 3600.0, start_timeout_s: float = 600.0,
                 placement_timeout_s: float = 180.0):
        self.config = config if isinstance(config, CriticConfig) else load_config(list(config))
        self.name, self.call_timeout_s = name, call_timeout_s
        self._actors: list = []
        self._owned_pgs: list[PlacementGroup] = []
        self._pending: dict = {}   # ObjectRef -> (rank, operation): sent, not yet received
        self._received: dict = {}  # ObjectRef -> result, received for a future not read yet
        self._broken: CriticGroupError | None = None
        self.placements: list[RankPlacement] = []

        # Everything that can be refused is refused before a resource is taken.
        bundles = self._bundle_request(num_gpus_per_node, nnodes, placement_group, bundle_indices,
                                       num_gpus_per_actor, num_cpus_per_actor)
        self.world_size = len(bundles)
        validate(self.config)
        ParallelLayout.from_config(self.config.megatron, self.world_size).check_batch_sizes(self.config)
        try:
            if placement_group is None:
                bundles = self._reserve(num_gpus_per_node, nnodes, num_gpus_per_actor, num_cpus_per_actor,
                                        placement_timeout_s)
            elif not ray.wait([placement_group.ready()], timeout=placement_timeout_s)[0]:
                raise CriticGroupError(f"{name}: the given placement group ({placement_group.bundle_specs}) is not "
                                       f"ready after {placement_timeout_s:g} s (placement_timeout_s); the cluster has "
                                       f"{ray.available_resources()} free", operation="placement")
            self._start(bundles, num_gpus_per_actor, num_cpus_per_actor, runtime_env, master_addr, master_port,
                        start_timeout_s)
        except BaseException:
            self._teardown()
            raise

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

    def _reserve(self, per_node, nnodes, gpus, cpus, timeout_s) -> list:
        """One STRICT_PACK placement group per node (its ranks stay on one node), owned by the group."""
        bundle = {"CPU": cpus, "GPU": gpus} if gpus > 0 else {"CPU": cpus}
        bundle = {k: v for k, v in bundle.items() if v > 0}
        for node in range(nnodes):
            self._owned_pgs.append(placement_group([dict(bundle)] * per_node, strategy="STRICT_PACK",
                                                   name=f"{self.name}_node{node}_{os.getpid()}_{id(self)}"))
        ready, _ = ray.wait([pg.ready() for pg in self._owned_pgs], num_returns=nnodes, timeout=timeout_s)
        if len(ready) < nnodes:
            raise CriticGroupError(
                f"{self.name}: placement group of {nnodes} node(s) x {per_node} bundles {bundle} (STRICT_PACK, "
                f"one node each) not ready after {timeout_s:g} s (placement_timeout_s); the cluster has "
                f"{ray.cluster_resources()} in all, {ray.available_resources()} free", operation="placement")
        return [(pg, i) for pg in self._owned_pgs for i in range(per_node)]

    def _start(self, bundles, gpus, cpus, runtime_env, master_addr, master_port, timeout_s) -> None:
        actor_cls = ray.remote(_RankActor)
        actors = [actor_cls.options(num_cpus=cpus, num_gpus=gpus, max_restarts=0, runtime_env=runtime_env,
                                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                                        pg, placement_group_bundle_index=i)).remote()
                  for pg, i in bundles]
        self._actors = actors  # (bundle order until the probe: killed by a teardown all the same)
        probes = self._collect([a.probe.remote() for a in actors], timeout_s, "start (actor probe)",
                               "start_timeout_s")
        order = rank_order(probes)
        self._actors = [actors[i] for i in order]
        self.placements = [RankPlacement(rank=r, **probes[i]) for r, i in enumerate(order)]
        check_placement(self.placements, self.config.megatron.tensor_model_parallel_size, self.name)
        addr = master_addr or self.placements[0].node_ip
        port = master_port or self._collect([self._actors[0].free_port.remote()], timeout_s, "start (free port)",
                                            "start_timeout_s")[0]
        self._collect([a.setup.remote(self.config, r, self.world_size, addr, int(port))
                       for r, a in enumerate(self._actors)], timeout_s, "start (setup)", "start_timeout_s")
        self.master_addr, self.master_port = addr, int(port)

    # ---------------------------------------------------------------- calls

    def init_model(self) -> None:
        """Build the model on every rank (joins the process group first)."""
        self._call("init_model")

    def compute_values(self, batch):
        """Values of the response tokens, float32 [B, R] (rank 0's copy; every rank holds the same)."""
        return self.compute_values_async(batch).get()

    def compute_values_async(self, batch) -> CriticFuture:
        ref = self._put(batch, need_targets=False)
        return CriticFuture(self, "compute_values", self._submit("compute_values", ref))

    def update_critic(self, batch) -> dict[str, list[float]]:
        """PPO value updates over ``batch`` (one batch or a list of them); rank 0's metrics (reduced over ranks)."""
        return self.update_critic_async(batch).get()

    def update_critic_async(self, batch) -> CriticFuture:
        ref = self._put(batch, need_targets=True)
        return CriticFuture(self, "update_critic", self._submit("update_critic", ref))

    def save_checkpoint(self, root: str, step: int, trainer_state: dict) -> str:
        """Write ``<root>/step_<step>`` (a folder every rank can reach); returns it."""
        return self._call("save_checkpoint", root, step, trainer_state)

    def load_checkpoint(self, folder: str) -> dict:
        """Restore a checkpoint saved under any layout; returns its trainer_state."""
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
        """Close every rank's worker, kill the actors and remove the placement group the group created.
        Safe to call twice, and after a failure."""
        if self._broken is None and self._actors:
            try:
                self._collect(self._submit("close"), timeout_s)
            except CriticGroupError:
                pass  # torn down already; the close failure was the last thing to report
        self._teardown()
        if self._broken is None:
            self._broken = CriticGroupError(f"{self.name}: the group was shut down")

    def __enter__(self) -> "CriticGroup":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def device_info(self) -> list[dict]:
        """Per rank: CUDA_VISIBLE_DEVICES, LOCAL_RANK, and (after init_model) its torch device and GPU UUID."""
        return self._collect([a.device_info.remote() for a in self._actors], None, operation="device_info")

    def _inject_failure(self, rank: int, operation: str) -> None:
        """Test hook: rank ``rank`` raises at the start of its next ``operation`` call (e.g. "update_critic"),
        while the other ranks go on into that call's collectives."""
        self._collect([self._actors[rank].fail_at.remote(operation)], None, operation="inject failure")

    # ---------------------------------------------------------------- internals

    def _put(self, batch, need_targets: bool):
        """Check the batch(es) here, so a bad one is refused before anything is sent; then one object in
        the store for all ranks."""
        self._check_alive()
        several = isinstance(batch, (list, tuple))
        tds = []
        for one in batch if several else [batch]:
            model = self.config.model
            rollouts = check_batch(one, need_targets, model.vocab_size, model.max_position_embeddings)
            if need_targets:
                mini_batch_indices(len(rollouts), self.config.ppo_mini_batch_size, 1, False, None)
            td = to_tensordict(one)  # (a verl DataProto's tensors)
            on_cpu = all(t.device.type == "cpu" for t in td.values(include_nested=True, leaves_only=True))
            tds.append(td if on_cpu else td.to("cpu"))
        return ray.put(tds if several else tds[0])

    def _call(self, operation: str, *args):
        return self._collect(self._submit(operation, *args), None)[0]

    def _submit(self, operation: str, *args) -> list:
        self._check_alive()
        refs = [actor.call.remote(operation, *args) for actor in self._actors]
        self._pending.update({ref: (rank, operation) for rank, ref in enumerate(refs)})
        return refs

    def _collect(self, refs: list, timeout: float | None, operation: str | None = None,
                 limit: str = "the call's timeout") -> list:
        """Every rank's answer to ``refs``, in rank order. Also watches the calls sent earlier and not yet
        read: a failure anywhere tears the group down at once. ``operation`` names untracked refs."""
        self._check_alive()  # a group torn down by another call's failure has no results to give
        untracked = {ref: (rank, operation) for rank, ref in enumerate(refs) if ref not in self._pending
                     and ref not in self._received}
        self._pending.update(untracked)
        limit = "call_timeout_s" if timeout is None else limit
        timeout = self.call_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while any(ref in self._pending for ref in refs):
            self._check_alive()
            left = deadline - time.monotonic()
            ready = ray.wait(list(self._pending), num_returns=1, timeout=left)[0] if left > 0 else []
            if not ready:
                late = [self._pending[r] for r in refs if r in self._pending]
                self._fail(late[0][0], late[0][1], f"no answer from rank(s) {[r for r, _ in late]} within "
                           f"{timeout:g} s ({limit})")
            for ref in ready:
                rank, op = self._pending.pop(ref)
                try:
                    result = ray.get(ref)
                except ray.exceptions.RayError as e:  # the actor died, or a task outside CriticWorker failed
                    self._fail(rank, op, f"{type(e).__name__}: {e}", e)
                if isinstance(result, _Failure):
                    during = f" (during {result.step})" if result.step != "idle" else ""
                    self._fail(rank, op, f"{result.error}{during}\n{result.traceback}", result.exception)
                self._received[ref] = result
        return [self._received.pop(ref) for ref in refs]

    def _fail(self, rank: int, operation: str, detail: str, cause: BaseException | None = None):
        self._teardown()
        self._broken = CriticGroupError(f"{self.name}: rank {rank} failed in {operation}; the group was torn "
                                        f"down (all actors killed). {detail}", rank=rank, operation=operation)
        raise self._broken from cause

    def _check_alive(self) -> None:
        if self._broken is not None:
            raise self._broken

    def _teardown(self) -> None:
        """Kill every actor (a rank blocked in a collective does not return) and remove owned placement groups."""
        for actor in self._actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:
                pass  # already dead
        for pg in self._owned_pgs:
            try:
                remove_placement_group(pg)
            except Exception:
                pass
        self._actors, self._owned_pgs = [], []
        self._pending.clear()
        self._received.clear()


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
