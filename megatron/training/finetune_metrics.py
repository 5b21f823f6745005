"""Generation metrics of seq2seq fine-tuning's validation (docs/finetuning.md).

- exact match: the fraction of examples whose decoded prediction equals the decoded target,
  both stripped of surrounding whitespace (nothing else is normalised: case and punctuation
  count);
- label accuracy (`--label-words`): a prediction counts as the label word it equals (stripped),
  and is right when that word is the example's target; a prediction equal to no label word is
  wrong, whatever the target.

Both take plain strings, so the same functions score a validation's greedy decoding and a
prediction file written by `python -m megatron.generate`.
"""

from __future__ import annotations

import functools
from contextlib import nullcontext
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

from megatron.data.datasets.seq2seq import is_scored
from megatron.data.preprocess.jsonl import BadLine, read_fields
from megatron.data.tokenizers.tokenizer_names import pad_id_of


def _checked(predictions: Sequence[str], targets: Sequence[str]) -> None:
    if len(predictions) != len(targets):
        raise ValueError(f"{len(predictions)} predictions for {len(targets)} targets")
    if not predictions:
        raise ValueError("no predictions to score")


def exact_match(predictions: Sequence[str], targets: Sequence[str]) -> float:
    """Fraction of predictions equal to their target (surrounding whitespace ignored)."""
    _checked(predictions, targets)
    return sum(p.strip() == t.strip() for p, t in zip(predictions, targets)) / len(targets)


def as_label(prediction: str, label_words: Sequence[str]) -> Optional[str]:
    """The label word `prediction` equals (stripped), or None."""
    text = prediction.strip()
    for word in label_words:
        if text == word.strip():
            return word
    return None


def label_accuracy(predictions: Sequence[str], targets: Sequence[str],
                   label_words: Sequence[str]) -> float:
    """Fraction of predictions that are a label word and the one of their target."""
    _checked(predictions, targets)
    if not label_words:
        raise ValueError("label accuracy needs --label-words")
    right = 0
    for prediction, target in zip(predictions, targets):
        label = as_label(prediction, label_words)
        right += label is not None and label.strip() == target.strip()
    return right / len(targets)


def generation_metrics(predictions: Sequence[str], targets: Sequence[str],
                       label_words: Sequence[str] = ()) -> Dict[str, float]:
    """{"exact_match": ..., and with label words "accuracy": ...}."""
    out = {"exact_match": exact_match(predictions, targets)}
    if label_words:
        out["accuracy"] = label_accuracy(predictions, targets, label_words)
    return out


def read_predictions(path: str, prediction_key: str = "prediction",
                     target_key: str = "target") -> Tuple[List[str], List[str]]:
    """(predictions, targets) of a JSONL file, one object per line.

    Raises:
        ValueError: naming the file and line: not JSON, a key missing or not a string
            (megatron/data/preprocess/jsonl.py's `parse_line`).
    """
    try:
        rows = read_fields(path, (prediction_key, target_key), key_flags=("", ""))
    except BadLine as e:
        raise ValueError(str(e)) from None
    predictions = [prediction for prediction, _ in rows]
    targets = [target for _, target in rows]
    return predictions, targets


def decoded_targets(batch, tokenizer) -> List[str]:
    """Each row's labelled target (EOS and padding left out) as text."""
    eos, pad = tokenizer.eos_id, pad_id_of(tokenizer)
    out = []
    for row in batch["labels"].cpu().tolist():
        out.append(tokenizer.decode([i for i in row if i != -100 and i not in (eos, pad)]))
    return out


def validation_decoding(max_new_tokens: int):
    """The decoding settings of validation's generation metrics: greedy search of at most
    `max_new_tokens` (--decoder-seq-length) new tokens (megatron/generation/settings.py)."""
    from megatron.generation import DecodingSettings

    return DecodingSettings(max_new_tokens=max_new_tokens)


