"""Core GPU evidence for `Trainer(strategy="megatrain")` (issue: core streaming engine), one device call.

Parts (each in its own process so one failure or OOM is recorded, not fatal):
  parity  ~110M-parameter Llama, bf16-mixed, 50 AdamW steps on fixed data: megatrain vs plain GPU-resident
          Lightning training; the loss curves must agree within 1% relative at every step.
  scale   Llama-3.2-3B shape (random init), 16K tokens/step, 10 steps: tokens/s, peak GPU memory, peak host RSS;
          then the same model at 2x depth (56 layers) for 3 steps, SGD without momentum so the host RAM of the lent
          machine holds it, to show that peak GPU memory does not grow with depth.

Usage (on the GPU machine):  python benchmarks/core_gpu.py --out DIR [--parts parity,scale,depth]
Writes DIR/core_gpu_<parts>.json and DIR/core_gpu_<parts>.md; `--summarize A.json B.json` prints one table for
result files of several calls (the device limits one call to 10 minutes).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from statistics import median

import torch

GIB = 1024**3


def llama_config(layers: int, hidden: int, intermediate: int, heads: int, kv_heads: int, vocab: int, tied: bool):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        tie_word_embeddings=tied,
        use_cache=False,
        attn_implementation="sdpa",
    )


SHAPES = {
    # hidden 768, 12 layers, tied 32K vocab: 110M parameters
    "llama-110m": dict(layers=12, hidden=768, intermediate=2048, heads=12, kv_heads=12, vocab=32000, tied=True),
    # Llama-3.2-3B: 28 layers, hidden 3072, GQA 24/8, intermediate 8192, tied 128256 vocab: 3.21B parameters
    "llama-3.2-3b": dict(layers=28, hidden=3072, intermediate=8192, heads=24, kv_heads=8, vocab=128256, tied=True),
    "llama-3.2-3b-x2depth": dict(
        layers=56, hidden=3072, intermediate=8192, heads=24, kv_heads=8, vocab=128256, tied=True
    ),
}


def make_module(shape: str, optimizer: str, lr: float):
    import lightning as L
    from transformers import AutoModelForCausalLM

    class BenchLM(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = AutoModelForCausalLM.from_config(llama_config(**SHAPES[shape]), dtype=torch.float32)

        def training_step(self, batch, batch_idx):
            loss = self.model(input_ids=batch, labels=batch).loss
            self.log("loss", loss)
            return loss

        def configure_optimizers(self):
            if optimizer == "adamw":
                return torch.optim.AdamW(self.parameters(), lr=lr, weight_decay=0.1, betas=(0.9, 0.95))
            return torch.optim.SGD(self.parameters(), lr=lr)

    return BenchLM()


def structured_tokens(n: int, seq: int, vocab: int) -> torch.Tensor:
    """Fixed data with learnable structure (a random first-order Markov chain with 4 successors per token)."""
    g = torch.Generator().manual_seed(1234)
    successors = torch.randint(0, vocab, (vocab, 4), generator=g)
    x = torch.empty(n, seq, dtype=torch.long)
    x[:, 0] = torch.randint(0, vocab, (n,), generator=g)
    for t in range(1, seq):
        pick = torch.randint(0, 4, (n,), generator=g)
        x[:, t] = successors[x[:, t - 1], pick]
    return x


def train(strategy: str, shape: str, steps: int, micro_batch: int, seq: int, optimizer: str, lr: float) -> dict:
    import lightning as L

    import lightning_megatrain  # noqa: F401  (registers "megatrain")

    torch.backends.cuda.matmul.allow_tf32 = True
    L.seed_everything(0)
    t_build = time.perf_counter()
    module = make_module(shape, optimizer, lr)
    n_params = sum(p.numel() for p in module.parameters())
    build_s = time.perf_counter() - t_build
    data = structured_tokens(micro_batch * steps, seq, SHAPES[shape]["vocab"])
    losses: list[float] = []
    times: list[float] = []

    phases: list[dict[str, float]] = []

    class Recorder(L.Callback):
        # Benchmark instrumentation only: synchronizing at phase boundaries costs little here because the engine
        # overlaps transfers *within* forward and backward, not across these boundaries.
        def _mark(self, name):
            torch.cuda.synchronize()
            self.marks[name] = time.perf_counter()

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.marks = {}
            self._mark("start")

        def on_before_backward(self, trainer, pl_module, loss):
            self._mark("forward")

        def on_after_backward(self, trainer, pl_module):
            self._mark("backward")

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            self._mark("finalize")  # wait for grad drains + resident grads

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self._mark("end")  # clipping + optimizer step
            m = self.marks
            times.append(m["end"] - m["start"])
            phases.append({
                "forward_s": m["forward"] - m["start"],
                "backward_s": m["backward"] - m["forward"],
                "grad_finalize_s": m["finalize"] - m["backward"],
                "clip_and_optimizer_s": m["end"] - m["finalize"],
            })
            losses.append(float(outputs["loss"]))

    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cuda",
        devices=1,
        precision="bf16-mixed",
        max_steps=steps,
        gradient_clip_val=1.0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Recorder()],
    )
    torch.cuda.reset_peak_memory_stats()
    t_fit = time.perf_counter()
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=micro_batch))
    fit_s = time.perf_counter() - t_fit
    measured = times[2:] if len(times) > 4 else times
    step_s = median(measured)
    tokens = micro_batch * seq
    layers = SHAPES[shape]["layers"]
    return {
        "strategy": strategy,
        "model": shape,
        "params": n_params,
        "layers": layers,
        "micro_batch": micro_batch,
        "seq_len": seq,
        "tokens_per_step": tokens,
        "steps": steps,
        "optimizer": optimizer,
        "losses": losses,
        "step_times_s": times,
        "median_step_s": step_s,
        "tokens_per_s": tokens / step_s,
        # model FLOPs = 6 * N * tokens (N: all parameters; Kaplan et al. 2020), MFU vs the 989 TFLOP/s bf16 peak
        "model_tflops": 6 * n_params * tokens / step_s / 1e12,
        "mfu": 6 * n_params * tokens / step_s / 989e12,
        "peak_gpu_gib": torch.cuda.max_memory_allocated() / GIB,
        "peak_host_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB,
        "breakdown": {k: median(p[k] for p in (phases[2:] if len(phases) > 4 else phases)) for k in phases[0]},
        "build_s": build_s,
        "fit_s": fit_s,
    }


RUNS = {
    "parity": [
        dict(strategy="auto", shape="llama-110m", steps=50, micro_batch=8, seq=512, optimizer="adamw", lr=3e-4),
        dict(strategy="megatrain", shape="llama-110m", steps=50, micro_batch=8, seq=512, optimizer="adamw", lr=3e-4),
    ],
    "scale": [
        dict(strategy="megatrain", shape="llama-3.2-3b", steps=10, micro_batch=4, seq=4096, optimizer="adamw", lr=1e-4),
    ],
    "depth": [
        dict(
            strategy="megatrain", shape="llama-3.2-3b-x2depth", steps=3, micro_batch=4, seq=4096, optimizer="sgd",
            lr=1e-4,
        ),
    ],
}


def summarize(results: list[dict]) -> str:
    lines = [
        "| strategy | model | params | tokens/step | tokens/s | MFU | peak GPU GiB | peak host RSS GiB "
        "| step breakdown (median) / error |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['strategy']} | {r['model']} | | | | | | | {r['error'][-200:]} |")
            continue
        lines.append(
            f"| {r['strategy']} | {r['model']} | {r['params'] / 1e9:.2f}B | {r['tokens_per_step']} | "
            f"{r['tokens_per_s']:,.0f} | {r['mfu']:.1%} | {r['peak_gpu_gib']:.1f} | {r['peak_host_rss_gib']:.1f} | "
            f"{' '.join(f'{k[:-2]}={v:.2f}s' for k, v in r['breakdown'].items())} |"
        )
    by = {(r["strategy"], r["model"]): r for r in results if "error" not in r}
    plain, ours = by.get(("auto", "llama-110m")), by.get(("megatrain", "llama-110m"))
    if plain and ours:
        rel = [abs(a - b) / abs(a) for a, b in zip(plain["losses"], ours["losses"])]
        lines += ["", f"bf16 parity, 50 steps: max relative loss difference {max(rel):.3%} (limit 1%), "
                  f"first/last loss plain {plain['losses'][0]:.4f}/{plain['losses'][-1]:.4f}, "
                  f"megatrain {ours['losses'][0]:.4f}/{ours['losses'][-1]:.4f}"]
    a, b = by.get(("megatrain", "llama-3.2-3b")), by.get(("megatrain", "llama-3.2-3b-x2depth"))
    if a and b:
        lines += ["", f"GPU peak at 2x depth: {b['peak_gpu_gib']:.2f} GiB vs {a['peak_gpu_gib']:.2f} GiB "
                  f"({b['peak_gpu_gib'] / a['peak_gpu_gib'] - 1:+.1%}, limit +10%)"]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out")
    parser.add_argument("--parts", default="parity,scale,depth")
    parser.add_argument("--summarize", nargs="+", metavar="JSON")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.summarize:
        files = [json.load(open(path)) for path in args.summarize]
        print(f"device: {files[0]['device']}, torch {files[0]['torch']}\n")
        print(summarize([r for f in files for r in f["results"]]))
        return
    if args.child:
        print("RESULT " + json.dumps(train(**json.loads(args.child))), flush=True)
        return
    os.makedirs(args.out, exist_ok=True)
    results = []
    for part in args.parts.split(","):
        for run in RUNS[part]:
            proc = subprocess.run(
                [sys.executable, __file__, "--out", args.out, "--child", json.dumps(run)],
                capture_output=True, text=True,
            )
            line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                results.append({**run, "model": run["shape"], "error": (proc.stderr or proc.stdout)[-2000:]})
            else:
                results.append(json.loads(line[len("RESULT "):]))
            print(summarize(results[-1:]), flush=True)
            with open(os.path.join(args.out, f"core_gpu_{args.parts.replace(',', '_')}.json"), "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "results": results}, f,
                          indent=1)
    table = summarize(results)
    with open(os.path.join(args.out, f"core_gpu_{args.parts.replace(',', '_')}.md"), "w") as f:
        f.write(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
