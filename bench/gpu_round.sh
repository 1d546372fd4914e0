#!/usr/bin/env bash
# One part of a GPU round on the lent nvidia-h200 machine, inside one device command (< 9 minutes with the
# machine's start): set up FlashAttention-4 and the wheels, then run PART, writing its files to OUT_DIR.
#   bash bench/gpu_round.sh OUT_DIR PART COMMIT        (carry: .gpu .whl)
# PART (estimated minutes after the setup, from the last rounds' per-process costs; each step is capped):
#   tests      pytest -m gpu tests/test_gpu.py (TESTS_K: only the tests pytest -k selects)              ~4
#   profile    0.5B, 1.5B, 3B, both phases: the GPU's time by kind of kernel (bench/profile_phase.py)     ~4
#   big        bench 7B, megacritic-packed (bf16 Adam moments, MLP recompute), 1 process                 ~4.5
#   small      bench 0.5B, every system (megacritic-packed in 2 processes)                              ~4
#   mid        bench 1.5B (16,384 and 32,768) and 3B, megacritic-packed in 2 processes                  ~7
#   baselines  bench 1.5B and 3B: HF + SDPA padded, megacritic-offload, megacritic-padded, 1 process each ~8
#              (at 830a336 its 480 s cap ended it after 3B's HF rows: run 3B's offload and padded as
#              bench=base3b with --shapes qwen2.5-3b --systems megacritic-offload,megacritic-padded)
#   graphs     model.cuda_graphs: its GPU tests                                                         ~1.5
#   graph-ab   model.cuda_graphs at 0.5B, 1.5B and 3B, and 1.5B eager: both phases timed                ~6
#   overlap    0.5B with graphs (also with glibc's malloc keeping freed memory), 0.5B and 1.5B eager   ~6
#   host       where the host's time goes (cProfile) at 0.5B / 1.5B, and two 0.5B A/Bs (unfused, 32k budget) ~5
#   qkv        bench/kernel_probe.py --only qkv,norm at 1.5B and 3B (QKV split + RoPE: Triton, compiled; RMSNorm) ~3
#   norm       bench/kernel_probe.py --only norm,swiglu at 1.5B and 3B (RMSNorm: ours at several tiles, liger,
#              quack; SwiGLU: Megatron's compiled, ours at several tiles)                               ~2.5
#   mlp        bench/kernel_probe.py --only mlp at 1.5B and 3B: quack's SwiGLU-in-epilogue GEMMs against today's MLP ~2.5
#   mlpbwd     bench/kernel_probe.py --only mlpbwd at 1.5B and 3B: the fused MLP's backward GEMMs, heuristic against
#              autotuned per pack (every config's time printed), each config pinned for all packs, cuBLAS ~6
#   fc1pins    bench/kernel_probe.py --only fc1pins at 1.5B and 3B: fc1's backward GEMMs, every tile configuration
#              pinned for all packs against the heuristic                                               ~6
#   keep       1.5B and 3B update_critic, model.fused_mlp_keep_activation off and on (GPU busy time by kernel) ~7
#   alloc      3B both phases, 4 calls, without and with megatron.expandable_segments=true           ~3.5
#   multiple   0.5B with graphs, packs padded to multiples of 1,024 / 256 / 128 (MULTIPLES): both phases timed ~7
#   multiple15 1.5B with graphs at a multiple of 128 tokens against 1.5B eager: both phases timed            ~6
#   byop       1.5B update_critic: the GPU's time by the autograd node and aten op that launched each kernel
#              (bench/kernels_by_op.py on a profiler trace)                                            ~3
#   launch     bench/launch_probe.py: one layer eager against a CUDA graph at a fixed pack size          ~4
#   kernels    bench/kernel_probe.py at 1.5B and 3B (RoPE, weight gradients, MLP with quack's fused SwiGLU) ~3
#   bench=NAME any other bench part: the arguments after COMMIT go to `megacritic bench` (part-NAME.json)
#   phase=NAME bench/profile_phase.py with the arguments after COMMIT (NAME.log), e.g. one shape's profile
# Parts run in this order and combine with commas (e.g. big,small); the command stops at BUDGET seconds
# (480), and a bench part cut short keeps the systems it finished. The parts' results (OUT_DIR/part-*.json)
# merge on any machine, refusing parts of another commit or environment:
#   python -m megacritic bench --merge part-big.json part-small.json part-mid.json part-baselines.json \
#       --out bench/results/nvidia-h200.json && python -m megacritic bench --markdown bench/results/nvidia-h200.json
# COMMIT: the commit whose tree the device got (it has no git metadata), e.g. $(git rev-parse --short=12 HEAD)
# of a clean checkout. OUT_DIR gets at most 8 files (what a device command brings back).
set -u
OUT=${1:?OUT_DIR}
PARTS=${2:?PART[,PART...]}
COMMIT=${3:?COMMIT}
shift 3  # what is left: the arguments of a bench=NAME or phase=NAME part
START=$(date +%s)
BUDGET=${BUDGET:-480}  # seconds this command may take from its start (the device call: 600 s with the machine start)
left() { local l=$(( BUDGET - ($(date +%s) - START) )); echo $(( l < ${1:-100000} ? l : ${1:-100000} )); }
has() { [[ ",$PARTS," == *",$1,"* ]]; }
step() { echo "=== $1 ($(date -u +%T), $(( $(date +%s) - START )) s)"; }

