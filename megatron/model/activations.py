"""The activations of a training rank: what autograd saves in forward, layer by layer.

An analytic model, counted from what our layers save (model/transformer.py, dropout.py,
tensor_parallel/cross_entropy.py) and checked against a measurement in
tests/unit/test_memory_estimate.py; it lives beside the FLOPs (model/flops.py). Backward's
transient gradients are left out, except the logits' gradient: a copy as large as the logits in
fp32 where the vocabulary is padded (else the loss's buffer, rewritten in place) plus its 16-bit
cast. megatron/cost/memory.py adds these terms up for a rank, with or without a pipeline.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

from megatron.model.config import T5Config


@dataclass(frozen=True)
class ActivationShape:
    """One tensor rank's activation sizes; a: bytes per activation element."""

    b: int
    D: int
    inner: int
    ff: int
    heads: int
    a: int
    fp16: bool
    dropout: bool
    kernel: str
    config: T5Config

    def norm(self, tokens: int) -> int:
        """Layer norm: fp32 rms_norm saves input and normalized, a 16-bit one also an fp32 copy
        of its input; its output (saved by the next linear); rstd."""
        return tokens * (self.D * (3 * self.a + (4 if self.a != 4 else 0)) + 4)

    def sublayer(self, tokens: int) -> int:
        """The norm, the residual dropout's mask and, in fp16, the residual before the clamp."""
        return self.norm(tokens) + tokens * self.D * (self.dropout + (self.a if self.fp16 else 0))

    def attention(self, q: int, k: int, is_self: bool) -> int:
        """q, k, v and the context (eager: reshaped copies; fused: the kernel's inputs/output),
        plus the score-sized tensors: eager keeps the probabilities in the scores' dtype and,
        with dropout, the dropped ones and the bool mask; fused keeps the logsumexp. (In 16 bits
        the self-attention bias is built once per stack: `bias_cast`.)"""
        out = self.a * self.b * self.inner * 2 * (q + k)
        scores = self.b * self.heads * q * k
        if self.kernel == "eager":
            out += scores * (self.a + (1 + self.a if self.dropout else 0))
        else:
            out += 4 * self.b * self.heads * q
        return out

    def bias_cast(self, q: int) -> int:
        """16 bits: block 0 adds the cast [1, heads, q, q] bias to the cast mask once per stack;
        fp16's clamp of the sum saves its input and, fused, sdpa saves the sum that every layer
        shares (bf16 eager: nothing of that size)."""
        if self.a == 4:
            return 0
        return (self.fp16 + (self.kernel != "eager")) * self.a * self.b * self.heads * q * q

    def feed_forward(self, tokens: int) -> int:
        """The activation's output (and input unless relu), the gate, wo's input (the dropped
        product when dropout is on) and the dropout mask."""
        c = self.config
        n = (c.activation != "relu") + 1 + (2 if c.is_gated_act else self.dropout)
        return tokens * self.ff * (n * self.a + self.dropout)

    def head(self, d: int, vocab: int, tp: int) -> Tuple[int, int, int, int]:
        """(the loss's saved tensors, what the head frees before any recompute, the logits, their
        gradient). The loss keeps log-probabilities over this rank's real columns (fp32), lse,
        target and masks, and a count. Backward rewrites the log-probabilities into the
        gradient in place; only a rank holding padding columns copies it into a new fp32 tensor
        of all its columns; 16 bits then cast it. (With TP the padding is the last rank's, whose
        log-probabilities are fewer than rank 0's counted here: a bound, by the padding.)"""
        b, a = self.b, self.a
        cross_entropy = b * d * (4 * min(vocab, self.config.vocab_size) + 14) + 8
        padded = vocab * tp > self.config.vocab_size
        return (cross_entropy, cross_entropy + a * b * d * self.D, a * b * d * vocab,
                b * d * vocab * (4 * padded + (a if a != 4 else 0)))

    def sparse_feed_forward(self, tokens: int) -> int:
        """A Mixture-of-Experts feed-forward (model/moe.py): k expert rows per token through the
        expert FFN (feed_forward's terms, k times), the gathered input rows, the expert output
        rows (for their weighting) and the weighted rows (index_add keeps its source), the
        router's fp32 input (in 16-bit training a copy of the norm's output, in fp32 that output
        itself), logits and probabilities, the choices' int64 indices (expert, order, token),
        and per token the top-k values, gate weights and kept flags and the balancing losses'
        normaliser and logsumexp (the per-sequence means of the balancing loss, batch x experts,
        are left out)."""
        c = self.config
        k = c.router_k
        return k * self.feed_forward(tokens) + 3 * tokens * k * self.D * self.a \
            + tokens * 4 * (self.D * (self.a != 4) + 2 * c.num_experts) + 3 * 8 * tokens * k \
            + tokens * (9 * k + 8)

    def encoder_block(self, e: int, sparse: bool = False) -> int:
        ff = self.sparse_feed_forward if sparse else self.feed_forward
        return 2 * self.sublayer(self.b * e) + self.attention(e, e, True) + ff(self.b * e)

    def decoder_block(self, d: int, e: int, sparse: bool = False) -> int:
        ff = self.sparse_feed_forward if sparse else self.feed_forward
        return 3 * self.sublayer(self.b * d) + self.attention(d, d, True) + \
            self.attention(d, e, False) + ff(self.b * d)



