"""configs/deepspeed/*.json: each preset parses with DeepSpeed's own DeepSpeedConfig to the values
the file states; the presets keep our conventions; the README's table lists exactly these files."""

import json
import re
from pathlib import Path

import pytest
from deepspeed.runtime.config import DeepSpeedConfig

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs" / "deepspeed"
PRESETS = sorted(p.name for p in CONFIG_DIR.glob("*.json"))


class _SingleRankMPU:
    """Data-parallel world of 1, so that DeepSpeedConfig's batch check does not depend on whether
    some earlier test left torch.distributed initialized (without an mpu it asks dist)."""

    def get_data_parallel_world_size(self):
        return 1

    def get_data_parallel_rank(self):
        return 0


def _load(name):
    with open(CONFIG_DIR / name, encoding="utf-8") as f:
        return json.load(f)


def _parse(raw):
    config = dict(raw)
    config["train_batch_size"] = (raw["train_micro_batch_size_per_gpu"]
                                  * raw["gradient_accumulation_steps"] * 1)
    return DeepSpeedConfig(config, mpu=_SingleRankMPU())


# Top-level keys the presets may use: DeepSpeedConfig ignores unknown top-level keys, so a typo
# there (say "gradient_cliping") would otherwise pass silently.
KNOWN_TOP_LEVEL = {"train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                   "gradient_clipping", "steps_per_print", "wall_clock_breakdown",
                   "zero_optimization", "fp16", "bf16", "aio", "activation_checkpointing"}


def test_presets_exist():
    assert len(PRESETS) >= 13, PRESETS


@pytest.mark.parametrize("name", PRESETS)
def test_preset_follows_our_conventions(name):
    raw = _load(name)
    assert set(raw) <= KNOWN_TOP_LEVEL, sorted(set(raw) - KNOWN_TOP_LEVEL)
    assert "optimizer" not in raw and "scheduler" not in raw, "the script builds both itself"
    assert "train_batch_size" not in raw, "train_batch_size depends on the number of GPUs"
    assert isinstance(raw["train_micro_batch_size_per_gpu"], int)
    assert isinstance(raw["gradient_accumulation_steps"], int)
    assert raw["gradient_clipping"] == 1.0
    assert raw["steps_per_print"] >= 1_000_000_000
    assert raw["wall_clock_breakdown"] is False
    assert not (raw.get("fp16", {}).get("enabled") and raw.get("bf16", {}).get("enabled"))
    stage = raw["zero_optimization"]["stage"]
    if raw.get("bf16", {}).get("enabled"):
        assert stage >= 1, "our script refuses bf16 with ZeRO-0"
    assert not raw.get("activation_checkpointing", {}).get("partition_activations", False)


