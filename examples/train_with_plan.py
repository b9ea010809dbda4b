"""Train with Hugging Face Trainer from a memplan plan file.

    memplan plan meta-llama/Llama-2-7b-hf --gpu "RTX 3060" --seq-len 512 -o plan.yaml
    python examples/train_with_plan.py plan.yaml --text-file train.txt --output-dir out
    python examples/train_with_plan.py plan.yaml --synthetic 64 --random-init --max-steps 3   # memory dry run

Everything memory-relevant comes from the plan (dtype, quantization, LoRA, freezing, micro-batch, accumulation,
checkpointing, optimizer, max length); the script adds data and the learning rate. --synthetic N trains on N random
token sequences padded to the plan's max_length (the worst case the estimate assumes) and needs no tokenizer;
--random-init builds the model from its config instead of downloading weights (memory does not depend on them).
Causal LMs, encoder-decoders (seq2seq) and masked LMs (BERT) are supported.
"""
from __future__ import annotations

import argparse
import math
import random

import torch
import transformers

import memplan
import memplan.model.catalog


def pad_collator(max_length: int, pad_id: int, multiple: int | None, mlm: bool):
    """Dynamic padding without a tokenizer: pad to the longest sample (rounded up to `multiple`, never beyond
    max_length); labels are -100 on padding so the loss ignores it."""
    def round_up(n: int) -> int:
        return min(max_length, math.ceil(n / multiple) * multiple) if multiple else n

    def pad(seqs, value):
        width = round_up(max(len(s) for s in seqs))
        return torch.tensor([s + [value] * (width - len(s)) for s in seqs])

    def collate(features):
        ids = [f["input_ids"] for f in features]
        batch = {"input_ids": pad(ids, pad_id),
                 "attention_mask": pad([[1] * len(s) for s in ids], 0)}
        labels = [f["labels"] for f in features]
        batch["labels"] = pad(labels, -100)
        if mlm:  # masked LM: predict every (unpadded) position of the random text
            batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        return batch

    return collate


def synthetic_dataset(n: int, vocab: int, data: dict, seq2seq: bool, seed: int = 0) -> list[dict]:
    """n samples of random tokens at full length (the memory worst case the plan was made for)."""
    rng = random.Random(seed)
    tgt_len = data.get("max_target_length", data["max_length"])
    out = []
    for _ in range(n):
        ids = [rng.randrange(4, vocab) for _ in range(data["max_length"])]
        labels = [rng.randrange(4, vocab) for _ in range(tgt_len)] if seq2seq else list(ids)
        out.append({"input_ids": ids, "labels": labels})
    return out


def text_dataset(path: str, tokenizer, data: dict, seq2seq: bool) -> list[dict]:
    """One sample per non-empty line; seq2seq lines are 'source<TAB>target'."""
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.rstrip("\n")
            if not line.strip():
                continue
            if seq2seq:
                src, _, tgt = line.partition("\t")
                enc = tokenizer(src, max_length=data["max_length"], truncation=True)
                enc["labels"] = tokenizer(text_target=tgt or src, max_length=data["max_target_length"],
                                          truncation=True)["input_ids"]
            else:
                enc = tokenizer(line, max_length=data["max_length"], truncation=True)
            out.append(dict(enc))
    return out


def build_model(plan, random_init: bool):
    cls = plan.model_class()
    if random_init:
        config = memplan.model.catalog.hf_config(plan.model_id)  # catalog configs need no network
        kwargs = {k: v for k, v in plan.model_kwargs.items() if k != "quantization_config"}
        if plan.quantization_config is not None:
            raise SystemExit("--random-init cannot quantize (bitsandbytes quantizes while loading weights); "
                             "load real weights, or use `memplan validate`, which quantizes random weights")
        model = cls.from_config(config, **kwargs)
    else:
        model = cls.from_pretrained(plan.model_id, **plan.model_kwargs)
    return plan.prepare_model(model)


def train(plan, model, train_data, collator, **trainer_kwargs):
    trainer = transformers.Trainer(model=model, args=plan.training_arguments, train_dataset=train_data,
                                   data_collator=collator, **trainer_kwargs)
    return trainer.train()


def parser(description: str, data_flag: str, data_help: str, learning_rate: float) -> argparse.ArgumentParser:
    """The command line both examples take: the plan, the data (a file or --synthetic N), the run's settings."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("plan")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument(data_flag, help=data_help)
    src.add_argument("--synthetic", type=int, metavar="N", help="N random samples at the plan's lengths")
    ap.add_argument("--random-init", action="store_true", help="build the model from its config (no weights)")
    ap.add_argument("--output-dir", default="trainer_output")
    ap.add_argument("--learning-rate", type=float, default=learning_rate)
    ap.add_argument("--max-steps", type=int, default=-1)
    return ap


def main(argv=None):
    args = parser(__doc__.split("\n\n")[0], "--text-file",
                  "training text, one sample per line (seq2seq: source<TAB>target)", 2e-4).parse_args(argv)

    plan = memplan.load_plan(args.plan, output_dir=args.output_dir, learning_rate=args.learning_rate,
                             max_steps=args.max_steps, report_to=[], save_strategy="no")
    seq2seq = plan.auto_class == "AutoModelForSeq2SeqLM"
    mlm = plan.auto_class == "AutoModelForMaskedLM"
    model = build_model(plan, args.random_init)
    data = plan.data
    if args.synthetic:
        vocab = model.get_input_embeddings().num_embeddings
        pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
        train_data = synthetic_dataset(args.synthetic, vocab, data, seq2seq)
        collator = pad_collator(data["max_length"], pad_id, data.get("pad_to_multiple_of"), mlm)
    else:
        tokenizer = transformers.AutoTokenizer.from_pretrained(plan.model_id)
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        train_data = text_dataset(args.text_file, tokenizer, data, seq2seq)
        if seq2seq:
            collator = transformers.DataCollatorForSeq2Seq(tokenizer, model=model, padding=data["padding"],
                                                           pad_to_multiple_of=data.get("pad_to_multiple_of"),
                                                           label_pad_token_id=data["label_pad_token_id"])
        else:  # causal LM: labels = input_ids with -100 on padding; masked LM: 15% masking
            collator = transformers.DataCollatorForLanguageModeling(tokenizer, mlm=mlm,
                                                                    pad_to_multiple_of=data.get("pad_to_multiple_of"))
    result = train(plan, model, train_data, collator)
    print(result)
    return result


if __name__ == "__main__":
    main()
