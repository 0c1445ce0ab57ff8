"""Shape parsing from the command line and from shape files."""

from __future__ import annotations

import pytest

from agent.shapes import ShapeError, parse_shape, parse_shape_list, read_shapes_file
from core.records import Problem


def test_parse_good_shapes():
    assert parse_shape("4096_4096_4096") == Problem(4096, 4096, 4096)
    assert parse_shape(" 1000_3000_2000 ", "nk") == Problem(1000, 3000, 2000, "nk")
    assert parse_shape_list("64_64_64,1_8_8,64_64_64") == [Problem(64, 64, 64), Problem(1, 8, 8)]


@pytest.mark.parametrize("text, match", [
    ("64_64", "malformed"), ("0_64_64", "positive"), ("-1_64_64", "malformed"), ("a_b_c", "malformed"),
    ("64_60_64", "multiples of 8"), ("64_64_12", "multiples of 8"), ("", "malformed"), ("64_64_64_64", "malformed"),
])
def test_bad_shapes(text, match):
    with pytest.raises(ShapeError, match=match):
        parse_shape(text)


def test_a_range_of_m():
    assert parse_shape("1-512_4096_4096:nk") == Problem(257, 4096, 4096, "nk", m_range=(1, 512))
    assert parse_shape("1-512_4096_4096:nk").key == "1-512_4096_4096:nk:f16"
    assert parse_shape("16-16_64_64") == Problem(16, 64, 64)  # one M: the plain problem and its key
    assert parse_shape("100-4000_64_64:kn:bf16:bias") == Problem(2050, 64, 64, "kn", "bf16", True, m_range=(100, 4000))
    gated = parse_shape("1-64_28672_4096:nk:bf16:silu_mul")  # a range with a fused epilogue: the key keeps both
    assert gated == Problem(33, 28672, 4096, "nk", "bf16", False, "silu_mul", m_range=(1, 64))
    assert gated.key == "1-64_28672_4096:nk:bf16:silu_mul"
    assert parse_shape_list("1-8_64_64,1-8_64_64:kn,8_64_64") == [Problem(5, 64, 64, m_range=(1, 8)),
                                                                 Problem(8, 64, 64)]


@pytest.mark.parametrize("text, match", [
    ("512-1_64_64", r"the M range 512-1 is empty \(reversed\): write it low-high, e.g. 1-512"),
    ("0-8_64_64", "M must be positive"), ("0-0_64_64", "positive"), ("1-_64_64", "malformed"),
    ("-8_64_64", "malformed"), ("1--8_64_64", "malformed"), ("1-8-9_64_64", "malformed"),
    ("1-300000_8192_8192", "32-bit"),  # A at the range's upper end
    ("1-4294967296_8_8", "32-bit"),
])
def test_bad_ranges(text, match):
    with pytest.raises(ShapeError, match=match):
        parse_shape(text)


def test_unknown_layout():
    with pytest.raises(ShapeError, match="unknown B layout"):
        parse_shape("64_64_64", "tn")


