"""Faults for the CriticGroup tests, injected from outside megacritic: a subclass of the group's rank actor that,
when a planned call arrives, stops at a chosen point of it and waits there (to be killed by the test, or to
hang past call_timeout_s), raises an out-of-memory error, or kills its own process.

The plan is a JSON list in a file the test writes (and may rewrite between calls); every rank reads it at each
call. A fault names the rank, the operation, the input (``input_key`` of the batch, so replays of other calls
after a restart do not match), where it strikes and what it does. It fires once (a marker file records each
firing) unless ``every_time`` is set.

    group class: monkeypatch.setattr(megacritic.ray, "_RankActor", faulty_actor(plan_file))
"""

import hashlib
import json
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.modules.module import register_module_forward_hook
from torch.optim.optimizer import register_optimizer_step_post_hook

from megacritic.ray import _RankActor

WHERE = ("start", "step", "forward", "collective")  # the call's start, after an optimizer step, in a forward,
ACTIONS = ("wait", "oom", "die")                     # in an all-reduce; wait there, raise OOM, SIGKILL itself


def input_key(batch) -> str:
    """What identifies a batch to a fault: a digest of its token ids."""
    return hashlib.sha1(batch["input_ids"].contiguous().numpy().tobytes()).hexdigest()[:16]


def fault(name, rank, operation, batch, where="start", action="wait", every_time=False) -> dict:
    """``batch`` None: any call of ``operation`` (one without a batch, such as save_checkpoint)."""
    assert where in WHERE and action in ACTIONS
    return {"name": name, "rank": rank, "operation": operation, "input": None if batch is None else input_key(batch),
            "where": where, "action": action, "every_time": every_time}


def write_plan(path: Path, faults: list[dict]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(faults))
    os.replace(tmp, path)  # the ranks never read half a plan


def fired(plan_path: Path, name: str) -> int:
    """How many times fault ``name`` has fired."""
    marker = plan_path.parent / f"{name}.fired"
    return len(marker.read_text().splitlines()) if marker.exists() else 0


class FaultyRankActor(_RankActor):
    PLAN: str = ""  # the plan file; set by faulty_actor

    def call(self, operation, *args):
        batch = args[0] if args and hasattr(args[0], "keys") and "input_ids" in args[0].keys() else None
        plan = json.loads(Path(self.PLAN).read_text()) if Path(self.PLAN).exists() else []
        armed = [f for f in plan if f["rank"] == self.rank and f["operation"] == operation
                 and (f["input"] is None or batch is not None and f["input"] == input_key(batch))
                 and (f["every_time"] or not self._fired(f))]
        undo = [self._arm(f, operation) for f in armed]
        try:
            return super().call(operation, *args)
        finally:
            for u in undo:
                u()

    def _marker(self, f) -> Path:
        return Path(self.PLAN).parent / f"{f['name']}.fired"

    def _fired(self, f) -> bool:
        return self._marker(f).exists()

    def _strike(self, f) -> None:
        with open(self._marker(f), "a") as out:
            out.write(f"{os.getpid()}\n")
        if f["action"] == "oom":
            raise torch.OutOfMemoryError(f"injected: out of memory on rank {self.rank} (tests/ray_faults.py)")
        if f["action"] == "die":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(3600)  # "wait": until killed, by the test or by the group's teardown after call_timeout_s

    def _arm(self, f, operation):
        """Install the fault; returns what removes it."""
        struck = []

        def strike_once(*_):
            if not struck:
                struck.append(True)
                self._strike(f)

        if f["where"] == "start":
            method = getattr(self.worker, operation)

            def wrapped(*args):
                strike_once()
                return method(*args)

            setattr(self.worker, operation, wrapped)  # an instance attribute shadows the method
            return lambda: delattr(self.worker, operation)
        if f["where"] == "step":  # after the first optimizer step of the call
            return register_optimizer_step_post_hook(strike_once).remove
        if f["where"] == "forward":  # in the first module's forward
            return register_module_forward_hook(strike_once).remove
        all_reduce = dist.all_reduce  # "collective": inside an all-reduce, before it is entered

        def hanging_all_reduce(*args, **kwargs):
            strike_once()
            return all_reduce(*args, **kwargs)

        dist.all_reduce = hanging_all_reduce

        def undo():
            dist.all_reduce = all_reduce
        return undo


def faulty_actor(plan_path: Path) -> type:
    return type("FaultyRankActor", (FaultyRankActor,), {"PLAN": str(plan_path)})
