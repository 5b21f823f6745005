#!/usr/bin/env bash
# CPM-2's three stages (arXiv 2106.10715, section 2.3; docs/cpm2-stages.md), stage 2 of 3:
# bilingual. Stage 1's Chinese model (cpm2_stage1_chinese.sh) continues on English and Chinese
# blended 1:2 (--data-path 1 EN 2 ZH: a third of the samples English), its vocabulary extended
# with English pieces: every old token keeps its id and its rows, a new token starts from the
# rows of its longest old prefix. Same layout as stage 1: TP 4 x DP 32 on 128 GPUs, bf16, ZeRO-2.
#
# Its inputs, from stage 1's tokenizer (bpe_cn) and checkpoint (runs/cpm2-stage1/ckpt):
#   python data_tools/train_tokenizer.py --extend bpe_cn/vocab.txt --input 'en/*.jsonl' \
#       --add-pieces 25000 --output-prefix spm/bpe_cn_en          # writes spm/bpe_cn_en/vocab.txt
#   python data_tools/convert_checkpoint.py --load runs/cpm2-stage1/ckpt --to megatron \
#       ckpt/cpm2-stage2-init --extend-vocab spm/bpe_cn_en --weights-only
#   python data_tools/preprocess_data.py --input 'en/*.jsonl' --output-prefix data/en \
#       --tokenizer-path spm/bpe_cn_en --append-eod --workers 32
#   python data_tools/preprocess_data.py --input 'zh/*.jsonl' --output-prefix data/zh_en \
#       --tokenizer-path spm/bpe_cn_en --append-eod --workers 32
# (Stage 1's Chinese dataset would also do as it is, every old piece keeping its id; preprocessed
# again, English words inside Chinese text get the new pieces.) Then
#   DATA_EN=data/en_text_document DATA_ZH=data/zh_en_text_document TOKENIZER=spm/bpe_cn_en \
#       INIT=ckpt/cpm2-stage2-init OUT=runs/cpm2-stage2 \
#       LAUNCHER="sbatch --nodes 16 --gpus-per-node 8 launch/slurm/pretrain_t5.sbatch" \
#       launch/examples/cpm2_stage2_bilingual.sh
# Its checkpoint, OUT/ckpt, is stage 3's starting point. Check the held-out English loss: it
# starts high (the new rows are copies, bench/RESULTS.md "Vocabulary extension") and must fall.
#
# Required: DATA_EN, DATA_ZH (the English and Chinese datasets' prefixes, preprocessed with
# TOKENIZER), TOKENIZER (the extended vocabulary: a vocab.txt or its folder, or a SentencePiece
# .model), OUT (checkpoints and log.txt), INIT (the stage-1 checkpoint grown by
# convert_checkpoint.py --extend-vocab: loaded with --finetune, weights only, while OUT has no
# checkpoint yet; its model_config.json, with the new vocab_size, is the model's).
# Optional: MODEL_CONFIG (default INIT/model_config.json; given without INIT, the run starts from
# random weights: a --dry-run of the flags, not CPM-2's stage 2), LAUNCHER (default
# launch/torchrun.sh; word-split) and torchrun.sh's settings. More flags after the script name
# override these. `WORLD_SIZE=128 LAUNCHER="python -m megatron.pretrain_t5 --dry-run"` prints
# the plan.
set -euo pipefail
SCRIPT_ARGS=("$@")
# shellcheck source=launch/examples/common.sh
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"

require_env DATA_EN DATA_ZH TOKENIZER OUT
if [ -z "${INIT:-}" ] && [ -z "${MODEL_CONFIG:-}" ]; then
    echo "error: set INIT (stage 1's checkpoint after convert_checkpoint.py --extend-vocab;" \
        "see the header of $0)" >&2
    exit 2
fi
MODEL_CONFIG=${MODEL_CONFIG:-$INIT/model_config.json}
require_files "$MODEL_CONFIG"
if [ ! -e "$TOKENIZER" ]; then
    echo "error: $TOKENIZER not found (the extended vocabulary: vocab.txt or its folder, or a" \
        "SentencePiece .model)" >&2
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
    --data-path 1 "$DATA_EN" 2 "$DATA_ZH" --split 950,30,20
    --enc-seq-length 512 --dec-seq-length 256
    --tensor-model-parallel-size 4
    --micro-batch-size 8 --global-batch-size 1024 --train-iters 100000
    --lr 0.0001 --min-lr 0.000001 --lr-decay-style linear --lr-warmup-iters 1000
    --weight-decay 1e-2 --clip-grad 1.0
    --bf16 --zero-stage 2 --checkpoint-activations
    --save "$OUT/ckpt" "${load[@]}" --save-interval 1000
    --eval-interval 500 --eval-iters 25 --log-interval 100 --log-file "$OUT/log.txt"
)
launch "${flags[@]}"
