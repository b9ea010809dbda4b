"""Which parameters train and which Linears are LoRA'd or quantized, mirroring peft and transformers (pure)."""
from __future__ import annotations

import fnmatch

from memplan import libs
from memplan.errors import BadInput, not_found
from memplan.model.spec import Linear, ModelSpec, Param


def _matches(name: str, target: str) -> bool:
    """peft's string rule (tuners_utils.check_target_module_exists): exact module name or a '.'-suffix of it."""
    return name == target or name.endswith("." + target)


def lora_linears(spec: ModelSpec, targets) -> tuple[Linear, ...]:
    """Linears peft's LoraConfig(target_modules=targets) wraps.

    None: peft's default for the model type (TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING, recorded in the
    inventory). "all-linear": every Linear/Conv1D except the output embedding (peft
    `_maybe_include_all_linear_layers`). A name that matches no module is an error listing the available names.
    On the MoE families peft converts (Arch.lora_expert_targets) the old expert and router names move to the fused
    expert tensors and the router (_moe_targets).
    """
    if targets is None:
        targets = spec.arch.lora_default_targets
        if not targets:
            raise BadInput(f"peft has no default LoRA target modules for model type {spec.arch.model_type!r}; "
                           "pass --lora-targets (module names, or all-linear)")
    all_linear = isinstance(targets, str) and targets.lower() == "all-linear"
    moved = _moved_targets(spec, all_linear)
    if all_linear:
        # peft moves every old name, so a shared expert's or a dense block's gate_proj is left unadapted (dots1)
        return tuple(m for m in spec.linears if not m.is_output and m.short_name not in moved) + \
            _moe_targets(spec, set(moved.values()))
    if isinstance(targets, str):
        targets = tuple(t.strip() for t in targets.split(",") if t.strip())
    old = {o for o in moved if any(_matches(t, o) for t in targets)}
    _check_fused(spec, moved, old)
    targets = tuple(t for t in targets if not any(_matches(t, o) for o in old))
    chosen = tuple(m for m in spec.linears if any(_matches(m.name, t) for t in targets))
    missing = [t for t in targets if not any(_matches(m.name, t) for m in spec.linears + spec.media_linears)]
    if missing:
        names = sorted({m.short_name for m in spec.linears + spec.media_linears} | set(moved))
        raise not_found("LoRA target", ", ".join(missing), names,
                        f"{spec.model_id} has these Linear modules: {', '.join(names)} (or use all-linear).")
    return chosen + _moe_targets(spec, {moved[o] for o in old})


def media_lora_linears(spec: ModelSpec, targets) -> tuple[Linear, ...]:
    """Linears of a composite model's media parts (vision tower, projector) peft wraps too: all of them under
    all-linear (peft `_maybe_include_all_linear_layers` walks the whole model), those a target name matches (SigLIP's
    q_proj/v_proj). Their adapters are resident but never run in a text-only step: no gradient, no optimizer state."""
    if not spec.media_linears:
        return ()
    if targets is None:
        targets = spec.arch.lora_default_targets
    if isinstance(targets, str) and targets.lower() == "all-linear":
        return spec.media_linears
    if isinstance(targets, str):
        targets = tuple(t.strip() for t in targets.split(",") if t.strip())
    return tuple(m for m in spec.media_linears if any(_matches(m.name, t) for t in targets))


#: peft moves LoRA targets onto transformers-5 fused experts and routers (utils/transformers_weight_conversion.py)
#: from 0.19 on; 0.18.1 has no such module and adapts the attention's Linears alone. 0.19.x fails on all-linear for
#: those families (its conversion reads the string as a set of names: "Target modules {'a', 'l', 'i', ...} not
#: found") but converts named targets; 0.20.0 adapts them under all-linear too.
PEFT_MOE_CONVERSION_SINCE = (0, 19)
PEFT_MOE_ALL_LINEAR_SINCE = (0, 20)


