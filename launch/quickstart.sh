#!/usr/bin/env bash
# The main job on a fresh machine with no network: build the embedded demo corpus, train its
# SentencePiece tokenizer, preprocess it into .bin/.idx (document and sentence level) and inspect
# the result. Everything goes under $DEMO_DIR (default ./demo).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
DEMO_DIR=${DEMO_DIR:-demo}
WORKERS=${WORKERS:-2}
mkdir -p "$DEMO_DIR"

echo "== 1/4 demo corpus (Python's help topics)"
$PYTHON data_tools/make_demo_corpus.py --output "$DEMO_DIR/corpus.jsonl"

echo "== 2/4 SentencePiece tokenizer (T5 layout: pad 0, eos 1, unk 2, 100 sentinels)"
$PYTHON data_tools/train_tokenizer.py --input "$DEMO_DIR/corpus.jsonl" \
    --output-prefix "$DEMO_DIR/spm" --vocab-size 4000 --character-coverage 1.0

echo "== 3/4 preprocess to Megatron .bin/.idx"
$PYTHON data_tools/preprocess_data.py --input "$DEMO_DIR/corpus.jsonl" \
    --output-prefix "$DEMO_DIR/demo" --tokenizer-model "$DEMO_DIR/spm.model" \
    --append-eod --workers "$WORKERS"
$PYTHON data_tools/preprocess_data.py --input "$DEMO_DIR/corpus.jsonl" \
    --output-prefix "$DEMO_DIR/demo" --tokenizer-model "$DEMO_DIR/spm.model" \
    --append-eod --workers "$WORKERS" --split-sentences

echo "== 4/4 inspect"
$PYTHON data_tools/inspect_dataset.py "$DEMO_DIR/demo_text_document" \
    --tokenizer-model "$DEMO_DIR/spm.model" --document 0
$PYTHON data_tools/inspect_dataset.py "$DEMO_DIR/demo_text_sentence" --bins 8

echo
echo "tokenizer:         $DEMO_DIR/spm.model"
echo "document dataset:  $DEMO_DIR/demo_text_document.bin/.idx"
echo "sentence dataset:  $DEMO_DIR/demo_text_sentence.bin/.idx"
