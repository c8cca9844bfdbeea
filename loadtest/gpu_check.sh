#!/usr/bin/env bash
# One-shot check of the Qwen3-Omni pipeline on a CUDA machine (about 10 minutes on one H200), the most
# telling checks first, so a short lease (GPU_CHECK_BUDGET_S) still gets them:
#   0. nvidia-smi and a CUDA build of torch (exits 3 at once without them: nothing to check here);
#   1. check-config of the 1-GPU 30B-A3B config on this host (devices included);
#   2. configs/qwen3-omni-30b-a3b.yaml with the released shapes on dummy weights (`preset: released`,
#      no checkpoint needed): first text / first audio, 1 then 16 requests, graphs on, then off;
#   3. the tiny pipeline with every stage on cuda: first text / first audio, 1 then 16 requests,
#      with the talker's CUDA graphs on and off;
#   4. the Talker+MTP frame step at the released sizes (dummy weights), batch 1 and 16: the eager
#      reference step (graphs off) and the runner's captured decode graphs (on);
#   5. the vision tower at the released sizes (bf16, dummy weights): a 1024x768 image, a 448x448 image,
#      4 s and 10 s of video, then a minute of video under a 4 GiB activation budget: forward times and
#      the device's peak memory against the encoder stage's formula (loadtest/bench_gpu_vision.py);
#   6. check-config of the 2-GPU config (its device check skipped on one GPU).
# The pipelines come first: the step and the tower alone passed on an H200 (2026-12-04), the pipelines
# had not yet run end to end there.
# CUDA_GRAPHS=off or on runs only that side (default: both). GPU_CHECK_BUDGET_S=N: the whole run's seconds;
# each check's limit is cut to what is left, and a check with under 30 s left is skipped (named at the end).
#
# Usage: loadtest/gpu_check.sh            (from anywhere; PYTHON=... picks the interpreter)
set -uo pipefail

cd "$(dirname -- "${BASH_SOURCE[0]}")/.." || exit 1
PYTHON="${PYTHON:-python}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
CUDA_GRAPHS="${CUDA_GRAPHS:-both}"
case "$CUDA_GRAPHS" in
    both) graph_modes=(off on) ;;
    off | on) graph_modes=("$CUDA_GRAPHS") ;;
    *) echo "gpu_check: CUDA_GRAPHS must be off, on or both, got '$CUDA_GRAPHS'" >&2; exit 2 ;;
esac
BUDGET_S="${GPU_CHECK_BUDGET_S:-0}"
if ! [[ "$BUDGET_S" =~ ^[0-9]+$ ]]; then
    echo "gpu_check: GPU_CHECK_BUDGET_S must be a whole number of seconds (0: no budget), got '$BUDGET_S'" >&2
    exit 2
fi
if ! command -v nvidia-smi >/dev/null 2>&1; then
    echo "gpu_check: no nvidia-smi on this machine: it needs an NVIDIA GPU and driver; nothing was run" >&2
    exit 3
fi
if ! nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader; then
    echo "gpu_check: nvidia-smi finds no usable GPU; nothing was run" >&2
    exit 3
fi
if ! "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_check: $PYTHON's torch sees no CUDA device (a CPU-only build?); nothing was run" >&2
    exit 3
fi
num_gpus="$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())')"
"$PYTHON" -c 'import sys, torch; print(f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
                                  f"{torch.cuda.get_device_name()}")'
if command -v pgrep >/dev/null 2>&1 && pgrep -x nvidia-cuda-mps-control >/dev/null 2>&1; then
    echo "CUDA MPS: the control daemon runs: the stages' CUDA_MPS_ACTIVE_THREAD_PERCENTAGE caps apply"
else
    echo "CUDA MPS: no control daemon (nvidia-cuda-mps-control -d): the stages' SM caps are ignored"
fi
echo "CUDA graphs of the talker decode step: ${graph_modes[*]}"

failed=()
skipped=()
step() {
    # step NAME SECONDS COMMAND...: run one check under a time limit; a failure is reported, not fatal.
    local name="$1" limit="$2"
    shift 2
    if (( BUDGET_S > 0 )); then
        local left=$((BUDGET_S - SECONDS))
        if (( left < 30 )); then
            skipped+=("$name")
            return
        fi
        (( limit > left )) && limit=$left
    fi
    echo
    echo "== $name (limit ${limit} s)"
    local start=$SECONDS
    if timeout "$limit" "$@"; then
        echo "== $name: ok in $((SECONDS - start)) s"
    else
        echo "== $name: FAILED (exit $?) after $((SECONDS - start)) s"
        failed+=("$name")
    fi
}

step "check-config 1 GPU" 120 "$PYTHON" -m voice_server.cli check-config configs/qwen3-omni-30b-a3b.yaml
# NOTE: the pipelines with graphs on first: it is what serves (talker `cuda_graphs: auto`).
serving_first=()
for ((i = ${#graph_modes[@]} - 1; i >= 0; i--)); do
    serving_first+=("${graph_modes[i]}")
done
for graphs in "${serving_first[@]}"; do
    step "30B-A3B pipeline, released shapes, graphs $graphs" 240 "$PYTHON" loadtest/bench_gpu.py pipeline \
        --config configs/qwen3-omni-30b-a3b.yaml --preset released --cuda-graphs "$graphs"
done
for graphs in "${serving_first[@]}"; do
    step "tiny pipeline on cuda, graphs $graphs" 120 "$PYTHON" loadtest/bench_gpu.py pipeline \
        --config configs/qwen3-omni-tiny.yaml --device cuda --cuda-graphs "$graphs"
done
for graphs in "${graph_modes[@]}"; do
    step "talker step, released sizes, graphs $graphs" 120 "$PYTHON" loadtest/bench_gpu.py talker \
        --preset released --device cuda --batches 1,16 --cuda-graphs "$graphs"
done
step "vision tower, released sizes" 240 "$PYTHON" loadtest/bench_gpu_vision.py --device cuda --budget-gib 4
two_gpu_flags=()
if (( num_gpus < 2 )); then
    two_gpu_flags=(--skip-device-check)  # NOTE: one GPU here: check the rest of the 2-GPU config
fi
step "check-config 2 GPUs" 120 "$PYTHON" -m voice_server.cli check-config ${two_gpu_flags[@]+"${two_gpu_flags[@]}"} \
    configs/qwen3-omni-30b-a3b-2gpu.yaml

echo
if (( ${#skipped[@]} )); then
    echo "gpu_check: SKIPPED (GPU_CHECK_BUDGET_S=$BUDGET_S spent):"
    printf '  %s\n' "${skipped[@]}"
fi
if (( ${#failed[@]} )); then
    echo "gpu_check: FAILED:"
    printf '  %s\n' "${failed[@]}"
    exit 1
fi
if (( ${#skipped[@]} )); then
    exit 4
fi
echo "gpu_check: all checks passed"