def _moved_targets(spec: ModelSpec, all_linear: bool) -> dict[str, str]:
    """The target names peft moves to fused experts and routers (Arch.lora_expert_targets, read from the peft the
    inventory was built with) as the peft installed (or assumed: memplan.libs) does: none before 0.19, all-linear
    refused by 0.19.x."""
    moved = dict(pair.split(":", 1) for pair in spec.arch.lora_expert_targets)
    peft = libs.version("peft")
    if not moved or peft is None:
        return moved
    if peft < PEFT_MOE_CONVERSION_SINCE:
        return {}
    if all_linear and peft < PEFT_MOE_ALL_LINEAR_SINCE:
        raise BadInput(f"peft {libs.dotted(peft)} fails on --lora-targets all-linear for {spec.model_id} (its "
                       "fused-expert conversion reads the string as a set of module names): upgrade peft to 0.20 "
                       "or later, or name the target modules")
    return moved


def _check_fused(spec: ModelSpec, moved: dict[str, str], old: set[str]) -> None:
    """peft refuses to adapt part of a fused expert tensor (gate_proj without up_proj: both live in gate_up_proj)."""
    for new in {moved[o] for o in old}:
        need = sorted(o for o, n in moved.items() if n == new)
        if len(need) > 1 and not set(need) <= old:
            raise BadInput(f"{spec.model_id} fuses {' and '.join(need)} into one expert tensor ({new}): peft adapts "
                           f"them together, so target all of {', '.join(need)} or none")


def _moe_targets(spec: ModelSpec, new_names: set[str]) -> tuple[Linear, ...]:
    """MoE layers that are not nn.Linear in transformers 5 that peft adapts under their new names, as Linears.

    These are a router module with an [E, hidden] weight and fused expert tensors [E, out, in], adapted as
    gate.weight, gate_up_proj and down_proj on the families peft converts (Arch.lora_expert_targets: Mixtral, OLMoE,
    Qwen3-MoE, ...; not Qwen2-MoE itself, whose shared expert's and gate's Linears it adapts instead). The adapter
    shapes get_peft_model builds (pinned in tests/test_select.py): router lora_A [r, H] / lora_B [E, r]; experts
    lora_A [r*E*m, in] / lora_B [out, r*E*m] with m = 2 for the fused gate_up_proj, 1 for down_proj.
    """
    if not new_names:
        return ()
    out = []
    for p in spec.params:
        leaf = p.name.rsplit(".", 1)[-1]
        router = router_linear(spec, p)
        if router and "gate.weight" in new_names and p.name.endswith(".gate.weight"):
            out.append(router)
        elif p.role == "expert" and len(p.shape) == 3 and leaf in new_names:
            mult = p.shape[0] * (2 if leaf == "gate_up_proj" else 1)
            out.append(Linear(p.name, p.shape[2], p.shape[1], False, p.block, p.stack, "expert", False, mult))
    return tuple(out)


def router_linear(spec: ModelSpec, p: Param) -> Linear | None:
    """A transformers-5 MoE router's weight as the Linear it acts as, kind "router": an [experts, hidden] parameter of
    a block's router module, which applies it with F.linear (Mixtral, Qwen3-MoE, OLMoE, DeepSeek-V3, GPT-OSS: a
    TopKRouter, not an nn.Linear); None for any other parameter."""
    a = spec.arch
    if (p.role == "other" and p.block is not None and a.num_experts and p.name.endswith(".weight")
            and tuple(p.shape) == (a.num_experts, a.hidden_size)):
        return Linear(p.name.removesuffix(".weight"), p.shape[1], p.shape[0], False, p.block, p.stack, "router")
    return None


def lora_params(spec: ModelSpec, targets, r: int) -> int:
    """Adapter parameters: r x (in + out) per targeted Linear (lora_A [r, in], lora_B [out, r]); fused experts
    use rank r x rank_mult."""
    return sum(r * m.rank_mult * (m.in_features + m.out_features)
               for m in lora_linears(spec, targets) + media_lora_linears(spec, targets))


def new_token_kwargs(spec: ModelSpec, setup) -> dict:
    """LoraConfig kwargs that train the added tokens as Setup.train_new_tokens asks: modules_to_save with the input
    embedding and the output head (a full trainable copy of each), or trainable_token_indices with the new rows of
    the embedding (peft ties a tied head's rows to it) and of an untied head. The runtime builds its LoraConfig
    and the plan file writes its peft section from these."""
    if not setup.train_new_tokens:
        return {}
    embed = next((p.name.rsplit(".", 2)[-2] for p in spec.params if p.role == "embedding"), None)
    head = next((m.short_name for m in spec.linears if m.is_output), None)
    if setup.train_new_tokens == "modules-to-save":
        return {"modules_to_save": [embed, head]} if embed and head else {}
    if not embed:
        return {}
    rows = list(range(spec.arch.vocab_size, spec.arch.vocab_size + setup.added_tokens))
    return {"trainable_token_indices": rows if spec.tied or not head else {embed: rows, head: list(rows)}}


