#!/usr/bin/env bash
# The project's GPU evidence, in stages that each fit one 10-minute call on a GPU machine without
# network access (the wheels travel with the tree). Run from the repository root with
# `.gpu-wheels/base` carried (`bash ../shared/tools/gpu_wheels.sh` makes it); results and logs go to OUT_DIR:
#
#   bash scripts/gpu_evidence/gpu_evidence.sh STAGE OUT_DIR [ARGS...]
#
#   gpu_evidence.sh tests     OUT_DIR   # pytest -m gpu, file by file
#   gpu_evidence.sh suite     OUT_DIR   # the same in one pytest-xdist run (faster)
#   gpu_evidence.sh pytest    OUT_DIR ARGS...  # one pytest run with these arguments
#   gpu_evidence.sh cmd       OUT_DIR NAME SECS CMD...  # any command, logged as NAME
#   gpu_evidence.sh bisect    OUT_DIR ARGS...  # one pytest run (ARGS) in this tree and
#                     in each older tree under .bisect/, side by side (below)
#   gpu_evidence.sh kernels   OUT_DIR   # bench_rope / glu / rmsnorm / loss
#   gpu_evidence.sh attention OUT_DIR   # bench_attention: 32/8/128 on every case,
#                     then the other head configs on three cases
#   gpu_evidence.sh attention_bwd OUT_DIR  # triton backward: split vs fused (atomic
#                     dQ) on every case, f+b and per kernel (no FA4 needed)
#   gpu_evidence.sh tma       OUT_DIR   # tensor-descriptor loads (KernelConfig.tma)
#                     on vs off in one run (providers triton_tma, and
#                     triton_fused_tma: the fused backward with bulk dQ reductions),
#                     f+b on long and short packs (off: BENCHMARKS run Q)
#   gpu_evidence.sh tma_tests OUT_DIR   # the attention, compile and CUDA-graph GPU
#                     tests with descriptors forced on by the tuning override (needs
#                     pytest-xdist among the carried wheels, as `suite`)
#   gpu_evidence.sh e2e       OUT_DIR   # bench_e2e: 1B table + step profiles
#   gpu_evidence.sh train     OUT_DIR   # hf-varlen train: packed vs padded vs accelerate
#   gpu_evidence.sh trl       OUT_DIR   # bench_trl: TRL SFTTrainer, bf16, 1B shape
#                     (HF_VARLEN_TRL=captured: the captured step vs eager, batch 8 and 32)
#   gpu_evidence.sh baseline  OUT_DIR   # attention/rope timings, .baseline/ vs this tree
#   gpu_evidence.sh compile   OUT_DIR   # bench_e2e: compiled vs eager at one batch size
#                     (HF_VARLEN_BATCH_SIZES, default 32; HF_VARLEN_COMPILE_MODES;
#                      HF_VARLEN_DATA, HF_VARLEN_MAX_LENGTH as for peers;
#                      HF_VARLEN_REPEATS interleaved runs per cell, default 1; a
#                      1B-shape compile cell takes 85-200 s on the H200, a repeat
#                      ~45 s from Inductor's cache)
#   gpu_evidence.sh e2e_ab    OUT_DIR   # bench_e2e cells of an older tree in .baseline/
#                     beside this tree's, interleaved (HF_VARLEN_AB_MODES, HF_VARLEN_BATCH_SIZES)
#   gpu_evidence.sh graphs    OUT_DIR   # bench_e2e: --cuda-graphs on, eager and
#                     compiled, B32 and B8; 25 steps, so that steps replaying every
#                     shape remain after the capture steps
#                     (HF_VARLEN_GRAPH_MODES, HF_VARLEN_BATCH_SIZES)
#   gpu_evidence.sh coverage  OUT_DIR   # bench_coverage_check: the eager offsets check
#   gpu_evidence.sh multigpu  OUT_DIR   # bench_multigpu: 1 process vs DDP vs FSDP2
#                     (1B shape, 16K tokens per rank; needs a machine of >= 2 GPUs)
#   gpu_evidence.sh multigpu_extra OUT_DIR  # the one-process CUDA-graph step on
#                     the same packs (the ceiling beside DDP / FSDP2's eager steps),
#                     and DDP checkpoint + resume across the ranks (ddp-resume)
#   gpu_evidence.sh lora      OUT_DIR   # bench_e2e: LoRA r=16 vs full, B8 and B32
#                     (needs the peft wheel among the carried ones)
#   gpu_evidence.sh peers_install OUT_DIR  # the peers' wheels (carry the parts of
#                     .gpu-wheels/peers, scripts/gpu_evidence/gpu_wheels_peers.sh, in this call
#                     or earlier ones while the machine stays warm) into /tmp/peers/unsloth
#                     and /tmp/peers/trl, each site once all its wheels are here
#   gpu_evidence.sh peers     OUT_DIR   # bench_e2e: our modes beside Unsloth and TRL
#                     (+ Liger) at one batch size per call, each peer in its own
#                     worker and site (scripts/e2e_peers.py); HF_VARLEN_PEER_KIND full
#                     (default) | lora | qlora, HF_VARLEN_MODEL llama-1b | qwen3-8b,
#                     HF_VARLEN_LAYERS, HF_VARLEN_DATA alpaca | mix,
#                     HF_VARLEN_MAX_LENGTH (1024), HF_VARLEN_BATCH_SIZES (8),
#                     HF_VARLEN_PEER_MODES (instead of the kind's list),
#                     HF_VARLEN_STEPS (20), HF_VARLEN_WARMUP (5); the saved models stay
#                     in /tmp/hf_varlen_e2e
#   gpu_evidence.sh bundle    OUT_DIR   # everything under OUT_DIR into one
#                     OUT_DIR/bundle.tgz, the rest removed: the GPU machine returns
#                     only a few files per call (a call's results.json were lost so)
#
# `tests` takes optional test files after OUT_DIR (default: every file that holds a GPU test), and
# also runs the TRL / mixed-precision files, whose trainers use the GPU when there is one.
#
# `suite` runs every GPU test in one pytest session spread over HF_VARLEN_GPU_WORKERS processes
# (default 8 on a card of more than 100 GB, else 4; the Inductor tests are CPU-bound compiles) next to the TRL / mixed-precision files,
# then the `big_memory` ones (past 2^31 elements) alone;
# it needs pytest-xdist and pytest-timeout among the carried wheels
# (`pip download --no-deps pytest-xdist execnet pytest-timeout -d .gpu-wheels/base`).
#
# `baseline` compares our triton kernel (torch's varlen attention in the same run as the drift
# anchor) against an older tree unpacked in .baseline/ (carry it):
#   git archive REV hf_varlen scripts | (mkdir -p .baseline && tar -x -C .baseline)
#
# `bisect` tells which commit broke a GPU-only test in one call: unpack each older tree first,
#   git archive REV hf_varlen tests pyproject.toml | (mkdir -p .bisect/REV && tar -x -C .bisect/REV)
# and carry `.bisect`. Every tree runs the same pytest ARGS at once, each with its own Inductor
# cache (a cache hit must not hide a compile failure), logged as OUT_DIR/bisect_<tree>.log; the
# step timeout is HF_VARLEN_STEP_TIMEOUT (default 300).
#
# `train` and `e2e` read the shared data from runs/shared (carry it): alpaca_5000.json, lima.json
# and the qwen2 tokenizer folder. FA4 joins `attention` when it is importable (its wheels are installed in two calls).
# Every step has its own timeout, so a slow one never hides the others' results.
# With `.gpu-wheels/latest` carried too (scripts/gpu_evidence/gpu_wheels_latest.sh), every stage
# runs on the transformers / kernels / huggingface_hub a fresh install resolves instead of base's
# 5.22.2.
set -uo pipefail
stage=${1:?stage: tests|suite|pytest|bisect|cmd|kernels|attention|e2e|train|trl|baseline|compile|...}
out=${2:?OUT_DIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)  # absolute: some stages run from another directory
export PYTHONPATH="/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PATH="/tmp/site/bin:$PATH"  # the carried wheels' executables (py-spy for bench_e2e --profile)
site_wheels() {  # base's wheels, or with .gpu-wheels/latest (gpu_wheels_latest.sh beside this
    # script) its wheels and base's other ones: one release per project, so /tmp/site holds one
    # dist-info each
    [ -d .gpu-wheels/latest ] || { ls .gpu-wheels/base/*.whl; return; }
    local w newer
    newer=" $(ls .gpu-wheels/latest/*.whl | xargs -n1 basename | cut -d- -f1 | tr 'A-Z\n' 'a-z ')"
    for w in .gpu-wheels/base/*.whl; do
        [[ "$newer" == *" $(basename "$w" | cut -d- -f1 | tr 'A-Z' 'a-z') "* ]] || echo "$w"
    done
    ls .gpu-wheels/latest/*.whl
}
(  # under a lock: stages started side by side must not install into /tmp/site at the same time
    flock 9
    if ! python3 -c "import kernels, trl, xdist" 2>/dev/null && [ -d .gpu-wheels/base ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site $(site_wheels)
    fi
) 9>/tmp/hf_varlen_site.lock
export PYTHONUNBUFFERED=1
data=runs/shared
if [ -d "$data" ] && [ -z "${HF_VARLEN_SHARED_DATA:-}" ]; then  # the tests' ../shared/data layout
    tree=/tmp/hf_varlen_shared
    mkdir -p "$tree/tokenizers" "$tree/alpaca" "$tree/lima"
    ln -sfn "$PWD/$data/qwen2" "$tree/tokenizers/qwen2"
    ln -sfn "$PWD/$data/alpaca_5000.json" "$tree/alpaca/alpaca_5000.json"
    ln -sfn "$PWD/$data/lima.json" "$tree/lima/lima.json"
    export HF_VARLEN_SHARED_DATA=$tree
elif [ -z "${HF_VARLEN_SHARED_DATA:-}" ]; then  # skipped tests would pass unnoticed otherwise
    echo "note: $data not carried and HF_VARLEN_SHARED_DATA unset: the tests that need the" \
        "shared data skip, the e2e / train stages fail (carry $data)" >&2
fi
# bench_e2e's saved models (a 1B model is ~2.4 GB) and prepared batches stay on the machine for
# the next call, never under OUT_DIR: the machine returns no file of that size
e2e_cache=(--model-cache /tmp/hf_varlen_e2e)

own_bitsandbytes() {  # our QLoRA modes and big_memory tests need bitsandbytes in /tmp/site; its
    # wheel travels with the peers' (.gpu-wheels/peers/part*), not with base
    python3 -c "import bitsandbytes" 2>/dev/null && return 0
    local w
    w=$(ls .gpu-wheels/peers/part*/bitsandbytes-*.whl .gpu-wheels/base/bitsandbytes-*.whl \
        2>/dev/null | head -n 1)
    if [ -z "$w" ]; then
        echo "note: no bitsandbytes wheel carried: QLoRA modes skip (carry .gpu-wheels/peers)" >&2
        return 0
    fi
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$w"
}

