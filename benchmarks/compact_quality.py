"""Training quality of the compact host-state layouts against fp32 AdamW, on real text (docs/compact-state.md).

Every variant trains the same Llama-shaped model from the same initial weights on the same batches in the same order;
only the optimizer and its weight format differ:

- ``adamw_fp32``: ``torch.optim.AdamW`` on fp32 parameters (the reference; fused on a GPU);
- ``int8_moments``, ``compact_kahan``, ``compact``: ``CompactAdamW`` in the formats ``HOST_STATE_LAYOUTS`` gives each
  ``host_state`` (fp32 weights and 8-bit moments; bf16 weights with Kahan compensation; bf16 weights with stochastic
  rounding).

Same hyperparameters for all: AdamW betas (0.9, 0.95), eps 1e-8, weight decay 0.1 on matrices (none on norms),
linear warmup then cosine decay to 10% of the peak lr, gradient norm clipped at 1.0 (the norm accumulated in fp32,
the factor multiplied into the gradients in their dtype), bf16 autocast. The model and the optimizer run on one
device (the GPU): the kernel is the one the host runs (optim/compact_adam.py, compiled on a GPU through Triton), and
``kernel_check`` in the summary gives its largest difference from the CPU's eager kernel after a few steps.

How the bf16-weight variants (``compact_kahan``, ``compact``) compute, as the engine does with a compact
``host_state`` (whose layer slots and resident compute copies are its bf16 masters): their parameters are bf16
tensors, the optimizer's weights themselves, and the forward reads them directly under bf16 autocast; the
embedding's output is therefore bf16, and so is the residual stream, where the fp32 variants' is fp32 (their
embedding is fp32) and their matmuls' operands are autocast's round-to-nearest bf16 copies of the fp32 weights.
Autograd returns the gradients in bf16, the compact layouts' gradient dtype. Buffers (the rotary frequencies) stay
fp32.

Data: the ``.py`` files (source and docstrings) of the installed ``--packages``, listed in sorted path order; one in
``--held-out-every`` (by a CRC32 of its path) is held out, the rest shuffled with ``--seed``. A byte-level BPE
tokenizer (data/tokenizer.py's trainer) is trained on the first ``--tokenizer-chars`` characters of the training
files; the training files are then tokenized, in that order, into rows of ``--seq`` tokens (files separated by EOS)
until ``--steps`` x ``--batch`` rows exist, and the rows are shuffled once with ``--seed``: step i takes the same
rows for every variant. The held-out loss is the mean over ``--eval-rows`` rows of held-out files, every
``--eval-every`` steps. Nothing is written outside ``--out`` except a temporary folder for the tokenizer.

The variants run in lock step (step i of each, then step i + 1), so a run stopped by ``--budget-s`` (checked before
each step, with the time of one more step and of the final evaluation held back) has the same number of steps for
every variant, and the outputs are rewritten at every evaluation.

Time (defaults: hidden 768, 12 layers, MLP 2048, vocab 16,384 untied: 110M parameters; 16 x 512 = 8,192 tokens per
step): 6 x 110e6 x 8,192 = 5.4 TFLOP per step. Measured on the H200: fp32 AdamW 0.055 s per step, the compact
layouts 0.11 s (the compact kernel runs a chunk of 2^20 elements per call), about 0.1 s per layout and step with the
evaluations, the data and tokenizer 10 s, the first compiles about 25 s: all four layouts for 1,000 steps need about
7.5 minutes (``--budget-s 450``), three 5.5. ``--budget-s`` counts from the start of ``main``, after the imports: a
command limit needs about 30 s more.

Outputs in ``--out``: ``curves.csv`` (step, variant, train loss, held-out loss where evaluated, lr, gradient norm),
``summary.json`` (final train loss = mean of the last ``--avg-last`` steps, final held-out loss, relative
differences against ``adamw_fp32`` and the within-1% verdict, steps, tokens, seconds per variant, data and config),
``loss.svg`` (all steps), ``loss_tail.svg`` (the second half, where a 1% difference is visible) and ``rel_diff.svg``
(each variant's train and held-out loss relative to ``adamw_fp32``, in %, with the 1% band); a table on stdout.

Usage (one H200, about 7.5 minutes):
    python benchmarks/compact_quality.py --out DIR
    python benchmarks/compact_quality.py --variants adamw_fp32,compact --out DIR     (a subset; same data and seeds)
"""

