"""Vocabulary extension, CPM-2's bilingual stage (issue 38, item 3): `train_tokenizer.py --extend`
(megatron/data/tokenizers/extend.py) and `convert_checkpoint.py --extend-vocab`
(megatron/checkpoint/formats/vocab_extension.py).

A tiny Chinese SentencePiece model is extended with pieces trained on English; a tiny model of
its vocabulary is grown to the extended one: old rows bitwise under their ids, sentinels moved
with their ids, new rows by the prefix rule, Adam's moments kept for old rows and zero for new,
and the extended model's logits for the old tokens are the old model's on held-out Chinese ids.
CPM-2's vocab.txt is extended in CPM-2's layout."""

import json
import re
from pathlib import Path

import pytest
import torch

from data_tools import convert_checkpoint, train_tokenizer
from megatron.checkpoint.formats.weights import (
    WeightsReader,
    full_tensors,
    write_weights_checkpoint,
)
from megatron.data.tokenizers.extend import SPACE, row_sources
from megatron.data.tokenizers.tokenizer import T5Tokenizer
from megatron.model import T5Model
from megatron.model.config import T5Config
from megatron.model.state_dict import load_full_state_dict

CPM2 = "tests/data/cpm2"


def _sample(corpora_dir, name, size, out, skip=0):
    with open(corpora_dir / name, encoding="utf-8") as src, open(out, "w", encoding="utf-8") as f:
        taken = 0
        for i, line in enumerate(src):
            if i < skip:
                continue
            text = json.loads(line)["text"][:20_000]
            f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
            taken += len(text.encode("utf-8"))
            if taken >= size:
                break
    return out


@pytest.fixture(scope="module")
def tokenizers(corpora_dir, tmp_path_factory):
    """(old Chinese model, extended model, English sample): 2000 pieces + 300 trained on
    English."""
    tmp = tmp_path_factory.mktemp("vocab_ext")
    zh = _sample(corpora_dir, "zh_cmrc2019_stories.jsonl", 60_000, tmp / "zh.jsonl")
    en = _sample(corpora_dir, "en_shakespeare.jsonl", 60_000, tmp / "en.jsonl")
    assert train_tokenizer.main(["--input", str(zh), "--output-prefix", str(tmp / "zh"),
                                 "--vocab-size", "2000", "--character-coverage", "0.98",
                                 "--num-threads", "1", "--seed", "1"]) == 0
    assert train_tokenizer.main(["--extend", str(tmp / "zh.model"), "--input", str(en),
                                 "--add-pieces", "300", "--output-prefix", str(tmp / "zh_en"),
                                 "--character-coverage", "1.0", "--num-threads", "1"]) == 0
    return tmp / "zh.model", tmp / "zh_en.model", en


def test_the_extended_model_keeps_old_ids_and_puts_sentinels_on_top(tokenizers):
    from megatron.data.tokenizers.extend import load_model_proto

    old_path, new_path, _ = tokenizers
    old, new = T5Tokenizer(old_path), T5Tokenizer(new_path)
    added = new.sp_vocab_size - old.sp_vocab_size
    assert 250 < added <= 300  # those of the 300 the Chinese model lacked
    old_proto, new_proto = load_model_proto(old_path), load_model_proto(new_path)
    for a, b in zip(old_proto.pieces, new_proto.pieces):  # old pieces: same id, score, type
        assert (a.piece, a.score, a.type) == (b.piece, b.score, b.type)
    old_pieces = {p.piece for p in old_proto.pieces}
    new_pieces = [p.piece for p in new_proto.pieces[old.sp_vocab_size:]]
    assert not old_pieces & set(new_pieces) and f"{SPACE}the" in new_pieces
    assert new.sentinel_ids[0] == new.vocab_size - 1 == old.sentinel_ids[0] + added
    assert new.piece_to_id("<extra_id_7>") == old.piece_to_id("<extra_id_7>") + added
    # English now in words, not bytes; the .vocab file lists the same pieces
    assert len(new.encode("thee the summer")) < len(old.encode("thee the summer"))
    lines = new_path.with_suffix(".vocab").read_text(encoding="utf-8").splitlines()
    assert [line.split("\t")[0] for line in lines] == [p.piece for p in new_proto.pieces]


class _Vocab:
    """A tokenizer's piece interface over a list."""

    def __init__(self, pieces):
        self.pieces = pieces
        self.vocab_size = len(pieces)

    def id_to_piece(self, i):
        return self.pieces[i]


