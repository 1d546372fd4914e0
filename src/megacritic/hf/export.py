"""Export of the critic as a Hugging Face ``*ForTokenClassification`` (one label) folder, gathered from any
TP / PP / EP layout."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from megacritic.config.schema import ModelConfig
from megacritic.hf.config import export_config, export_family
from megacritic.model.weights import hf_from_megatron, hf_shapes, param_layer
from megacritic.parallel import ProcessGroups, Ranks


def _gather_expert(name: str, local: torch.Tensor, model: ModelConfig, ranks: Ranks,
                   groups: ProcessGroups) -> list[tuple[str, list[torch.Tensor]]]:
    """Routed-expert parameter ``name`` (local expert index) of every EP rank: (its name with the global expert
    index, its pieces on the expert TP ranks). Collective over this rank's expert TP and EP groups."""
    etp, ep = ranks.experts.etp_size, ranks.experts.ep_size
    pieces = torch.stack([local])
    if etp > 1:
        parts = [torch.empty_like(local) for _ in range(etp)]
        dist.all_gather(parts, local.contiguous(), group=groups.expert_tp)
        pieces = torch.stack(parts)
    per_rank = [pieces]
    if ep > 1:
        per_rank = [torch.empty_like(pieces) for _ in range(ep)]
        dist.all_gather(per_rank, pieces, group=groups.expert_ep)
    parts = name.split(".")
    at = parts.index("local_experts") + 1
    local_index, per_ep = int(parts[at]), model.num_experts // ep
    out = []
    for r, stacked in enumerate(per_rank):
        parts[at] = str(r * per_ep + local_index)
        out.append((".".join(parts), list(stacked.unbind(0))))
    return out


@torch.no_grad()
def export_hf(chunks: list, model: ModelConfig, out_dir: str | Path, ranks: Ranks, groups: ProcessGroups,
              tp: int, dtype: torch.dtype | None = None) -> None:
    """Write the critic as a Hugging Face ``*ForTokenClassification`` folder (config.json + safetensors).

    Collective: every rank of the world calls it. Each pipeline stage's tensors are gathered over TP on its
    first data-parallel replica, then sent stage by stage to global rank 0, which writes one safetensors
    shard per stage (one file for PP = 1). Memory on rank 0 is bounded by one stage's full tensors.
    ``chunks`` may be DDP-wrapped; ``tp``: the tensor-parallel size; ``dtype`` defaults to the parameters' dtype.
    """
    from safetensors.torch import save_file

    export_family(model)  # refuse on every rank before any collective
    chunks = [getattr(chunk, "module", chunk) for chunk in chunks]
    first_replica = ranks.dp_rank == 0
    writer = first_replica and ranks.tp_rank == 0
    rank = dist.get_rank()
    device = next(chunks[0].parameters()).device
    dtype = dtype or next(chunks[0].parameters()).dtype

    # 1. This stage's full tensors, gathered over its TP group; routed experts over expert TP, then EP (the
    #    writer is the first rank of its stage, so it is also the first expert replica).
    tensors: dict[str, torch.Tensor] = {}
    first_expert_replica = ranks.expert_dp_rank == 0
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            layer = param_layer(chunk, name)
            if ".experts.local_experts." in name:
                if not first_expert_replica:
                    continue
                for global_name, pieces in _gather_expert(name, param.data, model, ranks, groups):
                    if writer:
                        for hf_name, t in hf_from_megatron(global_name, layer, pieces, model).items():
                            tensors[hf_name] = t.to(dtype).contiguous()
                continue
            if not first_replica:
                continue
            pieces = [param.data]
            if tp > 1:
                pieces = [torch.empty_like(param.data) for _ in range(tp)]
                dist.all_gather(pieces, param.data.contiguous(), group=groups.tp)
            if writer:
                for hf_name, t in hf_from_megatron(name, layer, pieces, model).items():
                    tensors[hf_name] = t.to(dtype).contiguous()

    # 2. Every writer's tensor names and shapes, then rank 0 receives and writes stage by stage.
    listing = [(n, tuple(t.shape)) for n, t in tensors.items()] if writer else None
    listings = [None] * dist.get_world_size()
    dist.all_gather_object(listings, listing)
    stages = [(src, names) for src, names in enumerate(listings) if names is not None]
    out = Path(out_dir)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    total = 0
    for k, (src, names) in enumerate(stages):
        file = "model.safetensors" if len(stages) == 1 else f"model-{k + 1:05d}-of-{len(stages):05d}.safetensors"
        if rank == src and src != 0:
            for name, _ in names:
                dist.send(tensors[name], dst=0)
        if rank == 0:
            shard = {}
            for name, shape in names:
                if src == 0:
                    t = tensors[name]
                else:
                    t = torch.empty(shape, dtype=dtype, device=device)
                    dist.recv(t, src=src)
                shard[name] = t.cpu()
                weight_map[name] = file
                total += t.numel() * t.element_size()
            save_file(shard, str(out / file), metadata={"format": "pt"})
            del shard
    if rank == 0:
        missing = set(hf_shapes(model)) ^ set(weight_map)
        if missing:
            raise RuntimeError(f"export gathered the wrong set of tensors: {sorted(missing)[:5]}")
        if len(stages) > 1:
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        export_config(model, dtype).save_pretrained(str(out))
    dist.barrier()

