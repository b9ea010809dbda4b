"""Every decoder, encoder and encoder-decoder family transformers ships, shaped small and traced: where is the estimate
still wrong for a family nobody has checked?

    python benchmarks/family_survey.py [--families qwen3_moe,gpt_oss,...] [--variant]

For each family, its transformers config class with the sizes below (hidden 512, 4 blocks, 4 experts of which 2
per token, vocabulary 32,000; every other field the class default) is built into a config.json in a temporary
folder, and four setups run through `memplan trace` and the estimate: LoRA all-linear bf16 (sdpa, s256), full bf16
(s512), LoRA all-linear bf16 eager (s512), full bf16-mixed (s256), batch 2. Writes benchmarks/results/
family_survey.md: one row per family with the four errors, and what failed. The families checked in CI-sized detail
live in benchmarks/shapes/ (trace_vs_estimate.py); this script is the wide net that found most of them.

Vision-language families (VLM_FAMILIES) are composite configs: their text_config is shaped as above, their vision
tower at VISION_SIZES (width 256, 2 blocks), and the four setups are text-only steps.
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

FAMILIES = ("llama mistral qwen2 qwen3 gemma gemma2 gemma3_text phi phi3 olmo olmo2 cohere cohere2 glm glm4 exaone4 "
            "helium smollm3 ernie4_5 seed_oss hunyuan_v1_dense arcee apertus nemotron persimmon stablelm starcoder2 "
            "granite bitnet ministral lfm2 mixtral qwen2_moe qwen3_moe olmoe granitemoe minimax dots1 deepseek_v2 "
            "deepseek_v3 glm4_moe_lite longcat_flash minicpm3 youtu sarvam_mla deepseek_v32 "
            "glm4_moe ernie4_5_moe hunyuan_v1_moe exaone_moe gpt_oss qwen3_next llama4_text bert roberta xlm-roberta "
            "deberta-v2 modernbert electra distilbert albert mpnet t5 mt5 umt5 bart mbart marian pegasus").split()
#: vision-language families (composite configs, estimated for text-only steps: the vision tower held, never run)
VLM_FAMILIES = ("gemma3 gemma4 gemma3n mistral3 mistral4 llava llava_next paligemma qwen2_vl qwen2_5_vl qwen3_vl "
                "qwen3_vl_moe qwen3_5 qwen3_5_moe idefics3 smolvlm mllama aya_vision internvl llama4 lfm2_vl glm4v "
                "cohere2_vision").split()
#: a vision tower shaped small: the names vision configs use for width, depth and heads; out_hidden_size is Qwen-VL's
#: merger output, which must equal the language model's width
VISION_SIZES = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, depth=2,
                    embed_dim=256, num_heads=4, out_hidden_size=512, num_key_value_heads=4, head_dim=64,
                    vision_output_dim=256, num_global_layers=1)
SIZES = dict(hidden_size=512, intermediate_size=1536, num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=4,
             vocab_size=32000, max_position_embeddings=4096, head_dim=64, d_model=512, encoder_layers=4,
             decoder_layers=4, encoder_attention_heads=8, decoder_attention_heads=8, encoder_ffn_dim=1536,
             decoder_ffn_dim=1536, d_ff=1536, d_kv=64, num_heads=8, num_layers=4, num_decoder_layers=4, dim=512,
             hidden_dim=1536, n_layers=4, n_heads=8, num_experts=4, num_local_experts=4, n_routed_experts=4,
             moe_intermediate_size=256, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=1,
             topk_group=1, shared_expert_intermediate_size=512, moe_num_experts=4, moe_k=2, moe_num_shared_experts=1,
             kv_lora_rank=64, q_lora_rank=96, qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=64)
#: special token ids inside the small vocabulary (a config class default such as 151329 is out of range)
TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=0, cls_token_id=3, sep_token_id=4,
              mask_token_id=5)
SETUPS = (("LoRA bf16", dict(technique="lora", precision="bf16", lora_targets="all-linear", batch_size=2, seq_len=256)),
          ("full bf16", dict(technique="full", precision="bf16", optimizer="adamw-fused", batch_size=2, seq_len=512)),
          ("LoRA bf16 eager", dict(technique="lora", precision="bf16", lora_targets="all-linear", batch_size=2,
                                   seq_len=512, attn_impl="eager")),
          ("full bf16-mixed", dict(technique="full", precision="bf16-mixed", optimizer="adamw-fused", batch_size=2,
                                   seq_len=256)))
#: `--variant`: four other setups (checkpointing, QLoRA, freezing, padding) -> family_survey_variant.md
VARIANT_SETUPS = (
    ("QLoRA ckpt", dict(technique="qlora", precision="bf16", lora_targets="all-linear", batch_size=2, seq_len=512,
                        grad_ckpt=True)),
    ("LoRA bf16-mixed eager ckpt", dict(technique="lora", precision="bf16-mixed", lora_targets="all-linear",
                                        batch_size=2, seq_len=512, attn_impl="eager", grad_ckpt=True)),
    ("freeze bf16-mixed", dict(technique="freeze", trainable="2", precision="bf16-mixed", batch_size=2, seq_len=256)),
    ("full bf16 ckpt padded", dict(technique="full", precision="bf16", optimizer="adamw-fused", batch_size=2,
                                   seq_len=1024, grad_ckpt=True, padded=True)))


def shape_config(family: str) -> dict:
    """The family's config class at SIZES (only the fields it has), its layer pattern cut to the block count."""
    from transformers import AutoConfig

    default = AutoConfig.for_model(family)
    config = AutoConfig.for_model(family, **{k: v for k, v in SIZES.items() if hasattr(default, k)})
    for key in ("layer_types", "mlp_layer_types"):
        pattern = getattr(config, key, None)
        if isinstance(pattern, list) and pattern:
            setattr(config, key, (pattern * SIZES["num_hidden_layers"])[:SIZES["num_hidden_layers"]])
    if getattr(config, "kv_lora_rank", None) is not None:  # MLA expands K/V to every head (real configs: kv = heads)
        config.num_key_value_heads = config.num_attention_heads
        if getattr(default, "head_dim", None) == default.qk_rope_head_dim:  # DeepseekV3Config: the rotary part
            config.head_dim = config.qk_rope_head_dim
        elif getattr(default, "head_dim", None) == default.qk_nope_head_dim + default.qk_rope_head_dim:  # Mistral-4
            config.head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
    d = config.to_diff_dict()
    d["model_type"] = family
    d.update({k: v for k, v in TOKENS.items() if d.get(k) is not None})
    if config.is_encoder_decoder:  # the labels' shift needs it (T5's class default is not in the diff)
        d["decoder_start_token_id"] = TOKENS["decoder_start_token_id"]
    return d


