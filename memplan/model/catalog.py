"""Models: the built-in catalog, local config.json files and (online) Hub ids -> ModelSpec.

A catalog lookup reads a cached inventory JSON and imports no torch. Building an inventory instantiates the real
transformers class on the meta device (accelerate.init_empty_weights), so the parameter list is exact.
Refresh the catalog after dropping a config.json into memplan/data/models/configs/:
`memplan refresh-catalog` (or `python -m memplan.model.catalog refresh`).
"""
from __future__ import annotations

import functools
import json
import os
import re
import socket
import sys
from dataclasses import replace
from pathlib import Path

from memplan.errors import BadInput, OfflineError, close_matches, not_found
from memplan.model.config_rules import config_problems
from memplan.model.hf import TASKS, config_from_dict
from memplan.model.spec import ModelSpec
from memplan.setup import GROUP_SIZES, GROUPED_QUANTS, LORA_PREQUANTIZED, PREQUANTIZED
from memplan.fileio import content_key, read_cached, source_digest, write_cached, write_json_atomic

DATA = Path(__file__).parents[1] / "data" / "models"
CONFIGS = DATA / "configs"
INVENTORY = DATA / "inventory"
INDEX = DATA / "catalog.json"

#: Legacy short Hub ids that the Hub redirects to their organisation repos.
LEGACY = {
    "gpt2": "openai-community/gpt2", "gpt2-medium": "openai-community/gpt2-medium",
    "gpt2-large": "openai-community/gpt2-large", "gpt2-xl": "openai-community/gpt2-xl",
    "bert-base-uncased": "google-bert/bert-base-uncased", "bert-large-uncased": "google-bert/bert-large-uncased",
    "t5-small": "google-t5/t5-small", "t5-base": "google-t5/t5-base", "t5-large": "google-t5/t5-large",
}


VARIANTS = DATA / "variants.csv"

#: Repo-name endings of pre-quantized uploads: (regex, format named in messages, the Setup.quant memplan loads it
#: with, or None where the format is not modelled yet). A -bnb-4bit upload is stored as bitsandbytes NF4, the
#: 4-bit default of BitsAndBytesConfig (bnb_4bit_quant_type="nf4"); unsloth's "-unsloth-bnb-4bit" uploads keep
#: chosen layers in 16 bit (llm_int8_skip_modules), which a uniform nf4 estimate would under-count.
QUANT_SUFFIXES = (
    (r"-unsloth-bnb-4bit", "unsloth dynamic 4-bit (some layers kept in 16 bit)", None),
    (r"-bnb-4bit", "bitsandbytes 4-bit NF4", "nf4"),
    (r"-bnb-8bit", "bitsandbytes 8-bit", "int8"),
    (r"-GPTQ-Int8", "GPTQ 8-bit", "gptq-int8"),
    (r"-GPTQ(-Int4)?", "GPTQ 4-bit", "gptq-int4"),
    (r"-AWQ", "AWQ 4-bit", "awq"),
    (r"-FP8", "FP8 (128 x 128 block scales)", "fp8"),
    (r"-FP8-(Dynamic|Static)", "compressed-tensors FP8 (per-channel scales)", "fp8-dynamic"),
    (r"-MXFP4", "MXFP4", None),
    (r"-int4wo(-hqq)?", "torchao int4 weight-only", "torchao-int4"),
    (r"-int8wo", "torchao int8 weight-only", "torchao-int8"),
)


def file_stem(model_id: str) -> str:
    return model_id.replace("/", "__")


@functools.lru_cache(maxsize=1)
def catalog_index() -> dict[str, dict]:
    """model id -> index row (params_total, kind, model_type, source, aliases) without loading inventories."""
    if not INDEX.exists():
        raise BadInput(f"the model catalog index {INDEX} is missing; run `memplan refresh-catalog`")
    return json.loads(INDEX.read_text())


def catalog_id(name: str) -> str | None:
    """The catalog id `name` refers to (exact, case-insensitive, legacy short id or unique bare name: another
    organisation's copy such as unsloth/Qwen2.5-7B-Instruct finds Qwen/Qwen2.5-7B-Instruct), else None. Variants
    are catalog ids too (their rows name the base in "variant_of")."""
    index = catalog_index()
    low = {k.lower(): k for k in index}
    key = LEGACY.get(name.lower(), name).lower()
    if key in low:
        return low[key]
    bare_key = key.split("/", 1)[-1]
    bare = [k for k in index if k.lower().split("/", 1)[-1] == bare_key]
    return bare[0] if len(bare) == 1 else None


