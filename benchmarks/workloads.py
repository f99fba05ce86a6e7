"""What the throughput benchmark trains: the systems a Lightning user would pick and the model shapes.

Systems (each run in its own subprocess: an OOM, a crash or a timeout becomes a row with "error"):
  megatrain                MegaTrainStrategy() with no arguments, what `strategy="megatrain"` gives: every "auto"
                           choice is the engine's (engine/placement.py: on CUDA compiled layers, the overlapped host
                           step, gpu_optimizer_groups planned for the first micro-batch; keep_layers="auto"; the
                           chunked HF loss), bf16-mixed, torch AdamW, clip 1.0; the row's engine_config records the
                           choices. Rows before the "auto" defaults ran compile_layers=False, overlap_optimizer=False,
                           gpu_optimizer_groups=0 and HF's own loss here.
  megatrain_overlap        explicit options from here on (compile_layers=False, gpu_optimizer_groups=0 unless the
                           name says otherwise): overlap_optimizer=True: step N's host Adam (and the clip scaling)
                           runs layer by layer on a worker thread while step N+1's forward starts (engine/overlap.py);
                           the host AdamW is then torch's fused one (cpu_adam="auto" with the overlap).
  megatrain_overlap_deepspeed  overlap_optimizer=True with cpu_adam="deepspeed" (DeepSpeedCPUAdam holds the GIL).
  megatrain_overlap_gpuN   megatrain_overlap with gpu_optimizer_groups=N (any megatrain system takes the _gpuN
                           suffix): the residents and the first N-1 layers keep fp32 master, grad and Adam states
                           on the GPU too and step there (engine/device_state.py), the rest on the host.
  megatrain_recompute_all  keep_layers=0: every layer recomputed (the paper's scheme; the engine before this option).
  megatrain_muon           MegaTrainStrategy() with no arguments and lightning_megatrain.optim.Muon over
                           muon_param_groups (lr, betas and weight decay as the AdamW runs; "rms" scale): the host
                           Muon step, its Newton-Schulz iteration on the GPU; gpu_optimizer_groups="auto" places none.
  ..._compiled             any megatrain system or plain with every decoder layer run through torch.compile
                           (megatrain: compile_layers=True; plain: each HF decoder layer's ``.compile()``, inside HF's
                           gradient checkpointing).
  plain                    Lightning strategy "auto" on the GPU: fp32 params, bf16-mixed autocast, torch AdamW
                           fused on the GPU, clip 1.0 (by torch.nn.utils.clip_grad_norm_ in configure_gradient_clipping:
                           Lightning's MixedPrecision refuses gradient_clip_val with a fused optimizer), HF
                           `gradient_checkpointing_enable(use_reentrant=False)`.
  plain_muon               plain with Muon (its states and iteration on the GPU) instead of fused AdamW.
  deepspeed_zero3_offload  DeepSpeedStrategy(stage=3, offload_optimizer=True, offload_parameters=True,
                           pin_memory=True), bf16-mixed (DeepSpeed's bf16 mode: bf16 weights on the GPU, fp32 masters
                           in the optimizer), clip 1.0, HF gradient checkpointing. The optimizer is DeepSpeedCPUAdam:
                           with ZeRO-Offload DeepSpeed refuses a torch optimizer (deepspeed/runtime/engine.py
                           `_configure_optimizer` raises ZeRORuntimeException unless it is DeepSpeedCPUAdam or
                           `zero_force_ds_cpu_optimizer` is off) and Lightning hands configure_optimizers' optimizer
                           to `deepspeed.initialize` (lightning/pytorch/strategies/deepspeed.py,
                           `_initialize_deepspeed_train`).
  fsdp_cpu_offload         FSDPStrategy(cpu_offload=True, auto_wrap_policy and activation_checkpointing_policy = the
                           decoder-layer class), bf16-mixed, torch AdamW fused on the CPU. NO clipping: Lightning's
                           FSDPPrecision.clip_grad_by_norm raises MisconfigurationException ("gradient_clip_algorithm=
                           'norm' is currently not supported"); the row's "clip" is null and its notes say so.

Models (--models; random-init, from the published configs):
  llama-3.2-3b (default; 28 layers, hidden 3072, ffn 8192, heads 24/8, vocab 128256 tied: 3.21B),
  llama-2-7b (6.74B, vocab 32000 untied; DeepSpeed needs ~182 GB host at the measured 27 B/param and is not
  started), qwen3-30b-a3b-4l (Qwen3-30B-A3B TRUNCATED to 4 of its 48 layers for host RAM: 3.11B
  parameters, 0.85B active; its rows say so).
"""