step() {  # step NAME SECONDS CMD...: run with a timeout, log to OUT_DIR/NAME.log, print the tail
    local name=$1 secs=$2
    shift 2
    echo "== $name (timeout ${secs}s)"
    timeout "$secs" "$@" >"$out/$name.log" 2>&1
    echo "   rc=$?"
    tail -n 8 "$out/$name.log"
    pack_runs "$name"
}

pack_runs() {  # pack_runs STEP: bench_e2e's per-run folders into one archive per folder and step
    local d  # (the GPU machine returns only so many files; results.json and the tables hold what
    for d in "$out"/*/; do  # the report needs, the archive the per-step metrics)
        if compgen -G "$d"run[0-9]* >/dev/null; then
            (cd "$d" && tar czf "runs_$1.tgz" run[0-9]* && rm -rf run[0-9]*)
        fi
    done
}

case "$stage" in
tests)
    shift 2
    files=${*:-$(grep -rl --include="test_*.py" "mark.gpu" tests | sort)}  # default: every GPU file
    for f in $files; do
        case "$f" in
        *trl*|*mixed_precision*) marker=() ;;  # CPU-marked tests that train on CUDA when present
        *) marker=(-m gpu) ;;
        esac
        step "pytest_$(basename "$f" .py)" 240 python3 -m pytest -q "${marker[@]}" "$f"
    done
    ;;
suite)
    own_bitsandbytes  # the big_memory QLoRA test skips without it
    # 8 workers on a 141 GB H200; on an 80 GB H100 beside the trainers, 8 ran out of memory in 41
    # of 224 tests (all passed alone), so 4 there
    mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -n 1)
    workers=${HF_VARLEN_GPU_WORKERS:-$([ "${mib:-0}" -gt 100000 ] && echo 8 || echo 4)}
    gpu_files=$(grep -rl --include="test_*.py" "mark.gpu" tests | sort)
    trainer_files="tests/integrations/test_trl.py tests/integrations/test_trl_fused_loss.py
        tests/models/test_mixed_precision.py"
    opts=(--timeout 300 --durations 25)  # pytest-xdist and pytest-timeout load by entry point
    # -v: a run cut at its timeout still names every test that finished (95% took 420 s)
    cache=(-o cache_dir=/tmp/hf_varlen_suite_cache)  # its own: the trainers' run must not overwrite it
    step suite_gpu 470 python3 -m pytest -v -m "gpu and not big_memory" -n "$workers" "${opts[@]}" \
        "${cache[@]}" --junitxml "$out/suite_gpu.xml" $gpu_files &
    step suite_trainers 300 python3 -m pytest -q -n 4 "${opts[@]}" \
        --junitxml "$out/suite_trainers.xml" $trainer_files &
    wait
    # the past-2^31-element tests need tens of GiB each: alone, after the workers have exited
    # (beside 7 other workers one ran out of memory, BENCHMARKS run L)
    step suite_big_memory 110 python3 -m pytest -q -m "gpu and big_memory" -p no:xdist \
        --junitxml "$out/suite_big_memory.xml" $gpu_files
    # On an 80 GiB card, 8 workers beside the trainers can run out of memory (an H100 run: 4 of
    # 198 tests). suite_gpu.log keeps those failures; this reruns only them, one at a time
    # (rc=5: suite_gpu had none to rerun).
    step suite_gpu_failed_alone 240 python3 -m pytest -q -m "gpu and not big_memory" -p no:xdist \
        "${opts[@]}" "${cache[@]}" --last-failed --last-failed-no-failures none \
        --junitxml "$out/suite_gpu_failed_alone.xml" $gpu_files
    ;;
pytest)
    shift 2
    step "pytest_${HF_VARLEN_STEP_NAME:-args}" "${HF_VARLEN_STEP_TIMEOUT:-540}" python3 -m pytest "$@"
    ;;
bisect)
    shift 2
    for tree in . .bisect/*/; do
        [ -d "$tree/hf_varlen" ] || continue
        name=$(basename "$(cd "$tree" && pwd)")
        [ "$tree" = . ] && name=head
        # cd into the tree: its hf_varlen and tests come first on sys.path (python -m puts the cwd
        # before PYTHONPATH, which holds this tree)
        (cd "$tree" && TORCHINDUCTOR_CACHE_DIR="/tmp/inductor_bisect_$name" \
            step "bisect_$name" "${HF_VARLEN_STEP_TIMEOUT:-300}" python3 -m pytest "$@") &
    done
    wait
    ;;
cmd)  # cmd OUT_DIR NAME SECONDS CMD...: any command in this environment (a diagnostic)
    shift 2
    step "$@"
    ;;
