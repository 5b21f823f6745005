"""--to hf from a run of ours trained with CPM-2's tokenizer (bpe_cn): the folder carries its
vocab.txt and the README that names the tokenizer, and config.json has the vocabulary's special
ids, since transformers has no tokenizer for it (no spiece.model is written)."""

import json
from pathlib import Path

import torch

from data_tools import convert_checkpoint
from megatron.model.config import T5Config
from megatron.model.t5 import T5Model

REPO = Path(__file__).resolve().parents[2]
VOCAB = REPO / "tests/data/cpm2/bpe_cn/vocab.txt"
CONFIG = dict(vocab_size=26240, d_model=8, d_kv=4, d_ff=16, num_layers=1, num_heads=2,
              feed_forward_proj="gated-gelu", tie_word_embeddings=False, dropout_rate=0.0)


def write_run(root: Path, tokenizer: str) -> None:
    config = T5Config(**CONFIG)
    torch.manual_seed(0)
    net = T5Model(config, 128)
    folder = root / "iter_0000002"
    folder.mkdir(parents=True)
    torch.save({"module": net.state_dict(), "buffer_names": [], "optimizer": None,
                "param_shapes": None, "ds_version": "0.19.8"},
               folder / "mp_rank_00_model_states.pt")
    meta = {"iteration": 2, "consumed_samples": 8,
            "layout": {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
                       "data_parallel_size": 1, "zero_stage": 0},
            "flags": {"tokenizer_model": tokenizer, "tokenizer_type": "CPM2Tokenizer"},
            "model": {"config": config.to_dict(), "make_vocab_size_divisible_by": 128,
                      "precision": "fp32"}}
    (folder / "meta.json").write_text(json.dumps(meta))
    (root / "latest_checkpointed_iteration.txt").write_text("2\n")


def test_the_runs_vocab_and_special_ids_go_with_the_weights(tmp_path, capsys):
    write_run(tmp_path / "run", str(VOCAB))
    out = tmp_path / "hf"
    assert convert_checkpoint.main(["--load", str(tmp_path / "run"), "--to", "hf", str(out),
                                    "--no-progress"]) == 0
    assert (out / "vocab.txt").read_bytes() == VOCAB.read_bytes()
    assert not (out / "spiece.model").exists()
    assert "CPM2Tokenizer" in (out / "README.md").read_text()
    config = json.loads((out / "config.json").read_text())
    assert (config["decoder_start_token_id"], config["pad_token_id"], config["eos_token_id"]) \
        == (1, 5, 7)  # <s>, <pad>, <eod> of bpe_cn
    assert "tokenizer: see its README.md" in capsys.readouterr().out


def test_the_folder_given_on_the_command_line(tmp_path):
    write_run(tmp_path / "run", str(tmp_path / "gone" / "vocab.txt"))  # moved since training
    out = tmp_path / "hf"
    assert convert_checkpoint.main(["--load", str(tmp_path / "run"), "--to", "hf", str(out),
                                    "--tokenizer-model", str(VOCAB.parent), "--no-progress"]) == 0
    assert (out / "vocab.txt").is_file() and not (out / "spiece.model").exists()
