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
from pathlib import Path

from memplan.errors import BadInput, OfflineError, close_matches, not_found
from memplan.model.config_rules import config_problems
from memplan.model.hf import config_from_dict
from memplan.model.spec import ModelSpec
from memplan.fileio import write_json_atomic

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


def file_stem(model_id: str) -> str:
    return model_id.replace("/", "__")


@functools.lru_cache(maxsize=1)
def catalog_index() -> dict[str, dict]:
    """model id -> index row (params_total, kind, model_type, source, aliases) without loading inventories."""
    if not INDEX.exists():
        raise BadInput(f"the model catalog index {INDEX} is missing; run `memplan refresh-catalog`")
    return json.loads(INDEX.read_text())


def catalog_id(name: str) -> str | None:
    """The catalog id `name` refers to (exact, case-insensitive, legacy short id or unique bare name), else None."""
    index = catalog_index()
    low = {k.lower(): k for k in index}
    key = LEGACY.get(name.lower(), name).lower()
    if key in low:
        return low[key]
    bare = [k for k in index if k.lower().split("/", 1)[-1] == key]
    return bare[0] if len(bare) == 1 else None


@functools.lru_cache(maxsize=64)
def _load_inventory(model_id: str) -> ModelSpec:
    path = INVENTORY / (file_stem(model_id) + ".json")
    return ModelSpec.from_dict(json.loads(path.read_text()))


def load_spec(model, trust_remote_code: bool = False) -> ModelSpec:
    """A ModelSpec from a ModelSpec, a catalog id, a config.json path or model folder, or (online) a Hub id."""
    if isinstance(model, ModelSpec):
        return model
    name = str(model).strip()
    path = Path(name).expanduser()
    if path.exists():
        cfg = path / "config.json" if path.is_dir() else path
        if not cfg.is_file():
            raise BadInput(f"{path} has no config.json; pass a config.json file or a folder that contains one")
        return _build_cached(str(cfg.resolve()), cfg.stat().st_mtime_ns, trust_remote_code)
    cid = catalog_id(name)
    if cid is not None:
        return _load_inventory(cid)
    return _from_hub(name, trust_remote_code)


@functools.lru_cache(maxsize=16)
def _build_cached(path: str, mtime_ns: int, trust_remote_code: bool) -> ModelSpec:
    from memplan.inventory.build import build_spec

    return build_spec(read_config(path), model_id=path, config_file=path, trust_remote_code=trust_remote_code)


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


def _from_hub(name: str, trust_remote_code: bool) -> ModelSpec:
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
    return build_spec(config.to_dict(), model_id=name, config_file=f"hub:{name}", trust_remote_code=trust_remote_code)


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


def refresh_catalog(echo=print) -> int:
    """Rebuild every inventory under memplan/data/models/inventory/ and the catalog index. Returns the count."""
    from memplan.inventory.build import build_spec

    sources = _sources_by_id()
    index = {}
    for cfg in sorted(CONFIGS.glob("*.json")):
        model_id = cfg.stem.replace("__", "/", 1)
        spec = build_spec(read_config(cfg), model_id=model_id, config_file=f"configs/{cfg.name}")
        write_json_atomic(INVENTORY / cfg.name, spec.to_dict())
        index[model_id] = {"file": cfg.name, "params_total": spec.numel_total, "kind": spec.arch.kind,
                           "model_type": spec.arch.model_type,
                           "aliases": sorted(k for k, v in LEGACY.items() if v == model_id),
                           "source": sources.get(model_id, "")}
        echo(f"{model_id}: {spec.numel_total:,} parameters")
    write_json_atomic(INDEX, index, indent=1)
    catalog_index.cache_clear()
    _load_inventory.cache_clear()
    return len(index)


def _sources_by_id() -> dict[str, str]:
    """model id -> 'status; source' from SOURCES.md's table (the provenance of every catalog config)."""
    path = DATA / "SOURCES.md"
    out = {}
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        cells = [c.strip() for c in line.split("|")]
        if len(cells) > 4 and cells[2] in ("verbatim", "reconstructed"):
            mid = LEGACY.get(cells[1], cells[1])
            out[mid] = f"{cells[2]}; {cells[3]}"
    return out


if __name__ == "__main__":  # python -m memplan.model.catalog refresh
    if sys.argv[1:] != ["refresh"]:
        sys.exit("usage: python -m memplan.model.catalog refresh")
    refresh_catalog()