def _last_blocks(spec: ModelSpec, n: int) -> tuple[Param, ...]:
    """Parameters of the last n blocks of the stack that feeds the head: the decoder for causal LMs and
    encoder-decoders, the encoder for encoder-only models."""
    stack = "encoder" if spec.arch.kind == "encoder" else "decoder"
    indices = sorted({p.block for p in spec.params if p.block is not None and p.stack == stack})
    keep = set(indices[-n:])
    return tuple(p for p in spec.params if p.stack == stack and p.block in keep)


def _by_patterns(spec: ModelSpec, patterns: tuple[str, ...]) -> tuple[Param, ...]:
    """Parameters whose name contains a pattern or matches it as a glob."""
    def hit(name: str, pat: str) -> bool:
        return pat in name or fnmatch.fnmatchcase(name, pat)

    missing = [pat for pat in patterns if not any(hit(p.name, pat) for p in spec.params)]
    if missing:
        sample = sorted({p.name.rsplit(".", 2)[0] for p in spec.params})[:12]
        raise BadInput(f"--trainable pattern(s) {', '.join(map(repr, missing))} match no parameter of "
                       f"{spec.model_id}; parameter names look like: {', '.join(sample)}")
    return tuple(p for p in spec.params if any(hit(p.name, pat) for pat in patterns))


def trainable_params(spec: ModelSpec, setup) -> tuple[Param, ...]:
    """Base parameters that get gradients: all (full), none (lora/qlora: only the adapters train), or for freeze
    `setup.trainable` = N (last N blocks), name patterns, or None (the last block).

    Never a parameter the model builds frozen (Arch.frozen_params: Marian's sinusoidal position tables).
    """
    frozen = set(spec.arch.frozen_params)
    return tuple(p for p in _selected(spec, setup) if p.name not in frozen and not gets_no_grad(spec, p.name))


def gets_no_grad(spec: ModelSpec, name: str) -> bool:
    """A parameter (or Linear) that runs but never gets a gradient.

    DeepSeek-V3.2's lightning indexer (Arch.indexer) only feeds top-k indices (modeling_deepseek_v32
    DeepseekV32Indexer), so its weights' .grad stays None (torch's AdamW keeps no state for them) and the graph it
    records is freed when it returns (nothing saved).
    """
    return bool(spec.arch.indexer[0]) and ".indexer." in f".{name}."


def _selected(spec: ModelSpec, setup) -> tuple[Param, ...]:
    if setup.technique == "full":
        return spec.params
    if setup.technique in ("lora", "qlora"):
        return ()
    t = setup.trainable
    if t is None or isinstance(t, int):
        return _last_blocks(spec, t or 1)
    patterns = tuple(x.strip() for x in (t.split(",") if isinstance(t, str) else t) if x.strip())
    if all(x.isdigit() for x in patterns):
        return _last_blocks(spec, int(patterns[0]))
    return _by_patterns(spec, patterns)


def quantized_linears(spec: ModelSpec) -> tuple[Linear, ...]:
    """Linears bitsandbytes replaces through transformers' BitsAndBytesConfig (integrations/bitsandbytes.py
    replace_with_bnb_linear: nn.Linear and Conv1D) minus quantizers/base.py get_keys_to_not_convert: the output
    embedding, tied weights and the module of the model's last parameter; plus the model's _keep_in_fp32_modules
    (quantizer_bnb_4bit.py / quantizer_bnb_8bit.py pass them to get_modules_to_not_convert: T5's "wo")."""
    tied = {name.removesuffix(".weight") for pair in spec.tied for name in pair}
    last = spec.arch.last_module or (spec.params[-1].name.rsplit(".", 1)[0] if spec.params else "")
    keep = spec.arch.keep_in_fp32
    return tuple(m for m in spec.linears + spec.media_linears
                 if not m.is_output and m.name not in tied and m.name != last
                 and not any(_matches(m.name, k) or ("." + k + ".") in ("." + m.name + ".") for k in keep))
