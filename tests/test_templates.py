"""The family registry, the naive reference family, and rendering of untrusted (edited) templates."""

from __future__ import annotations

import pytest

from core.records import Problem
from sandbox.build import compile_cuda
from templates import FAMILIES, families_for_arch, get_family


def test_registry():
    assert "sm80_mma" in FAMILIES and "naive" in FAMILIES
    assert "naive" not in [f.name for f in families_for_arch("sm_90a")]  # a reference, not searched
    with pytest.raises(ValueError, match="unknown template family 'nope'"):
        get_family("nope")


@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
@pytest.mark.parametrize("layout", ["kn", "nk"])
def test_naive_compiles(arch, layout, tmp_path):
    fam, p = get_family("naive"), Problem(17, 24, 40, layout)
    for params in fam.space(p):
        b = compile_cuda(fam.render(params, p), arch, cache_dir=tmp_path)
        assert b.ok and b.spill_bytes == 0, b.log
        spec = fam.launch(params, p)
        assert spec.grid[0] * spec.block[0] >= p.n and spec.grid[1] * spec.block[1] >= p.m


def test_layout_reaches_the_template():
    fam = get_family("naive")
    kn, nk = (fam.render({}, Problem(8, 8, 8, layout)) for layout in ("kn", "nk"))
    assert "k * N + col" in kn and "col * K + k" in nk


def test_edited_template_cannot_reach_python():
    fam = get_family("naive")
    evil = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(Exception, match="unsafe"):
        fam.render({}, Problem(8, 8, 8), template=evil)


def test_undefined_template_variable_is_an_error():
    with pytest.raises(Exception, match="nope"):
        get_family("naive").render({}, Problem(8, 8, 8), template="{{ nope }}")


def test_params_are_validated_by_the_family():
    with pytest.raises(ValueError, match="block_x"):
        get_family("naive").parse({"block_x": 7}, Problem(8, 8, 8))
    with pytest.raises(ValueError, match="extra|not permitted|Extra"):
        get_family("naive").parse({"bogus": 1}, Problem(8, 8, 8))
