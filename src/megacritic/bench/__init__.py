"""``megacritic bench``: critic throughput on seeded long-tailed rollouts, against what users run today.

    python -m megacritic bench [--shapes qwen2.5-0.5b,qwen2.5-1.5b] [--systems ...] [--out FILE]
    python -m megacritic bench --merge PART.json [PART.json ...] --out FILE   # parts of one run -> one file
    python -m megacritic bench --markdown FILE                                # README's table of a file

Systems, on the same rollouts (prompts 64-1024 tokens, responses log-normal 16-8192, median ~1024):

* ``megacritic-packed``: our default, token-budget micro-batches packed without padding (THD);
* ``megacritic-offload``: the packed default with parameters, gradient buffers and optimizer state in host
  memory between calls (``megatron.*_offload``), as a job that shares its GPUs with a rollout engine runs;
* ``megacritic-padded``: our code with fixed-size micro-batches padded to their longest rollout;
* ``hf-sdpa-padded``: ``transformers`` AutoModelForTokenClassification (num_labels=1, SDPA attention),
  fused torch AdamW, the same clipped value loss, verl-layout padded micro-batches of the largest size
  that fits (halved on out-of-memory).

For ``update_critic`` (forward + backward + optimizer step, all mini-batches) and ``compute_values``
(forward): real (unpadded) tokens/s, MFU on real tokens against the device's dense bf16 peak
(:func:`megacritic.flops.mfu`), peak memory. The packed systems run at each token budget of the shape
(16,384; at 1.5B also verl's default 32,768, megacritic-packed only).

Each system runs in fresh processes, one after another (each one as a training job starts: its own CUDA
context, allocator and compilation): ``--processes`` of them for megacritic-packed at the shape's first
budget, whose rows are the targets' figures, ``--baseline-processes`` for the others. A row reports the
median of the processes' median call times, with the min / max over every timed call, each process' median
and per-process probes (SM clock, host launch cost), so that one slow or fast process cannot make the
figure (bench/NOTES.md: the spread between processes). Rows name the kernels in use (attention, norm,
SwiGLU, recompute, optimizer); the file names the commit and the environment (package versions, the
attention kernel of the device). A run writes its own file; a bench longer than one device command runs in
parts (``--shapes`` / ``--systems`` / ``--out``) that ``--merge`` joins, refusing parts of another commit,
machine or environment (:mod:`megacritic.bench.results`). Without CUDA it runs the ``tiny`` shape (so the
script itself stays tested); timings there mean nothing.

Modules: :mod:`~megacritic.bench.workloads` (shapes, systems, rollouts, configs),
:mod:`~megacritic.bench.runner` (processes, timing, the command line), :mod:`~megacritic.bench.hf_baseline`,
:mod:`~megacritic.bench.results` (rows, merge, tables), :mod:`~megacritic.bench.timing`.
"""

from megacritic.bench.runner import main, run_megacritic  # noqa: F401
from megacritic.bench.workloads import SHAPES, SYSTEMS, megacritic_overrides, rollouts  # noqa: F401
