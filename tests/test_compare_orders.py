"""tools/compare_orders.py on the CPU: both revisions' lists of each problem (HEAD's from a git archive), the union
sweep.py takes, and the table of which list held each problem's best, from a sweep file written here."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tools import compare_orders

ROOT = Path(__file__).parents[1]


def _sweep_file(path: Path, speeds: dict[tuple[str, str], float]) -> None:
    rows = [{"problem": f"{problem}:f16", "params": json.loads(params), "result": {
        "status": "ok", "warm": {"median_us": 10.0}, "cublas_warm": {"median_us": 10.0 * speed}}}
            for (problem, params), speed in speeds.items()]
    rows.append({"problem": "657_9984_3144:nk:f16", "params": None, "result": {"status": "invalid"}})
    path.write_text(json.dumps({"rows": rows}))


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="not a git checkout")
def test_prepare_lists_both_orders_and_their_union(tmp_path, capsys):
    out = tmp_path / "orders.json"
    assert compare_orders.main(["prepare", "--rev", "HEAD", "--shapes", "657_9984_3144:nk,64_64_64", "--top", "3",
                                "--out", str(out)]) == 0
    union, lists = json.loads(out.read_text()), json.loads(out.with_suffix(".lists.json").read_text())
    assert set(union) == {"657_9984_3144:nk", "64_64_64:kn"} and lists["rev"] == "HEAD"
    for problem, settings in union.items():
        both = lists["old"][problem] + lists["new"][problem]
        assert len(lists["new"][problem]) <= 3 and {compare_orders.key(p) for p in settings} == {
            compare_orders.key(p) for p in both}
    assert "over 2 problems" in capsys.readouterr().out

    first, second = (compare_orders.key(p) for p in lists["new"]["657_9984_3144:nk"][:2])
    lists["old"]["657_9984_3144:nk"] = [json.loads(second)]  # the other revision listed only the second
    out.with_suffix(".lists.json").write_text(json.dumps(lists))
    sweep = tmp_path / "sweep.json"
    _sweep_file(sweep, {("657_9984_3144:nk", first): 1.2, ("657_9984_3144:nk", second): 0.9})
    assert compare_orders.main(["table", str(out), str(sweep)]) == 0
    printed = capsys.readouterr().out
    assert "| 657_9984_3144:nk | 0.900 (1) | 1.200 (1) |" in printed and "| 64_64_64:kn | - | - |" in printed
    assert "old: geomean of the bests 0.900 over 1 problems" in printed


@pytest.mark.parametrize("argv", [["table", "none.json", "none.json"], ["prepare", "--rev", "no-such-rev", "--shapes",
                                  "64_64_64", "--out", "o.json"], ["prepare", "--rev", "HEAD", "--out", "o.json"]])
def test_bad_input_exits_2_and_writes_nothing(tmp_path, monkeypatch, argv, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        compare_orders.main(argv)
    assert e.value.code == 2 and "compare_orders:" in capsys.readouterr().err and not list(tmp_path.iterdir())
