"""The rollouts of ``megacritic train``: a rollout file, or the embedded synthetic task.

``rollout_source(config)`` picks one; each has ``batch(iteration) -> TensorDict`` in verl's layout. File
batches carry ``token_level_rewards`` (returns come from GAE on the critic's values); synthetic batches
carry their ``returns`` directly.

The synthetic task: rollouts whose returns a critic can learn.

Each token id v carries a fixed reward r(v) in {-1, +1} (drawn from ``data_loader_seed``). The return of
response token j is the mean reward of every token *before* it (the prompt and response tokens 0..j-1):
exactly the prefix the critic sees when it predicts that token's value, so a perfect critic reaches an
explained variance of 1. Batches come in verl's layout (left-padded prompts, right-padded responses) and
are identical for every parallel layout: they depend only on the seed and the iteration.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

from megacritic.data.rollouts import BatchError, verl_batch
from megacritic.config import CriticConfig
from megacritic.data.rollout_file import batch_indices, read_rollouts, to_batch


class SyntheticRollouts:
    def __init__(self, config: CriticConfig):
        self.vocab_size = config.model.vocab_size
        self.batch_size = config.data.rollouts_per_step
        self.prompt_range = tuple(config.data.prompt_length)
        self.response_range = tuple(config.data.response_length)
        self.seed = config.data_loader_seed if config.data_loader_seed is not None else 0
        gen = torch.Generator().manual_seed(self.seed)
        self.token_reward = torch.randint(0, 2, (self.vocab_size,), generator=gen).float() * 2 - 1

    def batch(self, iteration: int) -> TensorDict:
        gen = torch.Generator().manual_seed(self.seed * 7919 + iteration + 1)
        b, (p_lo, p_hi), (r_lo, r_hi) = self.batch_size, self.prompt_range, self.response_range
        p_len = torch.randint(p_lo, p_hi + 1, (b,), generator=gen)
        r_len = torch.randint(r_lo, r_hi + 1, (b,), generator=gen)
        tokens = torch.randint(0, self.vocab_size, (b, p_hi + r_hi), generator=gen)
        batch = verl_batch(tokens, p_len, r_len, prompt_width=p_hi)
        input_ids, attention_mask = batch["input_ids"], batch["attention_mask"]
        rewards = self.token_reward[input_ids] * attention_mask
        prefix_sum = rewards.cumsum(1) - rewards        # rewards strictly before each position
        prefix_len = attention_mask.cumsum(1) - attention_mask
        batch["returns"] = ((prefix_sum / prefix_len.clamp(min=1))[:, p_hi:] * batch["response_mask"]).float()
        return batch


class FileRollouts:
    """Batches of ``data.rollouts_per_step`` rows of a rollout file, in seeded shuffled passes."""

    def __init__(self, config: CriticConfig):
        self.rows = read_rollouts(config.data.path)
        self.batch_size = config.data.rollouts_per_step
        self.seed = config.data_loader_seed if config.shuffle else None
        if len(self.rows) < self.batch_size:
            raise BatchError(f"{config.data.path} has {len(self.rows)} rollouts, fewer than "
                             f"data.rollouts_per_step={self.batch_size}")
        vocab = config.model.vocab_size
        for i, row in enumerate(self.rows):
            ids = row["prompt_ids"] + row["response_ids"]
            if max(ids) >= vocab:
                raise BatchError(f"{config.data.path} row {i}: token id {max(ids)} is outside the model's "
                                 f"vocabulary of {vocab} (model.vocab_size)")

    def batch(self, iteration: int) -> TensorDict:
        per_pass = len(self.rows) // self.batch_size
        epoch, index = divmod(iteration, per_pass)
        rows = batch_indices(len(self.rows), self.batch_size, self.seed, epoch)[index]
        return to_batch([self.rows[i] for i in rows])


def rollout_source(config: CriticConfig):
    return FileRollouts(config) if config.data.path else SyntheticRollouts(config)
