"""Tiny random models of transformers' architectures: each config's dimensions set small under the names configs
use for them (nested configs too), one layer of each layer type, per-layer overrides and MLA's relations kept, so
that `tools/arch_probe.py` can build and run any causal LM on the CPU in seconds."""

from __future__ import annotations

import torch

# a tiny model's dimensions under the names configs use for them (set only where the config has the name)
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256, "max_position_embeddings": 256,
        "n_embd": 64, "n_layer": 2, "n_head": 4, "d_model": 64, "num_layers": 2, "ffn_dim": 128,
        "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "num_experts": 4, "n_routed_experts": 4,
        "num_experts_per_tok": 2, "kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 8, "v_head_dim": 16, "sliding_window": 64, "first_k_dense_replace": 1, "rotary_dim": 8,
        "n_group": 2, "topk_group": 1, "index_n_heads": 4, "index_head_dim": 16, "index_topk": 8,
        "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_headdim": 16, "mamba_d_state": 16,
        "mamba_d_ssm": 128}


def causal_lms() -> list[str]:
    """Every model type transformers builds as a causal LM."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def tiny_model(model_type: str, every_kind: bool = True, overrides: dict | None = None) -> torch.nn.Module:
    """The architecture as a tiny fp32 model with random weights (seeded; those init leaves constant too), in eval
    mode (shrink; `every_kind`: one layer of each of its layer types; `overrides`: config fields set after shrinking,
    a variant of the architecture)."""
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config = CONFIG_MAPPING[model_type]()
    shrink(config, every_kind=every_kind)
    for name, value in (overrides or {}).items():
        setattr(config, name, value)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():  # what init leaves constant (norms' ones and zeros, zero biases) made random, as training
        for p in model.parameters():  # would: a fusion that takes one norm for another shows in the logits
            if p.is_floating_point() and p.numel() > 1 and bool((p == p.flatten()[0]).all()):
                p.add_(torch.randn_like(p) * 0.1)
    return model


def shrink(config, depth: int = 0, every_kind: bool = True) -> None:
    """TINY's dimensions set on `config` where it has the name as a plain integer (not a property without a
    setter), and on the configs inside it (a multimodal model's text and vision configs); token ids moved into the
    tiny vocabulary; where it lists `layer_types` (hybrid models: linear and full attention, sliding windows), one
    layer of each type (at least TINY's depth), so that every kind of layer is fused and checked. A heterogeneous
    config's per-layer overrides (Gemma 4's wider full-attention heads) go to the tiny layers of the same types,
    scaled as their global values were; an MLA config keeps its rotary head_dim and its q/k head width; where the
    last layers share earlier layers' keys and values (Gemma 3n), the tiny model has as many of those as of the
    others."""
    per_layer = _without_per_layer(config)
    mla = {n: getattr(config, n, None)
           for n in ("head_dim", "qk_rope_head_dim", "qk_head_dim", "num_attention_heads", "num_key_value_heads")}
    for name, value in TINY.items():
        prop = getattr(type(config), name, None)
        if isinstance(prop, property) and prop.fset is None:
            continue
        if hasattr(config, name) and isinstance(getattr(config, name), int | type(None)):
            _set(config, name, value)
    kinds = getattr(config, "layer_types", None) if every_kind else None  # hybrid models: every kind of layer
    if isinstance(kinds, (list, tuple)) and kinds and all(isinstance(k, str) for k in kinds):
        kinds = list(dict.fromkeys(kinds))
        layers = max(len(kinds), TINY["num_hidden_layers"])
        shared = getattr(config, "num_kv_shared_layers", None)  # the last layers reuse earlier layers' keys and values
        sharing = isinstance(shared, int) and not isinstance(shared, bool) and shared > 0
        total = layers * (2 if sharing else 1)  # sharing: one sharing layer of each type after one computing its own
        try:
            if (depth_name := _depth_name(config)) is not None:
                setattr(config, depth_name, total)
            config.layer_types = (kinds * total)[:total]
            if sharing:
                config.num_kv_shared_layers = layers
        except (AttributeError, ValueError, TypeError):  # a validated or derived field
            pass
    if isinstance(mla["qk_rope_head_dim"], int) and mla["head_dim"] == mla["qk_rope_head_dim"]:
        _set(config, "head_dim", config.qk_rope_head_dim)  # the rotary's width (DeepSeek's MLA)
    if isinstance(mla["qk_head_dim"], int) and isinstance(getattr(config, "qk_nope_head_dim", None), int):
        _set(config, "qk_head_dim", config.qk_nope_head_dim + config.qk_rope_head_dim)
    if isinstance(mla["qk_rope_head_dim"], int) and mla["num_key_value_heads"] == mla["num_attention_heads"]:
        _set(config, "num_key_value_heads", config.num_attention_heads)  # MLA: a key and value a head
    if per_layer is not None:
        _with_per_layer(config, *per_layer)
    for i, name in enumerate(("pad_token_id", "bos_token_id", "eos_token_id")):  # inside the tiny vocabulary
        if isinstance(getattr(config, name, None), int) and getattr(config, name) >= TINY["vocab_size"]:
            setattr(config, name, i)
    for sub in list(vars(config).values()) if depth < 2 else []:
        if hasattr(sub, "to_dict") and hasattr(sub, "model_type"):  # a nested config
            shrink(sub, depth + 1, every_kind)


def _depth_name(config) -> str | None:
    """The name under which the config holds its number of layers."""
    names = ("num_hidden_layers", "n_layer", "num_layers")
    return next((n for n in names if isinstance(getattr(config, n, None), int)), None)


def _set(config, name: str, value) -> None:
    try:
        setattr(config, name, value)
    except (AttributeError, ValueError, TypeError):  # a validated or derived field
        pass


def _without_per_layer(config) -> tuple[dict, dict] | None:
    """A heterogeneous config (transformers' per_layer_config) made homogeneous: its overrides by layer type (by
    layer index where it lists no layer_types) and the global values they override; None for other configs."""
    spec = vars(config).get("_heterogeneity_spec")
    if spec is None:
        return None
    kinds = vars(config).get("layer_types") or []
    by_kind: dict = {}
    for index, overrides in sorted(spec.per_layer_overrides.items()):
        by_kind.setdefault(kinds[index] if index < len(kinds) else index, dict(overrides))
    seen = {name: config._getattr_without_heterogeneous_validation(name, None)
            for overrides in by_kind.values() for name in overrides}
    config.per_layer_config = None
    return by_kind, seen


def _with_per_layer(config, by_kind: dict, seen: dict) -> None:
    """The overrides again on the tiny layers of their types; a dimension the tiny config changed scaled alike."""
    kinds = getattr(config, "layer_types", None) or []
    depth_name = _depth_name(config)
    depth = getattr(config, depth_name) if depth_name else len(kinds)
    per_layer = {}
    for index in range(depth):
        overrides = by_kind.get(kinds[index] if index < len(kinds) else index)
        if overrides is None:
            continue
        per_layer[index] = {}
        for name, value in overrides.items():
            was, now = seen.get(name), getattr(config, name, None)
            scaled = isinstance(value, int) and isinstance(was, int) and was > 0 and isinstance(now, int)
            per_layer[index][name] = max(1, now * value // was) if scaled else value
    if per_layer:
        config.per_layer_config = per_layer
