#!/usr/bin/env bash
# CPM-2's three stages (arXiv 2106.10715, section 2.3; docs/cpm2-stages.md), stage 1 of 3: the
# Chinese 11B encoder-decoder (configs/model/cpm2-11b.json) on CPM-2's bpe_cn vocabulary.
# Stage 2 (cpm2_stage2_bilingual.sh) continues it on English and Chinese with an extended
# vocabulary, stage 3 (cpm2_stage3_moe.sh) copies it into 32 experts. The three stages share one
# layout, TP 4 x DP 32 on 128 GPUs (16 nodes x 8), micro batch 8 (global 1024), 512 encoder and
# 256 decoder tokens, bf16 and ZeRO-2, so that each stage's checkpoint feeds the next conversion
# as it is. (cpm2_11b_fp32_zero3.sh is the same model on CPM-2's own seed command line: fp32,
# ZeRO-3, 64 GPUs.)
#
# Its input, the Chinese corpus (JSONL) preprocessed with bpe_cn:
#   python data_tools/preprocess_data.py --input 'zh/*.jsonl' --output-prefix data/zh \
#       --tokenizer-path bpe_cn --append-eod --workers 32
# then
#   DATA=data/zh_text_document TOKENIZER=bpe_cn OUT=runs/cpm2-stage1 \
#       LAUNCHER="sbatch --nodes 16 --gpus-per-node 8 launch/slurm/pretrain_t5.sbatch" \
#       launch/examples/cpm2_stage1_chinese.sh
# Its checkpoint, OUT/ckpt, is stage 2's starting point.
#
# Required: DATA (the Chinese dataset's prefix), TOKENIZER (CPM-2's bpe_cn folder or its
# vocab.txt, read with CPM-2's own tokenizer, which needs jieba; or a SentencePiece .model), OUT
# (checkpoints and log.txt).
# Optional: LAUNCHER (default launch/torchrun.sh; word-split) and torchrun.sh's NPROC_PER_NODE,
# NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT. More flags after the script name override these.
# `WORLD_SIZE=128 LAUNCHER="python -m megatron.pretrain_t5 --dry-run"` prints the plan.
set -euo pipefail
SCRIPT_ARGS=("$@")
# shellcheck source=launch/examples/common.sh
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"

require_env DATA TOKENIZER OUT
if [ ! -e "$TOKENIZER" ]; then
    echo "error: $TOKENIZER not found (CPM-2's bpe_cn folder or its vocab.txt, or a" \
        "SentencePiece .model)" >&2
    exit 2
fi
if ! compgen -G "$DATA*.idx" >/dev/null; then
    echo "error: no $DATA*.idx: DATA must be the prefix of a preprocessed dataset" >&2
    exit 2
fi

flags=(
    --model-config "$REPO/configs/model/cpm2-11b.json" --tokenizer-path "$TOKENIZER"
    --data-path "$DATA" --split 950,30,20 --enc-seq-length 512 --dec-seq-length 256
    --tensor-model-parallel-size 4
    --micro-batch-size 8 --global-batch-size 1024 --train-iters 200000
    --lr 0.0001 --min-lr 0.000001 --lr-decay-style linear --lr-warmup-iters 2000
    --weight-decay 1e-2 --clip-grad 1.0
    --bf16 --zero-stage 2 --checkpoint-activations
    --save "$OUT/ckpt" --load "$OUT/ckpt" --save-interval 1000
    --eval-interval 500 --eval-iters 25 --log-interval 100 --log-file "$OUT/log.txt"
)
launch "${flags[@]}"
