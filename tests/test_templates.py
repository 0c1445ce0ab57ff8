"""The family registry, the naive reference family (fp16 and bf16, with and without a bias; on a GPU, marked `gpu`,
checked against torch), and rendering of untrusted (edited) templates."""

from __future__ import annotations

import pytest

from core.records import Problem
from sandbox.build import compile_cuda
from templates import FAMILIES, families_for_arch, get_family
from tests.gpu_reference import PAIRS, cases, check_kernel


def test_registry():
    assert "sm80_mma" in FAMILIES and "naive" in FAMILIES
    assert "naive" not in [f.name for f in families_for_arch("sm_90a")]  # a reference, not searched
    with pytest.raises(ValueError, match="unknown template family 'nope'"):
        get_family("nope")


@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
@pytest.mark.parametrize("layout", ["kn", "nk"])
@pytest.mark.parametrize("dtype,bias", PAIRS, ids=lambda x: str(x))
def test_naive_compiles(arch, layout, dtype, bias, tmp_path):
    fam, p = get_family("naive"), Problem(17, 24, 40, layout, dtype, bias)
    for params in fam.space(p):
        source = fam.render(params, p)
        assert f"cvt.rn.{dtype}.f32" in source and ("int K, const unsigned short* __restrict__ bias)" in source) == bias
        b = compile_cuda(source, arch, cache_dir=tmp_path)
        assert b.ok and b.spill_bytes == 0, b.log
        spec = fam.launch(params, p)
        assert spec.grid[0] * spec.block[0] >= p.n and spec.grid[1] * spec.block[1] >= p.m


@pytest.mark.gpu
@pytest.mark.parametrize("params,problem", cases({"naive": ({"block_x": 16, "block_y": 16}, (77, 200, 2056))}))
def test_naive_is_exact_and_close_to_torch(params, problem):
    check_kernel("naive", params, problem)


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