from __future__ import annotations

import argparse
import copy
import csv
import importlib.util
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import torch

# the GPU machine's copy of the tree has the package uninstalled: import it from this checkout
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from svg_plot import COLORS, Series, line_chart  # noqa: E402

from lightning_megatrain.optim.compact_adam import (  # noqa: E402
    HOST_STATE_LAYOUTS,
    CompactAdamW,
    state_nbytes,
)
from lightning_megatrain.optim.rounding import BLOCK  # noqa: E402

REFERENCE = "adamw_fp32"
VARIANTS = (REFERENCE, "int8_moments", "compact_kahan", "compact")  # the last three: HOST_STATE_LAYOUTS keys
TOLERANCE = 0.01  # the verdict: |relative difference| of the final train and held-out loss against REFERENCE
CSV_KEYS = ("step", "variant", "train_loss", "held_out_loss", "lr", "grad_norm")


# ----------------------------------------------------------------------------------------------------------- data
def source_files(packages: list[str]) -> list[tuple[str, Path]]:
    """(``package/relative/path.py``, path) of every ``.py`` file of the installed ``packages``, sorted by name."""
    files = []
    for name in packages:
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:
            raise SystemExit(f"--packages: {name!r} is not installed here; choose installed packages")
        root = Path(spec.origin).parent
        files += [(f"{name}/{p.relative_to(root).as_posix()}", p) for p in root.rglob("*.py")]
    return sorted(files)


def split_files(files: list[tuple[str, Path]], every: int, seed: int) -> tuple[list, list]:
    """(training files shuffled with ``seed``, held-out files shuffled with ``seed + 1``): a file is held out when
    the CRC32 of its name is divisible by ``every`` (independent of the package versions' other files)."""
    held = [f for f in files if zlib.crc32(f[0].encode()) % every == 0]
    train = [f for f in files if zlib.crc32(f[0].encode()) % every != 0]
    random.Random(seed).shuffle(train)
    random.Random(seed + 1).shuffle(held)
    return train, held


def read_texts(files: list[tuple[str, Path]], max_bytes: int = 1 << 20) -> Iterator[str]:
    """The files' text in order, skipping files over ``max_bytes`` (generated tables) and files not UTF-8."""
    for _, path in files:
        try:
            if path.stat().st_size <= max_bytes:
                yield path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue


def prefix_chars(files: list[tuple[str, Path]], n_chars: int) -> Iterator[str]:
    """The first files' texts, about ``n_chars`` characters in all (the tokenizer's training text)."""
    total = 0
    for text in read_texts(files):
        yield text
        total += len(text)
        if total >= n_chars:
            return


def token_stream(files: list[tuple[str, Path]], tokenizer, n_tokens: int) -> tuple[torch.Tensor, int]:
    """(the first ``n_tokens`` tokens of the files in order, an EOS after each file; files read). Fewer tokens when
    the files run out."""
    ids: list[int] = []
    group: list[str] = []
    used = 0

    def flush() -> None:
        for encoding in tokenizer.backend_tokenizer.encode_batch(group, add_special_tokens=False):
            ids.extend(encoding.ids)
            ids.append(tokenizer.eos_token_id)
        group.clear()

    for text in read_texts(files):
        group.append(text)
        used += 1
        if len(group) == 32:
            flush()
            if len(ids) >= n_tokens:
                break
    flush()
    return torch.tensor(ids[:n_tokens], dtype=torch.int64), used