kernels)
    step bench_rope 150 python3 scripts/bench_rope.py --json "$out/rope.json"
    step bench_glu 150 python3 scripts/bench_glu.py --json "$out/glu.json"
    step bench_rmsnorm 120 python3 scripts/bench_rmsnorm.py --json "$out/rmsnorm.json"
    step bench_loss 170 python3 scripts/bench_loss.py --time-budget 150 --json "$out/loss.json"
    ;;
attention)  # issue 16's target heads over every case first (its target lines), then the others
    step bench_attention 330 python3 scripts/bench_attention.py --heads 32/8/128 \
        --json "$out/attn.json"
    step bench_attention_heads 230 python3 scripts/bench_attention.py \
        --heads 16/16/64,40/8/128,16/8/256 --cases alpaca64k,lima64k,32k+alpaca32k \
        --json "$out/attn_heads.json"
    ;;
attention_bwd)  # the triton backward, split (default) vs fused (atomic dQ): every case, whole
    # backward and per kernel; no FA4 needed
    step bench_attention_bwd 400 python3 scripts/bench_attention.py --heads 32/8/128 \
        --providers triton,triton_fused_bwd,torch --json "$out/attn_bwd.json"
    step bench_attention_bwd_breakdown 150 python3 scripts/bench_attention.py --heads 32/8/128 \
        --breakdown --json "$out/attn_bwd_breakdown.json"
    ;;