def greedy_predictions(model, batch, tokenizer, max_new_tokens: int,
                       group=None) -> List[str]:
    """Each row's greedy decoding (megatron/generation) of the batch's encoder input, as text
    (EOS and padding left out, as `python -m megatron.generate` writes it). `model`: a whole
    T5Model in evaluation mode (any tensor-parallel size: training/whole_model.py makes one
    of ZeRO-3 partitions), or a pipeline stage (megatron/generation/stage.py: every stage of
    the pipeline decodes the batch together). `group`: the expert-parallel group the ranks
    decode in lockstep with (their Mixture-of-Experts all-to-alls; None: no other rank)."""
    from megatron.generation import SpecialTokens
    from megatron.generation.lockstep import decode

    tokens = SpecialTokens.of(tokenizer)
    eos, pad = tokens.eos, tokens.pad
    found = decode(model, batch["encoder_input_ids"], batch["encoder_attention_mask"], tokens,
                   validation_decoding(max_new_tokens), group)
    return [tokenizer.decode([i for i in h.ids if i not in (eos, pad)]) for h in found]


def generation_counts(model, batches, tokenizer, max_new_tokens: int,
                      label_words: Sequence[str] = (), group=None) -> Dict[str, int]:
    """{"examples", "exact", and with label words "label_right"} over `batches` (greedy
    decoding of each, the targets from its labels; a row without labels is not counted):
    sums, to be added over data-parallel ranks before `rates` divides them. `group`: as
    `greedy_predictions`' (every rank of it decodes the same number of batches)."""
    counts = {"examples": 0, "exact": 0}
    if label_words:
        counts["label_right"] = 0
    for batch in batches:
        # every row decoded (the ranks of `group` decode in lockstep), the scored ones counted:
        # a validation sample past the file's end repeats an example (data/datasets/seq2seq.py)
        predictions = greedy_predictions(model, batch, tokenizer, max_new_tokens, group)
        if "labels" not in batch:  # a later pipeline stage: it decodes, the first counts
            continue
        targets = decoded_targets(batch, tokenizer)
        scored = [is_scored(row) for row in batch["labels"]]
        predictions = [p for p, keep in zip(predictions, scored) if keep]
        targets = [t for t, keep in zip(targets, scored) if keep]
        n = len(targets)
        if n == 0:
            continue
        counts["examples"] += n
        counts["exact"] += round(exact_match(predictions, targets) * n)
        if label_words:
            counts["label_right"] += round(label_accuracy(predictions, targets, label_words) * n)
    return counts


def rates(counts: Dict[str, float]) -> Dict[str, float]:
    """{"exact_match", "examples" (how many were scored), and "accuracy" where labels were
    counted} from `generation_counts`'s sums (empty without examples)."""
    if not counts.get("examples"):
        return {}
    out = {"exact_match": counts["exact"] / counts["examples"], "examples": counts["examples"]}
    if "label_right" in counts:
        out["accuracy"] = counts["label_right"] / counts["examples"]
    return out


@functools.lru_cache(maxsize=2)
def _tokenizer(spec, extra_ids: int):
    """The run's tokenizer, built at the first evaluation and kept."""
    from megatron.data.tokenizers.tokenizer import build_tokenizer

    return build_tokenizer(spec, extra_ids=extra_ids)


def validation_generation(step, config, loader, watchdog=None,
                          tokenizer=None) -> Optional[Dict[str, float]]:
    """Exact match (and label accuracy with --label-words) of the greedy decoding of the
    validation batches `run_evaluation` scores (the first eval_iters global batches), summed
    over data-parallel ranks; at most --decoder-seq-length new tokens. None where there is
    nothing to score: no seq2seq validation data. Under ZeRO-3 the decoding runs on a whole
    copy of the model (training/whole_model.py); in a pipeline every stage decodes its part
    of the first stage's batches (megatron/generation/pipeline.py's PipelineDecoder) and the
    first stage, which holds the labels, counts (the other stages count nothing)."""
    import torch
    import torch.distributed as dist

    from megatron import parallel_state

    seq2seq = getattr(config.data.dataset, "seq2seq", None)
    if seq2seq is None or seq2seq.valid is None or config.batch.eval_iters == 0:
        return None
    pipeline = config.parallel.pipeline_model_parallel_size > 1
    if loader is None and not pipeline:  # (a pipeline's middle stages have no loader)
        return None
    if tokenizer is None:
        tokenizer = _tokenizer(seq2seq.tokenizer, seq2seq.extra_ids)
    device = config.runtime.torch_device()
    limit = config.batch.eval_iters * config.batch.gradient_accumulation_steps
    collective_s = 60 * config.runtime.distributed_timeout_minutes

    def batches():
        for index, batch in enumerate(() if loader is None else loader):
            if index == limit:
                return
            yield {k: v.to(device) for k, v in batch.items()}

    ep = config.parallel.expert_model_parallel_size
    group = parallel_state.get_expert_model_parallel_group() if ep > 1 else None
    step.train(False)
    try:
        with torch.no_grad():
            counts = _decoded_counts(step.reporting_module(), config, batches, tokenizer,
                                     seq2seq.label_words, group, device)
    finally:
        step.train(True)
    names = sorted(counts)
    summed = torch.tensor([float(counts[n]) for n in names], dtype=torch.float64,
                          device=device)
    if dist.is_initialized() and parallel_state.model_parallel_is_initialized():
        watch = watchdog.watch("collective: the all-reduce of the generation metrics",
                               collective_s) if watchdog is not None else nullcontext()
        with watch:
            dist.all_reduce(summed, group=parallel_state.get_data_parallel_group())
    return rates(dict(zip(names, summed.tolist())))


