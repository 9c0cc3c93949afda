#!/usr/bin/env bash
# Everything the project measures on a CUDA machine, in parts that each fit one 10-minute call.
#
#   OUT=/path/to/results bash benchmarks/run_gpu.sh PART... (tests, gdn, kernels, blocks, loss, e2e, long, warmup,
#                                                          cp or all; default all)
#
#   tests   every GPU test (pytest -m gpu) and `deltafuse verify` on cuda for the tiny models, fp32 and bf16
#   gdn     the gated delta rule benchmark vs FLA 0.6 and the HF fallback (benchmarks/run_gdn_gpu.sh)
#   kernels the GDN options sweep (tune_gdn.py), causal conv1d (bench_conv1d.py) and decoding vs FLA and
#           stock generate (bench_decode.py)
#   blocks  block ops, loss and experts benchmarks (bench_block_ops.py, then the loss part)
#   loss    loss and experts benchmark only (bench_loss_moe.py)
#   e2e     `deltafuse bench e2e` for moe8 and dense8 LoRA at 4096 packed tokens, stock vs deltafuse
#   long    moe8 LoRA at 16,384 tokens, stock vs deltafuse: packed rows, then one sequence per row (the loss
#           comparable); then deltafuse steps on single 65,536-token sequences with gradient checkpointing
#           (peak memory in the logs), and the same steps with FLA + Liger (FlashQLA under FLA when
#           .fqla/site.tar.xz holds it) when fla_core, einops and liger_kernel wheels are in .whl/
#   warmup  what a new process costs before its steps are fast: moe8 LoRA at 4096 packed tokens, 25 steps, with an
#           empty Triton cache (benchmarks/profile_train.py: each compilation with its step and seconds), first
#           with --compile-ahead off (kernels compiled one by one as step 1 runs), then with the default, the
#           same run again in a new process reusing that cache, then stock; whole-process wall times in warmup.txt
#   cp      context parallelism, 2 GPUs against 1 (benchmarks/context_parallel.py): moe8 LoRA on one sequence of
#           32,768 and 65,536 tokens both ways, 131,072 and 262,144 (gradient checkpointing) on 2 GPUs; needs 2 GPUs
#   graphs  CUDA graphs of the decoder layers (--cuda-graphs): their GPU tests (replays against eager steps, the GDN
#           chunk tables built on the device, varlen attention on padded offsets), then the moe8 LoRA step at 4,096
#           packed tokens under the profiler (benchmarks/profile_train.py: host and GPU time per step), eager and
#           with --cuda-graphs
#   graphs-full   the same for the full-depth Qwen3.5-35B-A3B LoRA step
#   moe-mm  the experts' grouped matmuls, torch's against Triton's (bench_grouped_mm.py), and the experts' GPU tests
#   moe-mm-steps  the moe8 LoRA step at 4,096 packed tokens under the profiler as shipped and without the Triton
#           grouped matmuls (profile_train.py --moe-matmuls torch)
#   moe-mm-full   the same two for the full-depth Qwen3.5-35B-A3B LoRA step
#   graphs-peers  `deltafuse bench e2e --cuda-graphs`: dense8 at 4,096 tokens against FLA and FLA+Liger, moe8 at
#           16,384 against FLA (FLA's Hopper guard lifted for timing); needs fla_core, einops, liger_kernel in .whl/
#
# Run from the repository root. Wheels in .whl/ (fla_core, einops) are installed for the gdn part only, so
# that "stock" elsewhere is transformers' own torch fallback; liger_kernel and trl wheels (with datasets, dill and
# multiprocess) there serve the blocks and loss parts.
# Logs and JSON go under $OUT. PACK_TO=/path/file.tgz also packs $OUT into one archive at the end (for
# transports that bring back only a few files).
set -uo pipefail
OUT=${OUT:-./deltafuse-out}
PARTS=" ${*:-all} "
for part in $PARTS; do
  case $part in
    tests|gdn|kernels|blocks|loss|e2e|long|warmup|cp|graphs|graphs-full|graphs-peers|moe-mm|moe-mm-steps|moe-mm-full|all) ;;
    *) echo "run_gpu.sh: unknown part '$part'; allowed: tests, gdn, kernels, blocks, loss, e2e, long, warmup, cp," \
         "graphs, graphs-full, graphs-peers, moe-mm, moe-mm-steps, moe-mm-full, all" >&2
       exit 2 ;;
  esac