tma)  # descriptors on vs off (and with the fused backward), interleaved per case
    for dim in 128 64; do  # file names without commas (odd names do not come back from the GPU machine)
        heads=$([ "$dim" = 128 ] && echo 32/8/128,40/8/128 || echo 16/16/64)
        step "bench_tma_$dim" 280 python3 scripts/bench_attention.py \
            --providers triton,triton_tma,triton_fused_tma,torch --no-check --heads "$heads" \
            --cases 32k+alpaca32k,8x8k,alpaca64k,lima64k,alpaca16k --json "$out/tma_$dim.json"
    done
    ;;
tma_tests)  # the attention, compile and CUDA-graph GPU tests with descriptors on everywhere
    cfg=/tmp/hf_varlen_tma.json
    python3 - "$cfg" <<'PY'
import dataclasses, json, sys
from hf_varlen.ops.attention import schedule as s
def row(c):  # the override's 18 entries: 15 tiles, bwd_fused, kv_stages_unfolded, tma (on)
    t = dataclasses.astuple(c)
    return [*t[:15], int(t[15]), t[16], 1]
cfg = {str(d): row(c) for d, c in s._CUDA_CONFIGS.items()}
cfg |= {f"long{d}": row(lp.cfg) for d, lp in s._CUDA_LONG.items()}
cfg["long_min_span"] = s._CUDA_LONG[128].min_span
json.dump(cfg, open(sys.argv[1], "w"))
PY
    # 4 workers: beside 7 others the long-path reference ran out of memory (BENCHMARKS run Q)
    step pytest_tma 500 env HF_VARLEN_TRITON_ATTN_CONFIG="$cfg" python3 -m pytest -q \
        -m "gpu and not big_memory" -n "${HF_VARLEN_GPU_WORKERS:-4}" \
        tests/ops/test_attention_tma.py tests/ops/test_triton_attention.py \
        tests/ops/test_attention_long_path.py \
        tests/backends/test_compile_attention.py tests/backends/test_cuda_graph_capture.py
    ;;
