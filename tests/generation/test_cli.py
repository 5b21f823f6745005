"""`python -m megatron.generate` end to end: a weights checkpoint of a tiny model and the
session's SentencePiece model -> OUT.jsonl, equal to decoding in-process; bad input gets one
message naming the file, line or flag, a non-zero exit, and no output."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron import generate
from megatron.checkpoint.formats.weights import write_weights_checkpoint
from megatron.data.tokenizers.tokenizer import T5Tokenizer
from megatron.generation import Decoder, DecodingSettings, SpecialTokens, search
from megatron.model import T5Config, T5Model
from megatron.model.state_dict import gather_full_state_dict

REPO = Path(__file__).resolve().parents[2]
TINY = dict(vocab_size=4100, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
            num_heads=4, feed_forward_proj="gated-gelu", tie_word_embeddings=False,
            dropout_rate=0.0)
TEXTS = ["To be, or not to be: that is the question.", "Hello world", "床前明月光"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(weights checkpoint folder, model): a random tiny model, its embedding scaled so that
    its outputs are peaked."""
    torch.manual_seed(0)
    model = T5Model(T5Config(**TINY), make_vocab_size_divisible_by=1).eval()
    with torch.no_grad():
        model.shared.weight.mul_(3.0)
        model.lm_head.weight.mul_(3.0)
    out = tmp_path_factory.mktemp("generate") / "ckpt"
    write_weights_checkpoint(out, gather_full_state_dict(model).items(),
                             {"config": T5Config(**TINY).to_dict(),
                              "make_vocab_size_divisible_by": 128})
    return out, model