def micro_batch_activations(s: ActivationShape, tp: int, vocab: int, e: int, d: int, checkpoint: bool,
                 chunk: int):
    """(saved after forward, peak) bytes of one micro-batch; vocab: padded columns per rank."""
    c, a, b, D = s.config, s.a, s.b, s.D
    ids = b * (e + d) * (8 if tp == 1 else 9)  # embedding indices (TP: local ids + a bool mask)
    # the final norms, the embedding and final dropout masks
    outer = ids + s.norm(b * e) + s.norm(b * d) + 2 * s.dropout * b * (e + d) * D
    cross_entropy, head, logits, logits_grad = s.head(d, vocab, tp)
    outer += cross_entropy
    sparse_e, sparse_d = set(c.sparse_blocks(False)), set(c.sparse_blocks(True))
    if not checkpoint:
        # + the relative-position buckets: one int64 [q, k] per stack
        blocks = sum(s.encoder_block(e, i in sparse_e) for i in range(c.num_layers)) + \
            sum(s.decoder_block(d, e, i in sparse_d) for i in range(c.num_decoder_layers))
        saved = outer + 8 * (e * e + d * d) + blocks + s.bias_cast(e) + s.bias_cast(d)
        if s.kernel == "fused" and a == 4:  # sdpa saves the shared fp32 bias
            saved += 4 * b * s.heads * (e * e + d * d)
        recompute = 0
    else:
        enc_chunks, dec_chunks = -(-c.num_layers // chunk), -(-c.num_decoder_layers // chunk)
        # each chunk saves its input carry: hidden; position bias and masks once per stack
        saved = outer + a * b * D * (e * enc_chunks + d * dec_chunks) + 4 * (b * e + d * d)
        bias_bytes = 4 if a == 4 else a  # the carried bias is already cast in 16 bits
        saved += bias_bytes * b * s.heads * ((enc_chunks > 1) * e * e + (dec_chunks > 1) * d * d)
        saved += 8 * b * d * (tp > 1)  # the decoder ids, saved apart from the local ids
        # one chunk's blocks (the first with its buckets), less its input, saved already
        recompute = max(  # (a chunk of sparse blocks where the stack has them: the larger)
            min(chunk, c.num_layers) * s.encoder_block(e, bool(sparse_e)) + 8 * e * e
            - a * b * e * D + s.bias_cast(e),
            min(chunk, c.num_decoder_layers) * s.decoder_block(d, e, bool(sparse_d))
            + 8 * d * d - a * b * d * D + s.bias_cast(d))
    # T5Output holds the logits through backward, which starts with the logits' gradient; a
    # recompute comes after the head is freed
    return saved, saved + logits + max(logits_grad, recompute - head)