e2e)
    step bench_e2e 560 python3 scripts/bench_e2e.py --out "$out/e2e" --plots-dir "$out/e2e" "${e2e_cache[@]}" \
        --tokenizer "$data/qwen2" --alpaca "$data/alpaca_5000.json" --lima "$data/lima.json" \
        --steps 20 --warmup 5 --timeout 120 --profile
    ;;
train)
    common=(--model llama-1b --tokenizer "$data/qwen2" --dataset "$data/alpaca_5000.json"
        --max-length 1024 --tokens-per-batch 16384 --max-steps 30 --no-progress --no-save-final)
    step train_packed 150 python3 -m hf_varlen.cli train "${common[@]}" --output-dir "$out/packed"
    step train_padded 150 python3 -m hf_varlen.cli train "${common[@]}" --padded \
        --output-dir "$out/padded"
    step train_accelerate 180 accelerate launch --num_processes 1 -m hf_varlen.cli train \
        "${common[@]}" --output-dir "$out/accelerate"
    ;;
trl)  # HF_VARLEN_TRL=captured: the captured step under TRL's defaults against its eager step
    # and TRL's own paths, padding_free at batch 8 and 32 (30 steps, so that steps capturing no new
    # shape remain); otherwise every mode and strategy at batch 32
    if [ "${HF_VARLEN_TRL:-}" = captured ]; then
        for b in 8 32; do
            step "bench_trl_captured_B$b" 280 python3 scripts/bench_trl.py --tokenizer "$data/qwen2" \
                --dataset "$data/alpaca_5000.json" --out "$out/trl_captured_B$b" --batch-size "$b" \
                --strategies padding_free --skip-ce --steps 30 --warmup 5 --timeout 120 \
                --modes varlen_auto,varlen_captured,varlen_fusedce,varlen_kernelize,sdpa,liger
        done
    else
        step bench_trl 560 python3 scripts/bench_trl.py --tokenizer "$data/qwen2" \
            --dataset "$data/alpaca_5000.json" --out "$out/trl" --steps 15 --warmup 5 --timeout 120
    fi
    ;;