def find_models(text: str | None = None, family: str | None = None) -> dict[str, dict]:
    """The catalog rows whose id contains `text` and whose model_type is `family` (both case-insensitive; "-",
    "_" and "." are alike, so "qwen2.5" finds Qwen2.5 and "qwen3-moe" the qwen3_moe family); BadInput naming
    the families when `family` is none of them."""
    index = catalog_index()
    fold = lambda t: re.sub(r"[-_.\s]", "", t.lower())  # noqa: E731
    if family is not None:
        families = sorted({row["model_type"] for row in index.values()})
        if fold(family) not in map(fold, families):
            raise not_found("model family", family, families, "Families are transformers' model_type names; "
                                                              "run `memplan models` to list them.")
        index = {k: v for k, v in index.items() if fold(v["model_type"]) == fold(family)}
    if text:
        index = {k: v for k, v in index.items()
                 if fold(text) in fold(k) or any(fold(text) in fold(a) for a in v["aliases"])}
    return index


def quantized_upload(name: str) -> tuple[str, str, str | None] | None:
    """(catalog id of the unquantized model, format, Setup.quant or None) for a pre-quantized upload's id such as
    Qwen/Qwen2.5-7B-Instruct-GPTQ-Int4 or unsloth/Llama-3.2-3B-Instruct-bnb-4bit; None if `name` is not one or its
    unquantized model is not in the catalog."""
    for pattern, label, quant in QUANT_SUFFIXES:
        m = re.search(pattern + "$", name, flags=re.IGNORECASE)
        if m:
            base = catalog_id(name[:m.start()])
            return (base, label, quant) if base else None
    return None


@functools.lru_cache(maxsize=64)
def _load_inventory(model_id: str) -> ModelSpec:
    row = catalog_index()[model_id]
    if row.get("variant_of"):
        return replace(_load_inventory(row["variant_of"]), model_id=model_id, variant_of=row["variant_of"])
    path = INVENTORY / (file_stem(model_id) + ".json")
    return ModelSpec.from_dict(json.loads(path.read_text()))


def _quantized_spec(name: str, base: str, label: str, quant: str | None) -> ModelSpec:
    """The spec of a pre-quantized upload of catalog model `base`: its architecture, the format's weights."""
    if quant is None:
        raise BadInput(f"{name} is a {label} upload of {base}; memplan does not model pre-quantized {label} weights "
                       f"yet. For the same architecture quantized on load, estimate {base} with --quant nf4 "
                       f"(bitsandbytes 4-bit) or without --quant (16-bit weights).")
    return replace(_load_inventory(base), model_id=name, variant_of=base, checkpoint_quant=quant)


def load_spec(model, trust_remote_code: bool = False, task: str | None = None) -> ModelSpec:
    """A ModelSpec from a ModelSpec, a catalog id, a config.json path or model folder, or (online) a Hub id.
    task: the head a training script builds (memplan.model.hf.TASKS: seq-cls, token-cls, ...) instead of the
    language-model head; built from the config (seconds, then cached: memplan.fileio.cache_dir)."""
    if isinstance(model, ModelSpec):
        return model
    name = str(model).strip()
    path = Path(name).expanduser()
    if path.exists():
        cfg = path / "config.json" if path.is_dir() else path
        if not cfg.is_file():
            raise BadInput(f"{path} has no config.json; pass a config.json file or a folder that contains one")
        return _build_cached(str(cfg.resolve()), cfg.stat().st_mtime_ns, trust_remote_code, task)
    cid = catalog_id(name)
    if cid is not None:
        spec = _load_inventory(cid)
        if task is None or _task_of(spec) == task:
            return spec
        base = catalog_index()[cid].get("variant_of") or cid
        cfg = CONFIGS / (file_stem(base) + ".json")
        built = _build_cached(str(cfg), cfg.stat().st_mtime_ns, trust_remote_code, task)
        return replace(built, model_id=cid, config_file=f"configs/{cfg.name}", variant_of=spec.variant_of)
    upload = quantized_upload(name)
    if upload is not None:
        return _quantized_spec(name, *upload)
    return _from_hub(name, trust_remote_code, task)


