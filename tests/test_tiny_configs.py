"""tools/tiny_configs.py: a config made tiny keeps what its model needs to build and run: the tiny dimensions where
the config has their names (nested configs too), one layer of each layer type, a heterogeneous config's per-layer
overrides on the layers of their types, MLA's rotary width and head counts."""

from __future__ import annotations

import pytest

from tests.test_e2e_tools import load_tool

tiny = load_tool("tiny_configs")


class FakeConfig:
    """A config as transformers writes them: dimensions as attributes, a derived one as a read-only property, a
    nested config (a multimodal model's text config)."""

    model_type = "fake"

    def __init__(self, nested: bool = True):
        self.hidden_size, self.num_attention_heads, self.eos_token_id, self.name = 4096, 32, 50000, "kept"
        self.text_config = FakeConfig(nested=False) if nested else None

    @property
    def head_dim(self):
        return self.hidden_size // self.num_attention_heads

    def to_dict(self):
        return dict(vars(self))


def test_shrink_sets_the_tiny_dimensions_inside_nested_configs_and_skips_read_only_ones():
    config = FakeConfig()
    tiny.shrink(config)
    for c in (config, config.text_config):
        assert (c.hidden_size, c.num_attention_heads, c.head_dim, c.name) == (64, 4, 16, "kept")
        assert c.eos_token_id == 2  # inside the tiny vocabulary


def test_shrink_keeps_one_layer_of_each_type_of_a_hybrid_model():
    config = FakeConfig(nested=False)
    config.num_hidden_layers = 48
    config.layer_types = ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 44
    tiny.shrink(config)
    assert (config.num_hidden_layers, config.layer_types) == (2, ["linear_attention", "full_attention"])
    config.layer_types, config.num_hidden_layers = ["a", "b", "c", "a"], 4  # three kinds: three layers
    tiny.shrink(config)
    assert (config.num_hidden_layers, config.layer_types) == (3, ["a", "b", "c"])
    config.layer_types = ["full_attention"] * 48  # one kind: TINY's depth
    tiny.shrink(config)
    assert (config.num_hidden_layers, config.layer_types) == (2, ["full_attention"] * 2)


def test_a_tiny_model_has_no_parameter_that_init_left_constant():
    pytest.importorskip("transformers")
    model = tiny.tiny_model("llama")
    norms = [p for n, p in model.named_parameters() if "norm" in n]
    assert norms and all(not bool((p == p.flatten()[0]).all()) for p in norms)  # ones at init: random now


class MlaConfig:
    """DeepSeek-style attention: the rotary's width is head_dim, q and k heads are nope + rope wide, a key and a
    value a head."""

    def __init__(self):
        self.hidden_size, self.num_attention_heads, self.num_key_value_heads = 7168, 128, 128
        self.qk_rope_head_dim = self.head_dim = 64
        self.qk_nope_head_dim, self.qk_head_dim = 128, 192


def test_shrink_keeps_an_mla_configs_relations():
    config = MlaConfig()
    tiny.shrink(config)
    assert config.head_dim == config.qk_rope_head_dim == tiny.TINY["qk_rope_head_dim"]
    assert config.qk_head_dim == config.qk_nope_head_dim + config.qk_rope_head_dim
    assert config.num_key_value_heads == config.num_attention_heads == tiny.TINY["num_attention_heads"]
    gqa = FakeConfig(nested=False)  # not MLA: GQA's tiny head counts
    gqa.num_key_value_heads = 32
    tiny.shrink(gqa)
    assert (gqa.num_attention_heads, gqa.num_key_value_heads) == (4, 2)


class Spec:
    def __init__(self, overrides):
        self.per_layer_overrides = overrides


class HeteroConfig:
    """A heterogeneous config as transformers keeps it: per-layer overrides by layer index, readable globally only
    through `_getattr_without_heterogeneous_validation` (a plain read of an overridden name raises)."""

    def __init__(self):
        self.hidden_size, self.head_dim, self.num_hidden_layers = 2304, 256, 12
        self.layer_types = (["sliding_attention"] * 5 + ["full_attention"]) * 2
        self.per_layer_config = {5: {"head_dim": 512}, 11: {"head_dim": 512}}

    def __getattribute__(self, name):
        spec = object.__getattribute__(self, "__dict__").get("_heterogeneity_spec")
        if spec is not None and any(name in o for o in spec.per_layer_overrides.values()):
            raise RuntimeError(f"'{name}' is a per-layer attribute")
        return object.__getattribute__(self, name)

    def _getattr_without_heterogeneous_validation(self, name, default):
        return object.__getattribute__(self, "__dict__").get(name, default)

    @property
    def per_layer_config(self):
        return self.__dict__.get("_heterogeneity_spec")

    @per_layer_config.setter
    def per_layer_config(self, overrides):
        if overrides is None:
            self.__dict__.pop("_heterogeneity_spec", None)
        else:
            self.__dict__["_heterogeneity_spec"] = Spec(dict(overrides))


def test_shrink_moves_a_heterogeneous_configs_overrides_to_the_tiny_layers_of_their_types():
    config = HeteroConfig()
    tiny.shrink(config)
    assert config.__dict__["layer_types"] == ["sliding_attention", "full_attention"]
    assert config.__dict__["num_hidden_layers"] == 2 and config.__dict__["head_dim"] == tiny.TINY["head_dim"]
    # the full-attention layer's heads twice as wide as the global ones, as before
    assert config.__dict__["_heterogeneity_spec"].per_layer_overrides == {1: {"head_dim": 2 * tiny.TINY["head_dim"]}}


def test_shrink_keeps_layers_that_share_keys_and_values_after_ones_that_compute_them():
    config = FakeConfig(nested=False)
    config.num_hidden_layers, config.num_kv_shared_layers = 35, 15  # Gemma 3n's: the last 15 reuse earlier KV
    config.layer_types = (["sliding_attention"] * 4 + ["full_attention"]) * 7
    tiny.shrink(config)
    assert config.num_hidden_layers == 4 and config.num_kv_shared_layers == 2
    assert config.layer_types == ["sliding_attention", "full_attention"] * 2
