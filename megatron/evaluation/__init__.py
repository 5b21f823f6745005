"""Evaluation of a trained model as the field scores it: CPM-2's task metrics over plain strings
(task_metrics.py: exact match, label accuracy, first-token accuracy over label words, ROUGE-L,
BLEU, as additive statistics that sum over ranks) for fine-tuning's validation and prediction
files. It sits above megatron/generation and below megatron/training (tests/training/
test_run_config.py's LAYERS)."""