def test_new_rows_by_the_prefix_rule_checked_by_hand():
    old = _Vocab(["<pad>", "</s>", "<unk>", "▁", "▁t", "▁th", "ing", "<0x41>",
                  "<extra_id_0>"])
    new = _Vocab(["<pad>", "</s>", "<unk>", "▁", "▁t", "▁th", "ing", "<0x41>",
                  "▁the", "▁tea", "ings", "xyz", "<0x41>z", "<extra_id_0>"])
    plan = row_sources(old, new, seed=5)
    assert plan.kind[:8] == ["old"] * 8 and plan.source[:8] == list(range(8))
    assert plan.source[13] == 8 and plan.kind[13] == "old"  # the sentinel moves with its id
    assert (plan.source[8], plan.kind[8]) == (5, "prefix")    # ▁the <- ▁th
    assert (plan.source[9], plan.kind[9]) == (4, "prefix")    # ▁tea <- ▁t (▁te is no token)
    assert (plan.source[10], plan.kind[10]) == (6, "prefix")  # ings <- ing
    # no old prefix ("<0x41>" is special, no prefix): a random ordinary old token, seeded
    assert plan.kind[11] == plan.kind[12] == "random"
    assert {plan.source[11], plan.source[12]} <= {3, 4, 5, 6}
    assert row_sources(old, new, seed=5).source == plan.source
    with pytest.raises(ValueError, match="no extension.*'ing' \\(id 6\\)"):
        row_sources(old, _Vocab([p for p in new.pieces if p != "ing"]))


TINY = dict(d_model=32, d_kv=8, d_ff=48, num_heads=4, num_layers=2, num_decoder_layers=2,
            feed_forward_proj="gated-gelu", dropout_rate=0.0)


def _read(out):
    folder = next(out.glob("iter_*"))
    meta = json.loads((folder / "meta.json").read_text())
    moments = {key: dict(full_tensors(WeightsReader(folder, key)))
               for key in ("exp_avg", "exp_avg_sq")} if "optimizer" in meta else None
    return meta, dict(full_tensors(WeightsReader(folder))), moments


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_the_grown_checkpoint_keeps_old_rows_and_old_logits(tokenizers, corpora_dir, tmp_path,
                                                            tied):
    old_path, new_path, _ = tokenizers
    old, new = T5Tokenizer(old_path), T5Tokenizer(new_path)
    torch.manual_seed(0)
    model = T5Model(T5Config(vocab_size=old.vocab_size, tie_word_embeddings=tied, **TINY), 1,
                    attention_backend="eager")
    state = {n: p.detach().clone() for n, p in model.named_parameters()}
    state["shared.weight"] = state["shared.weight"][:old.vocab_size]
    if not tied:
        state["lm_head.weight"] = state["lm_head.weight"][:old.vocab_size]
    moments = {key: [(n, torch.randn_like(t)) for n, t in state.items()]
               for key in ("exp_avg", "exp_avg_sq")}
    src = tmp_path / "old"
    write_weights_checkpoint(src, state.items(), {"config": model.config.to_dict()},
                             iteration=5, optimizer={"step": 5, **moments})
    outs = {}
    for tp in (1, 2):
        outs[tp] = tmp_path / f"new_tp{tp}"
        assert convert_checkpoint.main([
            "--load", str(src), "--to", "megatron", str(outs[tp]), "--extend-vocab",
            str(new_path), "--tokenizer-model", str(old_path), "--no-progress",
            "--target-tensor-parallel-size", str(tp)]) == 0
    meta, tensors, states = _read(outs[1])
    meta2, tensors2, states2 = _read(outs[2])
    assert meta2["layout"]["tensor_model_parallel_size"] == 2
    assert all(torch.equal(tensors[n], tensors2[n]) for n in tensors)  # full tensors either way
    assert all(torch.equal(states[k][n], states2[k][n]) for k in states for n in states[k])
    assert meta["model"]["config"]["vocab_size"] == new.vocab_size
    added = new.sp_vocab_size - old.sp_vocab_size
    vocab_names = ["shared.weight"] + ([] if tied else ["lm_head.weight"])
    for name in vocab_names:
        grown, was = tensors[name], state[name]
        assert grown.shape == (new.vocab_size, 32)
        assert torch.equal(grown[:old.sp_vocab_size], was[:old.sp_vocab_size])  # ids unchanged
        assert torch.equal(grown[new.sp_vocab_size:], was[old.sp_vocab_size:])  # sentinels
        assert torch.equal(grown[new.piece_to_id("<extra_id_0>")],
                           was[old.piece_to_id("<extra_id_0>")])
        # chosen pieces by hand: the Chinese model has no Latin letters (byte fallback), so an
        # English word start's longest old prefix is "▁" (new "▁th" is no old token), and "er"
        # has none: the row of some ordinary old token
        space = was[old.piece_to_id(SPACE)]
        for piece in ("▁the", "▁thou", "▁shall"):
            assert old.piece_to_id(piece) == old.unk_id and old.piece_to_id(piece[:3]) == \
                old.unk_id and torch.equal(grown[new.piece_to_id(piece)], space), piece
        assert old.piece_to_id("e") == old.unk_id and new.piece_to_id("er") >= old.sp_vocab_size
        assert (grown[new.piece_to_id("er")] == was[3:old.sp_vocab_size]).all(1).any()
        for key in ("exp_avg", "exp_avg_sq"):
            m, m_was = states[key][name], dict(moments[key])[name]
            assert torch.equal(m[:old.sp_vocab_size], m_was[:old.sp_vocab_size])
            assert torch.equal(m[new.sp_vocab_size:], m_was[old.sp_vocab_size:])
            assert not m[old.sp_vocab_size:new.sp_vocab_size].any()  # fresh for the new rows
    for name in state:
        if name not in vocab_names:
            assert torch.equal(tensors[name], state[name]), name
    rows = meta["source"]["vocab_extended"]["rows"]
    assert meta["optimizer"]["step"] == 5
    assert rows["old"] == old.vocab_size and rows["prefix"] + rows["random"] == added

    # logits: the old tokens' columns of the grown model are the old model's, on held-out
    # Chinese ids (documents the tokenizer did not see) with a sentinel in them
    text = json.loads((corpora_dir / "zh_cmrc2018_wiki.jsonl").read_text(
        encoding="utf-8").splitlines()[3])["text"][:200]
    ids = old.encode(text)[:40]
    enc = torch.tensor([ids[:20] + [old.sentinel_ids[0]] + ids[20:30]])
    dec = torch.tensor([[old.pad_id, old.sentinel_ids[0]] + ids[30:38]])
    moved = torch.tensor([i if i < old.sp_vocab_size else i + added
                          for i in range(old.vocab_size)])
    grown_model = T5Model(T5Config.from_dict(meta["model"]["config"]), 1,
                          attention_backend="eager")
    load_full_state_dict(grown_model, tensors)
    model.eval(), grown_model.eval()
    with torch.no_grad():
        want = model(enc, dec).logits[..., :old.vocab_size]
        got = grown_model(moved[enc], moved[dec]).logits
    assert got.shape[-1] >= new.vocab_size
    torch.testing.assert_close(got[..., moved], want, rtol=1e-6, atol=1e-6)


