"""Safetensors checkpoints read lazily, tensor by tensor and slice by slice, so a rank reads only the rows of
its own shard (a stage's tensors, cut by TP) and memory stays bounded by that shard."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from megacritic.config.schema import ConfigError, ModelConfig
from megacritic.model.weights import TensorSource, hf_shapes, seeded_initializer

# SafetensorsFolder tensors the critic does not use: the LM head (replaced by the value head) and a classification
# head unless the value head starts from it (rotary tables that old checkpoints stored are skipped by name).
_UNUSED_TENSORS = ("lm_head.weight", "lm_head.bias", "score.weight", "score.bias")


class SafetensorsFolder:
    """The tensors of a local safetensors checkpoint (one file, or shards with an index), read lazily."""

    def __init__(self, folder: str | Path):
        from safetensors import safe_open
        self._safe_open = safe_open
        self.folder = Path(folder)
        index, single = self.folder / "model.safetensors.index.json", self.folder / "model.safetensors"
        if index.is_file():
            self.files: dict[str, str] = json.loads(index.read_text())["weight_map"]
        elif single.is_file():
            with safe_open(str(single), framework="pt") as f:
                self.files = {name: single.name for name in f.keys()}
        else:
            raise ConfigError(f"model.path={str(folder)!r}: no model.safetensors or model.safetensors.index.json "
                              "(only safetensors checkpoints are read; re-save with save_pretrained)")
        self._handles: dict = {}

    def _handle(self, name: str):
        file = self.files[name]
        if file not in self._handles:  # memory-mapped: opening reads only the header
            self._handles[file] = self._safe_open(str(self.folder / file), framework="pt")
        return self._handles[file]

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def read(self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Tensor ``name``, or only its rows start:stop along ``dim``."""
        if dim is None:
            return self._handle(name).get_tensor(name)
        return self._handle(name).get_slice(name)[(slice(None),) * dim + (slice(start, stop),)]


class SafetensorsSource:  # a megacritic.model.weights.TensorSource
    """Full tensors (by value-model name, as :func:`hf_shapes`) from the checkpoint at model.path, plus the
    value head per model.value_head_init. Checks every name and shape up front, from headers only."""

    def __init__(self, model: ModelConfig, seed: int):
        self.ckpt = ckpt = SafetensorsFolder(model.path)
        path = model.path
        # *ForCausalLM / *ForTokenClassification name the decoder "model."; a bare *Model saves without it.
        self.prefix = "model." if "model.embed_tokens.weight" in ckpt else ""
        expected = {n: s for n, s in hf_shapes(model).items() if not n.startswith("score.")}
        for name, shape in expected.items():
            stored = self._stored(name)
            if stored not in ckpt:
                raise ConfigError(f"model.path={path!r}: tensor {stored} is missing from the checkpoint")
            if ckpt.shape(stored) != shape:
                raise ConfigError(f"model.path={path!r}: tensor {stored} has shape {ckpt.shape(stored)}, "
                                  f"config.json implies {shape}")
        known = {self._stored(n) for n in expected} | set(_UNUSED_TENSORS)
        extra = sorted(n for n in ckpt.files if n not in known and not n.endswith("rotary_emb.inv_freq"))
        if extra:
            raise ConfigError(f"model.path={path!r}: checkpoint tensor {extra[0]} (and {len(extra) - 1} more) has "
                              f"no place in a {model.model_type} value model; the architecture differs")
        self.head = self._value_head(model, seed)

    def _stored(self, name: str) -> str:
        return self.prefix + name[len("model."):] if name.startswith("model.") else name

    def _value_head(self, model: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
        if model.value_head_init != "from_checkpoint":
            seeded = seeded_initializer(model, seed)
            return {"score.weight": seeded("score.weight"), "score.bias": seeded("score.bias")}
        weight_name, bias_name = value_head_names(self.ckpt, model)
        weight = self.ckpt.read(weight_name)
        # *ForSequenceClassification heads have no bias: the value head's starts at zero then.
        bias = self.ckpt.read(bias_name).reshape(1) if bias_name else torch.zeros(1, dtype=weight.dtype)
        return {"score.weight": weight, "score.bias": bias}

    def __call__(self, name: str) -> torch.Tensor:
        if name in self.head:
            return self.head[name]
        return self.ckpt.read(self._stored(name))

    def read_slice(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        if name in self.head:
            return self.head[name].narrow(dim, start, stop - start)
        return self.ckpt.read(self._stored(name), dim, start, stop)


def value_head_names(ckpt: SafetensorsFolder, model: ModelConfig) -> tuple[str, str | None]:
    """SafetensorsFolder names of the (weight, bias or None) a from_checkpoint value head starts from: a reward
    model's one-label ``score`` head, else a one-row ``lm_head``. Reads headers only."""
    h = model.hidden_size
    for head in ("score", "lm_head"):
        if f"{head}.weight" not in ckpt:
            continue
        shape = ckpt.shape(f"{head}.weight")
        if head == "lm_head" and shape[0] != 1:
            continue  # an ordinary language-model head
        if shape != (1, h):
            raise ConfigError(f"model.value_head_init=from_checkpoint: {head}.weight has shape {shape} "
                              f"(num_labels={shape[0]}); need one label, shape (1, {h})")
        return f"{head}.weight", f"{head}.bias" if f"{head}.bias" in ckpt else None
    raise ConfigError(f"model.value_head_init=from_checkpoint: the checkpoint at model.path={model.path!r} has "
                      "no one-label score head (score.weight) nor a one-row lm_head.weight; use normal or zeros")

def weight_source(model: ModelConfig, seed: int) -> TensorSource:
    """The full tensors a run starts from: the checkpoint at model.path, else the seeded initialisation."""
    if model.path is not None:
        return SafetensorsSource(model, seed)
    return seeded_initializer(model, seed)