@pytest.mark.parametrize("name", PRESETS)
def test_preset_parses_with_deepspeed(name):
    raw = _load(name)
    ds = _parse(raw)
    zero = raw["zero_optimization"]

    assert ds.world_size == 1
    assert ds.train_micro_batch_size_per_gpu == raw["train_micro_batch_size_per_gpu"]
    assert ds.gradient_accumulation_steps == raw["gradient_accumulation_steps"]
    assert ds.train_batch_size == (raw["train_micro_batch_size_per_gpu"]
                                   * raw["gradient_accumulation_steps"])
    assert ds.gradient_clipping == raw["gradient_clipping"]
    assert ds.steps_per_print == raw["steps_per_print"]
    assert ds.wall_clock_breakdown == raw["wall_clock_breakdown"]
    assert ds.optimizer_name is None and ds.scheduler_name is None

    assert int(ds.zero_optimization_stage) == zero["stage"]
    assert ds.zero_enabled == (zero["stage"] > 0)

    # Precision.
    assert ds.float16_config.enabled == raw.get("fp16", {}).get("enabled", False)
    assert ds.bfloat16_config.enabled == raw.get("bf16", {}).get("enabled", False)
    for key, value in raw.get("fp16", {}).items():
        assert getattr(ds.float16_config, key) == value, key

    # ZeRO fields the file sets (aliases such as stage3_prefetch_bucket_size included).
    zc = ds.zero_config
    fields = {alias or name: name for name, alias in
              ((n, f.alias) for n, f in type(zc).model_fields.items())}
    fields.update({name: name for name in type(zc).model_fields})
    for key, value in zero.items():
        if key in ("stage", "offload_optimizer", "offload_param"):
            continue
        assert getattr(zc, fields[key]) == value, key

    # Offload.
    for section in ("offload_optimizer", "offload_param"):
        parsed = getattr(zc, section)
        if section not in zero:
            device = getattr(parsed, "device", "none")
            assert getattr(device, "value", device) == "none", section
            continue
        for key, value in zero[section].items():
            got = getattr(parsed, key)
            if key == "device":
                got = getattr(got, "value", got)  # an enum, or its value (use_enum_values)
            elif key == "nvme_path":
                got = str(got)
            assert got == value, f"{section}.{key}"
    if zero.get("offload_param", {}).get("device") not in (None, "none"):
        assert zero["stage"] == 3, "parameter offload needs ZeRO-3"

    # Asynchronous I/O for NVMe offload.
    if "aio" in raw:
        for key, value in raw["aio"].items():
            assert ds.aio_config[key] == value, key

    # Activation checkpointing.
    for key, value in raw.get("activation_checkpointing", {}).items():
        assert getattr(ds.activation_checkpointing_config, key) == value, key


def test_nvme_preset_has_placeholder_path_and_aio():
    raw = _load("zero3_offload_nvme.json")
    zero = raw["zero_optimization"]
    assert zero["offload_optimizer"]["device"] == "nvme"
    assert zero["offload_param"]["device"] == "nvme"
    assert zero["offload_optimizer"]["nvme_path"] == zero["offload_param"]["nvme_path"]
    assert set(raw["aio"]) >= {"block_size", "queue_depth", "intra_op_parallelism",
                               "single_submit", "overlap_events"}


def test_cpm2_preset_matches_the_run():
    raw = _load("cpm2_11b_zero3_fp32.json")
    assert raw["train_micro_batch_size_per_gpu"] == 48
    assert raw["gradient_accumulation_steps"] == 1
    assert "fp16" not in raw and "bf16" not in raw
    assert raw["zero_optimization"]["stage"] == 3
    assert raw["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is False
    assert raw["activation_checkpointing"] == {"partition_activations": False,
                                               "contiguous_memory_optimization": False,
                                               "cpu_checkpointing": False}
    # 8 nodes x 8 GPUs: what DeepSpeed derives for train_batch_size there.
    assert raw["train_micro_batch_size_per_gpu"] * raw["gradient_accumulation_steps"] * 64 == 3072


def _readme_table_files():
    text = (CONFIG_DIR / "README.md").read_text(encoding="utf-8")
    files = []
    for line in text.splitlines():
        match = re.match(r"^\|\s*`([^`]+\.json)`\s*\|", line)
        if match:
            files.append(match.group(1))
    return files


def test_readme_table_lists_exactly_the_presets():
    listed = _readme_table_files()
    assert len(listed) == len(set(listed)), "README table lists a file twice"
    assert sorted(listed) == PRESETS


def test_readme_table_matches_stage_and_precision():
    text = (CONFIG_DIR / "README.md").read_text(encoding="utf-8")
    for line in text.splitlines():
        match = re.match(r"^\|\s*`([^`]+\.json)`\s*\|\s*(\d)\s*\|\s*([^|]+?)\s*\|", line)
        if not match:
            continue
        raw = _load(match.group(1))
        assert int(match.group(2)) == raw["zero_optimization"]["stage"], match.group(1)
        precision = ("fp16" if raw.get("fp16", {}).get("enabled") else
                     "bf16" if raw.get("bf16", {}).get("enabled") else "fp32")
        assert match.group(3).split()[0] == precision, match.group(1)