def stored_format(config: dict) -> str:
    """The quant_method of a config.json's quantization_config ("fp8", "mxfp4", "gptq"...), "" if it has none."""
    q = config.get("quantization_config")
    return str(q.get("quant_method", "quantized")) if isinstance(q, dict) else ""


def model_notes(spec: ModelSpec) -> list[str]:
    """What a user should know about the config that answers for `spec`: a variant's base, and a checkpoint stored
    pre-quantized (estimated with 16-bit weights, as transformers dequantizes a format it has no kernels for)."""
    notes = [variant_note(spec)] if spec.variant_of else []
    row = catalog_index().get(spec.model_id, {})
    if not row and spec.config_file and not spec.config_file.startswith("hub:"):  # a local config.json
        try:
            config = read_config(spec.config_file)
        except BadInput:
            config = {}
        if spec.checkpoint_quant:
            groups = f" --group-size {spec.checkpoint_group_size}" if spec.checkpoint_group_size else ""
            notes.append(f"{spec.model_id}: its quantization_config loads the weights as {spec.checkpoint_quant} "
                         f"(--quant {spec.checkpoint_quant}{groups} by default)")
        elif stored := stored_format(config):
            row = {"stored_as": stored}
    if row.get("stored_as") == "mxfp4":
        notes.append(f"{spec.model_id}'s experts are stored as MXFP4 (its quantization_config): --quant mxfp4 "
                     "serves them as stored (transformers with the `kernels` package, compute capability 7.5 or "
                     "more); without --quant memplan estimates bf16 experts, as transformers dequantizes them to "
                     "fine-tune (Mxfp4Config(dequantize=True)) or without the kernels")
    elif row.get("stored_as") and not spec.checkpoint_quant:
        notes.append(f"{spec.model_id}'s checkpoint is stored as {row['stored_as']} (its quantization_config); "
                     f"memplan estimates 16-bit weights, what transformers holds where it dequantizes the format "
                     f"({row['stored_as']} over fused MoE experts is not modelled yet; --quant fp8 models dense "
                     "Linears only)")
    return notes


def variant_note(spec: ModelSpec) -> str:
    """One line saying which catalog config answers for a variant or pre-quantized upload; "" for any other."""
    if not spec.variant_of:
        return ""
    if spec.checkpoint_quant in PREQUANTIZED:
        layout = {"fp8": "128 x 128 block scales", "torchao-int8": "per-row scales",
                  "fp8-dynamic": "per-channel scales"}.get(spec.checkpoint_quant, "group size 128")
        path = {"fp8": "transformers' FP8LinearFunction", "torchao-int8": "peft's TorchaoLoraLinear"}.get(
            spec.checkpoint_quant, "gptqmodel's training path")
        lora = (f"serving and LoRA ({path}) are modelled"
                if spec.checkpoint_quant in LORA_PREQUANTIZED else "serving is modelled, LoRA on it not yet")
        return (f"{spec.model_id}: the architecture of {spec.variant_of}, weights stored as {spec.checkpoint_quant} "
                f"(--quant {spec.checkpoint_quant}; {layout}, as nearly every published upload; {lora})")
    if spec.checkpoint_quant:
        return (f"{spec.model_id}: the architecture of {spec.variant_of}, weights stored as bitsandbytes "
                f"{spec.checkpoint_quant} (estimate with --quant {spec.checkpoint_quant}; add --double-quant if its "
                f"quantization_config sets bnb_4bit_use_double_quant)")
    return (f"{spec.model_id}: answered from {spec.variant_of}'s config.json (the same architecture: "
            f"{catalog_index()[spec.model_id].get('source', 'see memplan models')})")


@functools.cache
def _builder_digest() -> bytes:
    """The source inventories are built with (memplan/inventory, memplan/model)."""
    return source_digest("inventory", "model")


def _inventory_key(text: bytes, trust_remote_code: bool) -> str:
    """The content hash an inventory is cached under: the config's bytes and everything the inventory is built
    with (the transformers, peft and memplan releases and builder source, remote code allowed)."""
    return content_key([text, _builder_digest(), b"remote" if trust_remote_code else b""], ("transformers", "peft"))


