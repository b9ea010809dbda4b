"""MemoryCallback: Trainer logs the memory fields with the prediction and a row in the validator's format is written;
the warnings fire once; on CUDA the measured peaks are real."""
from __future__ import annotations

import json
import warnings

import pytest

from memplan.measure import rows as measured
from memplan.measure.callbacks import MemoryCallback
from memplan.setup import Setup

TINY = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
        "max_position_embeddings": 128, "tie_word_embeddings": False}


@pytest.fixture
def tiny(tmp_path) -> str:
    p = tmp_path / "config.json"
    p.write_text(json.dumps(TINY))
    return str(p)


def test_trainer_logs_memory_fields_and_writes_a_row(tiny, tmp_path):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

    setup = Setup(batch_size=2, seq_len=16, optimizer="adamw")
    out = tmp_path / "runs.csv"
    cb = MemoryCallback(tiny, setup, out=out)
    cb.cpu_row = True  # no CUDA here: still write the row (no measured bytes)
    model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in TINY.items() if k != "architectures"}))
    data = [{"input_ids": torch.randint(0, 256, (16,)), "labels": torch.randint(0, 256, (16,))} for _ in range(8)]
    args = TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, max_steps=3,
                             logging_steps=1, report_to=[], save_strategy="no", use_cpu=True,
                             optim="adamw_torch", disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=data)
    seen = []

    class Reporter(TrainerCallback):  # stands for TensorBoard / W&B: what reaches a reporter's on_log
        def on_log(self, args, state, control, logs=None, **kwargs):
            seen.append(dict(logs or {}))
    trainer.add_callback(Reporter())
    cb.attach(trainer)
    trainer.train()
    assert any("memplan/predicted_device_bytes" in x for x in seen)
    logged = [h for h in trainer.state.log_history if "memplan/predicted_allocated_bytes" in h]
    assert len(logged) >= 3
    assert logged[0]["memplan/predicted_allocated_bytes"] == cb.estimate.peak_allocated_bytes
    rows = measured.read_rows(out)
    assert len(rows) == 1 and rows[0]["source"] == "memplan.measure.callbacks.MemoryCallback"
    assert measured.setup_from_row(rows[0]) == setup and rows[0]["model"] == tiny


def test_warns_once_over_prediction_and_near_the_limit(tiny):
    cb = MemoryCallback(tiny, Setup(batch_size=1, seq_len=16), tolerance=0.05, card_bytes=10**9)
    pred = cb.estimate.peak_allocated_bytes
    cb._cuda = lambda: False  # feed the peaks by hand
    cb.peak_allocated, cb.peak_device = int(pred * 1.2), int(0.97 * 10**9)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        fields = cb.step()
        cb.step()
    assert abs(fields["memplan/allocated_vs_prediction"] - 0.2) < 1e-6
    msgs = [str(x.message) for x in w]
    assert len(msgs) == 2
    assert any("exceeds the prediction" in m for m in msgs) and any("within 5%" in m for m in msgs)


def test_plain_loop_without_cuda_writes_nothing_by_default(tiny, tmp_path):
    cb = MemoryCallback(tiny, Setup(batch_size=1, seq_len=16), out=tmp_path / "r.csv")
    assert cb.step()["memplan/peak_allocated_bytes"] is None
    assert cb.finish() is None and not (tmp_path / "r.csv").exists()


@pytest.mark.gpu
def test_cuda_run_measures(tiny, tmp_path):
    import torch
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from transformers import LlamaConfig, LlamaForCausalLM
    cb = MemoryCallback(tiny, Setup(batch_size=2, seq_len=16), out=tmp_path / "r.csv")
    model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in TINY.items() if k != "architectures"})).cuda()
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    for _ in range(3):
        ids = torch.randint(0, 256, (2, 16), device="cuda")
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        cb.step()
    row = cb.finish()
    assert int(row["measured_allocated_bytes"]) > 0
    assert 0 < int(row["measured_requested_bytes"]) <= int(row["measured_allocated_bytes"])