from __future__ import annotations

import contextlib
import re
import time

DEFAULT_SYSTEMS = ("megatrain", "plain", "deepspeed_zero3_offload", "fsdp_cpu_offload")  # one device call per part
SYSTEMS = (*DEFAULT_SYSTEMS, "megatrain_overlap", "megatrain_overlap_deepspeed", "megatrain_recompute_all",
           "megatrain_muon", "plain_muon", "megatrain_no_backward_updates")



def split_system(system: str) -> tuple[str, int, bool]:
    """``"megatrain_overlap_gpu12_compiled"`` -> ``("megatrain_overlap", 12, True)``: the base system,
    gpu_optimizer_groups and whether the decoder layers run through torch.compile."""
    compiled = system.endswith("_compiled")
    system = system.removesuffix("_compiled")
    match = re.fullmatch(r"(megatrain\w*?)_gpu(\d+)", system)
    return (match.group(1), int(match.group(2)), compiled) if match else (system, 0, compiled)


_LLAMA = dict(model_type="llama", hidden_act="silu", rms_norm_eps=1e-5, attention_bias=False, use_cache=False)
_QWEN3_MOE = dict(model_type="qwen3_moe", norm_topk_prob=True, rms_norm_eps=1e-6, tie_word_embeddings=False,
                  use_cache=False, output_router_logits=False)
MODELS = {
    # micro_batch_cap: sequences of 1024 per micro-batch expected to fit on 141 GB per loss (HF's fp32 logits bound
    # it); plain_cap: lower cap for GPU-resident training (16 B/param of model states on the GPU).
    # Llama-3.2-3B shape; default RoPE, theta 5e5 (llama3 frequency scaling does not change the work).
    "llama-3.2-3b": dict(config=dict(_LLAMA, vocab_size=128256, hidden_size=3072, intermediate_size=8192,
                                     num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8,
                                     tie_word_embeddings=True, max_position_embeddings=8192,
                                     rope_parameters={"rope_theta": 500000.0, "rope_type": "default"}),
                         micro_batch_cap={"hf": 32, "chunked": 64}),
    # Llama-3.2-1B shape (16 layers, hidden 2048, ffn 8192, heads 32/8, vocab 128256 tied: 1.24B): the soak's model.
    "llama-3.2-1b": dict(config=dict(_LLAMA, vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                                     num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                                     tie_word_embeddings=True, max_position_embeddings=8192,
                                     rope_parameters={"rope_theta": 500000.0, "rope_type": "default"}),
                         micro_batch_cap={"hf": 32, "chunked": 64}),
    "llama-2-7b": dict(config=dict(_LLAMA, vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                                   num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                                   tie_word_embeddings=False, max_position_embeddings=4096,
                                   rope_parameters={"rope_theta": 10000.0, "rope_type": "default"}),
                       micro_batch_cap={"hf": 32, "chunked": 64}, plain_cap=8),
    "qwen3-30b-a3b-4l": dict(config=dict(_QWEN3_MOE, vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                                         moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                                         num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=4,
                                         head_dim=128, max_position_embeddings=32768,
                                         rope_parameters={"rope_theta": 1000000.0, "rope_type": "default"}),
                             micro_batch_cap={"hf": 32, "chunked": 64}, plain_cap=16,
                             note="Qwen3-30B-A3B shape truncated to 4 of its 48 layers (host RAM); 128 experts, top-8"),
    # --dry-run models (CPU): the code paths of the real ones at toy size.
    "tiny-llama": dict(config=dict(_LLAMA, vocab_size=512, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   tie_word_embeddings=True, max_position_embeddings=256),
                       micro_batch_cap={"hf": 2, "chunked": 2}),
    "tiny-qwen3-moe": dict(config=dict(_QWEN3_MOE, vocab_size=512, hidden_size=64, intermediate_size=128,
                                       moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                       max_position_embeddings=256),
                           micro_batch_cap={"hf": 2, "chunked": 2}),
}