def spec_for_task(spec: ModelSpec, task: str | None) -> ModelSpec:
    """`spec` as built for Setup.task: itself when no task is asked or it is that task's, else the same model (catalog
    id, config.json or Hub id) loaded with that head."""
    if task is None or _task_of(spec) == task:
        return spec
    return load_spec(spec.model_id, task=task)


def _task_of(spec: ModelSpec) -> str | None:
    """The --task whose class built `spec` (None for a class no task names)."""
    return next((t for t, cls in TASKS.items() if cls == spec.arch.auto_class), None)


@functools.lru_cache(maxsize=16)
def _build_cached(path: str, mtime_ns: int, trust_remote_code: bool, task: str | None = None) -> ModelSpec:
    """A local config's spec: from the on-disk cache when its content was built before (building takes seconds:
    the real transformers class on the meta device), else built and cached."""
    config = read_config(path)
    key = _inventory_key(Path(path).read_bytes() + (task or "").encode(), trust_remote_code)
    cached = read_cached("inventories", key)
    # a quantization_config names how the weights load
    stored = {"checkpoint_quant": stored_quant(config), "checkpoint_group_size": stored_group_size(config)}
    try:
        return replace(ModelSpec.from_dict(cached), model_id=path, config_file=path, **stored)
    except (ValueError, KeyError, TypeError, AttributeError):
        pass  # not cached yet, or written by another memplan: build it
    from memplan.inventory.build import build_spec

    spec = build_spec(config, model_id=path, config_file=path, trust_remote_code=trust_remote_code, task=task)
    write_cached("inventories", key, spec.to_dict())
    return replace(spec, **stored)


def _torchao_config(q: dict) -> tuple[str | None, dict]:
    """(config class name, its fields) of a torchao quantization_config (TorchAoConfig.to_dict: quant_type
    {"default": torchao's config_to_dict(config)}, {"_type": ..., "_data": {...}}); (None, {}) where malformed."""
    qt = q.get("quant_type")
    qt = qt.get("default") if isinstance(qt, dict) else None
    if not isinstance(qt, dict):
        return None, {}
    return qt.get("_type"), qt["_data"] if isinstance(qt.get("_data"), dict) else {}


def stored_group_size(config: dict) -> int | None:
    """A GPTQ / AWQ / torchao int4 quantization_config's group size where it is not 128 (GPTQConfig and AwqConfig
    `group_size`; torchao's Int4WeightOnlyConfig `_data.group_size`), None otherwise or where it is not one memplan
    models (Setup.GROUP_SIZES)."""
    q = config.get("quantization_config")
    if not isinstance(q, dict) or stored_quant(config) not in GROUPED_QUANTS:
        return None
    if str(q.get("quant_method", "")).lower() == "torchao":
        size = _torchao_config(q)[1].get("group_size", 128)
    else:
        size = q.get("group_size", q.get("q_group_size", 128))
    return size if size in GROUP_SIZES and size != 128 else None


def stored_quant(config: dict) -> str | None:
    """The Setup.quant a config.json's quantization_config loads its weights as (transformers' quantizers), None
    for none or a format memplan does not model (model_notes says so): GPTQ 4 / 8 bits, AWQ, FP8 (fine-grained),
    torchao's int4 (group size 128) and int8 (per row) weight-only configs, bitsandbytes 4-bit (its quant type) and
    8-bit."""
    q = config.get("quantization_config")
    if not isinstance(q, dict):
        return None
    method = str(q.get("quant_method", "")).lower()
    if method == "gptq":
        return {4: "gptq-int4", 8: "gptq-int8"}.get(q.get("bits", 4))
    if method in ("awq", "fp8"):
        return method if method == "fp8" or q.get("bits", 4) == 4 else None
    if method == "compressed-tensors":  # llm-compressor's FP8_DYNAMIC: float 8-bit weights per channel (or tensor)
        groups = q.get("config_groups") if isinstance(q.get("config_groups"), dict) else {}
        weights = [g.get("weights") for g in groups.values() if isinstance(g, dict)]
        fp8 = [isinstance(w, dict) and w.get("type") == "float" and w.get("num_bits") == 8
               and w.get("strategy") in ("channel", "tensor") for w in weights]
        return "fp8-dynamic" if fp8 and all(fp8) else None
    if method == "torchao":
        kind, data = _torchao_config(q)
        if kind == "Int4WeightOnlyConfig" and data.get("group_size", 128) in GROUP_SIZES:
            return "torchao-int4"
        granularity = data.get("granularity") if isinstance(data.get("granularity"), dict) else {}
        if kind == "Int8WeightOnlyConfig" and granularity.get("_type", "PerRow") == "PerRow":
            return "torchao-int8"
        return None
    if method == "bitsandbytes":
        if q.get("load_in_4bit"):
            return str(q.get("bnb_4bit_quant_type", "fp4")).lower()
        return "int8" if q.get("load_in_8bit") else None
    return None


