"""Evaluating a model as the field does:

- harness_lm.py: lm-evaluation-harness's LM over our model (`MegatronT5LM`, run by
  `python -m megatron.evaluate`; it imports `lm_eval`, the `eval` extra);
- task_metrics.py: CPM-2's task metrics over plain strings (exact match, label accuracy,
  first-token accuracy over label words, ROUGE-L, BLEU, as additive statistics that sum over
  ranks) for fine-tuning's validation and prediction files.

It sits above megatron/generation and below megatron/training (tests/training/
test_run_config.py's LAYERS)."""
