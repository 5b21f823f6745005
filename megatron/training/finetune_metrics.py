"""Task metrics of seq2seq fine-tuning's validation (docs/finetuning.md, docs/evaluation.md).

`--finetune-metrics` chooses among megatron/evaluation/task_metrics.py's metrics (default:
exact match, and label accuracy with `--label-words`): the generated ones score each
validation example's decoding (greedy, or `--eval-num-beams` beams) against its target,
first-token accuracy the first decoder step's logits over the label words' first tokens (no
generation). Each batch adds its additive statistics (task_metrics.statistics); one all-reduce
sums them over data-parallel ranks, so every layout reports the same numbers.

The scoring functions take plain strings, so the same functions score a validation's decoding
and a prediction file written by `python -m megatron.generate`
(data_tools/score_predictions.py).
"""

from __future__ import annotations

import functools
from contextlib import nullcontext
from typing import Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

from megatron.data.datasets.seq2seq import is_scored
from megatron.data.preprocess.jsonl import BadLine, read_fields
from megatron.data.tokenizers.tokenizer_names import pad_id_of
from megatron.evaluation import task_metrics
from megatron.evaluation.task_metrics import (  # noqa: F401 - imported from here too
    Scoring, as_label, exact_match, label_accuracy)


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


def validation_decoding(max_new_tokens: int, num_beams: int = 1):
    """The decoding settings of validation's generated metrics: greedy search (or beam search
    of `num_beams`, --eval-num-beams, with transformers' defaults otherwise) of at most
    `max_new_tokens` (--decoder-seq-length) new tokens (megatron/generation/settings.py)."""
    from megatron.generation import DecodingSettings

    return DecodingSettings(max_new_tokens=max_new_tokens, num_beams=num_beams)


def greedy_predictions(model, batch, tokenizer, max_new_tokens: int,
                       group=None) -> List[str]:
    """Each row's greedy decoding (megatron/generation) of the batch's encoder input, as text
    (EOS and padding left out, as `python -m megatron.generate` writes it). `model`: a whole
    T5Model in evaluation mode (any tensor-parallel size: training/whole_model.py makes one
    of ZeRO-3 partitions), or a pipeline stage (megatron/generation/stage.py: every stage of
    the pipeline decodes the batch together). `group`: the expert-parallel group the ranks
    decode in lockstep with (their Mixture-of-Experts all-to-alls; None: no other rank)."""
    texts, _ = decoded(model, batch, tokenizer, Scoring.of(), max_new_tokens, group)
    return texts


class _FirstStep:
    """A decoder (`step`, `reorder`) that keeps the logits of its first step."""

    def __init__(self, decoder) -> None:
        self.decoder, self.vocab_size, self.first = decoder, decoder.vocab_size, None

    def step(self, ids):
        logits = self.decoder.step(ids)
        if self.first is None:
            self.first = logits
        return logits

    def reorder(self, rows) -> None:
        self.decoder.reorder(rows)


def decoded(model, batch, tokenizer, scoring: Scoring, max_new_tokens: int, group=None):
    """(each row's decoding as text, or None when no chosen metric generates; the first
    decoder step's logits [rows, vocab]) of the batch's encoder input: the search
    `scoring.num_beams` asks for, or only the first step. `model` and `group`: as
    `greedy_predictions`' (every rank of a pipeline or expert-parallel group calls this
    together: megatron/generation/lockstep.py's `decode`, with the first step kept)."""
    import torch

    from megatron.generation import SpecialTokens
    from megatron.generation.lockstep import Lockstep
    from megatron.generation.pipeline import decoder_for
    from megatron.generation.search import search

    tokens = SpecialTokens.of(tokenizer)
    ids, mask = batch["encoder_input_ids"], batch["encoder_attention_mask"]
    beams = scoring.num_beams if scoring.generates else 1
    lockstep = Lockstep(decoder_for(model, ids, mask, beams), group, tokens.pad)
    decoder = _FirstStep(lockstep)
    texts = None
    if scoring.generates:
        found = search(decoder, ids.shape[0], tokens, validation_decoding(max_new_tokens, beams),
                       device=ids.device)
        texts = [tokenizer.decode([i for i in h.ids if i not in (tokens.eos, tokens.pad)])
                 for h in found]
    else:  # first-token accuracy alone: one step, no generation
        decoder.step(torch.full((ids.shape[0],), tokens.start, dtype=torch.long,
                                device=ids.device))
    lockstep.drain()
    return texts, decoder.first[::beams]  # (beam search: each input's rows start alike)


def scoring_of(seq2seq) -> Scoring:
    """The Scoring of a run's Seq2SeqConfig (its --finetune-metrics and --eval-* flags)."""
    return Scoring.of(seq2seq.metrics, seq2seq.label_words, seq2seq.bleu_tokenize,
                      seq2seq.rouge_tokenize, seq2seq.eval_num_beams)


def metric_problems(flags: Mapping[str, object], data=None) -> List[str]:
    """Every problem of --finetune-metrics and the --eval-* flags (`vars(namespace)`), and with
    first_token_accuracy and the run's resolved data (DataSettings; None: not known), label
    words that begin with the same token of the run's tokenizer."""
    problems = task_metrics.flag_problems(flags)
    seq2seq = getattr(getattr(data, "dataset", None), "seq2seq", None)
    if problems or seq2seq is None or "first_token_accuracy" not in scoring_of(seq2seq).metrics:
        return problems
    try:
        task_metrics.first_token_ids(seq2seq.label_words,
                                     _tokenizer(seq2seq.tokenizer, seq2seq.extra_ids).encode)
    except ValueError as e:
        return [str(e)]
    return []


