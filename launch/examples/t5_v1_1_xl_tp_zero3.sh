#!/usr/bin/env bash
# T5 v1.1 XL (2.85B parameters) with tensor parallelism 2 and ZeRO-3 in bf16, activations
# recomputed per block: configs/deepspeed/zero3_bf16.json (micro batch 8, accumulation 1).
#
#   DATA=data/mix_text_document TOKENIZER=spm/t5.model OUT=runs/xl \
#       LAUNCHER="sbatch --nodes 8 --gpus-per-node 8 launch/slurm/pretrain_t5.sbatch" \
#       launch/examples/t5_v1_1_xl_tp_zero3.sh
#
# The global batch is 8 x (GPUs / 2) x the JSON's gradient_accumulation_steps: 256 on 64 GPUs.
# For another batch, copy the JSON, change train_micro_batch_size_per_gpu or
# gradient_accumulation_steps and set DS_CONFIG; flags that contradict the JSON are refused.
# Required: DATA (a _text_document prefix), TOKENIZER (SentencePiece .model, at most 32,128 ids
# with the 100 sentinels), OUT (checkpoints, log.txt, tensorboard/).
# Optional: DS_CONFIG, TRAIN_ITERS (default 100,000), LAUNCHER (default launch/torchrun.sh;
# word-split), torchrun.sh's NPROC_PER_NODE, NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT.
# More flags after the script name override these.
set -euo pipefail
SCRIPT_ARGS=("$@")
# shellcheck source=launch/examples/common.sh
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"
DS_CONFIG=${DS_CONFIG:-$REPO/configs/deepspeed/zero3_bf16.json}

require_env DATA TOKENIZER OUT
require_files "$DATA.bin" "$DATA.idx" "$TOKENIZER" "$DS_CONFIG"

flags=(
    --model-config "$REPO/configs/model/t5-v1_1-xl.json" --tokenizer-model "$TOKENIZER"
    --data-path "$DATA" --encoder-seq-length 512 --num-workers 2
    --tensor-model-parallel-size 2
    --deepspeed --deepspeed_config "$DS_CONFIG" --bf16 --checkpoint-activations
    --train-iters "${TRAIN_ITERS:-100000}"
    --lr 1e-4 --min-lr 1e-5 --lr-decay-style cosine --lr-warmup-iters 2000
    --save "$OUT/ckpt" --load "$OUT/ckpt" --save-interval 1000
    --eval-interval 1000 --eval-iters 10 --log-interval 10
    --log-file "$OUT/log.txt" --tensorboard-dir "$OUT/tensorboard"
)
launch "${flags[@]}"