def test_refusals(tokenizers, tmp_path, capsys):
    old_path, new_path, _ = tokenizers
    out = tmp_path / "x"
    assert convert_checkpoint.main(["--load", str(tmp_path), "--to", "hf", str(out),
                                    "--extend-vocab", str(new_path)]) == 2
    assert "--extend-vocab has effect only with --to megatron" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train_tokenizer.main(["--input", "x", "--output-prefix", "y", "--add-pieces", "3"])
    assert "--extend OLD and --add-pieces N go together" in capsys.readouterr().err


def test_the_cpm2_vocabulary_is_extended_in_cpm2s_layout(tokenizers, tmp_path, capsys):
    from megatron.data.tokenizers.cpm2_tokenizer import CPM2Tokenizer, load_vocabulary

    _, _, en = tokenizers
    assert train_tokenizer.main(["--extend", f"{CPM2}/bpe_cn", "--input", str(en),
                                 "--add-pieces", "300", "--output-prefix", str(tmp_path / "v"),
                                 "--character-coverage", "1.0", "--num-threads", "1"]) == 0
    old = load_vocabulary(f"{CPM2}/bpe_cn/vocab.txt")
    lines = load_vocabulary(str(tmp_path / "v" / "vocab.txt"))
    added = len(lines) - len(old)
    assert added > 100
    # the 300 pieces asked for are the 300 trained, though the bare word start "▁" has no
    # CPM-2 form
    said = capsys.readouterr().out
    assert f"added {added} of the 300 pieces trained (1 without a CPM-2 form; " in said, said
    assert lines[:26050] == old[:26050]  # Chinese (and specials): ids unchanged
    assert lines[-190:] == old[26050:] == [f"<s_{i}>" for i in range(190)]  # sentinels last
    new_pieces = lines[26050:-190]
    assert not set(new_pieces) & set(old)
    assert all(re.fullmatch(r"(##)?[^#\s]+", p) for p in new_pieces)
    assert "shall" in new_pieces and "##ou" in new_pieces
    tok = CPM2Tokenizer(str(tmp_path / "v" / "vocab.txt"))
    before = CPM2Tokenizer(f"{CPM2}/bpe_cn/vocab.txt")
    assert tok.sentinel_ids[0] == before.sentinel_ids[0] + added
    assert tok.encode("我们去公园") == before.encode("我们去公园")
    # bpe_cn has "th" but no "##ou": English was mostly <unk>; now CPM-2's word pieces
    assert [before.id_to_piece(i) for i in before.encode("thou")] == ["th", "<unk>", "<unk>"]
    assert [tok.id_to_piece(i) for i in tok.encode("thou")] == ["th", "##ou"]