done
for variant in ${STEPS_VARIANTS:-eager graphs}; do
  case $variant in
    eager|graphs) ;;
    *) echo "run_gpu.sh: STEPS_VARIANTS has '$variant'; allowed: eager, graphs (one or both)" >&2; exit 2 ;;
  esac
done
# want PART: is PART (or all) among the parts asked for
want() { [[ $PARTS == *" $1 "* || $PARTS == *" all "* ]]; }
mkdir -p "$OUT"
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
rc=0
# step LOG CMD...: run CMD, show and keep its output in LOG, remember a failure
step() { local log=$1; shift; echo "== $*"; "$@" 2>&1 | tee "$log"; [[ ${PIPESTATUS[0]} == 0 ]] || rc=1; }

if want tests; then
  nvidia-smi --query-gpu=name,driver_version --format=csv | tee "$OUT/gpu.txt"
  python3 -m deltafuse info > "$OUT/info.txt" 2>&1
  step "$OUT/gpu_tests.log" python3 -m pytest -q -m gpu tests
  for model in tiny tiny-moe tiny-next; do
    for dtype in fp32 bf16; do
      step "$OUT/verify_${model}_${dtype}.json" python3 -m deltafuse verify --device cuda --model $model \
        --dtype $dtype --packed --json
    done
  done
fi
if want gdn; then
  step "$OUT/gdn_all.log" env OUT="$OUT" bash benchmarks/run_gdn_gpu.sh
fi
if want kernels; then
  # FLA from carried wheels for the decoding comparison only (stock generate then runs FLA's recurrent op)
  kpath=$PYTHONPATH
  fla=$(ls .whl/fla_core-*.whl .whl/einops-*.whl 2>/dev/null)
  if [[ -n $fla ]] && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site $fla; then
    kpath=/tmp/site:$PYTHONPATH
  fi
  step "$OUT/tune_gdn.log" python3 benchmarks/tune_gdn.py --out "$OUT/tune_gdn.json"
  step "$OUT/conv1d.log" python3 benchmarks/bench_conv1d.py --out "$OUT/conv1d.json"
  step "$OUT/decode.log" env PYTHONPATH="$kpath" python3 benchmarks/bench_decode.py --out "$OUT/decode.json"
fi
if want blocks || want loss; then
  # Liger (pure Python + Triton) and TRL (with datasets, dill, multiprocess, which the image lacks) from carried
  # wheels, for their rows only; a separate target keeps FLA out
  peers=$(ls .whl/liger_kernel-*.whl .whl/trl-*.whl .whl/datasets-*.whl .whl/dill-*.whl .whl/multiprocess-*.whl \
    2>/dev/null)
  if [[ -n $peers ]]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/peers $peers
    export PYTHONPATH=$PYTHONPATH:/tmp/peers
  fi
  want blocks && step "$OUT/block_ops.log" python3 benchmarks/bench_block_ops.py "$OUT/block_ops.json"
  step "$OUT/loss_moe.log" python3 benchmarks/bench_loss_moe.py "$OUT/loss_moe.json"
fi
if want e2e; then
  for model in moe8 dense8; do
    step "$OUT/e2e_$model.log" python3 -m deltafuse bench e2e --model $model --seq-len 4096 --max-steps 30 \
      --repeats 2 --no-progress --output-dir "$OUT/e2e_$model" --overwrite
    rm -rf "$OUT/e2e_$model"/{on,off}/checkpoint-* "$OUT/e2e_$model"/{on,off}/final
  done