baseline)  # HF_VARLEN_BASELINE="attn" runs only the attention comparison (default: attn rope);
    # HF_VARLEN_ATTN_CASES: a comma list of bench_attention's cases (default: all of them);
    # HF_VARLEN_BASELINE_TREES: the older trees, each unpacked in .baseline<SUFFIX>/ and logged
    # as old<SUFFIX> (default: .baseline)
    for bench in ${HF_VARLEN_BASELINE:-attn rope}; do
        for tree in ${HF_VARLEN_BASELINE_TREES:-.baseline} .; do  # older trees first, then this
            tag=$([ "$tree" = . ] && echo new || echo "old${tree#.baseline}")
            env=(env PYTHONPATH="$PWD/$tree:$PYTHONPATH")
            case "$bench" in
            attn) step "attn_$tag" 200 "${env[@]}" python3 "$tree/scripts/bench_attention.py" \
                --providers triton,torch --no-check --cases "${HF_VARLEN_ATTN_CASES:-all}" \
                --json "$out/attn_$tag.json" ;;
            rope) step "rope_$tag" 100 "${env[@]}" python3 "$tree/scripts/bench_rope.py" \
                --json "$out/rope_$tag.json" ;;
            esac
        done
    done
    ;;
compile)  # one batch size per call: the four B32 cells took 434 s (two 1B-shape compiles); 35
    # timed steps: the host-bound B8 step swings from run to run, 10 steps were too few
    modes=${HF_VARLEN_COMPILE_MODES:-minimal_varlen,minimal_varlen-compile,hf_varlen,hf_varlen-compile}
    batches=${HF_VARLEN_BATCH_SIZES:-32}
    # HF_VARLEN_PROFILE_MODES: also profile these modes at the first batch size (op profile,
    # cProfile of 5 steps, the step's host-device syncs, py-spy samples of ~3 s of steps when the
    # py-spy wheel is among the carried ones)
    profile=()
    if [ -n "${HF_VARLEN_PROFILE_MODES:-}" ]; then
        profile=(--profile --profile-batch "${batches%%,*}" --profile-modes "$HF_VARLEN_PROFILE_MODES")
    fi
    # HF_VARLEN_REPEATS: interleaved runs per cell (the host-bound B8 cells swing 20-45% between
    # runs; a repeat after the first compiles from Inductor's cache on the same machine)
    step bench_e2e_compile "${HF_VARLEN_STEP_TIMEOUT:-560}" python3 scripts/bench_e2e.py \
        --out "$out/compile" --plots-dir "$out/compile" "${e2e_cache[@]}" --tokenizer "$data/qwen2" \
        --alpaca "$data/alpaca_5000.json" --lima "$data/lima.json" --modes "$modes" \
        --data "${HF_VARLEN_DATA:-alpaca}" --max-lengths "${HF_VARLEN_MAX_LENGTH:-1024}" \
        --batch-sizes "$batches" --repeats "${HF_VARLEN_REPEATS:-1}" \
        --steps 40 --warmup 5 --timeout 240 "${profile[@]}"
    ;;