def test_cpm2_finetunes_bilingual_vocabulary_is_bpe_cn_plus_english():
    """What bpe_cn_en is (the layout the extension follows, and where it differs): bpe_cn's lines
    in order, `<go>` inserted at id 7 (so every later Chinese id moves up by one), 25,732 new
    pieces (English, `##` pieces, a few CJK radicals), then 185 of bpe_cn's 190 sentinels."""
    from megatron.data.tokenizers.cpm2_tokenizer import load_vocabulary

    cn = load_vocabulary(f"{CPM2}/bpe_cn/vocab.txt")
    en = load_vocabulary(f"{CPM2}/bpe_cn_en/vocab.txt")
    assert en[:7] == cn[:7] and en[7] == "<go>" and en[8:26051] == cn[7:26050]
    assert en[-185:] == cn[26050:26050 + 185]
    new = en[26051:-185]
    assert len(new) == 25_732 and not set(new) & set(cn)
    assert sum(p.isascii() for p in new) > 0.9 * len(new)


def test_extending_to_the_same_vocabulary_is_refused(tmp_path, capsys):
    """--extend-vocab with the checkpoint's own tokenizer would write an unchanged checkpoint
    marked as extended: refused (exit 2) before anything is written, naming both files."""
    fixture = Path(__file__).resolve().parents[1] / "data" / "cpm2_checkpoint"
    vocab = str(fixture / "vocab.txt")
    out = tmp_path / "grown"
    assert convert_checkpoint.main(["--from", "cpm2", str(fixture / "mp1"), "--model-config",
                                    str(fixture / "config.json"), "--tokenizer-path", vocab,
                                    "--no-progress", "--to", "megatron", str(out),
                                    "--extend-vocab", vocab]) == 2
    err = capsys.readouterr().err
    assert f"--extend-vocab {vocab} adds no piece to the checkpoint's tokenizer {vocab}" in err
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_a_cpm2_checkpoint_is_grown_on_import(tmp_path):
    """`--from cpm2 DIR --tokenizer-path vocab.txt --to megatron OUT --extend-vocab NEW.txt`: the
    rows of the CPM-2 checkpoint (written by CPM-2's code) under our names, old tokens' rows
    unchanged and sentinels moved with their ids, new rows by the prefix rule (checked by hand)
    or a copy of an old row."""
    fixture = Path(__file__).resolve().parents[1] / "data" / "cpm2_checkpoint"
    old = (fixture / "vocab.txt").read_text(encoding="utf-8").splitlines()
    first_sentinel = old.index("<s_0>")
    new_pieces = ["cab", "dd", "zzz"]
    grown = old[:first_sentinel] + new_pieces + old[first_sentinel:]
    (tmp_path / "new").mkdir()
    (tmp_path / "new" / "vocab.txt").write_text("\n".join(grown) + "\n", encoding="utf-8")
    common = ["--from", "cpm2", str(fixture / "mp1"), "--model-config",
              str(fixture / "config.json"), "--tokenizer-path", str(fixture / "vocab.txt"),
              "--no-progress", "--to", "megatron"]
    assert convert_checkpoint.main([*common, str(tmp_path / "plain")]) == 0
    assert convert_checkpoint.main([*common, str(tmp_path / "grown"), "--extend-vocab",
                                    str(tmp_path / "new" / "vocab.txt")]) == 0

    def reader(name):
        return WeightsReader(next((tmp_path / name).glob("iter_*")))

    before, after = reader("plain"), reader("grown")
    config = json.loads((tmp_path / "grown" / "model_config.json").read_text())
    assert config["vocab_size"] == len(grown)
    for name in ("shared.weight", "lm_head.weight"):
        a, b = before.slice(name), after.slice(name)
        assert b.shape[0] == len(grown)
        assert torch.equal(b[:first_sentinel], a[:first_sentinel])  # old ids unchanged
        assert torch.equal(b[first_sentinel + 3:], a[first_sentinel:])  # sentinels moved up
        added = b[first_sentinel:first_sentinel + 3]
        assert torch.equal(added[0], a[old.index("c")])  # 'cab': longest old prefix 'c'
        assert torch.equal(added[1], a[old.index("d")])  # 'dd': 'd'
        assert any(torch.equal(added[2], row) for row in a)  # 'zzz': a random old row