fi
if want long; then
  step "$OUT/e2e_moe8_16k.log" python3 -m deltafuse bench e2e --model moe8 --seq-len 16384 --max-steps 10 \
    --interval 5 --repeats 1 --no-progress --output-dir "$OUT/e2e_moe8_16k" --overwrite
  rm -rf "$OUT/e2e_moe8_16k"/{on,off}/checkpoint-* "$OUT/e2e_moe8_16k"/{on,off}/final
  python3 benchmarks/long_rows.py "$OUT/long_rows.jsonl" --rows 12 --chars 70000
  step "$OUT/e2e_moe8_16k_single.log" python3 -m deltafuse bench e2e --model moe8 --data "$OUT/long_rows.jsonl" \
    --no-packing --seq-len 16384 --max-steps 6 --interval 3 --repeats 1 --no-progress --output-dir "$OUT/e2e_moe8_16k_single" \
    --overwrite
  rm -rf "$OUT/e2e_moe8_16k_single"/{on,off}/checkpoint-* "$OUT/e2e_moe8_16k_single"/{on,off}/final
  step "$OUT/train_moe8_64k_single.log" python3 -m deltafuse train --model moe8 --data "$OUT/long_rows.jsonl" \
    --no-packing --seq-len 65536 --max-steps 4 --gradient-checkpointing --log-every 1 --no-progress \
    --output-dir "$OUT/train_moe8_64k_single" --overwrite
  rm -rf "$OUT/train_moe8_64k_single"/checkpoint-* "$OUT/train_moe8_64k_single"/final
  # the same steps with deltafuse off and FLA + Liger on, FlashQLA under FLA where .fqla/site.tar.xz has it (FLA
  # hands its GDN calls to FlashQLA by itself; TileLang compiles for minutes on an empty cache, kept in
  # .fqla/tilelang-cache.tgz); FLA's Hopper guard stays on: without FlashQLA its backward is refused here
  wheels=$(ls .whl/fla_core-*.whl .whl/einops-*.whl .whl/liger_kernel-*.whl 2>/dev/null)
  if [[ -n $wheels ]] && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/peers-long $wheels; then
    ppath=/tmp/peers-long:$PYTHONPATH
    export TILELANG_CACHE_DIR=${TILELANG_CACHE_DIR:-/tmp/tilelang-cache}
    if [[ -f .fqla/site.tar.xz ]]; then
      mkdir -p /tmp/fqla "$TILELANG_CACHE_DIR" && tar xJf .fqla/site.tar.xz -C /tmp/fqla && ppath=$ppath:/tmp/fqla/site
      [[ -f .fqla/tilelang-cache.tgz ]] && tar xzf .fqla/tilelang-cache.tgz -C "$TILELANG_CACHE_DIR"
    fi
    step "$OUT/train_moe8_64k_single_fla_liger.log" env PYTHONPATH="$ppath" python3 -m deltafuse.bench.peers \
      --run fla+liger --report "$OUT/train_moe8_64k_single_fla_liger.json" -- --model moe8 --data "$OUT/long_rows.jsonl" \
      --no-packing --seq-len 65536 --max-steps 4 --gradient-checkpointing --log-every 1 --no-progress --no-deltafuse \
      --output-dir "$OUT/train_moe8_64k_single_fla_liger" --overwrite
    rm -rf "$OUT/train_moe8_64k_single_fla_liger"/checkpoint-* "$OUT/train_moe8_64k_single_fla_liger"/final
    [[ -d $TILELANG_CACHE_DIR ]] && tar czf "$OUT/tilelang-cache.tgz" -C "$TILELANG_CACHE_DIR" .
  fi
  rm -f "$OUT/long_rows.jsonl"
fi
if want warmup; then
  # timed NAME CMD...: run CMD, append its whole-process wall time to warmup.txt
  timed() {
    local name=$1 t0 t1; shift; t0=$(date +%s.%N); step "$OUT/warmup_$name.log" "$@"; t1=$(date +%s.%N)
    echo "$name $(awk -v a="$t0" -v b="$t1" 'BEGIN{printf "%.1f", b-a}') s" | tee -a "$OUT/warmup.txt"
  }
  wargs=(--model moe8 --seq-len 4096 --max-steps 25 --log-every 1 --no-progress --overwrite)
  wcache=$(mktemp -d)  # an empty Triton cache of its own (the caller's TRITON_CACHE_DIR is left as it is)
  ocache=$(mktemp -d)
  timed cold_one_by_one env TRITON_CACHE_DIR="$ocache" python3 benchmarks/profile_train.py \
    "$OUT/warmup_cold_one_by_one.json" --profile-steps 2 -- "${wargs[@]}" --compile-ahead off \
    --output-dir /tmp/warmup-cold
  rm -rf "$ocache"
  timed cold env TRITON_CACHE_DIR="$wcache" python3 benchmarks/profile_train.py "$OUT/warmup_cold.json" \
    --profile-steps 2 -- "${wargs[@]}" --output-dir /tmp/warmup-cold
  timed warm env TRITON_CACHE_DIR="$wcache" python3 -m deltafuse train "${wargs[@]}" --output-dir /tmp/warmup-warm
  timed stock python3 -m deltafuse train "${wargs[@]}" --no-deltafuse --output-dir /tmp/warmup-stock
  rm -rf /tmp/warmup-{cold,warm,stock} "$wcache"
