"""Finding a model's parts by their modules: its blocks and its normalisation layers. Shared by the fact readers of
this package (probes, blocks, attention, linear_attention)."""
from __future__ import annotations

import re

from memplan.model.layout import BLOCK_LIST_NAMES

_BLOCK_NAMES = "|".join(BLOCK_LIST_NAMES)


#: a module path inside one of the model's blocks (`model.layers.3.mlp`, `transformer.h.0`, `encoder.block.1`)
BLOCK_PATH = re.compile(rf"(^|\.)({_BLOCK_NAMES})\.\d+(\.|$)")


def is_norm_module(m) -> bool:
    """A normalisation layer: a class named *Norm* (every family's own) or torch's nn.LayerNorm."""
    from torch import nn

    return "Norm" in type(m).__name__ or isinstance(m, nn.LayerNorm)


def block_module(model, index: int = 0):
    """The model's block `index` (the first module named like `layers.0`, `h.0`, `block.0`), None without one."""
    pattern = re.compile(rf"(^|\.)({_BLOCK_NAMES})\.{index}$")
    # the outermost match: T5's `encoder.block.0.layer.1` (a sublayer) comes before `encoder.block.1`
    found = [(name.count("."), i, module) for i, (name, module) in enumerate(model.named_modules())
             if pattern.search(name)]
    return min(found, key=lambda f: f[:2])[2] if found else None


def block_norm(model, hidden: int):
    """The model's normalisation layer: the first module named *Norm* (or an nn.LayerNorm) with a [hidden] weight,
    else the first *Norm* module (OLMo's has no parameters)."""
    norms = [m for m in model.modules() if is_norm_module(m)]
    for m in norms:
        if any(tuple(p.shape) == (hidden,) for p in m.parameters(recurse=False)):
            return m
    return norms[0] if norms else None
