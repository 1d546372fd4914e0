"""The word embedding, its weight gradient added straight to Megatron's gradient buffer (``main_grad``).

torch's embedding backward builds a dense gradient the size of the whole table ([vocab, hidden] in the
parameter's dtype: zeroed, then the looked-up rows scattered in) for every micro-batch, and Megatron's DDP
hook then adds all of it to ``main_grad``. For the ~16k rows a pack touches of a 151,936-row vocabulary that
is ~0.5 GB zeroed, read and added per micro-batch at 1.5B (~15 ms of a 1.38 s update on an H100,
bench/NOTES.md). Here the backward adds the looked-up rows' gradients to ``main_grad`` itself and tells DDP so
the way Megatron's linear layers do under ``gradient_accumulation_fusion`` (``grad_added_to_main_grad``).

Arithmetic: ``index_put_`` with ``accumulate`` sorts the rows and sums each row's contributions in order, in
one thread (deterministic, as the dense backward is), in ``main_grad``'s dtype: a micro-batch's sum is rounded
once into float32 where the dense path first rounded it to the parameter's dtype (bf16) and then added it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import VocabParallelEmbedding
from megatron.core.tensor_parallel.mappings import (reduce_from_tensor_model_parallel_region,
                                                    reduce_scatter_to_sequence_parallel_region)

from megacritic.model.grad_buffer import accumulates_into_main_grad, added_to_main_grad


class _LookupIntoMainGrad(torch.autograd.Function):
    """``F.embedding(ids, weight)`` whose backward adds the rows' gradients to ``weight.main_grad``."""

    @staticmethod
    def forward(ctx, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(ids, weight)
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        ids, weight = ctx.saved_tensors
        main_grad = weight.main_grad
        main_grad.index_put_((ids.reshape(-1),), grad_output.reshape(-1, main_grad.shape[-1]).to(main_grad.dtype),
                             accumulate=True)
        return None, added_to_main_grad(weight)


class MainGradEmbedding(VocabParallelEmbedding):
    """Megatron's vocab-parallel embedding (same masking of other ranks' rows, same reduction) whose lookup
    is :class:`_LookupIntoMainGrad` once the weight has a gradient buffer; before that, upstream's."""

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        if not accumulates_into_main_grad(self.weight):
            return super().forward(input_)
        split = self.tp_group.size() > 1
        if split:  # rows of other tensor-parallel ranks look up row 0 and come out zero
            foreign = (input_ < self.vocab_start_index) | (input_ >= self.vocab_end_index)
            input_ = (input_ - self.vocab_start_index).masked_fill(foreign, 0)
        output = _LookupIntoMainGrad.apply(input_, self.weight)
        if split:
            output = output.masked_fill(foreign.unsqueeze(-1), 0.0)
        if self.reduce_scatter_embeddings:  # [b, s, h] -> [s, b, h], scattered over the sequence
            return reduce_scatter_to_sequence_parallel_region(output.transpose(0, 1).contiguous(),
                                                              group=self.tp_group)
        return reduce_from_tensor_model_parallel_region(output, group=self.tp_group)


def lookup_into_main_grad(embedding: VocabParallelEmbedding) -> None:
    """Give this embedding :class:`MainGradEmbedding`'s forward (the object, its weight and their attributes
    stay as they are; Megatron's embedding takes no module spec to choose its class)."""
    if type(embedding) is not VocabParallelEmbedding:
        raise TypeError(f"expected Megatron's VocabParallelEmbedding, got {type(embedding).__name__}")
    embedding.__class__ = MainGradEmbedding