@pytest.mark.parametrize("text, defaults, problem", [
    ("16_4096_4096:nk", {}, Problem(16, 4096, 4096, "nk")),
    ("16_4096_4096:kn", {"b_layout": "nk", "dtype": "bf16"}, Problem(16, 4096, 4096, "kn", "bf16")),
    ("16_4096_4096:nk:bf16", {"bias": True}, Problem(16, 4096, 4096, "nk", "bf16")),  # a dtype names its bias too
    ("16_4096_4096:nk:fp16:bias", {}, Problem(16, 4096, 4096, "nk", "f16", True)),
    ("16_4096_4096:nk:f16", {"dtype": "bf16"}, Problem(16, 4096, 4096, "nk", "f16")),
    ("16_4096_4096", {"b_layout": "nk", "dtype": "fp16", "bias": True}, Problem(16, 4096, 4096, "nk", "f16", True)),
    ("16_4096_4096", {"dtype": "bf16"}, Problem(16, 4096, 4096, "kn", "bf16")),
    ("16_28672_4096:nk:bf16:bias:silu_mul", {}, Problem(16, 28672, 4096, "nk", "bf16", True, "silu_mul")),
    ("16_4096_4096:nk:f16:residual", {"bias": True}, Problem(16, 4096, 4096, "nk", "f16", False, "residual")),
    ("16_4096_4096:nk:f16:bias", {"epilogue": "relu"}, Problem(16, 4096, 4096, "nk", "f16", True)),  # named: none
    ("16_4096_4096:nk", {"epilogue": "gelu_tanh"}, Problem(16, 4096, 4096, "nk", "f16", False, "gelu_tanh")),
    # the dtype may be left out: --dtype's, with the shape's own bias and epilogue
    ("16_4096_4096:nk:relu2", {"dtype": "bf16", "bias": True}, Problem(16, 4096, 4096, "nk", "bf16", False, "relu2")),
    ("16_4096_4096:nk:bias:gelu", {}, Problem(16, 4096, 4096, "nk", "f16", True, "gelu")),
])
def test_layout_dtype_and_bias_fields(text, defaults, problem):
    assert parse_shape(text, **defaults) == problem
    assert parse_shape(problem.key) == problem  # the key the tables print reads back as the same problem


@pytest.mark.parametrize("text, match", [
    ("64_64_64:tn", "unknown B layout 'tn'"), ("64_64_64:nk:fp32", "unknown dtype 'fp32'"),
    ("64_64_64:nk:bf16:swiglu", "expected 'bias' and/or an epilogue"),
    ("64_64_64:nk:bf16:bias:x", "expected 'bias' and/or an epilogue"),
    ("64_64_64:nk:bf16:relu:bias", "expected 'bias' and/or an epilogue"),
    ("64_64_64:nk:bf16:bias:relu:relu", "malformed"), ("64_24_64:nk:f16:silu_mul", "multiple of 16"),
    ("64_64_64::bf16", "malformed"), ("64_64_64:", "malformed"),
])
def test_bad_fields(text, match):
    with pytest.raises(ShapeError, match=match):
        parse_shape(text)


def test_shapes_file_with_comments(tmp_path):
    f = tmp_path / "s.txt"
    f.write_text("# header\n64_64_64  # tiny\n\n1024_1024_1024\n")
    assert read_shapes_file(f) == [Problem(64, 64, 64), Problem(1024, 1024, 1024)]


def test_shapes_file_mixes_plain_and_full_lines(tmp_path):
    f = tmp_path / "s.txt"
    f.write_text("# recorded\n64_64_64\n8_1024_4096:nk:bf16:bias  # calls: 4\n8_1024_4096:nk:bf16\n")
    assert read_shapes_file(f, "nk", "fp16") == [Problem(64, 64, 64, "nk"), Problem(8, 1024, 4096, "nk", "bf16", True),
                                                 Problem(8, 1024, 4096, "nk", "bf16")]
    f.write_text("64_64_64\n64_64_64:nk:int8\n")
    with pytest.raises(ShapeError, match=r"s.txt:2: unknown dtype 'int8'"):
        read_shapes_file(f)


def test_shapes_file_junk_line_names_its_number(tmp_path):
    f = tmp_path / "s.txt"
    f.write_text("64_64_64\n# ok\nhello\n")
    with pytest.raises(ShapeError, match=r"s.txt:3: malformed shape 'hello'"):
        read_shapes_file(f)


def test_shapes_file_missing_or_empty(tmp_path):
    with pytest.raises(ShapeError, match="cannot read"):
        read_shapes_file(tmp_path / "nope.txt")
    (tmp_path / "e.txt").write_text("# nothing\n")
    with pytest.raises(ShapeError, match="holds no shape"):
        read_shapes_file(tmp_path / "e.txt")


def test_dev_suite_parses():
    from pathlib import Path

    dev = Path(__file__).resolve().parents[2] / "shared" / "shapes" / "dev.txt"
    if not dev.is_file():
        pytest.skip("shared/ is not beside the checkout")
    assert len(read_shapes_file(dev)) == 28
