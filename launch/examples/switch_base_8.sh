#!/usr/bin/env bash
# A Switch-Base-class Mixture-of-Experts T5 (configs/model/switch-base-8.json: T5-base with 8
# experts in every second feed-forward, 619M parameters, 223M active per token): top-1 routing,
# capacity factor 1.25 in training and 2.0 in evaluation, router z-loss and load-balancing loss;
# the experts split over 8 GPUs of each data-parallel group (one expert per GPU), bf16, ZeRO-1.
#
#   DATA=data/mix_text_document TOKENIZER=spm/t5.model OUT=runs/switch-base \
#       launch/examples/switch_base_8.sh
#   LAUNCHER="sbatch --nodes 4 --gpus-per-node 8 launch/slurm/pretrain_t5.sbatch" ... (Slurm)
#
# Required: DATA (a _text_document prefix), TOKENIZER (SentencePiece .model), OUT.
# Optional: MICRO_BATCH (16), GLOBAL_BATCH (1024), TRAIN_ITERS (65,536), EP (8: a divisor of the
# data-parallel size and of 8), LAUNCHER (default launch/torchrun.sh), torchrun.sh's settings.
# More flags after the script name override these. Plan first: `LAUNCHER="python -m
# megatron.pretrain_t5 --dry-run" WORLD_SIZE=32 launch/examples/switch_base_8.sh` prints the
# total and active parameters, the experts per GPU, the all-to-all traffic and the memory.
set -euo pipefail
SCRIPT_ARGS=("$@")
# shellcheck source=launch/examples/common.sh
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"

require_env DATA TOKENIZER OUT
require_files "$DATA.bin" "$DATA.idx" "$TOKENIZER"

flags=(
    --model-config "$REPO/configs/model/switch-base-8.json" --tokenizer-model "$TOKENIZER"
    --data-path "$DATA" --encoder-seq-length 512 --num-workers 2
    --expert-model-parallel-size "${EP:-8}"
    --micro-batch-size "${MICRO_BATCH:-16}" --global-batch-size "${GLOBAL_BATCH:-1024}"
    --train-iters "${TRAIN_ITERS:-65536}"
    --lr 3e-4 --min-lr 1e-5 --lr-decay-style cosine --lr-warmup-iters 2000
    --weight-decay 0.01 --clip-grad 1.0
    --bf16 --zero-stage 1
    --save "$OUT/ckpt" --load "$OUT/ckpt" --save-interval 5000
    --eval-interval 5000 --eval-iters 20 --log-interval 100
    --log-file "$OUT/log.txt" --tensorboard-dir "$OUT/tensorboard"
)
launch "${flags[@]}"