def shape_composite(family: str) -> dict:
    """A vision-language config: its text_config at SIZES (as shape_config), its vision_config at VISION_SIZES."""
    from transformers import AutoConfig

    top = AutoConfig.for_model(family)
    if getattr(top, "text_config", None) is None:  # Mistral-4: a flat config its image-text class takes
        return shape_config(family)
    d = top.to_diff_dict()
    d["model_type"] = family
    text = top.get_text_config()
    d["text_config"] = _shaped(text, SIZES, pattern=True) | {"model_type": text.model_type}
    d["text_config"].update({k: v for k, v in TOKENS.items() if d["text_config"].get(k) is not None})
    vision = getattr(top, "vision_config", None)
    if vision is not None:
        d["vision_config"] = _shaped(vision, VISION_SIZES) | {"model_type": vision.model_type}
    for k in ("image_token_id", "image_token_index", "video_token_id", "boi_token_id", "eoi_token_id",
              "vision_start_token_id", "vision_end_token_id"):
        if isinstance(d.get(k), int) or isinstance(getattr(top, k, None), int):
            d[k] = 31990 + len([x for x in d if x.endswith("token_id") or x.endswith("token_index")]) % 9
    return d


def _shaped(config, sizes: dict, pattern: bool = False) -> dict:
    """A sub-config's fields at `sizes` where it has them (layer patterns cut to the block count)."""
    d = config.to_dict()
    depth = d.get("num_hidden_layers")
    d.update({k: v for k, v in sizes.items() if k in d})
    if pattern:
        n = sizes["num_hidden_layers"]
        for key, value in list(d.items()):  # per-layer lists (Gemma-3n's widths and sparsity): the first blocks
            if isinstance(value, list) and len(value) == depth and key not in ("layer_types", "mlp_layer_types"):
                d[key] = [sizes[key]] * n if key in sizes else value[:n]
        if isinstance(d.get("per_layer_config"), dict):  # Gemma-4: the last block global, at twice the head_dim
            d["per_layer_config"] = {f"{n - 1:02d}": {"head_dim": 2 * sizes["head_dim"]}}
        for key in ("layer_types", "mlp_layer_types"):
            if isinstance(d.get(key), list) and d[key]:
                d[key] = (d[key] * sizes["num_hidden_layers"])[:sizes["num_hidden_layers"]]
        if isinstance(d.get("cross_attention_layers"), list):  # Mllama: one of the shaped blocks
            d["cross_attention_layers"] = [1]
        rope = d.get("rope_parameters") or d.get("rope_scaling")
        if isinstance(rope, dict) and "_vl" in d.get("model_type", ""):  # Qwen-VL's M-RoPE spans head_dim / 2
            section = rope.get("mrope_section") or [16, 24, 24]  # Qwen2-VL's code default, for head_dim 128
            rope["mrope_section"] = [x * (sizes["head_dim"] // 2) // sum(section) for x in section]
    return d


def survey(family: str, folder: Path, setups=None) -> tuple[list[str], str]:
    """(four error cells, failures) of one family, over `setups` (default SETUPS)."""
    setups = setups or SETUPS
    from memplan.errors import MemplanError
    from trace_vs_estimate import run_row

    path = folder / family / "config.json"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(shape_composite(family) if family in VLM_FAMILIES else shape_config(family)))
    except Exception as e:  # the config class rejects the sizes
        return ["-"] * len(setups), f"config: {type(e).__name__}: {' '.join(str(e).split())[:120]}"
    cells, failures = [], []
    for name, fields in setups:
        try:
            _, _, c, _ = run_row(str(path), fields, None)
            cells.append(f"{100 * c['rel_error']:+.2f}%")
        except MemplanError as e:  # memplan refuses the setup, or the traced step fails on fake tensors
            cells.append("not run")
            failures.append(f"{name}: {' '.join(str(e).split())[:160]}")
        except Exception as e:  # a crash in memplan itself: reported, never hidden
            cells.append("crash")
            failures.append(f"{name}: {type(e).__name__}: {' '.join(str(e).split())[:160]}")
    return cells, "; ".join(failures)


#: `--catalog`: the catalog's own configs at their real widths, cut to 2 and 3 blocks and extrapolated to the full
#: depth (memplan.tracer.training.trace layers=2), batch 1 x 512 tokens
CATALOG_SETUPS = (
    ("LoRA bf16", dict(technique="lora", precision="bf16", lora_targets="all-linear", batch_size=1, seq_len=512)),
    ("full bf16", dict(technique="full", precision="bf16", optimizer="adamw-fused", batch_size=1, seq_len=512)),
)


def survey_catalog(pattern: str | None) -> int:
    """Estimate vs trace on every catalog config (not variants) whose id contains one of the comma-separated
    `pattern`s: real shapes, cut to a few blocks; writes benchmarks/results/family_survey_catalog.md."""
    import torch
    import transformers

    from memplan.errors import MemplanError
    from memplan.fileio import write_text_atomic
    from memplan.model.catalog import catalog_index
    from trace_vs_estimate import run_row

    index = catalog_index()
    wanted = [p.strip().lower() for p in (pattern or "").split(",") if p.strip()]
    ids = [k for k, row in index.items() if not row.get("variant_of")
           and (not wanted or any(w == k.lower() or w in k.lower() for w in wanted))]
    rows, errors = [], []
    for model_id in ids:
        cells, failures = [], []
        for name, fields in CATALOG_SETUPS:
            try:
                _, _, c, sec = run_row(model_id, fields, 2)
                cells.append(f"{100 * c['rel_error']:+.2f}%")
                errors.append(abs(100 * c["rel_error"]))
            except MemplanError as e:
                cells.append("not run")
                failures.append(f"{name}: {' '.join(str(e).split())[:160]}")
            except Exception as e:  # a crash in memplan itself: reported, never hidden
                cells.append("crash")
                failures.append(f"{name}: {type(e).__name__}: {' '.join(str(e).split())[:160]}")
        rows.append((model_id, index[model_id]["model_type"], cells, "; ".join(failures)))
        print(model_id, *cells, rows[-1][3][:120], flush=True)
    out = ROOT / "benchmarks" / "results" / "family_survey_catalog.md"
    if pattern and out.exists():  # a partial run replaces its models' rows and keeps the others
        ran = {r[0] for r in rows}
        for line in out.read_text().splitlines():
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if line.startswith("| ") and len(cells) == 3 + len(CATALOG_SETUPS) and cells[0] in index \
                    and cells[0] not in ran:
                rows.append((cells[0], cells[1], cells[2:2 + len(CATALOG_SETUPS)], cells[-1]))
                errors += [abs(float(c.rstrip("%"))) for c in cells[2:2 + len(CATALOG_SETUPS)] if c.endswith("%")]
        rows.sort(key=lambda r: r[0].lower())
    within = sum(e <= 3 for e in errors)
    head = (f"{datetime.date.today()} · torch {torch.__version__} · transformers {transformers.__version__} · "
            f"{len(rows)} catalog configs · {len(errors)} setups traced · median |error| "
            f"{statistics.median(errors or [0]):.2f}% · max {max(errors or [0]):.2f}% · within 3%: {within}/{len(errors)}")
    lines = ["# Family survey on the catalog's real shapes: estimate vs trace", "",
             "Each catalog config at its real widths, traced cut to 2 and 3 blocks and extrapolated to its depth "
             "(`memplan trace --layers 2`), batch 1 x 512 tokens. Written by `python benchmarks/family_survey.py "
             "--catalog`.", "", head, "",
             "| model | type | " + " | ".join(name for name, _ in CATALOG_SETUPS) + " | not run / failures |",
             "|---|---|" + "---:|" * len(CATALOG_SETUPS) + "---|"]
    lines += [f"| {m} | {t} | " + " | ".join(cells) + f" | {failures} |" for m, t, cells, failures in rows]
    write_text_atomic(out, "\n".join(lines) + "\n")
    print(head)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--families", default=",".join(FAMILIES + VLM_FAMILIES),
                    help="comma-separated transformers model types")
    ap.add_argument("--variant", action="store_true", help="the VARIANT_SETUPS, written to family_survey_variant.md")
    ap.add_argument("--catalog", nargs="?", const="", default=None, metavar="TEXT",
                    help="survey the catalog's configs (ids containing TEXT; comma-separated) at their real shapes instead")
    args = ap.parse_args(argv)
    if args.catalog is not None:
        return survey_catalog(args.catalog)
    setups = VARIANT_SETUPS if args.variant else SETUPS
    import torch
    import transformers

    from memplan.fileio import write_text_atomic

    rows, errors = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families.split(","):
            cells, failures = survey(family, Path(tmp), setups)
            rows.append((family, cells, failures))
            errors += [abs(float(c.rstrip("%"))) for c in cells if c.endswith("%")]
            print(family, *cells, failures[:120], flush=True)
    within = sum(e <= 3 for e in errors)
    head = (f"{datetime.date.today()} · torch {torch.__version__} · transformers {transformers.__version__} · "
            f"{len(rows)} families · {len(errors)} setups traced · median |error| {statistics.median(errors or [0]):.2f}% · "
            f"within 3%: {within}/{len(errors)}")
    lines = ["# Family survey: estimate vs trace on every family, shaped small", "", head, "",
             "| family | " + " | ".join(name for name, _ in setups) + " | not run / failures |",
             "|---|" + "---:|" * len(setups) + "---|"]
    lines += [f"| {f} | " + " | ".join(cells) + f" | {failures} |" for f, cells, failures in rows]
    name = "family_survey_variant.md" if args.variant else "family_survey.md"
    write_text_atomic(ROOT / "benchmarks" / "results" / name, "\n".join(lines) + "\n")
    print(head)
    return 0


if __name__ == "__main__":
    sys.exit(main())
