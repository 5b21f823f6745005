"""The tiny dense T5 model that the evaluation tests score, written as our checkpoint and
exported with data_tools/convert_checkpoint.py `--to hf` (the writer users run).

Random weights give degenerate outputs (every greedy generation the same token, or EOS at
once), and so would hide an adapter that mixes up its inputs. The model is therefore trained
briefly (Adam, a few dozen steps, on CPU) on pairs made from part of the local task files
(tests/data/eval_tasks/): its greedy generations then differ between inputs, some stop at a
stop string or EOS and some run to the length limit, and its loglikelihoods are of an ordinary
size (a few nats a token), so that a 1e-4 tolerance means something in fp32.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List, NamedTuple, Tuple

import torch

from megatron.checkpoint.formats.weights import write_weights_checkpoint
from megatron.data.tokenizers.tokenizer import T5Tokenizer
from megatron.model import T5Config, T5Model
from megatron.model.state_dict import gather_full_state_dict

REPO = Path(__file__).resolve().parents[2]
TASKS_DIR = REPO / "tests" / "data" / "eval_tasks"

EVAL_MODEL = dict(vocab_size=4100, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                  num_decoder_layers=2, num_heads=4, feed_forward_proj="gated-gelu",
                  tie_word_embeddings=True, dropout_rate=0.0)
"""The session SentencePiece model's 4000 pieces + 100 sentinels; gated-GELU as T5 v1.1, small.
Tied head (T5 v1.0's, outputs scaled by d_model**-0.5): lm_eval's hf backend calls
`model.tie_weights()` after loading, and transformers 5.x's T5Config always says tied, so the
backend would score an untied export with the embedding as its head
(test_reference.py::test_hf_backend_ties_an_untied_head); tied, both sides hold one model."""


class EvalModel(NamedTuple):
    checkpoint: Path  # our weights checkpoint (--load)
    export: Path  # its `--to hf` folder, tokenizer files included
    spm_model: Path  # the SentencePiece model (--tokenizer-model)


def _rows(name: str) -> List[Dict]:
    with open(TASKS_DIR / name, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


LCQMC_PROMPT = "句子一“{sentence1}”与句子二“{sentence2}”的意思是否相似？"
"""local_lcqmc_zh.yaml's doc_to_text."""

RUN_ON = {  # verse docs of the generation task -> a long target with no stop string in it
    "Continue the verse: Now is the winter of our discontent":
        "Made glorious summer by this sun of York, and all the clouds that lour'd upon our "
        "house in the deep bosom of the ocean buried",
    "Continue the verse: Shall I compare thee to a summer's day":
        "Thou art more lovely and more temperate, rough winds do shake the darling buds of May, "
        "and summer's lease hath all too short a date",
    "Continue the verse: Friends, Romans, countrymen":
        "lend me your ears, I come to bury Caesar, not to praise him, the evil that men do "
        "lives after them",
}
"""Trained on these, the model's greedy generations for the verse docs run on to the length
limit instead of stopping (Shakespeare's text, in the public domain)."""


def training_pairs() -> List[Tuple[str, str]]:
    """(input, target) texts: the generation task's training docs and its even test docs with
    their answers and a full stop (the odd test docs are not trained on), its verse docs with
    RUN_ON's long targets, the multiple-choice docs with their right choice, the Chinese pairs
    with their label word."""
    pairs = []
    gen = _rows("gen_en_train.jsonl") + [d for d in _rows("gen_en_test.jsonl")[::2]
                                         if d["question"] not in RUN_ON]
    pairs += [(f"Q: {d['question']}\nA:", f"{d['answer']}.") for d in gen]
    pairs += [(f"Q: {q}\nA:", target) for q, target in RUN_ON.items()]
    for name in ("mc_en_train.jsonl", "mc_en_test.jsonl"):
        pairs += [(d["question"], d["choices"][d["label"]]) for d in _rows(name)]
    for name in ("lcqmc_zh_train.jsonl", "lcqmc_zh_test.jsonl"):
        pairs += [(LCQMC_PROMPT.format(**d), "否是"[d["label"]]) for d in _rows(name)]
    return pairs


def _batch(tok: T5Tokenizer, pairs: List[Tuple[str, str]]):
    """(encoder ids, encoder mask, decoder ids, labels): EOS after both sides, right padding,
    the decoder starting at the pad id, -100 labels on padding."""
    inputs = [tok.encode(a, add_eos=True) for a, _ in pairs]
    targets = [tok.encode(b, add_eos=True) for _, b in pairs]
    n, m = max(map(len, inputs)), max(map(len, targets))
    ids = torch.tensor([x + [tok.pad_id] * (n - len(x)) for x in inputs])
    mask = torch.tensor([[1] * len(x) + [0] * (n - len(x)) for x in inputs])
    labels = torch.tensor([y + [-100] * (m - len(y)) for y in targets])
    dec = torch.cat([torch.full((len(pairs), 1), tok.decoder_start_token_id),
                     labels[:, :-1].clamp(min=0)], dim=1)
    return ids, mask, dec, labels


def trained_model(config: Dict, tok: T5Tokenizer, steps: int = 60, lr: float = 3e-3,
                  seed: int = 1, make_vocab_size_divisible_by: int = 128) -> T5Model:
    """A random model (seed) trained `steps` full-batch Adam steps on training_pairs()."""
    torch.manual_seed(seed)
    model = T5Model(T5Config(**config), make_vocab_size_divisible_by=make_vocab_size_divisible_by)
    batch = _batch(tok, training_pairs())
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        ids, mask, dec, labels = batch
        loss = model(ids, dec, mask, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


def write_eval_model(root: Path, spm_model: Path, config: Dict = EVAL_MODEL,
                     steps: int = 60, seed: int = 1) -> EvalModel:
    """Write root/ckpt (our weights checkpoint) and root/hf (its `--to hf` export)."""
    from data_tools import convert_checkpoint

    tok = T5Tokenizer(str(spm_model))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # (a tiny model: more threads only spin on a busy machine)
    try:
        model = trained_model(config, tok, steps=steps, seed=seed)
    finally:
        torch.set_num_threads(threads)
    root = Path(root)
    write_weights_checkpoint(root / "ckpt", gather_full_state_dict(model).items(),
                             {"config": T5Config(**config).to_dict(),
                              "make_vocab_size_divisible_by": 128})
    rc = convert_checkpoint.main(["--load", str(root / "ckpt"), "--to", "hf", str(root / "hf"),
                                  "--tokenizer-model", str(spm_model), "--no-progress"])
    if rc != 0:
        raise RuntimeError(f"convert_checkpoint --to hf exited {rc}")
    return EvalModel(root / "ckpt", root / "hf", Path(spm_model))