def inputs(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return str(path)


def argv(ckpt, spm, inp, out, *extra):
    return ["--load", str(ckpt), "--tokenizer-model", str(spm), "--input", str(inp),
            "--output", str(out), "--max-new-tokens", "8", "--micro-batch-size", "2", *extra]


def reference(model, spm, texts, beams=1):
    tok = T5Tokenizer(str(spm))
    encoded = [tok.encode(t, add_eos=True) for t in texts]
    out = []
    for i in range(0, len(encoded), 2):
        chunk = encoded[i:i + 2]
        n = max(map(len, chunk))
        ids = torch.tensor([e + [tok.pad_id] * (n - len(e)) for e in chunk])
        mask = torch.tensor([[1] * len(e) + [0] * (n - len(e)) for e in chunk])
        out += search(Decoder(model, ids, mask, expand=beams), len(chunk),
                      SpecialTokens(tok.pad_id, tok.eos_id, tok.pad_id),
                      DecodingSettings(max_new_tokens=8, num_beams=beams))
    return out, tok


@pytest.mark.parametrize("beams", [1, 3])
def test_cli_writes_text_and_ids(tiny, spm_model, tmp_path, beams):
    ckpt, model = tiny
    lines = [json.dumps({"text": t, "other": 1}, ensure_ascii=False) for t in TEXTS]
    inp, out = inputs(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    assert generate.main(argv(ckpt, spm_model, inp, out, "--num-beams", str(beams))) == 0
    got = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    want, tok = reference(model, spm_model, TEXTS, beams)
    assert [g["ids"] for g in got] == [h.ids for h in want]
    assert [g["text"] for g in got] == [tok.decode([i for i in h.ids if i > 1])
                                        for h in want]  # (pad 0, EOS 1)
    assert ("score" in got[0]) == (beams > 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "out.jsonl"]
    assert any(len(g["ids"]) > 1 for g in got)


def test_cli_sampling_is_reproducible(tiny, spm_model, tmp_path):
    ckpt, _ = tiny
    inp = inputs(tmp_path / "in.jsonl", [json.dumps({"q": t}) for t in TEXTS])
    runs = []
    for name in ("a", "b"):
        out = tmp_path / f"{name}.jsonl"
        assert generate.main(argv(ckpt, spm_model, inp, out, "--input-key", "q", "--do-sample",
                                  "--top-k", "20", "--seed", "3")) == 0
        runs.append(out.read_text())
    assert runs[0] == runs[1]


def run_cli(args):
    return subprocess.run([sys.executable, "-m", "megatron.generate", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"})


def check_refused(result, out, *words):
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr
    for word in words:
        assert word in result.stderr, result.stderr
    assert not out.exists()
    assert not list(out.parent.glob(f".{out.name}.tmp-*"))


def test_bad_inputs_are_refused_by_name(tiny, spm_model, tmp_path):
    ckpt, _ = tiny
    out = tmp_path / "out.jsonl"
    missing = tmp_path / "nope.jsonl"
    check_refused(run_cli(argv(ckpt, spm_model, missing, out)), out, str(missing), "--input")
    bad = inputs(tmp_path / "bad.jsonl", [json.dumps({"text": "a"}), "{not json"])
    check_refused(run_cli(argv(ckpt, spm_model, bad, out)), out, bad, "line 2", "invalid JSON")
    key = inputs(tmp_path / "key.jsonl", [json.dumps({"text": "a"}), json.dumps({"q": "b"})])
    check_refused(run_cli(argv(ckpt, spm_model, key, out)), out, key, "line 2", "'text'",
                  "--input-key")
    ok = inputs(tmp_path / "ok.jsonl", [json.dumps({"text": "a"})])
    check_refused(run_cli(argv(ckpt, spm_model, ok, out, "--num-beams", "2", "--do-sample")),
                  out, "--do-sample")
    check_refused(run_cli(argv(tmp_path / "no_ckpt", spm_model, ok, out)), out, "--load",
                  "no_ckpt")


def test_a_cpm2_moe_checkpoint_decodes_with_test_time_routing(spm_model, tmp_path):
    """CPM-2-MoE (router cpm2): the command decodes what the in-process decoder does, whose
    greedy test-time routing tests/generation/test_search.py checks by hand; the experts and
    the centroids (a buffer) come from the checkpoint."""
    torch.manual_seed(3)
    config = T5Config(**TINY, num_experts=2, router_type="cpm2", router_centroid_gain=1.0)
    model = T5Model(config, make_vocab_size_divisible_by=1).eval()
    with torch.no_grad():
        model.shared.weight.mul_(3.0)
        model.lm_head.weight.mul_(3.0)
    ckpt = tmp_path / "moe"
    write_weights_checkpoint(ckpt, gather_full_state_dict(model).items(),
                             {"config": config.to_dict(), "make_vocab_size_divisible_by": 128})
    out = tmp_path / "out.jsonl"
    ok = inputs(tmp_path / "in.jsonl", [json.dumps({"text": t}) for t in TEXTS])
    assert generate.main(argv(ckpt, spm_model, ok, out)) == 0
    got = [json.loads(line)["ids"] for line in out.read_text(encoding="utf-8").splitlines()]
    want, _ = reference(model, spm_model, TEXTS)
    assert got == [h.ids for h in want]


def test_every_problem_is_named_at_once(tmp_path, capsys):
    """The flags, --input, --load and the tokenizer in one list (argparse used to stop at the
    missing --output alone), exit 2; --load naming a file says so."""
    weights = tmp_path / "model.pt"
    weights.write_bytes(b"not a folder")
    code = generate.main(["--load", str(weights), "--input", str(tmp_path / "nope.jsonl"),
                          "--top-p", "3", "--tokenizer-model", str(tmp_path / "no.model")])
    err = capsys.readouterr().err
    assert code == 2, err
    for problem in ("--output is required", "--top-p must be in (0, 1], not 3.0",
                    f"--input {tmp_path / 'nope.jsonl'}: no such file",
                    f"--load {weights} is a file: give the checkpoint folder",
                    f"--tokenizer-model {tmp_path / 'no.model'}: no such file"):
        assert sum(problem in line for line in err.splitlines()) == 1, (problem, err)
    assert "usage:" not in err


@pytest.mark.parametrize("how", ["decoding", "writing", "sigterm"])
def test_an_interrupt_is_one_line_exit_130_and_no_output(tiny, spm_model, tmp_path, capsys,
                                                          monkeypatch, how):
    """Ctrl-C (KeyboardInterrupt) while decoding or while the output is written, or SIGTERM:
    `interrupted; no output was written`, exit 130, neither OUT nor its temporary file."""
    import os
    import signal

    ckpt, _ = tiny
    inp = inputs(tmp_path / "in.jsonl", [json.dumps({"text": t}) for t in TEXTS])
    out = tmp_path / "out.jsonl"
    if how == "decoding":
        def interrupted(*args, **kwargs):
            raise KeyboardInterrupt
        monkeypatch.setattr(generate, "generate_all", interrupted)
    elif how == "writing":
        real_dumps, written = json.dumps, []

        def dumps(record, **kwargs):  # the second record: the temporary file is half-written
            written.append(record)
            if len(written) == 2:
                raise KeyboardInterrupt
            return real_dumps(record, **kwargs)
        monkeypatch.setattr(generate.json, "dumps", dumps)
    else:
        real_generate_all = generate.generate_all

        def terminated(*args, **kwargs):
            records = real_generate_all(*args, **kwargs)
            os.kill(os.getpid(), signal.SIGTERM)  # as a launcher or scancel sends it
            return records
        monkeypatch.setattr(generate, "generate_all", terminated)
    before = signal.getsignal(signal.SIGTERM)
    assert generate.main(argv(ckpt, spm_model, inp, out)) == 130
    assert capsys.readouterr().err.splitlines() == ["interrupted; no output was written"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]
    assert signal.getsignal(signal.SIGTERM) is before


def test_only_the_speaking_rank_reports(tiny, spm_model, tmp_path, capsys, monkeypatch):
    """Under a launcher, rank 0 says why; rank 1 of the same node exits as it does, silent."""
    ckpt, _ = tiny
    out = tmp_path / "out.jsonl"
    missing = tmp_path / "nope.jsonl"
    for rank, lines in (("0", 2), ("1", 0)):
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("LOCAL_RANK", rank)
        monkeypatch.setattr(generate, "run", lambda args: generate.prepare(args, 2))
        assert generate.main(argv(ckpt, spm_model, missing, out)) == 2
        assert len(capsys.readouterr().err.splitlines()) == lines
