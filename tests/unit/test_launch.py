"""The emitted launcher configs load with the real parsers: accelerate's config loader and launcher (the path
`accelerate launch --config_file` takes), accelerate's DeepSpeed/FSDP plugins, and DeepSpeed's own config schema."""
from __future__ import annotations

import json
import os
from unittest import mock

import pytest
import yaml

from memplan.planner.export import launcher_paths, write_plan
from memplan.gpus import find_gpu
from memplan.model.catalog import load_spec
from memplan.planner.search import plan

LLAMA7 = "meta-llama/Llama-2-7b-hf"


def _write(tmp_path, **pins):
    spec = load_spec(LLAMA7)
    p = plan(spec, find_gpu("A100 40GB"), host_memory="2TiB", **pins)
    assert p.fits
    path = write_plan(p, spec, tmp_path / "plan.yaml")
    acc, ds = launcher_paths(path)
    return p, acc, ds


def _launcher_env(config_file) -> dict:
    """Run accelerate's launcher argument handling on the config file; the environment it would export."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    args = launch_command_parser().parse_args(["--config_file", str(config_file), "train.py"])
    args, defaults, mp_flag = _validate_launch_command(args)
    if args.use_deepspeed:
        args.deepspeed_fields_from_accelerate_config = ",".join(
            list(defaults.deepspeed_config.keys()) + (["mixed_precision"] if mp_flag else []))
        _, env = prepare_deepspeed_cmd_env(args)
    else:
        env = prepare_multi_gpu_env(args)
    return {k: v for k, v in env.items() if k.startswith(("ACCELERATE_", "FSDP_"))}


@pytest.mark.parametrize("pins, distributed_type", [
    (dict(technique="lora", num_gpus=4, sharding="ddp"), "MULTI_GPU"),
    (dict(technique="full", num_gpus=8, num_nodes=2, sharding="zero3"), "DEEPSPEED"),
    (dict(technique="full", num_gpus=4, sharding="zero2", offload="optimizer"), "DEEPSPEED"),
    (dict(technique="full", num_gpus=8, sharding="fsdp-full-shard"), "FSDP"),
])
def test_accelerate_loads_the_config(tmp_path, pins, distributed_type):
    from accelerate.commands.config.config_args import load_config_from_file

    p, acc, ds = _write(tmp_path, **pins)
    c = load_config_from_file(str(acc))
    assert c.distributed_type.value == distributed_type
    assert c.num_processes == p.setup.world_size and c.num_machines == p.setup.num_nodes
    env = _launcher_env(acc)
    if distributed_type == "DEEPSPEED":
        assert env["ACCELERATE_DEEPSPEED_CONFIG_FILE"] == str(ds.resolve())
    if distributed_type == "FSDP":
        assert env["FSDP_VERSION"] == "2" and env["FSDP_RESHARD_AFTER_FORWARD"].lower() == "true"


def test_accelerate_deepspeed_plugin_reads_the_json(tmp_path, monkeypatch):
    from accelerate.utils import DeepSpeedPlugin

    p, acc, ds = _write(tmp_path, technique="full", num_gpus=4, sharding="zero3", offload="params+optimizer")
    for k, v in _launcher_env(acc).items():
        monkeypatch.setenv(k, v)
    plugin = DeepSpeedPlugin()  # raises if the YAML duplicates what the JSON sets (mixed_precision, zero_stage, ...)
    assert plugin.zero_stage == 3 and plugin.hf_ds_config.is_offload()
    assert plugin.deepspeed_config["train_micro_batch_size_per_gpu"] == p.setup.batch_size


def test_accelerate_fsdp_plugin_builds_from_the_launcher_env(tmp_path, monkeypatch):
    from accelerate.utils import FullyShardedDataParallelPlugin

    _, acc, _ = _write(tmp_path, technique="full", num_gpus=8, sharding="fsdp-full-shard",
                       offload="params+optimizer")
    for k, v in _launcher_env(acc).items():
        monkeypatch.setenv(k, v)
    plugin = FullyShardedDataParallelPlugin()
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is True
    assert type(plugin.cpu_offload).__name__ == "CPUOffloadPolicy"  # FSDP2: params, grads and the step on the CPU


@pytest.mark.parametrize("pins", [
    dict(technique="full", num_gpus=8, sharding="zero3"),
    dict(technique="full", num_gpus=8, sharding="zero3", offload="params+optimizer"),
    dict(technique="lora", num_gpus=4, sharding="zero2"),
    dict(technique="full", num_gpus=4, sharding="zero1"),
])
def test_deepspeed_schema_accepts_the_json(tmp_path, pins):
    """DeepSpeed's pydantic schema forbids unknown keys in every section and checks the batch arithmetic
    (train_batch_size = micro x accumulation x world size)."""
    pytest.importorskip("deepspeed")
    import deepspeed.comm as dscomm
    from deepspeed.runtime.config import DeepSpeedConfig

    p, _, ds = _write(tmp_path, **pins)
    doc = json.loads(ds.read_text())
    with mock.patch.object(dscomm, "get_rank", return_value=0), \
            mock.patch.object(dscomm, "get_world_size", return_value=p.setup.world_size):
        c = DeepSpeedConfig(doc)
    assert c.zero_config.stage == int(pins["sharding"][-1])
    assert c.train_micro_batch_size_per_gpu == p.setup.batch_size and c.bfloat16_config.enabled
    if pins.get("offload") == "params+optimizer":
        assert c.zero_config.offload_param.device == "cpu" and c.zero_config.offload_optimizer.device == "cpu"
    assert c.zero_config.reduce_bucket_size == load_spec(LLAMA7).arch.hidden_size ** 2


def test_single_gpu_plans_write_no_launcher_files(tmp_path):
    spec = load_spec("openai-community/gpt2")
    path = write_plan(plan(spec, find_gpu("A100 40GB")), spec, tmp_path / "plan.yaml")
    assert not any(f.exists() for f in launcher_paths(path))
    assert "accelerate" not in yaml.safe_load(path.read_text())
    assert os.listdir(tmp_path) == ["plan.yaml"]


def test_sharded_qlora_plan_stores_4bit_weights_in_the_compute_dtype(tmp_path):
    """FSDP-QLoRA: the 4-bit weights are sharded with the bf16 ones, so the plan sets bnb_4bit_quant_storage, and
    load_plan turns it into a real BitsAndBytesConfig."""
    import torch

    from memplan.planner.export import load_plan
    spec = load_spec("meta-llama/Llama-2-70b-hf")
    p = plan(spec, find_gpu("RTX 3060"), technique="qlora", num_gpus=8, sharding="fsdp-full-shard",
             host_memory="2TiB")
    assert p.fits
    path = write_plan(p, spec, tmp_path / "plan.yaml")
    doc = yaml.safe_load(path.read_text())
    assert doc["model"]["quantization_config"]["bnb_4bit_quant_storage"] == "bfloat16"
    loaded = load_plan(path, output_dir=str(tmp_path / "out"), use_cpu=not torch.cuda.is_available())
    assert loaded.quantization_config.bnb_4bit_quant_storage == torch.bfloat16
