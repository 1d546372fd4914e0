#!/usr/bin/env bash
# The wheels bench/verl_engine_gpu.py needs on the GPU machine beyond its image (CPython 3.12, torch,
# transformers, accelerate, peft, safetensors, pyarrow, pandas, psutil, pyyaml, tqdm ...; no internet), at the
# versions of tests/integrations/requirements-verl.txt (verl's own pins: tensordict 0.10.0, omegaconf 2.3):
#   megatron-core                            megacritic
#   tensordict, pyvers, orjson               megacritic and verl (tensordict's own imports)
#   verl                                     the engine seam, its config classes, value_loss, padding
#   omegaconf, antlr4-python3-runtime,       verl's configs (omega_conf_to_dataclass instantiates through hydra)
#     hydra-core
#   codetiming, datasets, dill, multiprocess imported by the verl modules the engine path loads
# Found by running the script on CPU (--shape tiny) with only these, Ray and the image's packages importable
# (python -S, one site folder of exactly those distributions, transformers 5.17 as on the image); hydra-core
# and each of the rest were missed when left out. verl's import needs Ray too: bench/ray_bundle.sh builds it
# (.raywhl, ~20 MB), too big for this folder. TransferQueue, pyzmq, msgspec, fastapi and opentelemetry are
# not needed by this script (verl's TrainingWorker and V1 trainer import them).
#   bash bench/verl_gpu_wheels.sh OUTDIR        (e.g. .verlwhl; git-ignore it)
# On the GPU machine (carry OUTDIR, .raywhl and the source tree):
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site OUTDIR/*.whl .raywhl/*.whl \
#     && tar -xJf .raywhl/ray-site.tar.xz -C /tmp/site \
#     && python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site .
#   PYTHONPATH=$PWD/src:/tmp/site RAY_AUTH_MODE=disabled python3 bench/verl_engine_gpu.py --out OUT.json
# (the last install puts megacritic's verl.plugins entry point where verl finds it; src/ stays first).
set -euo pipefail
OUT=${1:?OUTDIR}
mkdir -p "$OUT"
TARGET=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
python3 -m pip download -q --no-deps "${TARGET[@]}" -d "$OUT" \
    megatron-core==0.16.1 tensordict==0.10.0 pyvers==0.1.0 orjson==3.13.0 verl==0.9.1 \
    omegaconf==2.3.1 hydra-core==1.3.8 codetiming==1.4.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
# antlr4-python3-runtime 4.9.3 (omegaconf 2.3's parser runtime) is published as source only: pure Python,
# so the wheel built here is the one for any Python 3.
if ! ls "$OUT"/antlr4_python3_runtime-4.9.3-*.whl >/dev/null 2>&1; then
    python3 -m pip wheel -q --no-deps -w "$OUT" antlr4-python3-runtime==4.9.3
fi
ls -l "$OUT"
du -sh "$OUT"
