#!/usr/bin/env bash
# T5-base (v1.0, 223M parameters) with data parallelism on GPUs: bf16, ZeRO-1 (optimizer states
# sharded over the data-parallel ranks), T5's span corruption on 512-token inputs.
#
#   DATA=data/mix_text_document TOKENIZER=spm/t5.model OUT=runs/t5-base launch/examples/t5_base.sh
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=host0 ... launch/examples/t5_base.sh     (on each node)
#   LAUNCHER="sbatch --nodes 4 --gpus-per-node 8 launch/slurm/pretrain_t5.sbatch" ... (Slurm)
#
# Required: DATA (a _text_document prefix), TOKENIZER (SentencePiece .model, at most 32,128 ids
# with the 100 sentinels), OUT (checkpoints, log.txt, tensorboard/).
# Optional: MICRO_BATCH (16 per GPU), GLOBAL_BATCH (1024 = MICRO_BATCH x GPUs x gradient
# accumulation: 8 to 64 GPUs divide it), TRAIN_ITERS (65,536: T5's 2^19 steps of 128 x 512
# tokens, 34B tokens, at 8 times the batch), LAUNCHER (default launch/torchrun.sh; word-split), and
# torchrun.sh's NPROC_PER_NODE, NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT. More flags after the
# script name override these. Plan first: `LAUNCHER="python -m megatron.pretrain_t5 --dry-run"
# WORLD_SIZE=32 launch/examples/t5_base.sh` checks the flags and files and prints the memory per
# GPU without starting anything.
set -euo pipefail
SCRIPT_ARGS=("$@")
# shellcheck source=launch/examples/common.sh
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"

require_env DATA TOKENIZER OUT
require_files "$DATA.bin" "$DATA.idx" "$TOKENIZER"

flags=(
    --model-config "$REPO/configs/model/t5-base.json" --tokenizer-model "$TOKENIZER"
    --data-path "$DATA" --encoder-seq-length 512 --num-workers 2
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
