"""EleutherAI's lm-evaluation-harness (`lm_eval`, the `eval` extra) over our T5 model:
`MegatronT5LM`, an `lm_eval.api.model.LM` that the harness's own evaluator runs
(`lm_eval.simple_evaluate(model=MegatronT5LM(...))`, or `python -m megatron.evaluate`).

It answers the harness's three request types as the harness's `hf` backend does with
`backend=seq2seq` (lm_eval/models/huggingface.py, 0.4.13) on our `--to hf` export of the same
checkpoint, so that the numbers are that backend's (docs/evaluation.md):

- tokens: the context is encoded with EOS appended (a T5 tokenizer's special tokens), the
  continuation without; the harness moves a context's trailing spaces into the continuation
  (TemplateLM._encode_pair); an empty context is EOS alone (prefix_token_id: T5 has no BOS);
  contexts and continuations are cut to their last `max_length` tokens;
- `loglikelihood`: the encoder reads the context, the decoder the continuation shifted right
  behind the decoder start token (teacher forcing, transformers' shift of `labels`); the answer
  is the sum of the continuation's log-softmax (float32) and whether each of its tokens is the
  argmax; requests are sorted longest first and batched `batch_size` at a time (the harness's
  Collator, the hf backend's order);
- `generate_until`: requests grouped by their generation arguments, sorted longest context
  first, batched; greedy search (or sampling / beam search where the arguments ask) with
  megatron/generation. transformers' `generate(max_length=L)` bounds an encoder-decoder's
  *decoder* length, start token included, and the backend passes L = the batch's padded context
  length + max_gen_toks: so at most L - 1 new tokens here too (the output of a generation that
  reaches it depends on its batch, there as here). A row ends at EOS or once its text holds a
  stop string; the text is decoded without special tokens and cut before the first stop string;
- `loglikelihood_rolling`: as that backend defines it for an encoder-decoder: the text's tokens
  (EOS appended) in windows of `max_length`, each window scored as a continuation of the token
  before it (EOS before the first), summed.

Layouts: `model` is a whole T5Model (any tensor-parallel size: the logits are gathered) or this
rank's pipeline stage (megatron/generation/stage.py), built by megatron/loaded_model.py. The
harness's rank and world size are the data-parallel ones (`data_group`): it splits the documents
over them and gathers the results on data-parallel rank 0; every rank of a tensor- or
pipeline-parallel group answers the same requests together. With expert parallelism the ranks
of `expert_group` run the model the same number of times (dummy batches and steps for a rank
with fewer: megatron/generation/lockstep.py), as their all-to-alls need.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lm_eval import utils as harness_utils
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import (Collator, handle_stop_sequences, normalize_gen_kwargs,
                                  postprocess_generated_text)

from megatron.generation.lockstep import Lockstep, decode, dummy_decoder, padded
from megatron.generation.pipeline import decoder_for
from megatron.generation.settings import DecodingSettings, SpecialTokens
from megatron.generation.stage import PipelineStage
from megatron.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

DEFAULT_MAX_LENGTH = 2048
"""The hf backend's length when the model's config names none (a T5 config names none)."""

DEFAULT_MAX_GEN_TOKS = 256
"""The hf backend's default of a generation's `max_gen_toks`."""

GENERATION_ARGUMENTS = ("num_beams", "length_penalty", "early_stopping", "no_repeat_ngram_size",
                        "do_sample", "temperature", "top_k", "top_p")
"""A task's generation arguments (transformers' names) that megatron/generation follows."""

Request = Tuple[Optional[Tuple[str, str]], List[int], List[int]]
"""(the request's strings or None, context ids, continuation ids): TemplateLM's."""


class MegatronT5LM(TemplateLM):
    """The harness's LM over our model (module doc).

    Args:
        model: in evaluation mode: a T5Model or this rank's PipelineStage.
        tokenizer: the run's (megatron/data/tokenizers: `encode(text, add_eos)`,
            `decode(ids, skip_special_tokens)`, eos_id, decoder_start_token_id).
        batch_size: requests run together (the harness's --batch-size).
        max_length: the most context (and continuation) tokens read, as the hf backend's
            `max_length` (2048 for a T5 export).
        max_gen_toks: a generation's new tokens when its task names no `max_gen_toks`.
        data_group: the data-parallel process group (None: one data-parallel rank).
        expert_group: the expert-parallel group (None: no other rank).
        seed: of sampling, where a task samples (each batch reseeded by its position).
    """

    backend = "seq2seq"

    def __init__(self, model, tokenizer, *, batch_size: int = 1,
                 max_length: int = DEFAULT_MAX_LENGTH,
                 max_gen_toks: int = DEFAULT_MAX_GEN_TOKS, device=None, data_group=None,
                 expert_group=None, seed: int = 1234) -> None:
        super().__init__()
        if batch_size < 1 or max_length < 1 or max_gen_toks < 1:
            raise ValueError("batch_size, max_length and max_gen_toks must be at least 1")
        self.model, self.tokenizer = model, tokenizer
        self._batch_size, self._max_length, self._max_gen_toks = batch_size, max_length, \
            max_gen_toks
        self._device = torch.device(device) if device is not None else \
            next(p.device for p in model.parameters() if not p.is_meta)
        self.data_group, self.expert_group, self.seed = data_group, expert_group, seed
        if data_group is not None:
            self._rank = dist.get_rank(data_group)
            self._world_size = dist.get_world_size(data_group)
        self.tokens = SpecialTokens.of(tokenizer)
        core = model.model if isinstance(model, PipelineStage) else model
        self.vocab_size = core.config.vocab_size
        self._eos_text = tokenizer.decode([self.tokens.eos])  # "</s>", as HF decodes EOS

    # what the harness reads --------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokens.eos

    @property
    def prefix_token_id(self) -> int:
        return self.tokens.eos  # the hf backend's BOS-or-EOS: T5 has no BOS

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def device(self):
        return self._device

    def tok_encode(self, string: str, add_special_tokens: Optional[bool] = None,
                   left_truncate_len: Optional[int] = None, **kwargs) -> List[int]:
        """The ids of `string`, EOS appended unless `add_special_tokens` is False (or, left to
        the default, the string starts with EOS's text, as the hf backend does)."""
        add = add_special_tokens
        if add is None:
            add = not string.startswith(self._eos_text)
        ids = self.tokenizer.encode(string, add_eos=bool(add))
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, tokens: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(tokens), skip_special_tokens=skip_special_tokens)

    # the data-parallel ranks, for the harness's evaluator ----------------------------------------
    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.data_group is None:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.data_group)
        return torch.stack(parts) if tensor.dim() == 0 else torch.cat(parts)

    def gather_object(self, obj, dst: int = 0):
        if self.data_group is None:
            return [obj]
        everyone = [None] * self.world_size
        dist.all_gather_object(everyone, obj, group=self.data_group)
        return everyone if self.rank == dst else None

    def barrier(self) -> None:
        if self.data_group is not None:
            dist.barrier(group=self.data_group)

    # loglikelihood ------------------------------------------------------------------------------
    def _loglikelihood_tokens(self, requests: List[Request], disable_tqdm: bool = False,
                              override_bs: Optional[int] = None) -> List[Tuple[float, bool]]:
        def longest_first(request: Request):
            ids = request[1] + request[2]
            return -len(ids), tuple(ids)

        order = Collator(requests, sort_fn=longest_first)
        chunks = list(order.get_batched(n=override_bs or self.batch_size))
        answers: List[Tuple[float, bool]] = []
        for chunk in self._in_lockstep(chunks, self._dummy_forward):
            for (strings, _, _), answer in zip(chunk, self._score(chunk)):
                answers.append(answer)
                if strings is not None:  # (a rolling window has none: its request caches)
                    self.cache_hook.add_partial("loglikelihood", strings, answer)
        return order.get_original(answers)

    def _score(self, chunk: List[Request]) -> List[Tuple[float, bool]]:
        """(summed log-probability, all greedy) of each request's continuation."""
        contexts = [context[-self.max_length:] for _, context, _ in chunk]
        continuations = [continuation[-self.max_length:] for _, _, continuation in chunk]
        ids, mask = padded(contexts, self.tokens.pad, self.device)
        decoder_ids, _ = padded([[self.tokens.start] + c[:-1] for c in continuations],
                                self.tokens.pad, self.device)
        logprobs = F.log_softmax(self._teacher_forced(ids, mask, decoder_ids), dim=-1)
        out = []
        for row, continuation in enumerate(continuations):
            target = torch.tensor(continuation, dtype=torch.long, device=self.device)
            scores = logprobs[row, :len(continuation)]
            greedy = bool((scores.argmax(dim=-1) == target).all())
            out.append((float(scores.gather(1, target[:, None]).sum()), greedy))
        return out

    def _teacher_forced(self, ids: torch.Tensor, mask: torch.Tensor,
                        decoder_ids: torch.Tensor) -> torch.Tensor:
        """Logits [rows, decoder length, vocab_size] (float32) of the decoder fed
        `decoder_ids`: one forward of a whole model; on a pipeline the stages step through
        the positions together (megatron/generation/pipeline.py), in lockstep over the
        expert-parallel group."""
        with torch.no_grad():
            if not isinstance(self.model, PipelineStage):
                logits = self.model(ids, decoder_ids, mask, test_time_routing=True).logits
                logits = gather_from_tensor_model_parallel_region(logits,
                                                                  self.model.tensor_parallel)
                return logits[..., :self.vocab_size].float()
            decoder = Lockstep(decoder_for(self.model, ids, mask), self.expert_group,
                               self.tokens.pad)
            steps = [decoder.step(decoder_ids[:, t]) for t in range(decoder_ids.shape[1])]
            decoder.drain()
            return torch.stack(steps, dim=1)

    def _dummy_forward(self) -> None:
        """A one-token run of the model, for a rank with no batch left in a round of the
        expert-parallel group (a pipeline scores by decoding: its dummy decoding)."""
        if isinstance(self.model, PipelineStage):
            self._dummy_decoding()
            return
        ids = torch.full((1, 1), self.tokens.eos, dtype=torch.long, device=self.device)
        with torch.no_grad():
            self.model(ids, ids, torch.ones_like(ids), test_time_routing=True)

    def _in_lockstep(self, chunks: List, dummy: Callable[[], None]):
        """`chunks`, and with expert parallelism a `dummy()` for each round this rank has
        none left while another rank of the group has (the group agrees on the rounds)."""
        rounds = len(chunks)
        if self.expert_group is not None:
            most = torch.tensor([rounds], dtype=torch.long, device=self.device)
            dist.all_reduce(most, op=dist.ReduceOp.MAX, group=self.expert_group)
            rounds = int(most.item())
        for index in range(rounds):
            if index < len(chunks):
                yield chunks[index]
            else:
                dummy()

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> List[float]:
        windows, owners = [], []
        for index, (string,) in enumerate(request.args for request in requests):
            for context, continuation in map(
                    harness_utils.make_disjoint_window,
                    harness_utils.get_rolling_token_windows(
                        token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                        max_seq_len=self.max_length, context_len=1)):
                windows.append((None, context, continuation))
                owners.append(index)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows)):
            totals[owner] += logprob
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    # generate_until -----------------------------------------------------------------------------
    def generate_until(self, requests, disable_tqdm: bool = False) -> List[str]:
        encoded = {args[0]: self.tok_encode(args[0]) for args in (r.args for r in requests)}

        def longest_first(args):
            return -len(encoded[args[0]]), args[0]

        order = Collator([request.args for request in requests], sort_fn=longest_first,
                         group_by="gen_kwargs", group_fn=lambda args: args[1])
        chunks = list(order.get_batched(n=self.batch_size))
        texts: List[str] = []
        for number, chunk in enumerate(self._in_lockstep(chunks, self._dummy_decoding)):
            contexts, arguments = zip(*chunk)
            rows = [encoded[c][-self.max_length:] for c in contexts]
            for context, text in zip(contexts, self._generate(rows, arguments[0], number)):
                texts.append(text)
                self.cache_hook.add_partial("generate_until", (context, arguments[0]), text)
        return order.get_original(texts)

    def _generate(self, rows: List[List[int]], arguments: dict, number: int) -> List[str]:
        """The texts generated for the contexts' ids `rows` (EOS appended, left-truncated),
        batch `number` of their group."""
        kwargs = dict(normalize_gen_kwargs(arguments, self.max_gen_toks))
        until = handle_stop_sequences(kwargs.pop("until", None), eos=self._eos_text)
        max_gen_toks = kwargs.pop("max_gen_toks")
        ids, mask = padded(rows, self.tokens.pad, self.device)
        # transformers' max_length: the decoder's length, its start token included (module doc)
        max_length = kwargs.pop("max_length", ids.shape[1] + max_gen_toks)
        settings = generation_settings(kwargs, max_length - 1,
                                       self.seed + number * self.batch_size)
        stop = self._stop_strings([u for u in until if u and u != self._eos_text])
        found = decode(self.model, ids, mask, self.tokens, settings, self.expert_group, stop)
        return [postprocess_generated_text(self.tok_decode(h.ids), until, None)
                for h in found]

    def _stop_strings(self, until: List[str]):
        """search.py's `stop` of the stop strings: a row ends once the text of its last tokens
        (as many as the longest stop string's, and 2 more, special tokens written, as the
        harness's stopping criteria look back) holds one."""
        if not until:
            return None
        back = max(len(self.tok_encode(u, add_special_tokens=False)) for u in until) + 2

        def stop(rows, ids):
            return [any(u in self.tok_decode(r[-back:], skip_special_tokens=False)
                        for u in until) for r in ids]

        return stop

    def _dummy_decoding(self) -> None:
        Lockstep(dummy_decoder(self.model, self.tokens.eos, self.device), self.expert_group,
                 self.tokens.pad).drain()


def generation_settings(arguments: dict, max_new_tokens: int, seed: int) -> DecodingSettings:
    """megatron/generation's settings of a task's generation arguments (normalized by the
    harness: `do_sample`, `temperature` 0 when greedy, the rest transformers' names).

    Raises:
        ValueError: an argument megatron/generation does not follow (named).
    """
    kw = dict(arguments)
    do_sample = bool(kw.pop("do_sample", False))
    temperature = float(kw.pop("temperature", 0.0) or 0.0)
    unknown = sorted(k for k in kw if k not in GENERATION_ARGUMENTS)
    if unknown:
        raise ValueError(f"generation arguments {', '.join(unknown)}: not followed by "
                         f"megatron/generation (it follows do_sample, until, max_gen_toks, "
                         f"{', '.join(GENERATION_ARGUMENTS[:-1])})")
    settings = {k: kw[k] for k in GENERATION_ARGUMENTS if k in kw}
    if do_sample:
        settings["temperature"] = temperature if temperature > 0 else 1.0
    settings.update(do_sample=do_sample, max_new_tokens=max(1, max_new_tokens), seed=seed)
    return DecodingSettings.from_flags(settings)  # (early_stopping's words read there)
