"""Evaluating a model as the field does: lm-evaluation-harness's LM over our model
(harness_lm.py, run by `python -m megatron.evaluate`; it imports `lm_eval`, the `eval` extra)."""
