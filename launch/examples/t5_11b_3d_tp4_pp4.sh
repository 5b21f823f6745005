#!/usr/bin/env bash
# T5-11B (v1.0, 11.3B parameters) in 3D parallelism on 8 nodes x 8 GPUs: tensor parallelism 4
# inside a node, pipeline parallelism 4 (DeepSpeed's 1F1B pipeline engine), data parallelism 4;
# bf16 with ZeRO-1 (optimizer states sharded over the data-parallel ranks of each stage).
# Global batch 2048 x 512 tokens (T5's): micro batch 8 x DP 4 x 64 micro-batches per step, so
# the pipeline bubble is (4 - 1) / (64 + 4 - 1) = 4.5% of a step (on 16 nodes: DP 8, 32
# micro-batches, 8.6%).
#
#   DATA=data/mix_text_document TOKENIZER=spm/t5.model OUT=runs/t5-11b \
#       LAUNCHER="sbatch --nodes 8 --gpus-per-node 8 launch/slurm/pretrain_t5.sbatch" \
#       launch/examples/t5_11b_3d_tp4_pp4.sh
#   NNODES=8 NODE_RANK=0 MASTER_ADDR=host0 ... launch/examples/t5_11b_3d_tp4_pp4.sh  (each node)
#
# Ranks are ordered tensor fastest, then data, then pipeline: a tensor group of 4 shares a node,
# stage boundaries cross nodes. Without a split rank the stages are cut by layer cost (T5's
# 114-token decoder blocks are cheap, so the last stage takes most of the decoder);
# `--pipeline-model-parallel-split-rank 2` puts the encoder on stages 0-1 as Megatron does.
# Plan first: `LAUNCHER="python -m megatron.pretrain_t5 --dry-run" WORLD_SIZE=64
# launch/examples/t5_11b_3d_tp4_pp4.sh --dry-run-device cuda` prints the cut, the bubble and the
# memory per stage (about 24 GiB per GPU on the busiest stage; `--checkpoint-activations` takes
# it to 16 GiB, room for a larger MICRO_BATCH). To rank every layout of this model on the cluster
# by memory and estimated step time: `python -m megatron.plan --cluster 8x8xH100-80GB
# --model-config t5-11b --global-batch-size 2048 --explain`.
# Required: DATA (a _text_document prefix), TOKENIZER (SentencePiece .model, at most 32,128 ids
# with the 100 sentinels), OUT (checkpoints, log.txt, tensorboard/).
# Optional: MICRO_BATCH (8), GLOBAL_BATCH (2048 = MICRO_BATCH x GPUs / 16 x micro-batches per
# step: 16, 32, 64, 128 ... GPUs divide it), TRAIN_ITERS (1,000,000: T5's final models, about 1T
# tokens), LAUNCHER (default launch/torchrun.sh; word-split), torchrun.sh's NPROC_PER_NODE,
# NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT. More flags after the script name override these.
set -euo pipefail
SCRIPT_ARGS=("$@")
# shellcheck source=launch/examples/common.sh
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"

require_env DATA TOKENIZER OUT
require_files "$DATA.bin" "$DATA.idx" "$TOKENIZER"

flags=(
    --model-config "$REPO/configs/model/t5-11b.json" --tokenizer-model "$TOKENIZER"
    --data-path "$DATA" --encoder-seq-length 512 --num-workers 2
    --tensor-model-parallel-size 4 --pipeline-model-parallel-size 4
    --micro-batch-size "${MICRO_BATCH:-8}" --global-batch-size "${GLOBAL_BATCH:-2048}"
    --bf16 --zero-stage 1
    --train-iters "${TRAIN_ITERS:-1000000}"
    --lr 1e-4 --min-lr 1e-5 --lr-decay-style cosine --lr-warmup-iters 2000
    --weight-decay 0.01 --clip-grad 1.0
    --save "$OUT/ckpt" --load "$OUT/ckpt" --save-interval 1000
    --eval-interval 1000 --eval-iters 10 --log-interval 10
    --log-file "$OUT/log.txt" --tensorboard-dir "$OUT/tensorboard"
)
launch "${flags[@]}"
