#!/usr/bin/env bash
# CPM-2-MoE (198B parameters, 11B active per token): CPM-2's 11B encoder-decoder with every
# feed-forward of its 24 + 24 blocks replaced by 32 experts routed as CPM-2-MoE routed them
# (router 'cpm2', the preset's: CPM-2's shuffle, frozen random centroids, its balanced assignment
# over the data-parallel group, no gate, no auxiliary loss); the experts split over the 32
# data-parallel ranks (one expert per rank, as CPM-2-MoE was trained: the cpm2 router needs
# EP = DP), each tensor-parallel over 4 GPUs; bf16, ZeRO-2: 128 GPUs (16 nodes x 8). As
# CPM-2-MoE was, start it from the dense CPM-2 checkpoint: `python data_tools/convert_checkpoint.py
# --load cpm2-dense --to megatron OUT/upcycled --num-experts 32 --moe-router-type cpm2` (each
# expert a copy of the dense feed-forward, centroids of gain 0.01 as CPM-2's init_ckpt.py), then
# INIT=OUT/upcycled. CPM-2's three stages from the start: docs/cpm2-stages.md.
#
#   DATA=data/mix_cpm2_t5_document TOKENIZER=bpe_cn OUT=runs/cpm2-moe \
#       LAUNCHER="sbatch --nodes 16 --gpus-per-node 8 launch/slurm/pretrain_t5.sbatch" \
#       launch/examples/cpm2_moe_198b.sh
#
# Required: DATA (a prefix of CPM-2's three files, or a _text_document dataset), TOKENIZER
# (CPM-2's bpe_cn folder or vocab.txt, or a SentencePiece .model), OUT.
# Optional: INIT (an upcycled checkpoint to start from: loaded with --finetune when OUT has no
# checkpoint yet), LAUNCHER, torchrun.sh's settings. More flags after the script name override
# these. `WORLD_SIZE=128 LAUNCHER="python -m megatron.pretrain_t5 --dry-run"` prints the plan.
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
load=(--load "$OUT/ckpt")
if [ -n "${INIT:-}" ] && [ ! -f "$OUT/ckpt/latest_checkpointed_iteration.txt" ]; then
    load=(--load "$INIT" --finetune)
fi

flags=(
    --model-config "$REPO/configs/model/cpm2-moe-198b.json" --tokenizer-path "$TOKENIZER"
    --data-path "$DATA" --split 950,30,20 --enc-seq-length 512 --dec-seq-length 256
    --tensor-model-parallel-size 4 --expert-model-parallel-size 32
    --micro-batch-size 8 --global-batch-size 1024 --train-iters 100000
    --lr 0.0001 --min-lr 0.000001 --lr-decay-style linear --lr-warmup-iters 1000
    --weight-decay 1e-2 --clip-grad 1.0
    --bf16 --zero-stage 2 --checkpoint-activations
    --save "$OUT/ckpt" "${load[@]}" --save-interval 1000
    --eval-interval 500 --eval-iters 25 --log-interval 100 --log-file "$OUT/log.txt"
)
launch "${flags[@]}"
