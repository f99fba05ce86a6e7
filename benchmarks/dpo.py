"""DPO beside SFT under `Trainer(strategy="megatrain")` on one GPU: tokens/s, GPU and host memory, the reference pass.

Workload: the Llama-3.2-3B shape of benchmarks/workloads.py (random init like HF's), synthetic pairs of `--seq`
tokens per sequence, a shared `--prompt`-token prompt and two random responses, no padding; `--pairs` pairs per
micro-batch, so each forward runs 2 x pairs rows (default 16 pairs: 32 x 1024 = 32K tokens, the README's SFT step).
Both tasks train the same batches with `strategy="megatrain"` and no options (every "auto" choice the engine's),
bf16-mixed, torch AdamW, clip 1.0:
  sft      CausalLMModule's chunked loss on the response tokens of all 2 x pairs rows;
  dpo      DPOModule(loss_type="sigmoid"): one forward of the 2 x pairs rows, the chunked sequence log-probabilities
           (the LM head's matmul once more than SFT), after a reference pass over every pair (one no-grad forward
           each, through the strategy: `reference_s`);
  simpo    DPOModule(loss_type="simpo"): the same without a reference pass.
Each task runs in its own subprocess (pinned host memory is released between them). --warmup steps, then --measured
steps whose median step time gives tokens_per_s = 2 x pairs x seq / step (all tokens, as the SFT rows of
docs/performance.md count them). Rows: task, tokens_per_s, peak_gpu_gib (max allocated), peak_host_gib (VmHWM of
the subprocess), host_bytes_per_param, reference_s (dpo), step_times_s, losses, first_step_s.

On the device (as benchmarks/throughput.py; `--wheels` is not needed: no DeepSpeed):
  python3 benchmarks/dpo.py --out $OUT --commit SHA        # about 4 minutes for the three tasks on one H200
Check on a CPU first:  python benchmarks/dpo.py --dry-run --out /tmp/dpo   (tiny model, two steps, in-process)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from statistics import median

REPO = str(Path(__file__).resolve().parents[1])
sys.path.insert(0, str(Path(__file__).resolve().parent))
from workloads import MODELS, count_params, fill_like_hf_init_  # noqa: E402  (benchmarks/ on the path first)

GIB = 1 << 30
TASKS = ("sft", "dpo", "simpo")


def make_module(task: str, config: dict):
    """The task's LightningModule with the benchmark's fast init (HF's init skipped, then filled like HF's)."""
    import torch
    from transformers import AutoModelForCausalLM

    from lightning_megatrain.models import CausalLMModule, DPOModule

    try:
        from transformers.initialization import no_init_weights
    except ImportError:
        no_init_weights = contextlib.nullcontext
    base = CausalLMModule if task == "sft" else DPOModule

    class Bench(base):
        reference_s = None

        def configure_model(self) -> None:
            if self.model is not None:
                return
            with no_init_weights():
                model = AutoModelForCausalLM.from_config(self.hf_config, dtype=torch.float32,
                                                         attn_implementation="sdpa")
            model.tie_weights()
            fill_like_hf_init_(model, std=self.hf_config.initializer_range, seed=0)
            self.model = model

        def _ensure_reference(self, every_split: bool) -> None:
            start = time.perf_counter()
            super()._ensure_reference(every_split)
            self.reference_s = time.perf_counter() - start

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-6, betas=(0.9, 0.95), weight_decay=0.1)

    kwargs = {} if task == "sft" else {"loss_type": "sigmoid" if task == "dpo" else "simpo"}
    return Bench(config=config, loss_chunk_size=4096, **kwargs)


def make_data(n: int, pairs: int, seq: int, prompt: int, vocab: int):
    """``n`` synthetic pairs: a shared random prompt, two random responses, labels on the responses."""
    import lightning as L
    import torch
    from torch.utils.data import DataLoader

    from lightning_megatrain.data import PairCollator, PairExample
    from lightning_megatrain.data.encoding import IGNORE_INDEX, Example

    g = torch.Generator().manual_seed(1234)
    examples = []
    for index in range(n):
        ids = torch.randint(0, vocab, (prompt + 2 * (seq - prompt),), generator=g).tolist()
        shared, chosen, rejected = ids[:prompt], ids[prompt:seq], ids[seq:]
        mask = [IGNORE_INDEX] * prompt
        examples.append(PairExample(Example(shared + chosen, mask + chosen), Example(shared + rejected,
                                                                                    mask + rejected), index))

    class Pairs(L.LightningDataModule):
        def train_dataloader(self) -> DataLoader:
            return DataLoader(examples, batch_size=pairs, collate_fn=PairCollator(0))

        def reference_dataloaders(self) -> dict[str, DataLoader]:
            return {"train": self.train_dataloader()}

    return Pairs()


def train(spec: dict) -> dict:
    """One task in this process; returns its row."""
    sys.path.insert(0, REPO)
    import lightning as L
    import torch

    import lightning_megatrain  # noqa: F401  (registers "megatrain")
    from lightning_megatrain._hardware import host_rss_gib

    on_cuda = spec["device"] == "cuda"
    if on_cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.cuda.reset_peak_memory_stats()
    L.seed_everything(0, verbose=False)
    config = MODELS[spec["model"]]["config"]
    params, _ = count_params(config)
    steps = spec["warmup"] + spec["measured"]
    module = make_module(spec["task"], config)
    data = make_data(spec["pairs"] * steps, spec["pairs"], spec["seq"], spec["prompt"], config["vocab_size"])
    ends: list[float] = []
    losses: list[float] = []

    class Times(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if not ends:  # the first step starts here, after the reference pass (in DPOModule.on_train_start)
                ends.append(time.perf_counter())

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            ends.append(time.perf_counter())
            losses.append(float(outputs["loss"] if isinstance(outputs, dict) else outputs))

    # on CUDA the defaults overlap the host step, which takes torch's fused AdamW: the dry run takes it too
    strategy = "megatrain" if on_cuda else lightning_megatrain.MegaTrainStrategy(cpu_adam="torch")
    trainer = L.Trainer(strategy=strategy, accelerator="cuda" if on_cuda else "cpu", devices=1,
                        precision="bf16-mixed", max_steps=steps, gradient_clip_val=1.0, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[Times()])
    start = time.perf_counter()
    trainer.fit(module, datamodule=data)
    step_times = [b - a for a, b in zip(ends, ends[1:])]
    tokens = 2 * spec["pairs"] * spec["seq"]
    peak_host = host_rss_gib("VmHWM")
    return {
        **spec, "params": params, "tokens_per_step": tokens,
        "tokens_per_s": tokens / median(step_times[spec["warmup"]:]),
        "peak_gpu_gib": torch.cuda.max_memory_allocated() / GIB if on_cuda else None,
        "peak_host_gib": peak_host, "host_bytes_per_param": None if peak_host is None else peak_host * GIB / params,
        "reference_s": module.reference_s if spec["task"] == "dpo" else None,
        "first_step_s": step_times[0], "step_times_s": step_times, "losses": losses,
        "fit_s": time.perf_counter() - start, "error": None,
    }


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-3.2-3b", choices=sorted(MODELS))
    parser.add_argument("--tasks", default=",".join(TASKS))
    parser.add_argument("--pairs", type=int, default=16)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--measured", type=int, default=5)
    parser.add_argument("--out", required=True)
    parser.add_argument("--commit", default=None)
    parser.add_argument("--dry-run", action="store_true", help="tiny model on the CPU, in this process")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(train(json.loads(args.child))), flush=True)
        return []
    if args.dry_run:
        args.model, args.pairs, args.seq, args.prompt, args.warmup, args.measured = "tiny-llama", 2, 32, 8, 1, 1
    import torch

    device = "cuda" if torch.cuda.is_available() and not args.dry_run else "cpu"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{time.strftime('%Y-%m-%d')}-dpo-{args.model}-{device}.json"

    def write(rows: list[dict]) -> None:
        path.write_text(json.dumps({"commit": args.commit, "device": device, "dry_run": args.dry_run,
                                    "results": rows}, indent=1))

    rows = []
    for task in args.tasks.split(","):
        spec = {"task": task, "model": args.model, "pairs": args.pairs, "seq": args.seq, "prompt": args.prompt,
                "warmup": args.warmup, "measured": args.measured, "device": device}
        if args.dry_run:
            rows.append(train(spec))
            continue
        proc = subprocess.run([sys.executable, __file__, "--out", args.out, "--child", json.dumps(spec)],
                              capture_output=True, text=True, check=False, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        rows.append(json.loads(lines[-1]) if proc.returncode == 0 and lines
                    else {**spec, "error": (proc.stderr or proc.stdout)[-2000:]})
        print(f"{task}: " + (f"{rows[-1]['tokens_per_s']:,.0f} tokens/s" if not rows[-1]["error"] else "error"),
              flush=True)
        write(rows)  # after each task: a command cut short keeps the tasks that finished
    write(rows)
    for row in rows:
        if row["error"]:
            print(f"| {row['task']} | error: {row['error'][-300:]} |")
            continue
        gpu = "-" if row["peak_gpu_gib"] is None else f"{row['peak_gpu_gib']:.1f}"
        reference = "-" if row["reference_s"] is None else f"{row['reference_s']:.1f} s"
        print(f"| {row['task']} | {row['tokens_per_s']:,.0f} tokens/s | GPU {gpu} GiB | host "
              f"{row['peak_host_gib']:.1f} GiB ({row['host_bytes_per_param']:.1f} B/param) | reference {reference} |")
    return rows


if __name__ == "__main__":
    main()