def _decoded_counts(module, config, batches, tokenizer, label_words, group,
                    device) -> Dict[str, int]:
    """`generation_counts` of `batches()` on the trained `module`: itself, a ZeRO-3 copy, or
    in a pipeline this rank's stage (training/whole_model.py)."""
    from megatron.training.whole_model import stage_model, whole_model

    model_config = config.model
    how = (model_config.make_vocab_size_divisible_by, model_config.attention_backend)
    length = config.data.decoder_seq_length
    if config.parallel.pipeline_model_parallel_size == 1:
        with whole_model(module, *how) as model:
            return generation_counts(model, batches(), tokenizer, length, label_words, group)
    stage = stage_model(module, config.pipeline_cut(), *how)  # (dropped on return)
    return generation_counts(stage, pipeline_batches(stage, batches(), device), tokenizer,
                             length, label_words, group)


def pipeline_batches(stage, batches: Iterator[Dict], device) -> Iterator[Dict]:
    """On every rank of `stage`'s pipeline group, the first stage's `batches` (on the others,
    ignored): there the batches themselves (with their labels), elsewhere their encoder input
    (`encoder_input_ids`, `encoder_attention_mask`, int64) broadcast from the first stage, which
    the stages decode together. Each batch is sent when the one before it is decoded; an empty
    header ends them on every stage."""
    import torch
    import torch.distributed as dist

    first, source = stage.stage == 0, stage.ranks[0]
    while True:
        batch = next(batches, None) if first else None
        header = torch.zeros(3, dtype=torch.long, device=device)  # (more, rows, columns)
        if batch is not None:
            header[0] = 1
            header[1:] = torch.tensor(batch["encoder_input_ids"].shape)
        dist.broadcast(header, source, group=stage.group)
        if not header[0]:
            return
        shape = tuple(header[1:].tolist())
        sent = {}
        for key in ("encoder_input_ids", "encoder_attention_mask"):
            sent[key] = batch[key].to(torch.long).contiguous() if first else \
                torch.empty(shape, dtype=torch.long, device=device)
            dist.broadcast(sent[key], source, group=stage.group)
        yield batch if first else sent


def generation_scalars(metrics: Dict[str, float]) -> Dict[str, float]:
    """TensorBoard's `validation/exact_match` (and `validation/accuracy`) of
    `validation_generation`'s numbers."""
    return {f"validation/{k}": v for k, v in metrics.items() if k != "examples"}


def accuracy_name(config) -> str:
    """What the evaluation's teacher-forced accuracy is called in the log: a seq2seq target
    holds no spans, so there it is the share of target tokens predicted right."""
    objective = config.data.dataset.objective
    return "token accuracy" if objective == "seq2seq" else "span accuracy"


def generation_line(iteration: int, metrics: Dict[str, float]) -> str:
    """The log line of `validation_generation`'s numbers, with how many examples they score."""
    parts = [f"exact match: {metrics['exact_match']:.4f}"]
    if "accuracy" in metrics:
        parts.append(f"label accuracy: {metrics['accuracy']:.4f}")
    parts.append(f"{int(metrics['examples'])} examples")
    return f" validation generation at iteration {iteration} | " + " | ".join(parts) + " |"
