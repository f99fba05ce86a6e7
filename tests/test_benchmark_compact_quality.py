"""CPU smoke test of benchmarks/compact_quality.py (the compact layouts against fp32 AdamW on real text): a tiny
Llama on the installed packages' source for 20 steps, its outputs' structure, finite and falling losses, the
layouts' state sizes, the budget stop; and benchmarks/svg_plot.py's axes."""

from __future__ import annotations

import csv
import importlib.util
import math
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from lightning_megatrain.optim.compact_adam import HOST_STATE_LAYOUTS

from helpers.benchmarks import load_benchmark

TINY = ["--hidden", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--intermediate", "128",
        "--vocab", "512", "--seq", "64", "--batch", "4", "--eval-rows", "8", "--tokenizer-chars", "200000",
        "--warmup", "5", "--lr", "3e-3", "--avg-last", "5", "--smooth", "3", "--device", "cpu",
        "--compile-optimizer", "off"]
SVG = "{http://www.w3.org/2000/svg}"



quality = load_benchmark("compact_quality")
svg_plot = importlib.import_module("svg_plot")  # on sys.path now; a dataclass needs its module registered


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("quality")
    return out, quality.main([*TINY, "--steps", "20", "--eval-every", "10", "--out", str(out)])


def test_summary_has_every_variant_and_the_verdict(run):
    out, summary = run
    assert summary == __import__("json").loads((out / "summary.json").read_text())
    assert (summary["steps"], summary["tokens"], summary["stopped_by_budget"]) == (20, 20 * 4 * 64, False)
    per = summary["variants"]
    assert list(per) == list(quality.VARIANTS)
    assert per["adamw_fp32"]["train_rel_diff"] == per["adamw_fp32"]["held_out_rel_diff"] == 0.0
    for name, row in per.items():
        assert row["nonfinite_losses"] == 0 and row["median_step_s"] > 0
        assert row["seconds"] == pytest.approx(20 * row["s_per_step"])
        assert row["final_held_out_loss"] < row["initial_held_out_loss"], name
        assert isinstance(row["within_1pct"], bool)
        assert row["within_1pct"] == (abs(row["train_rel_diff"]) <= 0.01 and abs(row["held_out_rel_diff"]) <= 0.01)
    assert summary["within_1pct"] == all(r["within_1pct"] for n, r in per.items() if n != "adamw_fp32")
    # every variant starts from the same weights on the same rows (bf16 weights round them: a close start)
    initial = [r["initial_held_out_loss"] for r in per.values()]
    assert max(initial) - min(initial) < 1e-2 and initial[0] == pytest.approx(math.log(512), rel=0.02)
    assert summary["data"]["train_tokens"] == 20 * 4 * 64 and summary["data"]["train_epochs"] == 1.0
    assert summary["data"]["held_out_tokens"] == 8 * 64 and summary["data"]["vocab"] == 512


def test_each_variant_runs_its_layout(run):
    """The optimizer state and weight dtype are the layout's: 8-bit moments (+ scales), a bf16 compensation for
    Kahan, bf16 weights; fp32 AdamW keeps 8 B/param. The CPU's eager kernel checked against itself is exact."""
    _, summary = run
    per = summary["variants"]
    assert per["adamw_fp32"]["optimizer_state_bytes_per_param"] == pytest.approx(8.0, abs=0.01)
    for name in ("int8_moments", "compact_kahan", "compact"):
        layout = HOST_STATE_LAYOUTS[name]
        nbytes = layout.bytes_per_param()
        compensation = nbytes["weights"] - layout.weight_dtype.itemsize
        assert per[name]["optimizer_state_bytes_per_param"] == pytest.approx(
            nbytes["optimizer states"] + compensation, abs=0.01), name
        assert per[name]["weight_dtype"] == str(layout.weight_dtype).replace("torch.", "")
        assert summary["data"]["kernel_check"][name]["max_abs_diff"] == 0.0


def test_curves_csv_and_plots(run):
    out, summary = run
    with open(out / "curves.csv") as f:
        rows = list(csv.DictReader(f))
    assert tuple(rows[0]) == quality.CSV_KEYS
    for name in quality.VARIANTS:
        mine = [r for r in rows if r["variant"] == name]
        assert [int(r["step"]) for r in mine] == list(range(21))  # step 0: the held-out loss before training
        assert [int(r["step"]) for r in mine if r["held_out_loss"]] == [0, 10, 20]
        train = [float(r["train_loss"]) for r in mine[1:]]
        assert all(math.isfinite(x) for x in train)
        assert sum(train[-5:]) / 5 < sum(train[:5]) / 5 - 0.3, name  # from ~ln(512) = 6.2: falls visibly
        assert sum(train[-5:]) / 5 == pytest.approx(summary["variants"][name]["final_train_loss"])
        assert float(mine[1]["lr"]) == pytest.approx(3e-3 / 5)  # the first warmup step
    for name, lines in (("loss", 8), ("loss_tail", 8), ("rel_diff", 2 + 2 * 3)):
        root = ET.parse(out / f"{name}.svg").getroot()
        assert len(root.findall(f"{SVG}polyline")) == lines, name


def test_budget_stops_cleanly_with_what_it_has(tmp_path):
    summary = quality.main([*TINY, "--steps", "30", "--budget-s", "0", "--variants", "adamw_fp32,compact",
                            "--out", str(tmp_path)])
    assert (summary["steps"], summary["stopped_by_budget"], summary["tokens"]) == (0, True, 0)
    assert list(summary["variants"]) == ["adamw_fp32", "compact"]
    with open(tmp_path / "curves.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["step"], r["variant"]) for r in rows] == [("0", "adamw_fp32"), ("0", "compact")]
    assert (tmp_path / "summary.json").exists() and not (tmp_path / "loss.svg").exists()


def test_argument_errors(tmp_path):
    with pytest.raises(SystemExit):  # argparse's error: unknown variant
        quality.parse_args(["--out", str(tmp_path), "--variants", "adamw_fp32,bf16"])
    with pytest.raises(SystemExit, match="--packages: 'no_such_package_xyz' is not installed"):
        quality.source_files(["no_such_package_xyz"])
    with pytest.raises(SystemExit, match="fewer than one row of --seq 64"):
        quality.rows_of(__import__("torch").arange(10), 4, 64)


def test_lr_schedule():
    f = lambda s: quality.lr_factor(s, warmup=10, total=110, min_ratio=0.1)
    assert [f(0), f(9)] == [pytest.approx(0.1), 1.0]
    assert f(60) == pytest.approx(0.55) and f(110) == pytest.approx(0.1) and f(200) == pytest.approx(0.1)


def test_svg_ticks_and_mapping():
    assert svg_plot.ticks(0, 1) == [0, 0.2, 0.4, 0.6, 0.8, 1.0]
    assert svg_plot.ticks(2.37, 2.61) == [2.4, 2.45, 2.5, 2.55, 2.6]
    doc = svg_plot.line_chart([svg_plot.Series("a", [0, 10], [1.0, 3.0]), svg_plot.Series("", [0], [float("nan")])],
                              title="t", xlabel="x", ylabel="y", width=400, height=300)
    root = ET.fromstring(doc)
    line, empty = root.findall(f"{SVG}polyline")
    # the plot area is [64, 400 - 210] x [34, 300 - 46]: the first point bottom left, the last top right
    assert line.get("points") == "64.0,254.0 190.0,34.0" and empty.get("points") == ""
    assert [t.text for t in root.findall(f"{SVG}text")].count("a") == 1  # the unlabelled series has no legend
