"""How launch-bound the critic's transformer layers are, and what fixed-size packs replayed as CUDA graphs
would give: one layer's forward + backward, for each micro-batch of the bench's update_critic (the seeded
32 rollouts, shuffled into 4 mini-batches and packed by token budget as the critic does), eager at each
pack's own length (today) against the same layer captured once at the fixed pack size (the budget: each
pack padded to it, a trailing dummy rollout) and replayed (``torch.cuda.make_graphed_callables``).

    python bench/launch_probe.py [--shapes qwen2.5-0.5b,qwen2.5-1.5b] [--budget 16384] [--iters 10] [--out F]
    python bench/launch_probe.py --cpu-tiny      # the eager path on the CPU, so the script stays tested

Per shape, for one layer: the host's time to queue its forward + backward (no synchronisation) and the
device's time (CUDA events), per micro-batch, eager; then the graphed replay at the fixed size. The
update's predicted change is layers x (sum of graphed replays - sum of eager calls): positive where the
padding costs more than the launches saved. Prediction only: the whole critic is not graphed here
(Megatron-Core 0.16's own CUDA graphs need Transformer Engine; ``make_graphed_callables`` of each layer
inside the critic would need static pack buffers, which is the next step if this pays).
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

import torch

from megacritic import CriticWorker, load_config
from megacritic.bench import SHAPES, megacritic_overrides, rollouts
from megacritic.data.rollouts import mini_batch_indices
from megacritic.packing.pack import Pack
from megacritic.packing.partition import token_budget_partitions


def update_packs(lens: list[int], budget: int, config) -> list[int]:
    """The real lengths of update_critic's packs (first call: its shuffle and mini-batches)."""
    out = []
    for rows in mini_batch_indices(len(lens), config.ppo_mini_batch_size, config.ppo_epochs, config.shuffle,
                                   config.data_loader_seed, call_index=0):
        mini = [lens[i] for i in rows]
        out += [sum(mini[i] for i in part) for part in token_budget_partitions(mini, budget)]
    return out


class OneLayer(torch.nn.Module):
    """A decoder layer on a fixed pack (what a CUDA graph captures: the pack's tensors are static)."""

    def __init__(self, layer, pack):
        super().__init__()
        self.layer, self.pack = layer, pack

    def forward(self, x):
        return self.layer(x, attention_mask=None, packed_seq_params=self.pack)[0]


def fresh_leaves(module) -> None:
    """Give ``module`` new parameter objects over the same storage (and attributes: main_grad ...): Megatron's
    DDP created the old parameters' gradient accumulators on the default (legacy) stream when it wrapped the
    model, and autograd runs each accumulation on its node's stream, which a capture on another stream cannot
    depend on. New leaves get their accumulators in the warm-up, on the capture's side stream."""
    for sub in module.modules():
        for name, param in list(sub._parameters.items()):
            if param is not None:
                new = torch.nn.Parameter(param.data, requires_grad=param.requires_grad)
                new.__dict__.update(param.__dict__)
                sub._parameters[name] = new


def pack_of(model, lengths: list[int], total: int, device, dtype) -> Pack:
    """A pack of rollouts of ``lengths`` (a trailing dummy rollout fills it to ``total``), with its RoPE."""
    if total > sum(lengths):
        lengths = lengths + [total - sum(lengths)]
    lens = torch.tensor(lengths)
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])
    pos = torch.arange(total) - torch.repeat_interleave(cu[:-1], lens)
    table = model.rotary_pos_emb(int(lens.max()), packed_seq=True)
    freqs = table[pos.to(table.device), 0]
    cu32 = cu.to(torch.int32).to(device)
    return Pack(qkv_format="sbhd", cu_seqlens_q=cu32, cu_seqlens_kv=cu32, max_seqlen_q=int(lens.max()),
                max_seqlen_kv=int(lens.max()), rotary=(freqs.cos().to(dtype), freqs.sin().to(dtype)))


