"""tools/inductor_ref.py on the CPU: each problem's model form computes what the project's epilogue defines (gate
and up as two projections against the merged, interleaved weight), and its errors are one line with exit 2."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from core.records import Problem  # noqa: E402
from tools import inductor_ref  # noqa: E402


@pytest.mark.parametrize("epilogue", ["none", "silu_mul", "residual", "gelu_tanh", "gelu_mul"])
@pytest.mark.parametrize("dtype,bias,layout", [("f16", False, "nk"), ("bf16", True, "nk"), ("f16", True, "kn")])
def test_the_model_form_computes_the_projects_epilogue(epilogue, dtype, bias, layout):
    p = Problem(3, 48, 72, layout, dtype, bias, epilogue)
    fn, args, expected = inductor_ref.model_form(p)
    out = fn(*args).double()
    assert out.shape == expected.shape == (3, p.out_n)
    assert ((out - expected).norm() / expected.norm()).item() < 2e-2  # the dtype's roundings, not a wrong pairing
    if epilogue == "silu_mul":  # the halves swapped would be far off
        x, wg, wu, bg, bu = args
        swapped = fn(x, wu, wg, bu, bg).double()
        assert ((swapped - expected).norm() / expected.norm()).item() > 0.3


def test_bad_input_is_one_line_and_exit_2(capsys):
    assert inductor_ref.main(["--shapes", "12_x_4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:")
    if not torch.cuda.is_available():
        assert inductor_ref.main(["--shapes", "1_64_64:nk"]) == 2
        assert "needs a CUDA GPU" in capsys.readouterr().err
