#!/usr/bin/env bash
# CPM-2's three stages (arXiv 2106.10715, section 2.3; docs/cpm2-stages.md), stage 3 of 3:
# Mixture-of-Experts. Stage 2's bilingual model (cpm2_stage2_bilingual.sh) copied into 32
# experts per feed-forward of its 24 + 24 blocks (CPM-2-MoE, 198B parameters, 11B active per
# token), routed as CPM-2-MoE routed them (--moe-router-type cpm2: BASE layers with CPM-2's
# shuffle, frozen centroids and no gate; docs/cpm2-stages.md), and trained on stage 2's 1:2
# English:Chinese blend. One expert per data-parallel rank: experts = expert-model-parallel size
# = data-parallel size (EXPERTS), each expert tensor-parallel over 4 GPUs: 4 x EXPERTS GPUs,
# 128 (16 nodes x 8) for CPM-2-MoE's 32. The router balances the tokens of a micro-batch on a
# rank over the experts: micro batch x 512 and micro batch x 256 must be multiples of EXPERTS
# (8 x 512 = 4096 and 8 x 256 = 2048: 32 divides both). bf16, ZeRO-2.
# (cpm2_moe_198b.sh is the same model and router started from the dense CPM-2 directly.)
#
# Its input, stage 2's checkpoint upcycled (each expert a copy of the dense feed-forward), with
# stage 2's datasets and tokenizer:
#   python data_tools/convert_checkpoint.py --load runs/cpm2-stage2/ckpt --to megatron \
#       ckpt/cpm2-stage3-init --num-experts 32 --moe-router-type cpm2 \
#       --target-expert-parallel-size 32
# then
#   DATA_EN=data/en_text_document DATA_ZH=data/zh_en_text_document TOKENIZER=spm/bpe_cn_en \
#       INIT=ckpt/cpm2-stage3-init OUT=runs/cpm2-stage3 \
#       LAUNCHER="sbatch --nodes 16 --gpus-per-node 8 launch/slurm/pretrain_t5.sbatch" \
#       launch/examples/cpm2_stage3_moe.sh
#
# Required: DATA_EN, DATA_ZH (stage 2's datasets), TOKENIZER (stage 2's extended vocabulary),
# OUT (checkpoints and log.txt), INIT (the upcycled checkpoint: loaded with --finetune while OUT
# has no checkpoint yet; its model_config.json, with the experts and the extended vocab_size, is
# the model's).
# Optional: EXPERTS (default 32: the experts, the expert-model-parallel size and the data-parallel
# size; the upcycling's --num-experts and --target-expert-parallel-size must say the same, and
# the world size must be 4 x EXPERTS), MODEL_CONFIG (default INIT/model_config.json; given
# without INIT, the run starts from random weights: a --dry-run of the flags, e.g.
# configs/model/cpm2-moe-198b.json), LAUNCHER (default launch/torchrun.sh; word-split) and
# torchrun.sh's settings. More flags after the script name override these.
# `WORLD_SIZE=128 LAUNCHER="python -m megatron.pretrain_t5 --dry-run"` prints the plan;
# `EXPERTS=4 WORLD_SIZE=16` that of a small world (4 experts, DP 4).
set -euo pipefail
SCRIPT_ARGS=("$@")
# shellcheck source=launch/examples/common.sh
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"

require_env DATA_EN DATA_ZH TOKENIZER OUT
if [ -z "${INIT:-}" ] && [ -z "${MODEL_CONFIG:-}" ]; then
    echo "error: set INIT (stage 2's checkpoint after convert_checkpoint.py --num-experts;" \
        "see the header of $0)" >&2
    exit 2
fi
MODEL_CONFIG=${MODEL_CONFIG:-$INIT/model_config.json}
require_files "$MODEL_CONFIG"
EXPERTS=${EXPERTS:-32}
if ! [[ "$EXPERTS" =~ ^[1-9][0-9]*$ ]]; then
    echo "error: EXPERTS=$EXPERTS: a positive number (the experts = the data-parallel size)" >&2
    exit 2
fi
if [ ! -e "$TOKENIZER" ]; then
    echo "error: $TOKENIZER not found (stage 2's extended vocabulary: vocab.txt or its folder," \
        "or a SentencePiece .model)" >&2
    exit 2
fi
for data in "$DATA_EN" "$DATA_ZH"; do
    if ! compgen -G "$data*.idx" >/dev/null; then
        echo "error: no $data*.idx: DATA_EN and DATA_ZH must be prefixes of preprocessed" \
            "datasets" >&2
        exit 2
    fi
done
load=(--load "$OUT/ckpt")
if [ -n "${INIT:-}" ] && [ ! -f "$OUT/ckpt/latest_checkpointed_iteration.txt" ]; then
    load=(--load "$INIT" --finetune)
fi

flags=(
    --model-config "$MODEL_CONFIG" --tokenizer-path "$TOKENIZER"
    --num-experts "$EXPERTS" --moe-router-type cpm2
    --data-path 1 "$DATA_EN" 2 "$DATA_ZH" --split 950,30,20
    --enc-seq-length 512 --dec-seq-length 256
    --tensor-model-parallel-size 4 --expert-model-parallel-size "$EXPERTS"
    --micro-batch-size 8 --global-batch-size 1024 --train-iters 100000
    --lr 0.0001 --min-lr 0.000001 --lr-decay-style linear --lr-warmup-iters 1000
    --weight-decay 1e-2 --clip-grad 1.0
    --bf16 --zero-stage 2 --checkpoint-activations
    --save "$OUT/ckpt" "${load[@]}" --save-interval 1000
    --eval-interval 500 --eval-iters 25 --log-interval 100 --log-file "$OUT/log.txt"
)
launch "${flags[@]}"