e2e_ab)  # end-to-end cells of an older tree (unpacked in .baseline/, see `baseline`: git
    # archive REV hf_varlen scripts) beside the same cells of this tree, interleaved per batch
    # size in one call: HF_VARLEN_AB_MODES (default: the default mode and the compiled
    # integration, the anchor), HF_VARLEN_BATCH_SIZES (default 8,16)
    [ -d .baseline/hf_varlen ] || { echo "e2e_ab: unpack the older tree in .baseline/ first" >&2; exit 2; }
    for b in $(echo "${HF_VARLEN_BATCH_SIZES:-8,16}" | tr ',' ' '); do
        for tree in old new; do
            root=$([ "$tree" = old ] && echo "$PWD/.baseline" || echo "$PWD")
            step "bench_e2e_ab_${tree}_B$b" 280 env PYTHONPATH="/tmp/site:$root" \
                python3 "$root/scripts/bench_e2e.py" --out "$out/ab_${tree}_B$b" "${e2e_cache[@]}" \
                --tokenizer "$data/qwen2" --alpaca "$data/alpaca_5000.json" \
                --lima "$data/lima.json" --modes "${HF_VARLEN_AB_MODES:-hf_varlen-auto,minimal_varlen-compile}" \
                --batch-sizes "$b" --steps 40 --warmup 5 --timeout 240
        done
    done
    ;;
graphs)
    modes=minimal_varlen,hf_varlen,hf_varlen-graphs,hf_varlen-compile-graphs
    step bench_e2e_graphs 560 python3 scripts/bench_e2e.py --out "$out/graphs" \
        --plots-dir "$out/graphs" "${e2e_cache[@]}" --tokenizer "$data/qwen2" --alpaca "$data/alpaca_5000.json" \
        --lima "$data/lima.json" --modes "${HF_VARLEN_GRAPH_MODES:-$modes}" \
        --batch-sizes "${HF_VARLEN_BATCH_SIZES:-32,8}" --steps 25 --warmup 5 --timeout 240
    ;;
lora)
    step bench_e2e_lora 560 python3 scripts/bench_e2e.py --out "$out/lora" \
        --plots-dir "$out/lora" "${e2e_cache[@]}" --tokenizer "$data/qwen2" --alpaca "$data/alpaca_5000.json" \
        --lima "$data/lima.json" --modes minimal_varlen,minimal_varlen-lora,hf_varlen,hf_varlen-lora \
        --batch-sizes 32,8 --steps 15 --warmup 5 --timeout 120
    ;;
multigpu)  # a machine with HF_VARLEN_PROCESSES GPUs (default 2): 1 process vs DDP vs FSDP2
    step bench_multigpu 580 python3 scripts/bench_multigpu.py \
        --processes "${HF_VARLEN_PROCESSES:-2}" --model llama-1b --tokenizer "$data/qwen2" \
        --dataset "$data/alpaca_5000.json" --tokens-per-batch 16384 --steps 30 \
        --out "$out/multigpu" --timeout 160
    ;;
multigpu_extra)  # the one-GPU CUDA-graph step (graphs are one process only); DDP resume
    step bench_multigpu_extra 560 python3 scripts/bench_multigpu.py \
        --runs single-graphs,ddp-resume --processes "${HF_VARLEN_PROCESSES:-2}" \
        --model llama-1b --tokenizer "$data/qwen2" --dataset "$data/alpaca_5000.json" \
        --tokens-per-batch 16384 --steps 30 --out "$out/multigpu_extra" --timeout 180
    ;;
