"""Where the pipeline cuts the encoder-decoder: which layers each stage runs.

The model's flat layer list (model/t5.py) is

    embed_encoder, encoder block 0 .. E-1, finish_encoder, embed_decoder,
    decoder block 0 .. D-1, finish_decoder, head (with the loss)

and a stage is a contiguous run of it holding at least one block. The small layers go with the
blocks beside them: the embedding with the first encoder block, finish_encoder with the last
encoder block, embed_decoder with the first decoder block, finish_decoder and the head with the
last decoder block.

- With Megatron's `--pipeline-model-parallel-split-rank R`, stages 0 .. R-1 hold the encoder and
  stages R .. P-1 the decoder, each side's blocks spread as evenly as their count allows.
- Without it, the cut minimises the largest stage cost, a stage's cost being the forward FLOPs
  of its layers (model/flops.py): a decoder block costs more than an encoder block
  (cross-attention, and its own K/V projections of the encoder output), and the LM head weighs
  on the last stage. A stage may then hold the end of the encoder and the start of the decoder.

No process group is needed: `--dry-run` and the planner print the same cut the run uses.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from megatron.model.config import T5Config
from megatron.model.flops import block_flops_per_sample, forward_flops_per_sample

WIRE_ORDER = ("hidden", "encoder_output", "position_bias", "aux_loss", "enc_ids", "dec_ids",
              "enc_mask", "dec_mask")
"""What travels between a pipeline's layers, in this order (DeepSpeed sends tuples, not dicts
or None: a field absent from a tuple is not there):

    enc_ids, dec_ids        int64 ids (the decoder's ride through the encoder stages)
    enc_mask, dec_mask      int64 0/1 attention masks; each stage makes its additive masks
    hidden                  the current stack's activations
    encoder_output          from the encoder's final norm to the last decoder block
    position_bias           the stack's bias, made on each stage by its bias layer: never sent
    aux_loss                float32 [1]: the weighted balancing losses of the sparse blocks run
                            so far (Mixture-of-Experts, `Cut.aux_blocks`), from the first such
                            block to the head, which hands it to the loss with the logits; its
                            gradient flows back through the stages like the hidden state's

DeepSpeed makes every received floating tensor require a gradient and sends one back for each,
so a floating field leaves the tuple as soon as no later layer reads it: `encoder_output` after
the last decoder block, `position_bias` at the end of every stage."""
BIAS_TABLE = "block.0.layer.0.SelfAttention.relative_attention_bias"
"""A stack's relative position bias table in the single-process model, under its stack's name
(block 0 holds it; the pipeline module's stages each hold a tied copy)."""
INPUT_FIELDS = ("enc_ids", "dec_ids", "enc_mask", "dec_mask")
"""The first stage's input tuple (batch[0] of DeepSpeed's (inputs, labels) pairs)."""


@dataclass(frozen=True)
class PipeLayer:
    """One layer of the pipeline's flat list: the single-process model's part it runs, and the
    fields it takes and passes on (`WIRE_ORDER`; the head passes on its logits alone).

    kind: 'embed' (the shared embedding, of `stack`'s ids), 'bias' (`stack`'s relative
        attention bias table), 'block' (`stack`.block.`index`), 'final_norm' (`stack`'s final
        layer norm) or 'head' (the logits: the shared embedding when tied, else lm_head).
    """

    kind: str
    stack: Optional[str]
    index: Optional[int]
    fields_in: Tuple[str, ...]
    fields_out: Tuple[str, ...]

    def owner(self, tie_word_embeddings: bool) -> str:
        """The single-process model's name of the module whose weights it holds ('shared',
        'encoder.relative_attention_bias', 'encoder.block.3', 'decoder.final_layer_norm',
        'lm_head'); written into pipeline checkpoints (pipeline/module.py's LAYERS_FILE)."""
        if self.kind == "embed" or (self.kind == "head" and tie_word_embeddings):
            return "shared"
        if self.kind == "bias":
            return f"{self.stack}.relative_attention_bias"
        if self.kind == "block":
            return f"{self.stack}.block.{self.index}"
        if self.kind == "final_norm":
            return f"{self.stack}.final_layer_norm"
        return "lm_head"


@dataclass(frozen=True)
class Cut:
    """Stage s runs blocks `blocks[s]` .. `blocks[s + 1] - 1` of the flat block order (encoder
    blocks 0 .. E-1, then decoder blocks as E .. E+D-1)."""

    encoder_layers: int
    decoder_layers: int
    blocks: Tuple[int, ...]
    split_rank: Optional[int]
    stage_costs: Tuple[float, ...]
    """Forward FLOPs per sample of each stage (embeddings, blocks, norms, head)."""
    aux_blocks: Tuple[int, ...] = ()
    """The blocks (flat order) whose experts add balancing losses in training: the sparse
    blocks of a Mixture-of-Experts model that does not route by BASE layers."""

    @property
    def stages(self) -> int:
        return len(self.blocks) - 1

    def stage_blocks(self, stage: int) -> Tuple[range, range]:
        """(encoder block indices, decoder block indices) that `stage` runs."""
        start, stop = self.blocks[stage], self.blocks[stage + 1]
        e = self.encoder_layers
        return range(min(start, e), min(stop, e)), range(max(start, e) - e, max(stop, e) - e)

    @functools.cached_property
    def layers(self) -> Tuple[Tuple[PipeLayer, ...], ...]:
        """Each stage's layers in order, with the fields each takes and passes on: the one
        description of what crosses a stage boundary (module docstring, `WIRE_ORDER`)."""
        stages, fields = [], set(INPUT_FIELDS)
        for stage in range(self.stages):
            out = []
            plan = self.stage_plan(stage)
            for n, (kind, stack, index) in enumerate(plan):
                after = _after(kind, stack, index, fields, self.decoder_layers)
                if kind == "block" and self._flat(stack, index) in self.aux_blocks:
                    after = after | {"aux_loss"}
                if n == len(plan) - 1:  # the bias is made again on the next stage
                    after = after - {"position_bias"}
                out.append(PipeLayer(kind, stack, index, _ordered(fields), _ordered(after)))
                fields = after
            stages.append(tuple(out))
        return tuple(stages)

    def _flat(self, stack: str, index: int) -> int:
        return index + (self.encoder_layers if stack == "decoder" else 0)

    def stage_layers(self, stage: int) -> Tuple[PipeLayer, ...]:
        return self.layers[stage]

    def sent_after(self, stage: int) -> Tuple[str, ...]:
        """The fields stage `stage` sends to the next one."""
        return self.layers[stage][-1].fields_out

    def stage_plan(self, stage: int) -> List[Tuple[str, Optional[str], Optional[int]]]:
        """(kind, stack, index) of each layer of `stage`, in order (`PipeLayer.kind`): the
        small layers go with the blocks beside them (module docstring). The one answer to
        which layers and embeddings a stage holds: training's pipeline module is built from it
        (`layers`), generation's stages too (`stage_modules`)."""
        enc, dec = self.stage_blocks(stage)
        plan: List[Tuple[str, Optional[str], Optional[int]]] = []
        if stage == 0:
            plan.append(("embed", "encoder", None))
        if len(enc):
            plan.append(("bias", "encoder", None))
            plan += [("block", "encoder", i) for i in enc]
            if enc.stop == self.encoder_layers:
                plan.append(("final_norm", "encoder", None))
        if len(dec):
            if dec.start == 0:
                plan.append(("embed", "decoder", None))
            plan.append(("bias", "decoder", None))
            plan += [("block", "decoder", j) for j in dec]
        if stage == self.stages - 1:
            plan += [("final_norm", "decoder", None), ("head", None, None)]
        return plan

    def stage_modules(self, stage: int, tie_word_embeddings: bool) -> List[str]:
        """The single-process T5Model's modules that `stage` holds (`stage_plan`'s owners,
        each once): 'shared', '{stack}.block.{i}', '{stack}.final_layer_norm', 'lm_head',
        and a stack's relative position bias table ('{stack}.' + `BIAS_TABLE`, block 0's)
        where the stage holds blocks of the stack but not block 0 (which holds the table)."""
        names: List[str] = []
        for kind, stack, index in self.stage_plan(stage):
            if kind == "bias":
                held = self.stage_blocks(stage)[stack == "decoder"]
                if held.start == 0:
                    continue
                name = f"{stack}.{BIAS_TABLE}"
            else:
                name = PipeLayer(kind, stack, index, (), ()).owner(tie_word_embeddings)
            if name not in names:
                names.append(name)
        return names

    def describe(self) -> List[str]:
        """One line per stage, for the start of a run and --dry-run."""
        total = sum(self.stage_costs) or 1.0
        how = (f"--pipeline-model-parallel-split-rank {self.split_rank}"
               if self.split_rank is not None else "cut by layer cost")
        lines = [f"pipeline: {self.stages} stages, {how}"]
        for s in range(self.stages):
            enc, dec = self.stage_blocks(s)
            parts = []
            if s == 0:
                parts.append("embedding")
            if len(enc):
                parts.append(f"encoder blocks {enc.start}-{enc.stop - 1}")
            if len(enc) and enc.stop == self.encoder_layers:
                parts.append("encoder final norm")
            if len(dec):
                if dec.start == 0:
                    parts.append("decoder embedding")
                parts.append(f"decoder blocks {dec.start}-{dec.stop - 1}")
            if s == self.stages - 1:
                parts.append("decoder final norm, LM head, loss")
            lines.append(f"  stage {s}: {', '.join(parts)} "
                         f"({100 * self.stage_costs[s] / total:.0f}% of the forward FLOPs)")
        return lines


def _ordered(fields) -> Tuple[str, ...]:
    return tuple(k for k in WIRE_ORDER if k in fields)


def _after(kind: str, stack: Optional[str], index: Optional[int], fields: set,
           decoder_layers: int) -> set:
    """The fields alive after a layer that takes `fields` (WIRE_ORDER's docstring)."""
    if kind == "embed":
        return fields - {"enc_ids" if stack == "encoder" else "dec_ids"} | {"hidden"}
    if kind == "bias":
        return fields | {"position_bias"}
    if kind == "block":
        if stack == "decoder" and index == decoder_layers - 1:  # their last reader
            return fields - {"encoder_output", "enc_mask", "dec_mask"}
        return set(fields)
    if kind == "final_norm":
        after = fields - {"position_bias"}
        return after - {"hidden"} | {"encoder_output"} if stack == "encoder" else after
    return set()  # the head: its logits alone (with the balancing losses where they come)


def cut_problems(config: T5Config, pipeline_size: int, split_rank: Optional[int]) -> List[str]:
    """Why the model cannot be cut into `pipeline_size` stages (flags named)."""
    problems = []
    e, d = config.num_layers, config.num_decoder_layers
    p = pipeline_size
    if split_rank is not None:
        if p == 1:
            problems.append(f"--pipeline-model-parallel-split-rank {split_rank} needs "
                            f"--pipeline-model-parallel-size > 1")
        elif not 1 <= split_rank <= p - 1:
            problems.append(f"--pipeline-model-parallel-split-rank {split_rank} is out of range: "
                            f"with --pipeline-model-parallel-size {p} it must be 1 .. {p - 1} "
                            f"(encoder on stages below it, decoder on the others)")
        else:
            if split_rank > e:
                problems.append(f"--pipeline-model-parallel-split-rank {split_rank}: the encoder "
                                f"has {e} blocks, too few for {split_rank} stages")
            if p - split_rank > d:
                problems.append(f"--pipeline-model-parallel-split-rank {split_rank}: the decoder "
                                f"has {d} blocks, too few for {p - split_rank} stages")
    if p > e + d:
        problems.append(f"--pipeline-model-parallel-size {p} is larger than the model's {e + d} "
                        f"blocks ({e} encoder + {d} decoder): every stage needs a block")
    return problems


def layer_costs(config: T5Config, enc_len: int, dec_len: int, vocab_size: int
                ) -> Tuple[List[float], float, float]:
    """(forward FLOPs per sample of each block in flat order, of the first stage's extras, of
    the last stage's extras)."""
    parts = forward_flops_per_sample(config, enc_len, dec_len, vocab_size)
    encoder, decoder = block_flops_per_sample(config, enc_len, dec_len)
    embed = (enc_len + dec_len) * config.d_model  # lookups: memory-bound, counted lightly
    return [float(f) for f in encoder + decoder], embed, parts["lm_head"]


def _balanced(costs: Sequence[float], parts: int, first_extra: float = 0.0,
              last_extra: float = 0.0) -> List[int]:
    """Boundaries of `parts` contiguous non-empty runs of `costs` minimising the largest run
    (the first run also pays first_extra, the last last_extra); ties go to the earlier cut."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def run(i: int, j: int) -> float:
        cost = prefix[j] - prefix[i]
        if i == 0:
            cost += first_extra
        if j == n:
            cost += last_extra
        return cost

    inf = float("inf")
    # best[k][j]: the smallest largest run cutting costs[:j] into k runs; back[k][j] the cut
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    back = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for j in range(k, n - (parts - k) + 1):
            for i in range(k - 1, j):
                value = max(best[k - 1][i], run(i, j))
                if value < best[k][j] - 1e-9 * max(value, 1.0):
                    best[k][j], back[k][j] = value, i
    bounds = [n]
    for k in range(parts, 0, -1):
        bounds.append(back[k][bounds[-1]])
    return bounds[::-1]


def cut_model(config: T5Config, pipeline_size: int, split_rank: Optional[int] = None,
              enc_len: int = 512, dec_len: int = 128, vocab_size: Optional[int] = None) -> Cut:
    """The stages of `config` on `pipeline_size` stages (see the module docstring).

    Raises:
        ValueError: cut_problems has something to say.
    """
    problems = cut_problems(config, pipeline_size, split_rank)
    if problems:
        raise ValueError("; ".join(problems))
    vocab = vocab_size or config.vocab_size
    costs, first, last = layer_costs(config, enc_len, dec_len, vocab)
    e = config.num_layers
    if split_rank is None:
        blocks = _balanced(costs, pipeline_size, first, last)
    else:
        encoder = _balanced(costs[:e], split_rank)
        decoder = _balanced(costs[e:], pipeline_size - split_rank)
        blocks = encoder[:-1] + [e + b for b in decoder]
    stage_costs = []
    for s in range(pipeline_size):
        cost = sum(costs[blocks[s]:blocks[s + 1]])
        cost += first if s == 0 else 0.0
        cost += last if s == pipeline_size - 1 else 0.0
        stage_costs.append(cost)
    return Cut(e, config.num_decoder_layers, tuple(blocks), split_rank, tuple(stage_costs),
               aux_blocks(config))


def aux_blocks(config: T5Config) -> Tuple[int, ...]:
    """`Cut.aux_blocks` of `config`."""
    if not config.has_balancing_losses:
        return ()
    e = config.num_layers
    return tuple(config.sparse_blocks(False)) + tuple(e + i for i in config.sparse_blocks(True))


def bubble_fraction(pipeline_size: int, micro_batches: int) -> float:
    """The idle share of a 1F1B (or GPipe) step: (P - 1) / (m + P - 1)."""
    return (pipeline_size - 1) / (micro_batches + pipeline_size - 1)