fi
if want cp; then
  ngpu=$(python3 -c "import torch; print(torch.cuda.device_count())")
  if (( ngpu >= 2 )); then
    step "$OUT/context_parallel.log" python3 benchmarks/context_parallel.py "$OUT/context_parallel"
  else
    echo "== cp: needs 2 GPUs, this machine has $ngpu; skipped"
    [[ $PARTS == *" cp "* ]] && rc=1
  fi
fi
# steps NAME MODEL [STEPS [PROFILE_ARGS...]]: profile_train.py of MODEL's LoRA step at 4,096 packed tokens, eager
# and with --cuda-graphs (STEPS_VARIANTS="graphs" or "eager" runs one of the two)
steps() {
  local name=$1 model=$2 steps=${3:-12} graphs
  shift $(( $# < 3 ? $# : 3 ))
  for graphs in ${STEPS_VARIANTS:-eager graphs}; do
    step "$OUT/steps_${name}_$graphs.log" python3 benchmarks/profile_train.py "$OUT/steps_${name}_$graphs.json" \
      --profile-steps 2 "$@" -- --model "$model" --seq-len 4096 --max-steps "$steps" --log-every 1 --no-progress \
      --overwrite --output-dir "/tmp/steps-$name" $([[ $graphs == graphs ]] && echo --cuda-graphs)
    rm -rf "/tmp/steps-$name"
  done
}
if want graphs; then
  step "$OUT/graphs_tests.log" python3 -m pytest -q -rs tests/integrations/test_graphed_layers.py \
    tests/integrations/test_packed_attention.py tests/test_ops_api.py -k "gpu or empty_sequences"
  step "$OUT/graphs_gdn_tests.log" python3 -m pytest -q tests/ops/test_gdn_triton.py -k "device_plan"
  steps moe8 moe8
fi
if want graphs-full; then
  steps moe moe 8
fi
if want moe-mm; then
  step "$OUT/grouped_mm.log" python3 benchmarks/bench_grouped_mm.py "$OUT/grouped_mm.json"
  step "$OUT/moe_tests.log" python3 -m pytest -q -m gpu tests/ops/test_moe.py
fi
for model in moe8 moe; do
  if want "$([[ $model == moe ]] && echo moe-mm-full || echo moe-mm-steps)"; then
    n=$([[ $model == moe ]] && echo 8 || echo 12)
    steps "${model}_shipped" $model $n
    steps "${model}_torch_mm" $model $n --moe-matmuls torch
  fi
done
if want graphs-peers; then
  ppath=$PYTHONPATH
  wheels=$(ls .whl/fla_core-*.whl .whl/einops-*.whl .whl/liger_kernel-*.whl 2>/dev/null)
  if [[ -n $wheels ]] && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/peers-graphs $wheels; then
    ppath=/tmp/peers-graphs:$PYTHONPATH
  fi
  step "$OUT/peers_dense8.log" env PYTHONPATH="$ppath" python3 -m deltafuse bench e2e --model dense8 --seq-len 4096 \
    --max-steps 30 --repeats 1 --peers fla,fla+liger --fla-lift-hopper-guard --cuda-graphs --no-progress \
    --output-dir "$OUT/peers_dense8" --overwrite
  step "$OUT/peers_moe8_16k.log" env PYTHONPATH="$ppath" python3 -m deltafuse bench e2e --model moe8 \
    --seq-len 16384 --max-steps 10 --interval 5 --repeats 1 --peers fla --fla-lift-hopper-guard --cuda-graphs \
    --no-progress --output-dir "$OUT/peers_moe8_16k" --overwrite
  rm -rf "$OUT"/peers_*/*/checkpoint-* "$OUT"/peers_*/*/final
fi
if [[ -n ${PACK_TO:-} ]]; then
  tar czf "$PACK_TO" -C "$OUT" . && echo "packed $OUT into $PACK_TO" || rc=1
fi
exit $rc