def generation_counts(model, batches, tokenizer, max_new_tokens: int,
                      label_words: Sequence[str] = (), group=None,
                      scoring: Optional[Scoring] = None) -> Dict[str, int]:
    """task_metrics' additive statistics ("examples", "exact", "label_right", ...) of
    `scoring`'s metrics (None: the default ones of `label_words`) over `batches` (each one
    decoded, the targets from its labels; a row without labels is not counted): sums, to be
    added over data-parallel ranks before `rates` turns them into numbers. `group`: as
    `greedy_predictions`' (every rank of it decodes the same number of batches)."""
    if scoring is None:
        scoring = Scoring.of(label_words=label_words)
    first_ids = None
    if "first_token_accuracy" in scoring.metrics:
        first_ids = task_metrics.first_token_ids(scoring.label_words, tokenizer.encode)
    counts = task_metrics.empty_statistics(scoring)
    for batch in batches:
        # every row decoded (the ranks of `group` decode in lockstep), the scored ones counted:
        # a validation sample past the file's end repeats an example (data/datasets/seq2seq.py)
        texts, logits = decoded(model, batch, tokenizer, scoring, max_new_tokens, group)
        if "labels" not in batch:  # a later pipeline stage: it decodes, the first counts
            continue
        scored = [bool(is_scored(row)) for row in batch["labels"]]
        targets = [t for t, keep in zip(decoded_targets(batch, tokenizer), scored) if keep]
        if texts is not None:
            texts = [p for p, keep in zip(texts, scored) if keep]
        first = None
        if first_ids is not None:
            first = [w for w, keep in zip(task_metrics.first_token_labels(
                logits, first_ids, scoring.label_words), scored) if keep]
        counts = task_metrics.added(counts, task_metrics.statistics(scoring, texts, targets,
                                                                    first))
    return counts


def rates(counts: Mapping[str, float], scoring: Optional[Scoring] = None) -> Dict[str, float]:
    """{each metric's number, "examples" (how many were scored)} from `generation_counts`'s
    sums (empty without examples); `scoring` None: the metrics the counts hold."""
    if scoring is None:
        scoring = Scoring.of(tuple(m for m, key in task_metrics.COUNT_KEYS.items()
                                   if key in counts) + (("bleu",) if "bleu_sys_len" in counts
                                                        else ()))
    return task_metrics.scores(scoring, counts)


@functools.lru_cache(maxsize=2)
def _tokenizer(spec, extra_ids: int):
    """The run's tokenizer, built at the first evaluation and kept."""
    from megatron.data.tokenizers.tokenizer import build_tokenizer

    return build_tokenizer(spec, extra_ids=extra_ids)


def validation_generation(step, config, loader, watchdog=None,
                          tokenizer=None) -> Optional[Dict[str, float]]:
    """The task metrics (`scoring_of` the run's flags) of the validation batches
    `run_evaluation` scores (the first eval_iters global batches), their statistics summed
    over data-parallel ranks in one int64 all-reduce; at most --decoder-seq-length new tokens
    are generated. None where there is
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
    scoring = scoring_of(seq2seq)
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
                                     scoring, group, device)
    finally:
        step.train(True)
    names = sorted(counts)  # (every rank holds the same names: empty_statistics')
    summed = torch.tensor([counts[n] for n in names], dtype=torch.int64, device=device)
    if dist.is_initialized() and parallel_state.model_parallel_is_initialized():
        watch = watchdog.watch("collective: the all-reduce of the generation metrics",
                               collective_s) if watchdog is not None else nullcontext()
        with watch:
            dist.all_reduce(summed, group=parallel_state.get_data_parallel_group())
    return rates(dict(zip(names, summed.tolist())), scoring)


def _decoded_counts(module, config, batches, tokenizer, scoring: Scoring, group,
                    device) -> Dict[str, int]:
    """`generation_counts` of `batches()` on the trained `module`: itself, a ZeRO-3 copy, or
    in a pipeline this rank's stage (training/whole_model.py)."""
    from megatron.training.whole_model import stage_model, whole_model

    model_config = config.model
    how = (model_config.make_vocab_size_divisible_by, model_config.attention_backend)
    length = config.data.decoder_seq_length
    if config.parallel.pipeline_model_parallel_size == 1:
        with whole_model(module, *how) as model:
            return generation_counts(model, batches(), tokenizer, length, group=group,
                                     scoring=scoring)
    stage = stage_model(module, config.pipeline_cut(), *how)  # (dropped on return)
    return generation_counts(stage, pipeline_batches(stage, batches(), device), tokenizer,
                             length, group=group, scoring=scoring)


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
    """TensorBoard's `validation/<metric>` of `validation_generation`'s numbers; label
    accuracy also under its first name, `validation/accuracy`."""
    out = {f"validation/{k}": v for k, v in metrics.items() if k != "examples"}
    if "label_accuracy" in metrics:
        out["validation/accuracy"] = metrics["label_accuracy"]
    return out


def accuracy_name(config) -> str:
    """What the evaluation's teacher-forced accuracy is called in the log: a seq2seq target
    holds no spans, so there it is the share of target tokens predicted right."""
    objective = config.data.dataset.objective
    return "token accuracy" if objective == "seq2seq" else "span accuracy"


def generation_line(iteration: int, metrics: Dict[str, float]) -> str:
    """The log line of `validation_generation`'s numbers, with how many examples they score."""
    return f" validation generation at iteration {iteration} | {task_metrics.line(metrics)} |"