step setup
export PYTHONUNBUFFERED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1
if [ ! -f /tmp/mcsite/.stamp ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/mcsite .whl/*.whl && touch /tmp/mcsite/.stamp
fi
# A folder named site-packages: quack fingerprints its fused GEMMs' epilogues and treats functions of installed
# packages as fixed only under such a path; elsewhere it walks into cutlass's internals and every gemm_act /
# gemm_dact fails ("epilogue fn depends on <ContextVar _LOC_TRANSFORMS>": bench/NOTES.md, tenth session).
eval "$(python3 .gpu/activate.py /tmp/fa4/site-packages)" || { echo "FA4 bundle did not unpack"; exit 3; }
export PYTHONPATH=$PWD/src:/tmp/mcsite:$PYTHONPATH
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu,driver_version --format=csv,noheader
python3 -c "import torch, megatron.core, flash_attn.cute; print('torch', torch.__version__, 'megatron-core ok, FA4 ok', torch.cuda.get_device_capability())"

bench() {  # bench NAME SECONDS ARGS...: one results part, its log's end, its table
  local name=$1 limit; limit=$(left "$2"); shift 2
  step "bench $name (limit ${limit} s)"
  timeout "$limit" python3 -m megacritic bench --commit "$COMMIT" --out "$OUT/part-$name.json" "$@" \
    >"$OUT/$name.log" 2>&1
  echo "exit $?"; sed -n '/^commit /,$p' "$OUT/$name.log" | cut -c1-220
  [ -f "$OUT/part-$name.json" ] || tail -5 "$OUT/$name.log" | cut -c1-300
}

if has tests; then
  step tests
  timeout "$(left 330)" python3 -m pytest -q -m gpu -rs -p no:cacheprovider tests/test_gpu.py -s ${TESTS_K:+-k "$TESTS_K"} \
    >"$OUT/tests.log" 2>&1
  echo "exit $?"
  grep -aE "rel error|moments:|device memory|passed|failed|FAILED|SKIPPED|Error" "$OUT/tests.log" | tail -30 | cut -c1-250
fi
if has profile; then  # both phases at 1.5B and 3B: the GPU's time by kind of kernel, its busy time against the span
  for shape in ${PROFILE_SHAPES:-qwen2.5-0.5b qwen2.5-1.5b qwen2.5-3b}; do
    step "profile: $shape, both phases"
    graphs=""; [ $shape = qwen2.5-0.5b ] && graphs="model.cuda_graphs=true"  # as the bench runs it
    timeout "$(left 150)" python3 bench/profile_phase.py --shape $shape --phase both --calls 2 $graphs \
      >"$OUT/profile-$shape.log" 2>&1
    echo "exit $?"; grep -aE "^call|^profiled|GPU busy|^  +[0-9.]+ s +[0-9.]+%|Error" "$OUT/profile-$shape.log" | cut -c1-250
  done
fi
hostrun() {  # hostrun NAME SECONDS ARGS...: bench/profile_phase.py into OUT/NAME.log, its main lines
  local name=$1 limit; limit=$(left "$2"); shift 2
  step "profile $name (limit ${limit} s)"
  timeout "$limit" python3 bench/profile_phase.py "$@" >"$OUT/$name.log" 2>&1
  echo "exit $?"; grep -aE "^call|Self CUDA time total|GPU busy|kernel launches|synchronisations in|host profile:|own time by|^ +[0-9.]+ s +[0-9.]+%|Error" \
    "$OUT/$name.log" | head -40
}
if has host; then
  hostrun host-05b-update 150 --shape qwen2.5-0.5b --phase update --calls 4 --host --sync-sites
  hostrun host-05b-values 100 --shape qwen2.5-0.5b --phase values --calls 4 --host --no-torch-profile
  hostrun host-15b-update 150 --shape qwen2.5-1.5b --phase update --calls 3 --host
  hostrun ab-05b-unfused 80 --shape qwen2.5-0.5b --phase update --calls 4 --no-torch-profile model.use_fused_kernels=false
  hostrun ab-05b-32k 80 --shape qwen2.5-0.5b --phase update --calls 4 --no-torch-profile --token-budget 32768
fi
if has graphs; then
  step "graphs: GPU tests of model.cuda_graphs"
  timeout "$(left 240)" python3 -m pytest -q -m gpu -rs -p no:cacheprovider tests/test_gpu.py -k cuda_graphs \
    >"$OUT/graphs-tests.log" 2>&1
  echo "exit $?"; grep -aE "passed|failed|FAILED|Error|error" "$OUT/graphs-tests.log" | tail -15 | cut -c1-300
fi
if has graph-ab; then  # both phases, 4 calls each: with graphs at every shape, eager at 1.5B (the host's speed varies by machine)
  hostrun ab-05b-graphs 100 --shape qwen2.5-0.5b --phase both --calls 4 --no-torch-profile model.cuda_graphs=true
  hostrun ab-15b-graphs 130 --shape qwen2.5-1.5b --phase both --calls 4 --no-torch-profile model.cuda_graphs=true
  hostrun ab-15b-eager 130 --shape qwen2.5-1.5b --phase both --calls 4 --no-torch-profile
  hostrun ab-3b-graphs 160 --shape qwen2.5-3b --phase both --calls 3 --no-torch-profile model.cuda_graphs=true
fi
if has overlap; then  # host work hidden behind the GPU's (micro-batches built as the schedule asks, next step prepared early)
  hostrun ov-05b-graphs 100 --shape qwen2.5-0.5b --phase both --calls 4 --no-torch-profile model.cuda_graphs=true
  MALLOC_MMAP_THRESHOLD_=1073741824 MALLOC_TRIM_THRESHOLD_=4294967296 \
    hostrun ov-05b-graphs-malloc 100 --shape qwen2.5-0.5b --phase both --calls 4 --no-torch-profile model.cuda_graphs=true
  hostrun ov-05b-eager 90 --shape qwen2.5-0.5b --phase both --calls 4 --no-torch-profile
  hostrun ov-15b-eager 120 --shape qwen2.5-1.5b --phase both --calls 4 --no-torch-profile
fi
if has overlap2; then
  hostrun ov-05b-graphs-512 90 --shape qwen2.5-0.5b --phase both --calls 4 --no-torch-profile model.cuda_graphs=true \
    model.cuda_graph_pack_multiple=512
  hostrun ov-15b-graphs 110 --shape qwen2.5-1.5b --phase both --calls 4 --no-torch-profile model.cuda_graphs=true
  hostrun ov-3b-eager 140 --shape qwen2.5-3b --phase both --calls 3 --no-torch-profile
fi
if has keep; then  # the fused MLP's activation kept from the forward (one output less for the backward's GEMM) or not
  for shape in qwen2.5-1.5b qwen2.5-3b; do
    for keep in false true; do
      hostrun keep-$shape-$keep 110 --shape $shape --phase update --calls 3 model.fused_mlp_keep_activation=$keep
    done
  done
fi
if has alloc; then  # 3B: the caching allocator's retries (2 a process at 14b7c37) against expandable segments
  hostrun alloc-3b-default 150 --shape qwen2.5-3b --phase both --calls 4 --no-torch-profile
  hostrun alloc-3b-expandable 150 --shape qwen2.5-3b --phase both --calls 4 --no-torch-profile \
    megatron.expandable_segments=true
fi
if has multiple; then  # the padding the graphs compute against the lengths they capture (one process each)
  for m in ${MULTIPLES:-1024 256 128}; do  # every length of a mode is captured at its first use: 16 / 64 / 128 of them
    hostrun multiple-05b-$m $(( m == 1024 ? 100 : m == 256 ? 130 : 170 )) --shape qwen2.5-0.5b --phase both --calls 4 --no-torch-profile model.cuda_graphs=true \
      model.cuda_graph_pack_multiple=$m
  done
fi
if has multiple15; then  # with little padding, do the graphs pay at 1.5B (no gain at 1,024: 7e92172)?
  hostrun multiple-15b-128 240 --shape qwen2.5-1.5b --phase both --calls 4 --no-torch-profile model.cuda_graphs=true \
    model.cuda_graph_pack_multiple=128
  hostrun multiple-15b-eager 130 --shape qwen2.5-1.5b --phase both --calls 4 --no-torch-profile
fi
if has big; then
  (while sleep 20; do nvidia-smi --query-gpu=memory.used --format=csv,noheader; done) >"$OUT/big.mem" &
  MEMLOG=$!
  # 7B fills the H200: its switches grow the allocator's segments in place (megatron.expandable_segments)
  bench big 330 --shapes qwen2.5-7b --processes 1
  kill $MEMLOG; echo "device memory used, every 20 s: $(tr '\n' ' ' <"$OUT/big.mem")"
fi
if has small; then
  bench small 330 --shapes qwen2.5-0.5b --processes 2
fi
if has mid; then
  bench mid 480 --shapes qwen2.5-1.5b,qwen2.5-3b --systems megacritic-packed --processes 2
fi
if has baselines; then
  bench baselines 480 --shapes qwen2.5-1.5b,qwen2.5-3b \
    --systems hf-sdpa-padded,megacritic-offload,megacritic-padded
fi
if has kernels; then  # bench/kernel_probe.py: RoPE, weight gradients, the MLP (quack's fused SwiGLU GEMMs), attention
  for shape in qwen2.5-1.5b qwen2.5-3b; do
    step "kernels $shape"
    timeout "$(left 150)" python3 bench/kernel_probe.py --shape $shape >"$OUT/kernels-$shape.log" 2>&1
    echo "exit $?"; tail -12 "$OUT/kernels-$shape.log" | cut -c1-220
  done
fi
if has qkv; then
  for shape in qwen2.5-1.5b qwen2.5-3b; do
    step "qkv split $shape"
    timeout "$(left 150)" python3 bench/kernel_probe.py --shape $shape --only qkv,norm >"$OUT/qkv-$shape.log" 2>&1
    echo "exit $?"; grep -avE "Warning|warn" "$OUT/qkv-$shape.log" | tail -24 | cut -c1-220
  done
fi
if has norm; then
  for shape in qwen2.5-1.5b qwen2.5-3b; do
    step "RMSNorm $shape"
    timeout "$(left 150)" python3 bench/kernel_probe.py --shape $shape --only norm,swiglu >"$OUT/norm-$shape.log" 2>&1
    echo "exit $?"; grep -avE "Warning|warn" "$OUT/norm-$shape.log" | grep -aE "forward|fwd|equal|Error|^torch" | cut -c1-200
  done
fi
if has mlp; then  # quack's fused SwiGLU GEMMs (gemm_act / gemm_dact) against today's MLP, one layer over the packs
  for shape in qwen2.5-1.5b qwen2.5-3b; do
    step "MLP $shape"
    timeout "$(left 150)" python3 bench/kernel_probe.py --shape $shape --only mlp >"$OUT/mlp-$shape.log" 2>&1
    echo "exit $?"; grep -avE "Warning|warn" "$OUT/mlp-$shape.log" | grep -aE "MLP|GEMM|Error|^torch" | cut -c1-200
  done
fi
if has mlpbwd; then  # the fused MLP's backward GEMMs: heuristic tile (today), autotuned, each config pinned, cuBLAS
  for shape in qwen2.5-1.5b qwen2.5-3b; do
    step "MLP backward $shape"
    QUACK_PRINT_AUTOTUNING=1 timeout "$(left 270)" python3 bench/kernel_probe.py --shape $shape --only mlpbwd \
      >"$OUT/mlpbwd-$shape.log" 2>&1
    echo "exit $?"; grep -avE "Warning|warn" "$OUT/mlpbwd-$shape.log" \
      | grep -aE "grad|dact|relative|best config|one configuration|^  [0-9]+x[0-9]+ |fastest|Error|^torch" | cut -c1-260
  done
fi
if has fc1pins; then  # fc1's backward GEMMs (quack): each Hopper tile configuration pinned for every pack
  for shape in qwen2.5-1.5b qwen2.5-3b; do
    step "fc1 pins $shape"
    timeout "$(left 260)" python3 bench/kernel_probe.py --shape $shape --only fc1pins >"$OUT/fc1pins-$shape.log" 2>&1
    echo "exit $?"; grep -avE "Warning|warn" "$OUT/fc1pins-$shape.log" \
      | grep -aE "heuristic|one configuration|^  [0-9]+x[0-9]+ |fastest|in turns|Error|^torch" | head -40 | cut -c1-220
  done
fi
if has byop; then  # one 1.5B update's device time by the op that launched each kernel (the trace stays there)
  hostrun byop-15b 240 --shape qwen2.5-1.5b --phase update --calls 2 --trace /tmp/byop-15b.json
  python3 bench/kernels_by_op.py /tmp/byop-15b.json --top 70 >"$OUT/byop-15b.txt"; head -50 "$OUT/byop-15b.txt" | cut -c1-220
fi
if has launch; then
  step "launch: fixed-size packs and CUDA graphs, 0.5B and 1.5B"
  timeout "$(left 300)" python3 bench/launch_probe.py --shapes qwen2.5-0.5b,qwen2.5-1.5b --out "$OUT/launch.json" \
    >"$OUT/launch.log" 2>&1
  echo "exit $?"; tail -12 "$OUT/launch.log" | cut -c1-220
fi
for part in ${PARTS//,/ }; do
  if [[ $part == bench=* ]]; then
    bench "${part#bench=}" 480 "$@"
  elif [[ $part == phase=* ]]; then
    hostrun "${part#phase=}" 480 "$@"
  fi
done
step done
