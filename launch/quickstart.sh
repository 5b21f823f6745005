#!/usr/bin/env bash
# The main job on a fresh machine with no network: build the embedded demo corpus, train its
# SentencePiece tokenizer, preprocess it into .bin/.idx (document and sentence level), inspect the
# result, then pretrain a tiny T5 (configs/model/t5-demo.json) with 2 processes on CPU (torchrun,
# gloo), saving and evaluating. Everything goes under $DEMO_DIR (default ./demo).
# STEPS (default 300) and NPROC (default 2) change the training run.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
DEMO_DIR=${DEMO_DIR:-demo}
WORKERS=${WORKERS:-2}
mkdir -p "$DEMO_DIR"

echo "== 1/5 demo corpus (Python's help topics)"
$PYTHON data_tools/make_demo_corpus.py --output "$DEMO_DIR/corpus.jsonl"

echo "== 2/5 SentencePiece tokenizer (T5 layout: pad 0, eos 1, unk 2, 100 sentinels)"
$PYTHON data_tools/train_tokenizer.py --input "$DEMO_DIR/corpus.jsonl" \
    --output-prefix "$DEMO_DIR/spm" --vocab-size 4000 --character-coverage 1.0

echo "== 3/5 preprocess to Megatron .bin/.idx"
$PYTHON data_tools/preprocess_data.py --input "$DEMO_DIR/corpus.jsonl" \
    --output-prefix "$DEMO_DIR/demo" --tokenizer-model "$DEMO_DIR/spm.model" \
    --append-eod --workers "$WORKERS"
$PYTHON data_tools/preprocess_data.py --input "$DEMO_DIR/corpus.jsonl" \
    --output-prefix "$DEMO_DIR/demo" --tokenizer-model "$DEMO_DIR/spm.model" \
    --append-eod --workers "$WORKERS" --split-sentences

echo "== 4/5 inspect"
$PYTHON data_tools/inspect_dataset.py "$DEMO_DIR/demo_text_document" \
    --tokenizer-model "$DEMO_DIR/spm.model" --document 0
$PYTHON data_tools/inspect_dataset.py "$DEMO_DIR/demo_text_sentence" --bins 8

STEPS=${STEPS:-300}
NPROC=${NPROC:-2}
echo "== 5/5 pretrain a tiny T5: $NPROC processes on CPU, $STEPS steps"
rm -rf "$DEMO_DIR/checkpoints"
OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} $PYTHON -m torch.distributed.run --standalone \
    --nproc_per_node "$NPROC" -m megatron.pretrain_t5 \
    --model-config configs/model/t5-demo.json --tokenizer-model "$DEMO_DIR/spm.model" \
    --data-path "$DEMO_DIR/demo_text_document" --encoder-seq-length 128 \
    --micro-batch-size 8 --global-batch-size 16 --train-iters "$STEPS" \
    --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --lr-warmup-iters 20 --split 95,4,1 \
    --log-interval 25 --eval-interval 100 --eval-iters 4 --num-workers 1 \
    --save "$DEMO_DIR/checkpoints" --save-interval 100 \
    --log-file "$DEMO_DIR/train.log" --tensorboard-dir "$DEMO_DIR/tensorboard"

echo
echo "tokenizer:         $DEMO_DIR/spm.model"
echo "document dataset:  $DEMO_DIR/demo_text_document.bin/.idx"
echo "sentence dataset:  $DEMO_DIR/demo_text_sentence.bin/.idx"
echo "training log:      $DEMO_DIR/train.log (TensorBoard: $DEMO_DIR/tensorboard)"
echo "checkpoints:       $DEMO_DIR/checkpoints (resume: add --load $DEMO_DIR/checkpoints)"