def rows_of(stream: torch.Tensor, n_rows: int, seq: int) -> tuple[torch.Tensor, float]:
    """([n_rows, seq] consecutive rows of ``stream``, repeated if it is too short; epochs over the stream)."""
    need = n_rows * seq
    if stream.numel() < seq:
        raise SystemExit(f"only {stream.numel()} tokens of text found, fewer than one row of --seq {seq}")
    reps = -(-need // stream.numel())
    return stream.repeat(reps)[:need].view(n_rows, seq), need / stream.numel()


def build_data(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor, object, dict]:
    """(training rows [steps * batch, seq] in step order, held-out rows [eval_rows, seq], tokenizer, data facts)."""
    from lightning_megatrain.data.tokenizer import build_demo_tokenizer

    files = source_files(args.packages)
    train_files, held_files = split_files(files, args.held_out_every, args.seed)
    t = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = build_demo_tokenizer(tmp, corpus=prefix_chars(train_files, args.tokenizer_chars),
                                         vocab_size=args.vocab)
    tokenizer_s = time.perf_counter() - t
    n_train = args.steps * args.batch
    stream, train_used = token_stream(train_files, tokenizer, n_train * args.seq)
    train, epochs = rows_of(stream, n_train, args.seq)
    train = train[torch.randperm(n_train, generator=torch.Generator().manual_seed(args.seed))]
    held_stream, held_used = token_stream(held_files, tokenizer, args.eval_rows * args.seq)
    held, held_epochs = rows_of(held_stream, args.eval_rows, args.seq)
    versions = {}
    for name in args.packages:
        try:
            versions[name] = __import__(name).__version__
        except (ImportError, AttributeError):
            versions[name] = None
    facts = {"packages": versions, "files": len(files), "train_files": len(train_files),
             "held_out_files": len(held_files), "train_files_read": train_used, "held_out_files_read": held_used,
             "train_tokens": int(stream.numel()), "train_epochs": epochs, "held_out_tokens": int(held.numel()),
             "held_out_epochs": held_epochs, "tokenizer_chars": args.tokenizer_chars, "vocab": len(tokenizer),
             "tokenizer_s": tokenizer_s}
    return train, held, tokenizer, facts


# ---------------------------------------------------------------------------------------------- model, optimizer
def make_model(args: argparse.Namespace, vocab: int, tokenizer) -> torch.nn.Module:
    """The Llama-shaped model every variant starts from (fp32, on the CPU, initialised with ``--seed``)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=-(-vocab // 64) * 64, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.seq, tie_word_embeddings=False, attn_implementation="sdpa",
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(args.seed)
    return LlamaForCausalLM(config)


def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup over ``warmup`` steps, then cosine from 1 to ``min_ratio`` at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class Variant:
    """One model copy, its optimizer and schedule, its losses and time."""

    def __init__(self, name: str, base: torch.nn.Module, args: argparse.Namespace, device: torch.device,
                 compile: bool) -> None:
        self.name = name
        self.model = copy.deepcopy(base)
        layout = None if name == REFERENCE else HOST_STATE_LAYOUTS[name]
        if layout is not None and layout.weight_dtype != torch.float32:
            for p in self.model.parameters():  # parameters only: buffers (rotary frequencies) stay fp32
                p.data = p.data.to(layout.weight_dtype)
        self.model.to(device).train()
        params = [p for p in self.model.parameters()]
        groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": args.weight_decay},
                  {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
        hyper = dict(lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
        if layout is None:
            self.optimizer = torch.optim.AdamW(groups, **hyper, fused=device.type == "cuda")
        else:
            self.optimizer = CompactAdamW(groups, **hyper, weights=layout.weights, moments=layout.moments,
                                          seed=args.seed, compile=compile)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(s, args.warmup, args.steps, args.min_lr_ratio))
        self.params = params
        self.seconds = 0.0
        self.step_seconds: list[float] = []
        self.losses: list[float] = []
        self.held_out: dict[int, float] = {}
        self.rows: list[dict] = []

    def train_step(self, batch: torch.Tensor, clip: float) -> None:
        """One step on ``batch`` [B, T] (labels = inputs, shifted inside the model); records loss, lr, grad norm."""
        t = time.perf_counter()
        lr = self.optimizer.param_groups[0]["lr"]
        with torch.autocast(batch.device.type, dtype=torch.bfloat16):
            loss = self.model(input_ids=batch, labels=batch).loss
        loss.backward()
        grads = [p.grad for p in self.params if p.grad is not None]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32)
                                                     for g in grads]))
        torch._foreach_mul_(grads, torch.clamp(clip / (norm + 1e-6), max=1.0))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        value, norm = loss.item(), norm.item()  # syncs: the step's time is complete
        self.step_seconds.append(time.perf_counter() - t)
        self.seconds += self.step_seconds[-1]
        self.losses.append(value)
        self.rows.append({"step": len(self.losses), "variant": self.name, "train_loss": value, "held_out_loss": "",
                          "lr": lr, "grad_norm": norm})

    @torch.no_grad()
    def evaluate(self, held: torch.Tensor, batch: int) -> float:
        """Mean loss over the held-out rows (each row the same number of predicted tokens)."""
        self.model.eval()
        total = 0.0
        for i in range(0, held.shape[0], batch):
            rows = held[i : i + batch]
            with torch.autocast(held.device.type, dtype=torch.bfloat16):
                total += self.model(input_ids=rows, labels=rows).loss.item() * rows.shape[0]
        self.model.train()
        loss = total / held.shape[0]
        step = len(self.losses)
        self.held_out[step] = loss
        if step == 0:
            self.rows.append({"step": 0, "variant": self.name, "train_loss": "", "held_out_loss": loss,
                              "lr": "", "grad_norm": ""})
        else:
            self.rows[-1]["held_out_loss"] = loss
        return loss


def kernel_check(names: list[str], device: torch.device, compile: bool, steps: int = 3) -> dict:
    """Largest difference between the weights (+ compensation) after ``steps`` steps of ``CompactAdamW`` as the run
    uses it (on ``device``, compiled or not) and as the CPU's eager kernel, from the same start and gradients, per
    layout. With weight decay, on whole quantization blocks: the graph compiled here is the one the training's
    matrices use (the norms, without weight decay, add one per layout)."""
    out = {}
    gen = torch.Generator().manual_seed(0)
    w0 = torch.randn(392 * BLOCK, generator=gen) * 0.02
    grads = [torch.randn(w0.numel(), generator=gen) * 1e-3 for _ in range(steps)]
    for name in names:
        layout = HOST_STATE_LAYOUTS[name]
        results = []
        for dev, comp in ((device, compile), (torch.device("cpu"), False)):
            p = torch.nn.Parameter(w0.to(dev, layout.weight_dtype, copy=True))
            opt = CompactAdamW([p], lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, weights=layout.weights,
                               moments=layout.moments, compile=comp)
            for g in grads:
                p.grad = g.to(dev, layout.grad_dtype)
                opt.step()
            comp_buffer = opt.state[p].get("compensation")
            results.append((p.detach().float() + (0 if comp_buffer is None else comp_buffer.float())).cpu())
        diff = (results[0] - results[1]).abs().max().item()
        out[name] = {"max_abs_diff": diff, "relative_to_max_weight": diff / results[1].abs().max().item()}
    return out


# ---------------------------------------------------------------------------------------------------- outputs
def summarize(variants: list[Variant], args: argparse.Namespace, facts: dict, seconds: dict) -> dict:
    steps = min(len(v.losses) for v in variants)
    per = {}
    for v in variants:
        last = v.losses[-args.avg_last:]
        final_held = v.held_out.get(steps) if steps else None
        per[v.name] = {"final_train_loss": sum(last) / len(last) if last else None,
                       "final_held_out_loss": final_held, "initial_held_out_loss": v.held_out.get(0),
                       "seconds": v.seconds, "s_per_step": v.seconds / steps if steps else None,
                       "median_step_s": statistics.median(v.step_seconds) if steps else None,
                       "nonfinite_losses": sum(not math.isfinite(x) for x in v.losses),
                       "optimizer_state_bytes_per_param": state_nbytes(v.optimizer) / sum(p.numel() for p in v.params),
                       "weight_dtype": str(v.params[0].dtype).replace("torch.", "")}
    ref = per.get(REFERENCE)
    for name, row in per.items():
        for key in ("train", "held_out"):
            a, b = row[f"final_{key}_loss"], (ref or {}).get(f"final_{key}_loss")
            row[f"{key}_rel_diff"] = (a - b) / b if a is not None and b else None
        diffs = (row["train_rel_diff"], row["held_out_rel_diff"])
        row["within_1pct"] = None if None in diffs else all(abs(d) <= TOLERANCE for d in diffs)
    verdicts = [r["within_1pct"] for n, r in per.items() if n != REFERENCE]
    return {"steps": steps, "steps_planned": args.steps, "stopped_by_budget": steps < args.steps,
            "tokens": steps * args.batch * args.seq, "tokens_per_step": args.batch * args.seq,
            "within_1pct": None if not verdicts or None in verdicts else all(verdicts),
            "tolerance": TOLERANCE, "variants": per, "data": facts, "seconds": seconds, "config": vars(args) | {
                "params": sum(p.numel() for p in variants[0].params)}}


def moving_average(xs: list[float], k: int) -> list[float]:
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x - (xs[i - k] if i >= k else 0.0)
        out.append(acc / min(i + 1, k))
    return out


def write_outputs(out: Path, variants: list[Variant], summary: dict, smooth: int) -> None:
    with open(out / "curves.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_KEYS)
        writer.writeheader()
        for v in variants:
            writer.writerows(v.rows)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    steps = summary["steps"]
    if steps == 0:
        return
    series = []
    for i, v in enumerate(variants):
        color = COLORS[i % len(COLORS)]
        series.append(Series(f"{v.name} train", list(range(1, steps + 1)), moving_average(v.losses[:steps], smooth),
                             color))
        held = sorted(v.held_out.items())
        series.append(Series(f"{v.name} held-out", [s for s, _ in held], [x for _, x in held], color, dashed=True))
    n_params = summary["config"]["params"]
    title = f"Llama {n_params / 1e6:.3g}M, {summary['tokens_per_step']} tokens/step"
    (out / "loss.svg").write_text(line_chart(series, title=f"{title}: train (mean of {smooth}), held-out (dashed)",
                                             xlabel="step", ylabel="loss"))
    half = steps // 2
    tail = [Series(s.label, [x for x in s.xs if x >= half], [y for x, y in zip(s.xs, s.ys) if x >= half], s.color,
                   s.dashed) for s in series]
    ys = [y for s in tail for y in s.ys if math.isfinite(y)]
    if ys:
        (out / "loss_tail.svg").write_text(line_chart(tail, title=f"{title}: second half", xlabel="step",
                                                      ylabel="loss", ylim=(min(ys), max(ys))))
    ref = next((v for v in variants if v.name == REFERENCE), None)
    if ref is None or len(variants) == 1:
        return
    band = 100 * TOLERANCE
    rel = [Series(f"+/-{TOLERANCE:.0%}", [0, steps], [band, band], "#999999", dashed=True),
           Series("", [0, steps], [-band, -band], "#999999", dashed=True)]
    ref_train = moving_average(ref.losses[:steps], smooth)
    for i, v in enumerate(variants):
        if v is ref:
            continue
        color = COLORS[i % len(COLORS)]
        train = moving_average(v.losses[:steps], smooth)
        rel.append(Series(f"{v.name} train", list(range(1, steps + 1)),
                          [100 * (a - b) / b for a, b in zip(train, ref_train)], color))
        held = sorted((s, x) for s, x in v.held_out.items() if s in ref.held_out)
        rel.append(Series(f"{v.name} held-out", [s for s, _ in held],
                          [100 * (x - ref.held_out[s]) / ref.held_out[s] for s, x in held], color, dashed=True))
    ys = [y for s in rel for y in s.ys if math.isfinite(y)]
    (out / "rel_diff.svg").write_text(line_chart(rel, title=f"{title}: loss vs {REFERENCE}", xlabel="step",
                                                 ylabel="relative difference, %",
                                                 ylim=(min(*ys, -1.5 * band), max(*ys, 1.5 * band))))


def table(summary: dict) -> str:
    lines = [f"{summary['steps']} steps x {summary['tokens_per_step']} tokens; within {TOLERANCE:.0%} of "
             f"{REFERENCE}: {summary['within_1pct']}",
             "| variant | train loss | vs fp32 | held-out loss | vs fp32 | within 1% | s/step | median s/step |",
             "| --- " * 8 + "|"]
    fmt = lambda x, f: "" if x is None else format(x, f)
    for name, r in summary["variants"].items():
        lines.append(f"| {name} | {fmt(r['final_train_loss'], '.4f')} | {fmt(r['train_rel_diff'], '+.2%')} | "
                     f"{fmt(r['final_held_out_loss'], '.4f')} | {fmt(r['held_out_rel_diff'], '+.2%')} | "
                     f"{r['within_1pct']} | {fmt(r['s_per_step'], '.3f')} | {fmt(r['median_step_s'], '.3f')} |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=1000, help="steps per variant (the lr schedule's length)")
    p.add_argument("--budget-s", type=float, default=450.0, help="wall seconds for everything, data included")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {list(VARIANTS)}")
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=16, help="rows per step")
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--kv-heads", type=int, default=12)
    p.add_argument("--intermediate", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=16384, help="the tokenizer's target vocabulary")
    p.add_argument("--lr", type=float, default=6e-4, help="peak learning rate")
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--eval-rows", type=int, default=128)
    p.add_argument("--avg-last", type=int, default=50, help="the final train loss is the mean of this many steps")
    p.add_argument("--smooth", type=int, default=25, help="moving average of the plotted train loss")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--packages", default="torch,transformers,lightning")
    p.add_argument("--held-out-every", type=int, default=50)
    p.add_argument("--tokenizer-chars", type=int, default=10_000_000)
    p.add_argument("--device", default="auto", help="'auto': cuda when available")
    p.add_argument("--compile-optimizer", choices=("auto", "on", "off"), default="auto",
                   help="CompactAdamW through torch.compile; 'auto': on a GPU only")
    args = p.parse_args(argv)
    args.packages = args.packages.split(",")
    args.variants = args.variants.split(",")
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        p.error(f"--variants: unknown {unknown}; choose from {list(VARIANTS)}")
    return args


def main(argv: list[str] | None = None) -> dict:
    start = time.perf_counter()
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    compile = args.compile_optimizer == "on" or (args.compile_optimizer == "auto" and device.type == "cuda")
    train, held, tokenizer, facts = build_data(args)
    data_s = time.perf_counter() - start
    print(f"data: {facts['train_tokens']:,} training tokens from {facts['train_files_read']} files, "
          f"{facts['held_out_tokens']:,} held-out, vocab {facts['vocab']}, {data_s:.0f} s", flush=True)
    train, held = train.to(device), held.to(device)
    base = make_model(args, facts["vocab"], tokenizer)
    variants = [Variant(name, base, args, device, compile) for name in args.variants]
    del base
    t = time.perf_counter()
    compact = [v for v in args.variants if v != REFERENCE]
    check = kernel_check(compact, device, compile) if compact else {}
    seconds = {"data": data_s, "kernel_check": time.perf_counter() - t}
    facts["kernel_check"] = check
    t = time.perf_counter()
    for v in variants:
        v.evaluate(held, args.batch)
    eval_s = time.perf_counter() - t
    round_s = 0.0  # the slowest round of steps so far
    step = 0
    while step < args.steps:
        if time.perf_counter() - start + round_s + eval_s + 5 > args.budget_s:
            print(f"budget: stopping after {step} of {args.steps} steps", flush=True)
            break
        t = time.perf_counter()
        batch = train[step * args.batch : (step + 1) * args.batch]
        for v in variants:
            v.train_step(batch, args.clip)
        step += 1
        round_s = max(round_s, time.perf_counter() - t) if step > 3 else 0.0  # the first steps compile
        if step == 20:
            rate, now = sum(statistics.median(v.step_seconds[3:]) for v in variants), time.perf_counter() - start
            print(f"step 20 ({now:.0f} s): {rate:.3f} s per step of all variants; {args.steps} steps projected to "
                  f"end at {now + (args.steps - 20) * rate:.0f} s of the {args.budget_s:.0f} s budget", flush=True)
        if step % args.eval_every == 0 or step == args.steps:
            t = time.perf_counter()
            losses = {v.name: v.evaluate(held, args.batch) for v in variants}
            eval_s = time.perf_counter() - t
            seconds |= {"total": time.perf_counter() - start}
            summary = summarize(variants, args, facts, seconds)
            write_outputs(out, variants, summary, args.smooth)
            print(f"step {step}: held-out " + ", ".join(f"{k} {x:.4f}" for k, x in losses.items())
                  + f" ({time.perf_counter() - start:.0f} s)", flush=True)
    if step and step not in variants[0].held_out:
        for v in variants:
            v.evaluate(held, args.batch)
    seconds |= {"total": time.perf_counter() - start}
    # graphs torch.compile built: the CompactAdamW kernel's, one per layout with and one without weight decay (6
    # for the three layouts); past torch._dynamo.config.recompile_limit (8) further shapes would run eagerly
    facts["compiled_graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    summary = summarize(variants, args, facts, seconds)
    write_outputs(out, variants, summary, args.smooth)
    print(table(summary))
    return summary


if __name__ == "__main__":
    main()
