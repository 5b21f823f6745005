"""lm_eval 0.4.13's hf backend with `backend=seq2seq`, restated in a few small functions: how it
turns each request into token ids, batches and generates (the file:line references are to
lm_eval/, docs/evaluation.md has the user's account). The tests recompute every
response of a real `lm_eval` run from these rules and the exported model, so the rules are
checked, not assumed.

`tok` is the tokenizer as the backend loads it: `AutoTokenizer.from_pretrained(export)` (fast).
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import torch

TokenIds = List[int]


def prefix_token_id(tok) -> int:
    """The token that stands for an empty context: BOS, else EOS (T5 has no BOS)
    (models/huggingface.py:611)."""
    return tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id


def encode_context(tok, context: str) -> TokenIds:
    """`tok_encode(context)` (models/huggingface.py:1040): the tokenizer's default special
    tokens, i.e. EOS appended for T5; none when the text starts with the decoded prefix token
    ("</s>" for T5)."""
    add = not context.startswith(tok.decode(prefix_token_id(tok)))
    return tok(context, add_special_tokens=add).input_ids


def loglikelihood_pair(tok, context: str, continuation: str) -> Tuple[TokenIds, TokenIds]:
    """(encoder ids, decoder labels) of a loglikelihood request (api/model.py:433-471 and
    _encode_pair, 393-431): an empty context becomes [prefix token] (unless the continuation
    starts with that token: then its first token is the context); otherwise the context's
    trailing whitespace moves to the front of the continuation, the context gets EOS and the
    continuation no special token."""
    if context == "":
        cont = tok(continuation, add_special_tokens=False).input_ids
        prefix = prefix_token_id(tok)
        return ([prefix], cont) if cont[0] != prefix else (cont[:1], cont[1:])
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        continuation = context[-n_spaces:] + continuation
        context = context[:-n_spaces]
    return encode_context(tok, context), tok(continuation, add_special_tokens=False).input_ids


def truncate_pair(context: TokenIds, continuation: TokenIds, max_length: int
                  ) -> Tuple[TokenIds, TokenIds]:
    """Both sides keep their last max_length tokens (models/huggingface.py:1441-1455)."""
    return context[-max_length:], continuation[-max_length:]


def rolling_windows(tok, text: str, max_length: int) -> List[Tuple[TokenIds, TokenIds]]:
    """(encoder ids, decoder labels) of each window of a loglikelihood_rolling request
    (models/huggingface.py:1226-1310, utils.py:335-384): the text's ids with EOS appended, cut
    into windows of max_length labels. The encoder gets what a causal model would see before
    the window, as one window of max_length + 1 tokens: the prefix token for the first window,
    the one token before each later full window, and the max_length - n + 1 tokens before a
    last window of n < max_length labels. The request's answer is the sum of the windows'."""
    ids = encode_context(tok, text)
    first = min(max_length, len(ids))
    windows = [([prefix_token_id(tok)], ids[:first])]
    start = first
    while start < len(ids):
        end = min(len(ids), start + max_length)
        windows.append((ids[max(0, end - max_length - 1):start], ids[start:end]))
        start = end
    return windows


@torch.no_grad()
def score(model, context: TokenIds, labels: TokenIds) -> Tuple[float, bool]:
    """(sum of the labels' log-softmax, whether each label is the argmax) of one unpadded
    request, as `_loglikelihood_tokens` computes it (models/huggingface.py:1490-1560): the
    model called with `labels` (so the decoder input is the start token then the labels shifted
    right), log-softmax in float32 over the model's whole vocabulary."""
    logits = model(input_ids=torch.tensor([context]), labels=torch.tensor([labels])).logits
    logprobs = torch.log_softmax(logits, dim=-1)[0]
    target = torch.tensor(labels)
    picked = logprobs.gather(1, target[:, None]).squeeze(1)
    return float(picked.sum()), bool((logprobs.argmax(-1) == target).all())


def generation_batches(tok, contexts: Sequence[str], batch_size: int) -> List[List[int]]:
    """The indices of `contexts` (one generate_until group: the same generation kwargs) in the
    backend's batches: sorted by descending token count (EOS included), then by the text, in
    chunks of batch_size (models/huggingface.py:1579-1625, models/utils.py Collator)."""
    order = sorted(range(len(contexts)),
                   key=lambda i: (-len(encode_context(tok, contexts[i])), contexts[i]))
    return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]


def generation_limit(tok, batch: Sequence[str], max_gen_toks: int, max_length: int) -> int:
    """The most tokens a generation in `batch` gets: generate's max_length is the batch's
    padded context length (after left truncation to max_length) + max_gen_toks
    (models/huggingface.py:1640-1667), and for an encoder-decoder that bounds the decoder's
    length, start token included, so max_gen_toks - 1 plus the longest context of the batch.
    """
    padded = min(max(len(tok(c).input_ids) for c in batch), max_length)
    return padded + max_gen_toks - 1


@torch.no_grad()
def greedy_ids(model, tok, context: str, limit: int, max_length: int) -> TokenIds:
    """The decoder ids of a greedy generation (start token first) of one context alone: stops
    after EOS or at `limit` new tokens. Unbatched: T5's relative attention makes the backend's
    left padding (masked) change nothing but rounding. The context keeps its last max_length
    tokens (the backend's left truncation)."""
    enc = torch.tensor([tok(context).input_ids[-max_length:]])
    start = model.config.decoder_start_token_id
    ids = [start]
    for _ in range(limit):
        logits = model(input_ids=enc, decoder_input_ids=torch.tensor([ids])).logits
        ids.append(int(logits[0, -1].argmax()))
        if ids[-1] == tok.eos_token_id:
            break
    return ids


def finish_generation(tok, ids: TokenIds, until: Sequence[str]) -> str:
    """The text of a generation: decoded with skip_special_tokens=True (start token, EOS,
    padding and sentinels dropped), cut before the first of the stop strings, to which the
    backend adds the decoded EOS "</s>" (models/huggingface.py:1627, 1690-1706,
    models/utils.py:641 and 943)."""
    text = tok.decode(ids, skip_special_tokens=True)
    for stop in list(until) + [tok.decode(tok.eos_token_id)]:
        if stop:
            text = text.split(stop)[0]
    return text
