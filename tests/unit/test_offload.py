"""TRL's activation offloading (issue 39; memplan.estimator.memory.offload, memplan.runtime.offload): the setup rules
and the closed form by hand. The traced agreement is pinned by the activation_offloading rows of
benchmarks/matrices/trace_vs_estimate.yaml (benchmarks/results/trace_vs_estimate_offload.md)."""
from __future__ import annotations

import pytest
from click.testing import CliRunner

from memplan.cli.main import main
from memplan.errors import SetupError
from memplan.estimator.breakdown import estimate
from memplan.setup import Setup


def test_offloading_is_sft_and_dpo_with_checkpointing():
    with pytest.raises(SetupError, match="--trainer sft"):
        Setup(technique="lora", activation_offloading=True, grad_ckpt=True)
    with pytest.raises(SetupError, match="without checkpointing"):
        Setup(trainer="sft", technique="lora", activation_offloading=True, grad_ckpt=False)
    Setup(trainer="dpo", technique="lora", activation_offloading=True, grad_ckpt=True)


def test_offloading_moves_all_block_inputs_but_two_to_the_host():
    """Qwen2.5-0.5B, SFT LoRA bf16, 4 x 1024 tokens: each of the 24 checkpointed blocks saves its input, 4 x 1024 x
    896 bf16 = 7 MiB; offloaded, two stay on the device (the first block's, the one recomputed) and 22 go to pinned
    host memory."""
    base = dict(trainer="sft", technique="lora", precision="bf16", batch_size=4, seq_len=1024, grad_ckpt=True)
    off = estimate("Qwen/Qwen2.5-0.5B", Setup(**base, activation_offloading=True))
    on = estimate("Qwen/Qwen2.5-0.5B", Setup(**base))
    block_input = 4 * 1024 * 896 * 2
    assert off.host_bytes == 22 * block_input and on.host_bytes == 0
    assert on.components["activations"] - off.components["activations"] == 22 * block_input


def test_offloading_through_the_cli_and_the_plan_file(tmp_path):
    args = ["estimate", "Qwen/Qwen2.5-0.5B", "--trainer", "sft", "--technique", "lora", "--activation-offloading",
            "--json"]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    import json
    assert json.loads(r.output)["host_bytes_per_gpu"] > 0
    r = CliRunner().invoke(main, ["plan", "Qwen/Qwen2.5-0.5B", "--gpu", "RTX 3060", "--trainer", "sft", "--technique",
                                  "lora", "--activation-offloading", "-o", str(tmp_path / "p.yaml")])
    assert r.exit_code == 0, r.output
    import yaml
    assert yaml.safe_load((tmp_path / "p.yaml").read_text())["trl"]["config"]["activation_offloading"] is True


def test_the_offloading_manager_wraps_each_micro_step_as_trl_does():
    """SFTTrainer.training_step enters TRL's manager around one micro-step's forward and backward (trl 1.16
    sft_trainer.py), so its __enter__ drops what the last micro-step left; the CUDA validator's loop does the same
    (memplan.runtime.steps.run_steps micro_ctx), never once around the optimizer steps."""
    import contextlib

    import torch

    from memplan.runtime.steps import run_steps

    w = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([w], lr=0.1)
    events, inside = [], {"now": False}

    @contextlib.contextmanager
    def micro():
        inside["now"] = True
        events.append("enter")
        yield
        inside["now"] = False
        events.append("exit")

    run_steps(opt, 2, 2, lambda m: ((w * 2).sum(), None),
              lambda phase: events.append(f"{phase}{'*' if inside['now'] else ''}"), micro_ctx=micro)
    step = ["enter", "backward*", "exit"] * 2 + ["optimizer", "zero_grad", "between"]
    assert events == step * 2
