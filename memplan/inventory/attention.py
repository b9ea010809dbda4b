"""Facts about a model's eager attention, read from its modeling code as installed when its inventory is built
(memplan.inventory.probes.read).

They say whether the softmax runs in fp32, which score-sized tensors stay named while it runs, and whether each
layer hands its attention probabilities back to the model's loop. memplan.estimator.memory.forward_block turns them
into the bytes an eager attention holds at once in the forward.
"""
from __future__ import annotations

import re

from memplan.inventory.modules import block_module

#: a softmax call that runs in fp32: `softmax(x, dim=-1, dtype=torch.float32)` (Llama's eager_attention_forward and
#: every family generated from it), or on an fp32 copy, `softmax(scores.float(), ...)` (T5 before 5.15)
_FP32_SOFTMAX = re.compile(r"softmax\([^\n]*(dtype=torch\.float32|\.float\(\))")
#: the scores' assignment from q times k: `x = torch.matmul(q, k...)`, `x = alibi.baddbmm(`, `x = query @ key...`
_SCORES = re.compile(r"^\s*(\w+)\s*=\s*(?:torch\.matmul\(|torch\.bmm\(|[\w.]+\.baddbmm\(|torch\.baddbmm\(|\w+\s*@)",
                     re.M)
#: the softmax call with its result's name and its first argument
_SOFTMAX = re.compile(r"^\s*(\w+)\s*=\s*[\w.]*softmax\(\s*([^,\n]+?)\s*,", re.M)
#: a layer's return statement that hands back attention weights (FalconDecoderLayer: `return output, attn_weights`)
_RETURNS_PROBS = re.compile(r"^\s*return\s+[^\n]*\b(\w*attn_weights|\w*attention_probs|\w*attn_probs)\b", re.M)


def eager_facts(model) -> dict:
    """The Arch fields this module reads for `model` (the language model whose layers they are about).

    eager_softmax_fp32: whether the eager softmax runs in fp32 (fp32 probabilities plus a compute-dtype copy). Llama
    and the families generated from it do; GPT-2, BERT, BART, T5 (5.15 on) and Falcon do not. Read from the source
    (_eager_source); without source, Llama's fp32 softmax, the common case.
    """
    source = _eager_source(model)
    return dict(eager_softmax_fp32=True if source is None else bool(_FP32_SOFTMAX.search(source)),
                eager_held=eager_held(source), returns_attn_probs=returns_attn_probs(model))


def _eager_source(model) -> str | None:
    """The source of the model module's `eager_attention_forward`, or of its attention classes where it has none.

    Falcon, BLOOM and GPT-J have no `eager_attention_forward`. None without source (a frozen or compiled module).
    """
    import inspect
    import sys

    module = sys.modules.get(type(model).__module__)
    fn = getattr(module, "eager_attention_forward", None)
    try:
        if fn is not None:
            return inspect.getsource(fn)
        return "\n".join(inspect.getsource(c) for name, c in vars(module).items()
                         if isinstance(c, type) and "Attention" in name and c.__module__ == module.__name__)
    except (OSError, TypeError):
        return None


def eager_held(source: str | None) -> tuple[bool, bool, bool]:
    """Which score-sized tensors an eager attention keeps named around its softmax, read from its source.

    A named tensor stays alive until its name is reassigned. Llama and every family generated from it reassign one
    name from the scores to the probabilities, so each is freed when the next is made.

    Returns:
        (scores held, sum held, cast back):
        - scores held: the raw q-times-k scores stay named while the softmax runs (Falcon's
          `softmax(attention_scores + attention_mask, ...)` sums inside the call; BLOOM views its scores under
          another name and sums that);
        - sum held: the masked sum handed to the softmax stays named past it (BLOOM assigns the probabilities to a
          name of their own);
        - cast back: the probabilities are cast to q's or v's dtype right after (Llama's `.to(query.dtype)`,
          GPT-2's `.type(value.dtype)`; BERT, T5 and Falcon do not).
        (False, False, True) for Llama's pattern, also without source.
    """
    if not source:
        return False, False, True
    scores, call = _SCORES.search(source), _SOFTMAX.search(source)
    if not scores or not call:
        return False, False, True
    arg = call.group(2)
    word = re.match(r"\w+", arg)
    base = word.group(0) if word else ""
    held_scores = "+" in arg or base != scores.group(1)
    held_sum = "+" not in arg and base != call.group(1) and base != scores.group(1)
    after = source[call.end():].split("\n", 4)[:4]  # the softmax's own line and the three after it
    cast = bool(re.search(r"\.(to|type)\(\s*\w+\.dtype", "\n".join(after)))
    return held_scores, held_sum, cast


def returns_attn_probs(model) -> bool:
    """Whether the model's decoder layer returns its attention probabilities whatever output_attentions says.

    The model's loop holds the previous layer's outputs until the next layer returns, so an eager layer's
    probabilities live through the next layer's attention. Example: transformers 5 FalconDecoderLayer and BloomBlock
    (`return output, attn_weights`).

    Read from the source of the forward of the model's first block.
    """
    import inspect

    block = block_module(model)
    if block is None:
        return False
    try:
        return bool(_RETURNS_PROBS.search(inspect.getsource(type(block).forward)))
    except (OSError, TypeError):
        return False