peers_install)  # each site once every wheel of its list is on this machine
    own_bitsandbytes
    for site in unsloth trl; do
        target=/tmp/peers/$site
        if [ -f "$target/.installed" ]; then
            echo "$site: installed in $target"
            continue
        fi
        files=() missing=()
        for w in $(cat .gpu-wheels/peers/part*/"site_$site.txt" 2>/dev/null | sort -u); do
            f=$(ls .gpu-wheels/peers/part*/"$w" 2>/dev/null | head -n 1)
            if [ -n "$f" ]; then files+=("$f"); else missing+=("$w"); fi
        done
        if [ ${#files[@]} -eq 0 ] || [ ${#missing[@]} -gt 0 ]; then
            echo "$site: not installed, ${#missing[@]} wheels not here (carry the other part of" \
                ".gpu-wheels/peers): ${missing[*]:0:6}"
            continue
        fi
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$target" "${files[@]}" && touch "$target/.installed" &&
            echo "$site: ${#files[@]} wheels installed in $target"
    done
    ;;
peers)  # one batch size per call: our modes and the peers' of one kind, one invocation
    kind=${HF_VARLEN_PEER_KIND:-full}
    case "$kind" in
    full | lora | qlora) modes=$(python3 -c "import sys; sys.path.insert(0, 'scripts')
import e2e_modes; print(e2e_modes.PEER_${kind^^}_MODES)") ;;
    *) echo "HF_VARLEN_PEER_KIND=$kind: full, lora or qlora" >&2; exit 2 ;;
    esac
    [ "$kind" = qlora ] && own_bitsandbytes
    for site in unsloth trl; do  # a site not installed: its peers report "skipped: ... not installed"
        var=HF_VARLEN_PEER_SITE_$(echo "$site" | tr 'a-z' 'A-Z')
        [ -f "/tmp/peers/$site/.installed" ] && export "$var=/tmp/peers/$site"
    done
    model=${HF_VARLEN_MODEL:-llama-1b}
    batches=${HF_VARLEN_BATCH_SIZES:-8}
    layers=()
    [ -n "${HF_VARLEN_LAYERS:-}" ] && layers=(--layers "$HF_VARLEN_LAYERS")
    name="peers_${kind}_${model}_${HF_VARLEN_DATA:-alpaca}_B${batches//,/-}"
    step "bench_e2e_$name" "${HF_VARLEN_STEP_TIMEOUT:-560}" python3 scripts/bench_e2e.py \
        --out "$out/$name" --plots-dir "$out/$name" "${e2e_cache[@]}" \
        --tokenizer "$data/qwen2" --alpaca "$data/alpaca_5000.json" --lima "$data/lima.json" \
        --models "$model" "${layers[@]}" --data "${HF_VARLEN_DATA:-alpaca}" \
        --max-lengths "${HF_VARLEN_MAX_LENGTH:-1024}" --modes "${HF_VARLEN_PEER_MODES:-$modes}" \
        --batch-sizes "$batches" --steps "${HF_VARLEN_STEPS:-20}" --warmup "${HF_VARLEN_WARMUP:-5}" \
        --timeout 300
    ;;
bundle)  # last in a call: one archive instead of the many files the stages leave; a file over
    # HF_VARLEN_BUNDLE_MAX_MB (default 20) stays out, named, so that the archive still comes back
    big=$(cd "$out" && find . -type f ! -name bundle.tgz -size +"${HF_VARLEN_BUNDLE_MAX_MB:-20}"M)
    ex=()
    for f in $big; do ex+=("--exclude=$f"); done
    [ -n "$big" ] && echo "left out of the bundle (over ${HF_VARLEN_BUNDLE_MAX_MB:-20} MB):" $big
    (cd "$out" && tar czf /tmp/hf_varlen_bundle.tgz --exclude=bundle.tgz "${ex[@]}" . &&
        find . -mindepth 1 -delete && mv /tmp/hf_varlen_bundle.tgz bundle.tgz)
    ls -l "$out"
    ;;
coverage)
    step bench_coverage_check 150 python3 scripts/bench_coverage_check.py --layers 16 \
        --docs 1,8,32 --steps 10 --json "$out/coverage.json"
    step bench_coverage_check_read_loss 150 python3 scripts/bench_coverage_check.py --layers 16 \
        --docs 8,32 --steps 10 --read-loss --json "$out/coverage_read_loss.json"
    ;;
*)
    echo "unknown stage $stage" >&2
    exit 2
    ;;
esac
