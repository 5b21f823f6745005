"""UL2's mode tokens `[NLU]`, `[NLG]`, `[S2S]`: `train_tokenizer.py --ul2-mode-tokens` makes each
one id (SentencePiece user-defined symbols), the run reads them as one id each, warns once at
start when a mode token is several pieces, and the Hugging Face export carries them (loaded with
transformers' own T5 tokenizers, offline, from the written folder)."""

import contextlib
import io
import json
import sys
from pathlib import Path

import pytest
from sentencepiece import sentencepiece_model_pb2

from data_tools import train_tokenizer
from megatron.data.tokenizers.tokenizer import T5Tokenizer
from megatron.data.datasets.ul2 import DEFAULT_MODE_TOKENS, PRESETS, UL2Config, mode_token_ids, \
    mode_token_pieces

TEXTS = dict(DEFAULT_MODE_TOKENS)  # kind -> "[NLU]", ...


@pytest.fixture(scope="module")
def mode_model(corpora_dir, tmp_path_factory):
    """A SentencePiece model trained by train_tokenizer.py --ul2-mode-tokens on English and
    Chinese text (3000 pieces)."""
    out = tmp_path_factory.mktemp("ul2_spm")
    with open(out / "in.jsonl", "w", encoding="utf-8") as f:
        for name, count in (("en_shakespeare.jsonl", 40), ("zh_cmrc2019_stories.jsonl", 40)):
            with open(corpora_dir / name, encoding="utf-8") as src:
                for _, line in zip(range(count), src):
                    f.write(json.dumps({"text": json.loads(line)["text"][:5000]},
                                       ensure_ascii=False) + "\n")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        rc = train_tokenizer.main(["--input", str(out / "in.jsonl"), "--output-prefix",
                                   str(out / "m"), "--vocab-size", "3000", "--num-threads", "1",
                                   "--seed", "1", "--ul2-mode-tokens"])
    assert rc == 0
    assert "UL2 mode tokens: [NLU] = 3, [NLG] = 4, [S2S] = 5" in printed.getvalue()
    return out / "m.model"


def test_the_flag_makes_each_mode_token_one_user_defined_piece(mode_model):
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(mode_model.read_bytes())
    pieces = [(p.piece, p.type) for p in proto.pieces]
    user = proto.SentencePiece.USER_DEFINED
    assert pieces[:6] == [("<pad>", proto.SentencePiece.CONTROL),
                          ("</s>", proto.SentencePiece.CONTROL),
                          ("<unk>", proto.SentencePiece.UNKNOWN),
                          ("[NLU]", user), ("[NLG]", user), ("[S2S]", user)]
    assert len(pieces) == 3000  # the symbols count in --vocab-size
    tok = T5Tokenizer(str(mode_model))
    modes = dict(mode_token_ids(tok, TEXTS))
    assert modes == {"R": (3,), "X": (4,), "S": (5,)}
    # in running text too, SentencePiece keeps each whole (after its dummy-prefix "▁")
    ids = tok.encode("[NLU] a question [S2S]")
    assert 3 in ids and 5 in ids
    assert tok.decode(tok.encode("[NLG] say it")) == "[NLG] say it"


def test_without_the_flag_each_is_several_pieces_with_one_warning(spm_model, mode_model):
    tok = T5Tokenizer(str(spm_model))  # the session's, trained without the flag
    modes = mode_token_ids(tok, TEXTS)
    assert all(len(ids) > 1 for _, ids in modes)
    firsts = {ids[0] for _, ids in modes}
    assert len(firsts) == 1  # they all start with the same piece: the issue
    config = UL2Config(PRESETS["ul2"], modes, "t5", mode_token_pieces(tok, TEXTS, modes))
    warning = config.mode_token_warning()
    for kind, text in TEXTS.items():
        pieces = " ".join(tok.id_to_piece(i) for i in dict(modes)[kind])
        assert f"{text} ({kind}) is {len(dict(modes)[kind])} pieces: {pieces}" in warning
    assert warning.startswith("warning: ") and "\n" not in warning
    assert warning.endswith("data_tools/train_tokenizer.py --ul2-mode-tokens to make each one id")
    assert config.describe_start(512) == config.describe_budget(512) + "\n" + warning
    # with the mode tokens as pieces: no warning, the budget line alone
    ours = T5Tokenizer(str(mode_model))
    modes = mode_token_ids(ours, TEXTS)
    config = UL2Config(PRESETS["ul2"], modes, "t5", mode_token_pieces(ours, TEXTS, modes))
    assert config.mode_token_warning() is None
    assert config.describe_start(512) == config.describe_budget(512)


def test_the_run_says_it_once_at_start(train_data, tmp_path):
    from megatron.arguments import parse_args
    from megatron.pretrain_t5 import _log_start
    from megatron.training.metrics import MetricsWriter

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "training"))
    from train_workers import base_argv

    config = parse_args(base_argv(train_data, "--t5-objective", "ul2", "--encoder-seq-length",
                                  "512"))
    log = tmp_path / "train.log"
    writer = MetricsWriter(log, None, enabled=True)
    _log_start(config, writer, None)
    writer.close()
    lines = log.read_text(encoding="utf-8").splitlines()
    warnings = [line for line in lines if "mode tokens of more than one piece" in line]
    assert len(warnings) == 1 and "--ul2-mode-tokens" in warnings[0]
    assert all(f"{text} ({kind}) is" in warnings[0] for kind, text in TEXTS.items())
    budget = [i for i, line in enumerate(lines) if line.startswith("UL2: ")]
    assert len(budget) == 1 and lines[budget[0] + 1] == warnings[0]


def test_the_hf_export_carries_them(mode_model, tmp_path, monkeypatch):
    pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    from megatron.checkpoint.formats.hf_tokenizer import hf_tokenizer_files

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder = tmp_path / "hf"
    folder.mkdir()
    hf_tokenizer_files(mode_model).write(folder)
    ours = T5Tokenizer(str(mode_model))
    ids = {text: ours.piece_to_id(text) for text in TEXTS.values()}
    assert sorted(ids.values()) == [3, 4, 5]
    readme = (folder / "README.md").read_text(encoding="utf-8")
    assert "`[NLU]` = 3, `[NLG]` = 4, `[S2S]` = 5" in readme
    texts = ["[NLU] what is it?", "[S2S] once upon", "x [NLG] y", "a[NLU]b", "[NLG]"]
    for cls in (transformers.T5TokenizerFast, transformers.T5Tokenizer,
                transformers.AutoTokenizer):
        hf = cls.from_pretrained(str(folder))
        for text, tid in ids.items():
            assert hf.convert_tokens_to_ids(text) == tid, (cls, text)
            assert hf.convert_ids_to_tokens(tid) == text, (cls, text)
        for text in texts:  # in running text: the ids of training
            assert hf(text).input_ids == ours.encode(text, add_eos=True), (cls, text)


def test_a_vocabulary_too_small_for_them_is_refused(capsys):
    with pytest.raises(SystemExit) as e:
        train_tokenizer.get_args(["--input", "x.jsonl", "--output-prefix", "m",
                                  "--vocab-size", "262", "--ul2-mode-tokens"])
    assert e.value.code == 2
    assert "--vocab-size 262 is too small for 3 special pieces and 256 byte pieces and 3 UL2 " \
        "mode tokens" in capsys.readouterr().err
    assert train_tokenizer.get_args(["--input", "x.jsonl", "--output-prefix", "m",
                                     "--vocab-size", "263", "--ul2-mode-tokens"]).ul2_mode_tokens