def read_config(path: str | Path) -> dict:
    """Parse a config.json, naming the file and the problem when it is not a usable config."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise BadInput(f"{path}: not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
    except UnicodeDecodeError as e:
        raise BadInput(f"{path}: not UTF-8 text (byte {e.start}); a config.json is UTF-8 JSON") from None
    except RecursionError:
        raise BadInput(f"{path}: nested too deeply to be a config.json") from None
    except OSError as e:
        raise BadInput(f"cannot read {path}: {e.strerror}") from None
    if not isinstance(data, dict):
        raise BadInput(f"{path}: a config.json must hold a JSON object, found {type(data).__name__}")
    if "model_type" not in data:
        raise BadInput(f"{path}: missing key 'model_type' (every transformers config.json names its model_type)")
    problems = config_problems(data)
    if problems:
        raise BadInput(f"{path} is not a usable config:\n" + "\n".join(f"  - {q}" for q in problems))
    return data


def _hub_reachable(timeout: float = 3.0) -> bool:
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0") or os.environ.get("TRANSFORMERS_OFFLINE", "0") not in ("", "0"):
        return False
    try:
        socket.create_connection(("huggingface.co", 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def _from_hub(name: str, trust_remote_code: bool, task: str | None = None) -> ModelSpec:
    ids = list(catalog_index()) + list(LEGACY)
    if not re.fullmatch(r"[\w.-]+/[\w.-]+", name):
        raise not_found("model", name, ids, "Run `memplan models` for the catalog, or pass a local config.json "
                                            "or model folder.")
    if not _hub_reachable():
        matches = close_matches(name, ids)
        did = f" Did you mean: {', '.join(matches)}?" if matches else ""
        raise OfflineError(f"{name!r} is not in the built-in catalog and the Hugging Face Hub is not reachable "
                           f"(offline). Download its config.json and pass the file or its folder instead "
                           f"(memplan estimate ./config.json).{did}")
    from transformers import AutoConfig

    from memplan.inventory.build import build_spec

    try:
        config = AutoConfig.from_pretrained(name, trust_remote_code=trust_remote_code)
    except Exception as e:  # the Hub's own errors (gated repo, missing file) are the user's to read
        raise BadInput(f"could not fetch the config of {name!r} from the Hub: {e}") from None
    return build_spec(config.to_dict(), model_id=name, config_file=f"hub:{name}", trust_remote_code=trust_remote_code,
                      task=task)


def config_dict(model) -> dict:
    """The config.json content behind a catalog id, a local config.json / model folder, or (online) a Hub id:
    what the tracer, the validator and examples build the real model from (no weights needed)."""
    spec = load_spec(model)
    ref = spec.config_file
    if ref.startswith("hub:"):
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(ref[4:]).to_dict()
    path = Path(ref)
    return read_config(path if path.is_absolute() else DATA / path)


def hf_config(model, **overrides):
    """A transformers PretrainedConfig for `model` (see config_dict), with `overrides` applied."""
    return config_from_dict(config_dict(model), **overrides)


def _build_one(cfg_name: str) -> tuple[str, dict, str]:
    """Build one catalog config's inventory (a worker of refresh_catalog): (file name, inventory dict, the format
    its checkpoint is stored in: stored_format)."""
    from memplan.inventory.build import build_spec

    cfg = CONFIGS / cfg_name
    config = read_config(cfg)
    spec = build_spec(config, model_id=cfg.stem.replace("__", "/", 1), config_file=f"configs/{cfg_name}")
    return cfg_name, spec.to_dict(), stored_format(config)


def refresh_catalog(echo=print, workers: int | None = None) -> int:
    """Rebuild every inventory under memplan/data/models/inventory/ and the catalog index (configs, then the
    variants in variants.csv). Builds run in `workers` processes (default: one per CPU). Returns the entry count."""
    import concurrent.futures
    import multiprocessing

    sources = _sources_by_id()
    names = sorted(p.name for p in CONFIGS.glob("*.json"))
    workers = max(1, min(workers or os.cpu_count() or 1, len(names) or 1))
    built: dict[str, ModelSpec] = {}
    stored: dict[str, str] = {}
    ctx = multiprocessing.get_context("spawn")  # a fresh interpreter per worker: no inherited torch threads
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx) as pool:
        for cfg_name, inv, stored_as in pool.map(_build_one, names):
            write_json_atomic(INVENTORY / cfg_name, inv)
            spec = ModelSpec.from_dict(inv)
            built[spec.model_id], stored[spec.model_id] = spec, stored_as
            echo(f"{spec.model_id}: {spec.numel_total:,} parameters")
    index = {}
    for model_id, spec in built.items():
        index[model_id] = {"file": file_stem(model_id) + ".json", "params_total": spec.numel_total,
                           "kind": spec.arch.kind, "model_type": spec.arch.model_type,
                           "aliases": sorted(k for k, v in LEGACY.items() if v == model_id),
                           "source": sources.get(model_id, {}).get("source", ""),
                           "published": sources.get(model_id, {}).get("published", "")}
        if stored[model_id]:
            index[model_id]["stored_as"] = stored[model_id]
    for variant, base, evidence in read_variants():
        if base not in built:
            raise BadInput(f"{VARIANTS}: {variant} names base {base!r}, which has no config in {CONFIGS}")
        if variant in built:
            raise BadInput(f"{VARIANTS}: {variant} has its own config; list it there or here, not both")
        row = index[base]
        index[variant] = {"variant_of": base, "params_total": row["params_total"], "kind": row["kind"],
                          "model_type": row["model_type"], "aliases": [], "source": evidence,
                          "published": sources.get(variant, {}).get("published", "")}
        if "stored_as" in row:
            index[variant]["stored_as"] = row["stored_as"]
    stale = {p.name for p in INVENTORY.glob("*.json")} - set(names)
    for name in stale:
        (INVENTORY / name).unlink()
    write_json_atomic(INDEX, dict(sorted(index.items(), key=lambda kv: kv[0].lower())), indent=1)
    catalog_index.cache_clear()
    _load_inventory.cache_clear()
    return len(index)


def read_variants() -> list[tuple[str, str, str]]:
    """(variant id, base id, evidence) rows of variants.csv: checkpoints whose config.json has the base's
    architecture (an -Instruct, -it or renamed release), answered from the base's inventory."""
    import csv

    if not VARIANTS.exists():
        return []
    with VARIANTS.open(newline="") as f:
        rows = [r for r in csv.reader(f) if r and not r[0].startswith("#")]
    if rows and rows[0][:2] == ["variant", "base"]:
        rows = rows[1:]
    return [(r[0].strip(), r[1].strip(), ",".join(r[2:]).strip()) for r in rows]


def _sources_by_id() -> dict[str, dict[str, str]]:
    """model id -> {"source": 'status; source', "published": the model card's count} from SOURCES.md's table
    (the provenance of every catalog config and the parameter count its card publishes)."""
    path = DATA / "SOURCES.md"
    out: dict[str, dict[str, str]] = {}
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        cells = [c.strip() for c in line.split("|")]
        if len(cells) > 7 and cells[2] in ("verbatim", "reconstructed", "variant"):
            mid = LEGACY.get(cells[1], cells[1])
            out[mid] = {"source": f"{cells[2]}; {cells[3]}", "published": cells[6]}
    return out


if __name__ == "__main__":  # python -m memplan.model.catalog refresh
    if sys.argv[1:] != ["refresh"]:
        sys.exit("usage: python -m memplan.model.catalog refresh")
    refresh_catalog()