def hf_config(config: dict):
    from transformers import AutoConfig

    kwargs = dict(config)
    return AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)


def layer_class(config: dict) -> type:
    """The HF decoder-layer class of ``config``'s model (its ``_no_split_modules[0]``): what ZeRO-3 and FSDP wrap."""
    import sys

    from transformers import AutoModelForCausalLM

    model_cls = AutoModelForCausalLM._model_mapping[type(hf_config(config))]
    return getattr(sys.modules[model_cls.__module__], model_cls._no_split_modules[0])


def count_params(config: dict) -> tuple[int, int]:
    """All and active (MoE: expert weights scaled by top-k / experts) parameters, from a meta-device build."""
    import torch
    from transformers import AutoModelForCausalLM

    cfg = hf_config(config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    total = active = 0
    experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)  # name differs by version
    for name, p in model.named_parameters():  # yields a tied weight once
        total += p.numel()
        active += p.numel() * cfg.num_experts_per_tok / experts if ".experts." in name else p.numel()
    return total, int(active)


def attention_flops_per_token(config: dict, seq_len: int) -> int:
    """12 * L * H * T (PaLM appendix B), H = attention heads * head dim, T = sequence length."""
    head_dim = config.get("head_dim", config["hidden_size"] // config["num_attention_heads"])
    return 12 * config["num_hidden_layers"] * config["num_attention_heads"] * head_dim * seq_len


def fill_like_hf_init_(model, std: float, seed: int) -> None:
    """normal(0, std) matrices, ones for norm weights, zeros for biases (HF's Llama / Qwen3-MoE init), drawn on the
    GPU when there is one and copied to wherever each parameter lives. Under ZeRO-3 each module's partitioned
    parameters are gathered, filled on rank 0 and re-partitioned."""
    import torch

    gen_device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator(device=gen_device).manual_seed(seed)
    seen: set[int] = set()
    for module in model.modules():
        named = [(n, p) for n, p in module.named_parameters(recurse=False) if id(p) not in seen]
        if not named:
            continue
        seen.update(id(p) for _, p in named)
        gather = contextlib.nullcontext()
        if any(hasattr(p, "ds_id") for _, p in named):
            import deepspeed

            gather = deepspeed.zero.GatheredParameters([p for _, p in named], modifier_rank=0)
        with gather, torch.no_grad():
            for name, p in named:
                if p.dim() == 1:
                    p.zero_() if name == "bias" else p.fill_(1.0)
                    continue
                flat = p.view(-1)  # freshly built parameters are contiguous
                for start in range(0, flat.numel(), 1 << 27):  # 512 MB of fp32 at a time
                    chunk = flat[start : start + (1 << 27)]
                    chunk.copy_(torch.empty(chunk.numel(), device=gen_device).normal_(0.0, std, generator=generator))


def make_module(config: dict, loss: str, optimizer: str, grad_ckpt: bool, direct_clip: bool, lr: float = 1e-4,
                compile_layers: bool = False, dtype: str = "float32", attn_implementation: str = "sdpa"):
    import torch
    from transformers import AutoModelForCausalLM

    from lightning_megatrain.models import CausalLMModule

    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # older transformers: HF's (slower) init runs, then the fill overwrites it
        no_init_weights = contextlib.nullcontext

    class BenchLM(CausalLMModule):
        """CausalLMModule (HF model in ``dtype``, fp32 by default; chunked loss) with the benchmark's init, loss
        choice and optimizer."""

        def configure_model(self) -> None:
            if self.model is not None:
                return
            t0 = time.perf_counter()
            # Skip torch's and HF's init (HF's ZeRO-3 path does the same): RoPE buffers are built in __init__, the
            # embedding is tied again below and every parameter is filled after. (Lightning's _EmptyInit does not
            # skip HF 5's init: its guard re-routes torch.nn.init.normal_ around the mode.)
            with no_init_weights():
                model = AutoModelForCausalLM.from_config(self.hf_config, dtype=getattr(torch, dtype),
                                                         attn_implementation=attn_implementation)
            model.tie_weights()
            fill_like_hf_init_(model, std=self.hf_config.initializer_range, seed=0)
            if grad_ckpt:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            if compile_layers:  # plain_compiled: what a user of plain training would compile
                for layer in model.model.layers:
                    layer.compile()
            self.model = model
            if loss == "chunked" and any(hasattr(p, "ds_id") for p in model.parameters()):
                import deepspeed

                # The chunked loss reads lm_head.weight outside lm_head's forward: ZeRO-3 must gather it for all of
                # training_step, which runs inside this module's forward.
                deepspeed.zero.register_external_parameter(self, model.get_output_embeddings().weight)
            self.build_s = time.perf_counter() - t0

        def on_before_batch_transfer(self, batch: torch.Tensor, dataloader_idx: int) -> dict:  # [B, T] token ids
            # as a dict batch: CausalLMModule's hook adds the chunked loss's target rows on the host (no device sync)
            return super().on_before_batch_transfer({"input_ids": batch}, dataloader_idx)

        def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
            if loss == "hf":
                return self.model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss
            return self._loss(batch)[0]

        def configure_optimizers(self):
            kwargs = dict(lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
            if optimizer == "ds_cpu_adam":
                from deepspeed.ops.adam import DeepSpeedCPUAdam

                return DeepSpeedCPUAdam(self.parameters(), adamw_mode=True, **kwargs)
            if optimizer == "muon":
                from lightning_megatrain.optim import Muon, muon_param_groups

                return Muon(muon_param_groups(self), **kwargs)
            return torch.optim.AdamW(self.parameters(), fused=(optimizer == "adamw_fused") or None, **kwargs)

    class DirectClipBenchLM(BenchLM):
        def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
            # Lightning's MixedPrecision refuses to clip for a fused optimizer (a guard for GradScaler unscaling,
            # which bf16 does not use): clip by the global norm directly, as Lightning would otherwise.
            if gradient_clip_val:
                torch.nn.utils.clip_grad_norm_(self.parameters(), gradient_clip_val)

    cls = DirectClipBenchLM if direct_clip else BenchLM
    return cls(config=config, loss_chunk_size=4096, learning_rate=lr, weight_decay=0.1)


def make_strategy(system: str, layer_cls: type, on_cuda: bool) -> tuple[object, float | None, str, str, list[str]]:
    """(strategy, gradient_clip_val, optimizer, activation checkpointing, notes) of one system."""
    import torch

    system, groups, compiled = split_system(system)  # plain, ZeRO-3 and FSDP compile in make_module
    if system.startswith("megatrain"):
        from lightning_megatrain import MegaTrainStrategy

        if system == "megatrain_recompute_all":
            return (MegaTrainStrategy(keep_layers=0, gpu_optimizer_groups=groups, compile_layers=compiled), 1.0,
                    "adamw", "megatrain: every layer recomputed", [])
        if system == "megatrain_muon":
            return (MegaTrainStrategy(), 1.0, "muon", "megatrain defaults, Muon (host momentum, iteration on the GPU)",
                    ["MegaTrainStrategy() with Muon: gpu_optimizer_groups='auto' places none (Adam/AdamW only)"])
        if system == "megatrain_no_backward_updates":
            return (MegaTrainStrategy(update_during_backward=False), 1.0, "adamw",
                    "megatrain defaults without host updates during backward",
                    ["MegaTrainStrategy(update_during_backward=False): the host step starts when backward ends"])
        if system == "megatrain" and not groups and not compiled:
            return (MegaTrainStrategy(), 1.0, "adamw", "megatrain defaults: every 'auto' choice the engine's",
                    ["MegaTrainStrategy() with no arguments: the choices are in engine_config"])
        overlap = system.startswith("megatrain_overlap")
        cpu_adam = "deepspeed" if system == "megatrain_overlap_deepspeed" else "auto"
        strategy = MegaTrainStrategy(overlap_optimizer=overlap, cpu_adam=cpu_adam, gpu_optimizer_groups=groups,
                                     compile_layers=compiled)
        notes = ([f"gpu_optimizer_groups={groups}: the residents and {groups - 1} layers step on the GPU"]
                 if groups else [])
        return (strategy, 1.0, "adamw",
                "megatrain keep_layers='auto': graphs kept for the layers that fit, the rest recomputed", notes)
    if system in ("plain", "plain_muon"):
        notes = [("clipped by torch.nn.utils.clip_grad_norm_ in configure_gradient_clipping: Lightning's "
                  "MixedPrecision refuses gradient_clip_val with a fused optimizer")]
        optimizer = "muon" if system == "plain_muon" else "adamw_fused"
        return "auto", 1.0, optimizer, "hf gradient_checkpointing_enable(use_reentrant=False)", notes
    if system == "deepspeed_zero3_offload":
        from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy

        notes = ["DeepSpeed bf16 mode: bf16 weights and compute on the GPU, fp32 masters in DeepSpeedCPUAdam"]
        cls = DeepSpeedStrategy
        if not on_cuda:
            class CPUDeepSpeedStrategy(DeepSpeedStrategy):
                # Dry run only: DeepSpeedStrategy refuses non-CUDA accelerators and device indices other than
                # 0..n-1; DeepSpeed's own CPU accelerator (gloo) runs the same Lightning and ZeRO-3 code.
                def setup_environment(self) -> None:
                    DDPStrategy.setup_environment(self)

                def setup_distributed(self) -> None:
                    self.set_world_ranks()
                    self._init_deepspeed_distributed()

                @property
                def root_device(self) -> torch.device:
                    return torch.device("cpu", 0)  # deepspeed.initialize(device_rank=root_device.index) needs an int

            cls = CPUDeepSpeedStrategy
            notes.append("dry run: DeepSpeedStrategy's CUDA-only checks bypassed, DeepSpeed CPU accelerator (gloo)")
        strategy = cls(stage=3, offload_optimizer=True, offload_parameters=True, pin_memory=True)
        return strategy, 1.0, "ds_cpu_adam", "hf gradient_checkpointing_enable(use_reentrant=False)", notes
    if system == "fsdp_cpu_offload":
        from lightning.pytorch.strategies import FSDPStrategy

        notes = ["no gradient clipping: Lightning's FSDPPrecision refuses gradient_clip_algorithm='norm'"]
        cls = FSDPStrategy
        if not on_cuda:
            class CPUFSDPStrategy(FSDPStrategy):
                """Dry run only: Lightning refuses `type(strategy) is FSDPStrategy` without a CUDA accelerator."""

            cls = CPUFSDPStrategy
            notes.append("dry run: Lightning's CUDA-only check for FSDP bypassed by a subclass")
        strategy = cls(cpu_offload=True, auto_wrap_policy={layer_cls}, activation_checkpointing_policy={layer_cls})
        return strategy, None, "adamw_fused", "lightning activation_checkpointing_policy (decoder layer)", notes
    raise ValueError(f"unknown system {system!r}; choose from {SYSTEMS}")
