#!/usr/bin/env bash
# CPM-2's 11B encoder-decoder run, its seed command line nearly as it was (CPM-2 flag spellings
# kept on purpose): fp32, ZeRO-3, micro batch 48 per GPU, 8 nodes x 8 GPUs = global batch 3072.
# The model is configs/model/cpm2-11b.json, DeepSpeed configs/deepspeed/cpm2_11b_zero3_fp32.json.
# See docs/migrating.md, "From CPM-2-Pretrain".
#
#   DATA=data/mix_cpm2_t5_document TOKENIZER=bpe_cn OUT=runs/cpm2 \
#       LAUNCHER="sbatch --nodes 8 --gpus-per-node 8 launch/slurm/pretrain_t5.sbatch" \
#       launch/examples/cpm2_11b_fp32_zero3.sh
#
# Required: DATA (a prefix of CPM-2's three files, or a _text_document dataset), TOKENIZER
# (CPM-2's bpe_cn folder, read with CPM-2's own tokenizer from its vocab.txt, which needs jieba;
# or a vocab.txt, a SentencePiece .model, or a folder holding exactly one), OUT (checkpoints and
# log.txt).
# Optional: LAUNCHER (default launch/torchrun.sh; word-split) and torchrun.sh's NPROC_PER_NODE,
# NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT. More flags after the script name override these.
# As in CPM-2, --no-load-optim: every restart from OUT/ckpt keeps the weights, iteration and data
# position but starts the Adam states fresh. `WORLD_SIZE=64 LAUNCHER="python -m
# megatron.pretrain_t5 --dry-run"` prints the parameters and memory per GPU (docs/migrating.md
# quotes them).
set -euo pipefail
SCRIPT_ARGS=("$@")
# shellcheck source=launch/examples/common.sh
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"

require_env DATA TOKENIZER OUT
if [ -d "$TOKENIZER" ]; then
    if [ ! -f "$TOKENIZER/vocab.txt" ] && ! compgen -G "$TOKENIZER/*.model" >/dev/null; then
        echo "error: $TOKENIZER holds neither CPM-2's vocab.txt nor a SentencePiece .model" >&2
        exit 2
    fi
elif [ ! -f "$TOKENIZER" ]; then
    echo "error: $TOKENIZER not found (CPM-2's bpe_cn folder or its vocab.txt, or a" \
        "SentencePiece .model or a folder holding one)" >&2
    exit 2
fi
if ! compgen -G "$DATA*.idx" >/dev/null; then
    echo "error: no $DATA*.idx: DATA must be the prefix of a preprocessed dataset" >&2
    exit 2
fi

# shellcheck disable=SC2054  # the commas belong to --split
flags=(
    --use-new-lr --min-lr 0.0000006
    --model-config "$REPO/configs/model/cpm2-11b.json" --model-parallel-size 1 --batch-size 48
    --enc-seq-length 512 --dec-seq-length 256 --train-iters 300000
    --save "$OUT/ckpt" --load "$OUT/ckpt" --log-file "$OUT/log.txt"
    --data-path "$DATA" --data-impl mmap --split 950,30,20
    --distributed-backend nccl --lr 0.000002 --no-load-optim --lr-decay-style linear
    --weight-decay 1e-2 --clip-grad 1.0 --warmup 0.01 --tokenizer-path "$TOKENIZER"
    --save-interval 1000 --eval-interval 500 --eval-iters 25 --log-interval 100
    --checkpoint-activations --deepspeed-activation-checkpointing
    --deepspeed --deepspeed_config "$REPO/configs/deepspeed/cpm2_11b_zero3_fp32.json"
)
launch "${flags[@]}"
