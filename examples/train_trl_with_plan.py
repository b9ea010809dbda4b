"""Train with TRL's SFTTrainer, DPOTrainer or GRPOTrainer from a memplan plan file.

    memplan plan Qwen/Qwen2.5-1.5B --gpu "RTX 4090" --trainer dpo --technique lora -o dpo.yaml
    python examples/train_trl_with_plan.py dpo.yaml --jsonl pairs.jsonl --output-dir out
    python examples/train_trl_with_plan.py dpo.yaml --synthetic 16 --random-init --max-steps 2   # dry run

The plan names the trainer (its `trl` section) and sets everything memory-relevant: dtype, quantization, LoRA,
micro-batch, accumulation, checkpointing, optimizer, max_length, and the trainer's own fields (packing, the
reference strategy, num_generations, max_completion_length, beta, vLLM). The script adds the data, the learning rate
and, for GRPO, a reward. --jsonl rows: {"text"} (SFT), {"prompt", "chosen", "rejected"} (DPO), {"prompt"} (GRPO).
--synthetic N makes N rows of random words at the plan's lengths with a word-level tokenizer built here, so that a dry
run needs neither the Hub nor a tokenizer download; --random-init builds the model from its config. GRPO's toy
reward prefers short completions: replace it with yours (a function of the completions returning floats).
Needs `pip install 'memplan[trl]'`.
"""
from __future__ import annotations

import json
import random

import memplan
import memplan.model.catalog
from train_with_plan import build_model, parser


def word_tokenizer(vocab: int):
    """A tokenizer of the words t0 ... t{vocab-1}, one id each (t0 pads, t1 ends a sequence): no download."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t2"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t1", unk_token="t2")


def synthetic_rows(trainer: str, n: int, plan, vocab: int, seed: int = 0) -> list[dict]:
    """n rows of random words for the trainer: full-length texts (SFT), pairs whose prompt is half the row (DPO),
    prompts of the planned prompt length (GRPO)."""
    rng = random.Random(seed)

    def words(k: int) -> str:
        return " ".join(f"t{rng.randrange(3, vocab)}" for _ in range(k))

    s = plan.setup
    if trainer == "sft":
        return [{"text": words(s.seq_len - 1)} for _ in range(n)]
    if trainer == "dpo":
        prompt = s.prompt_len or s.seq_len // 2
        return [{"prompt": words(prompt), "chosen": words(s.seq_len - prompt - 1),
                 "rejected": words(s.seq_len - prompt - 1)} for _ in range(n)]
    return [{"prompt": words(s.prompt_len or s.seq_len)} for _ in range(n)]


def short_completions(completions, **kwargs) -> list[float]:
    """A toy reward: shorter completions score higher."""
    return [-float(len(c)) for c in completions]


def train(plan, model, dataset, tokenizer, ref_model=None):
    import trl

    section = plan.document["trl"]
    kwargs = dict(model=model, args=plan.training_arguments, train_dataset=dataset, processing_class=tokenizer)
    if section["trainer_class"] == "GRPOTrainer":
        kwargs["reward_funcs"] = short_completions
    elif section["trainer_class"] == "DPOTrainer" and ref_model is not None:
        kwargs["ref_model"] = ref_model
    return getattr(trl, section["trainer_class"])(**kwargs).train()


def main(argv=None):
    import datasets
    import transformers

    args = parser(__doc__.split("\n\n")[0], "--jsonl", "training rows, one JSON object per line (columns: see "
                  "above)", 1e-5).parse_args(argv)

    plan = memplan.load_plan(args.plan, output_dir=args.output_dir, learning_rate=args.learning_rate,
                             max_steps=args.max_steps, report_to=[], save_strategy="no", logging_steps=1)
    if "trl" not in plan.document:
        raise SystemExit(f"{args.plan} plans transformers' Trainer: use examples/train_with_plan.py, or re-plan "
                         "with --trainer sft, dpo or grpo")
    trainer = plan.setup.trainer
    model = build_model(plan, args.random_init)
    # TRL's full-fine-tuning DPO loads its reference with from_pretrained: a random-init run builds its own
    ref = build_model(plan, True) if (trainer == "dpo" and args.random_init and plan.lora_config is None
                                      and not plan.setup.precompute_ref_log_probs) else None
    if args.synthetic:
        vocab = model.get_input_embeddings().num_embeddings
        tokenizer = word_tokenizer(vocab)
        rows = synthetic_rows(trainer, args.synthetic, plan, vocab)
    else:
        tokenizer = transformers.AutoTokenizer.from_pretrained(plan.model_id)
        with open(args.jsonl, encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
    result = train(plan, model, datasets.Dataset.from_list(rows), tokenizer, ref)
    print(result)
    return result


if __name__ == "__main__":
    main()
