#!/usr/bin/env bash
# A tiny model for a few steps on CPU (two gloo processes, fp32): checks that a launcher, the
# data and a checkpoint folder work together in a minute. tests/launch/test_slurm.py runs it
# under a real Slurm.
#
#   DATA=demo/demo_text_document TOKENIZER=demo/spm.model MODEL_CONFIG=tiny.json OUT=runs/tiny \
#       launch/examples/tiny_cpu.sh [more flags, which override these]
#
# Required: DATA (a _text_document prefix: DATA.bin and DATA.idx), TOKENIZER (a SentencePiece
# .model), MODEL_CONFIG (a small model JSON, e.g. d_model 32, 2+2 layers, vocab_size >= the
# tokenizer's pieces + 100), OUT (checkpoints, index caches and log.txt go here).
# Optional: ITERS (default 8), NPROC_PER_NODE (default 2), and LAUNCHER, the command that gets
# the flags (default launch/torchrun.sh; e.g. "sbatch launch/slurm/pretrain_t5.sbatch" or
# launch/slurm/srun_per_device.sh; word-split).
set -euo pipefail
SCRIPT_ARGS=("$@")
# shellcheck source=launch/examples/common.sh
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"
require_env DATA TOKENIZER MODEL_CONFIG OUT
require_files "$DATA.bin" "$DATA.idx" "$TOKENIZER" "$MODEL_CONFIG"
export NPROC_PER_NODE=${NPROC_PER_NODE:-2}

# shellcheck disable=SC2054  # the commas belong to --split
flags=(
    --model-config "$MODEL_CONFIG" --tokenizer-model "$TOKENIZER"
    --data-path "$DATA" --split 90,5,5 --data-cache-path "$OUT/cache" --num-workers 0
    --encoder-seq-length 64 --micro-batch-size 2 --global-batch-size 4
    --train-iters "${ITERS:-8}" --lr 3e-3 --lr-warmup-iters 1 --seed 7
    --eval-interval 4 --eval-iters 1 --log-interval 1 --log-file "$OUT/log.txt"
    --save "$OUT/ckpt" --load "$OUT/ckpt" --save-interval 4
)
launch "${flags[@]}"
