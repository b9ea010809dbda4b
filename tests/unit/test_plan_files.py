"""Plan files read back (load_plan, doctor --from) are checked against a schema (pydantic): a hand-edited section of
the wrong type is named, never a KeyError or AttributeError deep inside."""
from __future__ import annotations

import pytest
import yaml
from click.testing import CliRunner

from memplan.cli.main import main
from memplan.errors import BadInput
from memplan.planner.export import load_plan


@pytest.fixture(scope="module")
def plan_doc(tmp_path_factory) -> dict:
    path = tmp_path_factory.mktemp("plan") / "plan.yaml"
    r = CliRunner().invoke(main, ["plan", "gpt2", "--gpu", "RTX 3060", "--technique", "lora", "-o", str(path)])
    assert r.exit_code == 0, r.output
    return yaml.safe_load(path.read_text())


def _edited(doc: dict, edit) -> dict:
    import copy
    doc = copy.deepcopy(doc)
    edit(doc)
    return doc


@pytest.mark.parametrize("edit, needle", [
    (lambda d: d.update(memplan="hello"), "memplan: Input should be a valid dictionary"),
    (lambda d: d["memplan"].update(setup=["lora"]), "memplan.setup: Input should be a valid dictionary"),
    (lambda d: d.update(model=7), "model: Input should be a valid dictionary"),
    (lambda d: d["model"].pop("dtype"), "model.dtype: Field required"),  # load_plan raised KeyError
    (lambda d: d["model"].update(dtype="float128"), "model.dtype: Input should be 'float32', 'bfloat16' or 'float16'"),
    (lambda d: d["memplan"].update(gpu_memory_gib="abc"), "memplan.gpu_memory_gib"),
])
def test_hand_edited_plans_name_the_wrong_section(tmp_path, plan_doc, edit, needle):
    """issue 41, defect 6 (plan files)."""
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(_edited(plan_doc, edit)))
    r = CliRunner().invoke(main, ["doctor", "--from", str(path), "--memory", "12GiB"])
    assert r.exit_code == 2 and needle in r.output and "Traceback" not in r.output, r.output
    with pytest.raises(BadInput, match="is not a usable plan file"):
        load_plan(path, use_cpu=True)


def test_the_plan_memplan_writes_passes_its_own_schema(tmp_path, plan_doc):
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(plan_doc))
    r = CliRunner().invoke(main, ["doctor", "--from", str(path), "--memory", "12GiB", "--json"])
    assert r.exit_code in (0, 1), r.output


def test_launcher_files_with_other_content_need_force(tmp_path):
    """issue 41, defect 8: a multi-GPU plan overwrote the .accelerate.yaml / .deepspeed.json beside it without a
    word; the same content is rewritten, other content (a user's edit) only with --force."""
    path = tmp_path / "p.yaml"
    args = ["plan", "meta-llama/Llama-2-7b-hf", "--gpu", "t4", "--num-gpus", "4", "--sharding", "zero3", "-o", str(path)]
    runner = CliRunner()
    assert runner.invoke(main, args).exit_code == 0
    assert runner.invoke(main, args).exit_code == 0  # unchanged launcher files: rewritten quietly
    acc = tmp_path / "p.accelerate.yaml"
    acc.write_text(acc.read_text() + "main_process_port: 29501\n")
    r = runner.invoke(main, args)
    assert r.exit_code == 2 and "exists with other content: pass --force" in r.output, r.output
    assert "main_process_port" in acc.read_text()
    assert runner.invoke(main, args + ["--force"]).exit_code == 0 and "main_process_port" not in acc.read_text()


def test_a_bf16_pin_on_a_card_without_bf16_is_refused():
    """issue 42: plan --gpu t4 --precision bf16 -o wrote `bf16: true` for a T4, which has no bf16, without a word."""
    r = CliRunner().invoke(main, ["plan", "mistralai/Mistral-7B-v0.1", "--gpu", "t4", "--precision", "bf16"])
    assert r.exit_code == 2 and "has no bf16" in r.output and "fp16-mixed" in r.output, r.output


def test_a_bf16_plan_loads_on_a_machine_without_cuda(tmp_path, plan_doc):
    """issue 42: load_plan of the default bf16 plan raised transformers' "Your setup doesn't support bf16/gpu" on a
    laptop or in CI; without CUDA the arguments are built for the CPU, the planned values unchanged."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("checks the CPU-only path")
    doc = _edited(plan_doc, lambda d: d["training_arguments"].update(bf16=True, fp16=False))
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(doc))
    run = load_plan(path, output_dir=str(tmp_path / "out"))
    assert run.training_arguments.bf16 and run.training_arguments.use_cpu
    assert run.training_arguments.per_device_train_batch_size == doc["training_arguments"]["per_device_train_batch_size"]


@pytest.mark.slow  # builds BERT's classification inventory
def test_a_classification_plan_names_its_head_and_peft_task(tmp_path):
    """plan --task seq-cls writes the class the script builds and peft's SEQ_CLS task type, and load_plan builds
    them (issue 42: sequence-classification heads)."""
    from click.testing import CliRunner

    import memplan
    from memplan.cli.main import main
    out = tmp_path / "cls.yaml"
    r = CliRunner().invoke(main, ["plan", "google-bert/bert-base-uncased", "--task", "seq-cls", "--gpu", "t4",
                                  "--technique", "lora", "-o", str(out)])
    assert r.exit_code == 0, r.output
    run = memplan.load_plan(out, output_dir=str(tmp_path / "o"))
    assert run.auto_class == "AutoModelForSequenceClassification" and run.setup.task == "seq-cls"
    assert run.lora_config.task_type == "SEQ_CLS"


def test_an_apollo_plan_writes_what_transformers_builds_apollo_from(tmp_path):
    """issue 39: --optimizer apollo-adamw writes optim="apollo_adamw" with the targets and optim_args memplan
    estimates (setup.LOW_RANK_ARGS); transformers' own optimizer factory reads them back into APOLLOAdamW's group."""
    import torch
    from transformers import Trainer

    out = tmp_path / "apollo.yaml"
    r = CliRunner().invoke(main, ["plan", "HuggingFaceTB/SmolLM2-135M", "--gpu", "RTX 4090", "--technique", "full",
                                  "--optimizer", "apollo-adamw", "--precision", "bf16", "-o", str(out)])
    assert r.exit_code == 0, r.output
    run = load_plan(out, output_dir=str(tmp_path / "o"), use_cpu=True)
    args = run.training_arguments
    assert args.optim == "apollo_adamw" and list(args.optim_target_modules) == ["attn", "mlp"]

    class Tiny(torch.nn.Module):  # names as a decoder block's
        def __init__(self):
            super().__init__()
            self.attn = torch.nn.Linear(8, 8)
            self.norm = torch.nn.LayerNorm(8)
    cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, Tiny())
    assert cls.__name__ == "AdamW" and cls.__module__ == "apollo_torch.apollo"
    group = kwargs["params"][1]
    assert {k: group[k] for k in ("rank", "proj", "scale_type", "update_proj_gap", "scale", "proj_type")} == \
        {"rank": 128, "proj": "random", "scale_type": "channel", "update_proj_gap": 200, "scale": 1.0,
         "proj_type": "std"}
