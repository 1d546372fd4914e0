#!/usr/bin/env bash
# One GPU round of the Hopper work (bench/NOTES.md "FlashAttention-4"): checks, then times, in one call.
#   bash bench/gpu_round.sh OUT_DIR [STEPS]     STEPS: comma-separated of env,tests,spread,profile,probe,7b,fa2
# Each step has its own time limit, so the round ends inside the device's 10-minute command limit; full
# logs go to OUT_DIR, the tables to stdout. FlashAttention-4's compiled kernels are cached on disk
# (FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1), as a training job would keep them.
set -u
OUT=${1:?OUT_DIR}
STEPS=${2:-env,tests,spread,profile,7b,probe}
export PYTHONUNBUFFERED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1
PY=python3
START=$(date +%s)
left() { local l=$(( ${BUDGET:-570} - ($(date +%s) - START) )); echo $(( l < ${1:-1000} ? l : ${1:-1000} )); }
has() { [[ ",$STEPS," == *",$1,"* ]]; }
step() { echo "=== $1 ($(date -u +%T))"; }

if has env; then
  step env
  nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.draw,temperature.gpu,driver_version --format=csv
  $PY -c "import torch, flash_attn.cute as f; print('torch', torch.__version__, 'FA4 import ok', torch.cuda.get_device_capability())"
  git rev-parse --short HEAD 2>&1 | head -1
fi
if has tests; then
  step tests
  timeout $(left 150) $PY -m pytest -q -rs -p no:cacheprovider tests/test_gpu.py -s \
    -k "varlen or context or fa4 or recompute or cpu_optimizer" 2>&1 | tee "$OUT/tests.log" \
    | grep -E "rel error|passed|failed|Error|error|assert|FAILED|SKIPPED|device memory|^\{" | tail -40
fi
if has spread; then
  step "spread: 1.5B packed, 3 processes"
  nvidia-smi --query-gpu=clocks.sm,power.draw,temperature.gpu --format=csv,noheader
  timeout $(left 170) $PY -m megacritic bench --shapes qwen2.5-1.5b --systems megacritic-packed --processes 3 \
    --out "$OUT/spread.json" 2>"$OUT/spread.err" | tail -4
  $PY - "$OUT/spread.json" <<'EOF'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    if r.get("probes"):
        print(r["phase"], "process medians", [round(m, 4) for m in r["process_medians"]],
              "calls min/max", round(r["seconds_min"], 4), round(r["seconds_max"], 4))
        for p in r["probes"]:
            print("   ", {k: round(v, 2) if isinstance(v, float) else v for k, v in p.items()})
EOF
fi
if has fa2; then
  step "fa2: 1.5B packed, 1 process"
  timeout $(left 90) $PY -m megacritic bench --shapes qwen2.5-1.5b --systems megacritic-packed --processes 1 \
    --set model.attention_impl=fa2 --out "$OUT/fa2.json" 2>"$OUT/fa2.err" | tail -3
fi
if has profile; then
  step "profile: 1.5B update_critic after FA4"
  timeout $(left 80) $PY bench/profile_phase.py --shape qwen2.5-1.5b --phase update --calls 1 --sync-sites \
    >"$OUT/profile.log" 2>&1
  grep -E "^call|Self CUDA time total|Self CPU time total|synchronisations|^ +[0-9]+  " "$OUT/profile.log" | head -24
  sed -n '/Name/,/Self CPU time total/p' "$OUT/profile.log" | head -26 | cut -c1-60,100-200
fi
if has 7b; then
  step "7b: packed, CPU optimizer + MLP recompute, 1 process"
  (while sleep 20; do nvidia-smi --query-gpu=memory.used --format=csv,noheader; done) >"$OUT/7b.mem" &
  MEMLOG=$!
  timeout $(( $(left) - 40 )) $PY -m megacritic bench --shapes qwen2.5-7b --processes 1 ${SEVENB_ARGS:-} \
    --out "$OUT/7b.json" 2>"$OUT/7b.err" | tail -4
  kill $MEMLOG; echo "device memory used, every 20 s: $(tr '\n' ' ' <"$OUT/7b.mem")"
  tail -5 "$OUT/7b.err" | cut -c1-300
fi
if has probe; then
  step "probe: RMSNorm / SwiGLU"
  timeout $(left 45) $PY bench/swiglu_norm_probe.py --shape qwen2.5-1.5b 2>&1 | tee "$OUT/probe.log" | grep -vi warn | tail -8
fi
step done