def split(total: int, rollout: int) -> list[int]:
    """A pack of ``total`` tokens as rollouts of about ``rollout`` tokens (the bench's median sequence)."""
    n = max(1, total // rollout)
    return [total // n + (1 if i < total % n else 0) for i in range(n)]


def time_layer(module, x, grad, iters: int, cuda: bool) -> dict:
    """Median host (queueing) and wall time of forward + backward, and device time where there is a GPU."""
    host, wall, device = [], [], []
    for _ in range(iters):
        if cuda:
            torch.cuda.synchronize()
            start_ev, end_ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start_ev.record()
        t0 = time.perf_counter()
        module(x).backward(grad)
        t1 = time.perf_counter()
        if cuda:
            end_ev.record()
            torch.cuda.synchronize()
            device.append(start_ev.elapsed_time(end_ev) / 1e3)
        wall.append(time.perf_counter() - t0)
        host.append(t1 - t0)
        x.grad = None
    out = {"host_s": statistics.median(host), "wall_s": statistics.median(wall)}
    if device:
        out["device_s"] = statistics.median(device)
    return out


def probe(shape_name: str, budget: int, iters: int, cuda: bool, extra: list[str]) -> dict:
    shape = SHAPES[shape_name]
    widths = (1024, 8192) if cuda else (32, 128)
    batch = rollouts(32 if cuda else 16, shape["vocab_size"], *widths)
    lens = batch["attention_mask"].sum(1).tolist()
    config = load_config(megacritic_overrides(shape, batch, True, budget, 2) + extra)
    worker = CriticWorker(config)
    worker.init_model()
    try:
        model = worker.state.model[0].module
        layer = model.decoder.layers[0]
        device, dtype = next(layer.parameters()).device, next(layer.parameters()).dtype
        median_rollout = int(statistics.median(lens))
        packs = update_packs(lens, budget, config)
        result = {"shape": shape_name, "layers": config.model.num_hidden_layers, "budget": budget, "packs": packs,
                  "real_tokens": sum(packs), "eager": [], "graphed": None}
        for total in packs:
            pack = pack_of(model, split(total, median_rollout), total, device, dtype)
            x = torch.randn(total, 1, config.model.hidden_size, device=device, dtype=dtype, requires_grad=True)
            result["eager"].append(time_layer(OneLayer(layer, pack), x, torch.randn_like(x), iters, cuda))
        if cuda:
            pack = pack_of(model, split(budget, median_rollout), budget, device, dtype)
            x = torch.randn(budget, 1, config.model.hidden_size, device=device, dtype=dtype, requires_grad=True)
            try:
                fresh_leaves(layer)
                graphed = torch.cuda.make_graphed_callables(OneLayer(layer, pack), (x,))
                result["graphed"] = time_layer(graphed, x, torch.randn_like(x), iters, cuda)
            except Exception as exc:  # noqa: BLE001 - reported: the eager figures still stand
                traceback.print_exc()  # the op that broke the capture is in the chain, not the last line
                result["graph_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
        eager = sum(e["wall_s"] for e in result["eager"])
        result["eager_update_layer_s"] = eager
        if result["graphed"]:
            graphed_total = result["graphed"]["wall_s"] * len(packs)
            result["graphed_update_layer_s"] = graphed_total
            result["predicted_update_change_s"] = result["layers"] * (graphed_total - eager)
        return result
    finally:
        worker.close()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="qwen2.5-0.5b,qwen2.5-1.5b")
    parser.add_argument("--budget", type=int, default=16384, help="tokens per pack (ppo_max_token_len_per_gpu)")
    parser.add_argument("--iters", type=int, default=10, help="timed forward + backward per case (median)")
    parser.add_argument("--out", default=None, help="also write the results as JSON here")
    parser.add_argument("--cpu-tiny", action="store_true", help="the tiny shape on the CPU (eager path only)")
    args, extra = parser.parse_known_args()
    cuda = torch.cuda.is_available() and not args.cpu_tiny
    shapes, budget = (["tiny"], 512) if args.cpu_tiny else (args.shapes.split(","), args.budget)
    if cuda and len(shapes) > 1:
        # One process per shape: a failed graph capture leaves the CUDA context unusable for the next one.
        found = []
        for name in shapes:
            with tempfile.NamedTemporaryFile(suffix=".json") as part:
                subprocess.run([sys.executable, __file__, "--shapes", name, "--budget", str(budget), "--iters",
                                str(args.iters), "--out", part.name, *extra], check=False)
                try:
                    found += json.load(open(part.name))
                except ValueError:
                    print(f"{name}: no result (the process failed)")
        if args.out:
            with open(args.out, "w") as f:
                json.dump(found, f, indent=1)
        return
    found = []
    for name in shapes:
        r = probe(name, budget, args.iters if cuda else 2, cuda, extra)
        found.append(r)
        eager = r["eager"]
        fill = r["real_tokens"] / (len(r["packs"]) * budget)
        print(f"{name}: {len(r['packs'])} packs of {r['packs']} tokens (fixed size {budget}: {fill:.0%} real); "
              f"one layer's forward + backward, eager: host {sum(e['host_s'] for e in eager) * 1e3:.1f} ms, "
              + (f"device {sum(e['device_s'] for e in eager) * 1e3:.1f} ms, " if cuda else "")
              + f"wall {r['eager_update_layer_s'] * 1e3:.1f} ms per update")
        if r.get("graphed"):
            g = r["graphed"]
            print(f"  graphed at {budget}: wall {g['wall_s'] * 1e3:.2f} ms, device {g['device_s'] * 1e3:.2f} ms per "
                  f"pack, {r['graphed_update_layer_s'] * 1e3:.1f} ms per update; predicted update change "
                  f"{r['predicted_update_change_s']:+.3f} s ({r['layers']} layers)")
        elif r.get("graph_error"):
            print(f"  graph capture failed: {r['graph_error']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(found, f, indent=1)


if __name__ == "__main__":
    main()
