"""Muon (optim/muon.py) on the CPU: against a plain reference Muon written here, its Newton-Schulz iteration, the
param-group split, its errors, and an exact state_dict round trip."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

from lightning_megatrain.optim import Muon, muon_param_groups
from lightning_megatrain.optim.newton_schulz import DeviceOrthogonalizer, newton_schulz, ns_flops

from helpers.parity import ParityLM


def reference_orthogonalize(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """The quintic Newton-Schulz iteration as Muon describes it, with plain operators."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.T if g.shape[0] > g.shape[1] else g
    x = x / (x.norm() + 1e-7)
    for _ in range(steps):
        s = x @ x.T
        x = a * x + (b * s + c * s @ s) @ x
    return x.T if g.shape[0] > g.shape[1] else x


class ReferenceMuon:
    """Muon for the matrices, torch's AdamW (its for-loop implementation) for the vectors, one parameter at a time."""

    def __init__(self, matrices, vectors, lr, weight_decay, momentum=0.95, nesterov=True, scale="rms"):
        self.matrices, self.lr, self.wd, self.beta, self.nesterov, self.scale = matrices, lr, weight_decay, momentum, \
            nesterov, scale
        self.buffers = [torch.zeros_like(p) for p in matrices]
        self.adamw = torch.optim.AdamW(vectors, lr=lr, weight_decay=weight_decay, foreach=False)

    @torch.no_grad()
    def step(self):
        for p, buf in zip(self.matrices, self.buffers):
            buf.mul_(self.beta).add_(p.grad, alpha=1 - self.beta)
            u = (1 - self.beta) * p.grad + self.beta * buf if self.nesterov else buf
            m, n = p.shape
            s = 0.2 * max(m, n) ** 0.5 if self.scale == "rms" else max(1, m / n) ** 0.5
            p.mul_(1 - self.lr * self.wd).sub_(self.lr * s * reference_orthogonalize(u))
        self.adamw.step()


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(24, 40), (40, 24), (16, 16), (32,), (1, 32)]
    return [nn.Parameter(torch.randn(s, generator=g) * 0.1) for s in shapes]


def _grads(params, step):
    g = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)


@pytest.mark.parametrize(("nesterov", "scale"), [(True, "rms"), (False, "spectral")])
def test_muon_matches_a_reference_muon(nesterov, scale):
    """Five steps: every matrix within fp32 rounding of the reference (the iteration's matmuls fused differently),
    the 1-D and the [1, n] parameter in the AdamW group bit for bit torch's AdamW."""
    mine, ref = _params(), _params()
    muon = Muon([{"params": mine[:3]}, {"params": mine[3:], "use_muon": False}], lr=0.02, weight_decay=0.1,
                nesterov=nesterov, update_scale=scale)
    reference = ReferenceMuon(ref[:3], ref[3:], lr=0.02, weight_decay=0.1, nesterov=nesterov, scale=scale)
    for step in range(5):
        _grads(mine, step)
        _grads(ref, step)
        muon.step()
        reference.step()
    for p, q, start in zip(mine[:3], ref[:3], _params()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        assert (p - start).norm() > 0.1 * start.norm()  # the steps moved it
    for p, q in zip(mine[3:], ref[3:]):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(muon.state[mine[0]]["momentum_buffer"], reference.buffers[0], rtol=1e-6, atol=1e-7)


def test_reference_comparison_can_fail():
    """The tolerance above is far below what a wrong scale or a missed Nesterov term gives."""
    mine, ref = _params(), _params()
    muon = Muon([{"params": mine[:3]}], lr=0.02, update_scale="rms")
    reference = ReferenceMuon(ref[:3], ref[3:], lr=0.02, weight_decay=0.01, scale="spectral")
    _grads(mine, 0)
    _grads(ref, 0)
    muon.step()
    reference.step()
    with pytest.raises(AssertionError):
        torch.testing.assert_close(mine[0], ref[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape", [(64, 32), (32, 64), (48, 48)])
def test_newton_schulz_orthogonalizes(shape):
    """Singular values pushed into Muon's band around 1, the singular vectors of the input kept; zero stays zero."""
    g = torch.randn(shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    o = newton_schulz(g)
    sv = torch.linalg.svdvals(o)
    assert 0.6 < float(sv.min()) and float(sv.max()) < 1.25
    u, _, vh = torch.linalg.svd(g, full_matrices=False)
    d = u.T @ o @ vh.T  # o in g's singular bases: a polynomial of g g^T times g
    torch.testing.assert_close(o, u @ torch.diag(torch.diagonal(d)) @ vh, rtol=0, atol=1e-9)
    torch.testing.assert_close(newton_schulz(g.T), o.T, rtol=1e-12, atol=1e-12)
    assert torch.equal(newton_schulz(torch.zeros(shape)), torch.zeros(shape))
    assert ns_flops(*shape) == 5 * (4 * min(shape) ** 2 * max(shape) + 2 * min(shape) ** 3)


def test_param_groups_split_an_hf_model():
    """Embeddings and the head (tied or not), norms and biases to AdamW; every other matrix to Muon."""
    for family in ("llama_tied", "qwen2"):
        model = ParityLM(family).model
        groups = muon_param_groups(model)
        names = {id(p): n for n, p in model.named_parameters()}
        muon, adamw = ([names[id(p)] for p in g["params"]] for g in groups)
        assert [g["use_muon"] for g in groups] == [True, False]
        assert all(n.split(".")[-2] in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
                   for n in muon) and len(muon) == 3 * 7
        assert "model.embed_tokens.weight" in adamw and all("norm" in n or n.endswith(("embed_tokens.weight",
               "lm_head.weight", "bias")) for n in adamw)
        assert ("lm_head.weight" in adamw) == (family == "qwen2")  # tied: the head is the embedding, listed once
        Muon(groups)  # accepted as given


def test_a_plain_module_splits_by_shape_and_name():
    model = nn.ModuleDict({"emb": nn.Embedding(10, 4), "mlp": nn.Linear(4, 4), "lm_head": nn.Linear(4, 10)})
    model.mlp.bias.requires_grad_(False)
    (muon, adamw) = muon_param_groups(model)
    assert muon["params"] == [model.mlp.weight]
    assert adamw["params"] == [model.emb.weight, model.lm_head.weight, model.lm_head.bias]


def test_arguments_are_checked_and_named():
    w = nn.Parameter(torch.zeros(4, 4))
    with pytest.raises(ValueError, match=r"shape \[4\].*HINT: build the groups with .*muon_param_groups"):
        Muon([w, nn.Parameter(torch.zeros(4))])
    muon = Muon([w])
    with pytest.raises(ValueError, match=r"use_muon=True holds a parameter of shape \[2, 2, 2\]"):
        muon.add_param_group({"params": [nn.Parameter(torch.zeros(2, 2, 2))]})
    assert len(muon.param_groups) == 1
    with pytest.raises(ValueError, match=r"momentum=1.0: need 0 <= momentum < 1\n- ns_steps=0: .*\n- update_scale="
                                         r"'rmsprop': choose one of \('rms', 'spectral'\)\n- ns_device='tpu'"):
        Muon([w], momentum=1.0, ns_steps=0, update_scale="rmsprop", ns_device="tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"ns_device='cuda': CUDA is not available here; use 'auto' or 'cpu'"):
            Muon([w], ns_device="cuda")


def _train(muon, params, steps, first=0):
    for step in range(first, first + steps):
        _grads(params, step)
        muon.step()


def test_state_dict_round_trip_resumes_bit_for_bit():
    """Save after 2 steps (through torch.save), load into a fresh optimizer on fresh copies of the parameters, 3 more
    steps: parameters, momentum buffers and AdamW states equal an uninterrupted run's bit for bit."""
    def groups(params):
        return [{"params": params[:3]}, {"params": params[3:], "use_muon": False, "lr": 0.01}]

    straight = _params()
    uninterrupted = Muon(groups(straight), lr=0.02, weight_decay=0.1)
    _train(uninterrupted, straight, 5)

    first = _params()
    muon = Muon(groups(first), lr=0.02, weight_decay=0.1)
    _train(muon, first, 2)
    buffer = io.BytesIO()
    torch.save(muon.state_dict(), buffer)
    resumed = [nn.Parameter(p.detach().clone()) for p in first]
    loaded = Muon(groups(resumed), lr=0.5, weight_decay=0.0)  # the checkpoint's hyperparameters win
    buffer.seek(0)
    loaded.load_state_dict(torch.load(buffer, weights_only=True))
    assert [g["lr"] for g in loaded.param_groups] == [0.02, 0.01]
    _train(loaded, resumed, 3, first=2)
    for p, q in zip(resumed, straight):
        assert torch.equal(p, q)
        state, reference = loaded.state[p], uninterrupted.state[q]
        assert state.keys() == reference.keys() and state.keys() in ({"momentum_buffer"}, {"step", "exp_avg",
                                                                                           "exp_avg_sq"})
        assert all(torch.equal(state[k], reference[k]) for k in state)


def test_a_failed_prepare_updates_nothing():
    """A momentum buffer of the wrong shape (a checkpoint of another model): the step raises before any parameter
    or state changes, naming the tensor."""
    params = _params()
    muon = Muon([{"params": params[:3]}, {"params": params[3:], "use_muon": False}], lr=0.02)
    _train(muon, params, 1)
    before = [p.detach().clone() for p in params]
    muon.state[params[1]]["momentum_buffer"] = torch.zeros(3, 3)
    _grads(params, 1)
    with pytest.raises(RuntimeError, match=r"the momentum_buffer of a host parameter float32 \[40, 24\] on cpu is "
                                           r"float32 \[3, 3\] on cpu: the Muon kernel cannot update it"):
        muon.step()
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    assert float(muon.state[params[3]]["step"]) == 1.0


class EagerOrthogonalizer(DeviceOrthogonalizer):
    """``DeviceOrthogonalizer``'s pipeline and bf16 slots with the device's work done at once on the CPU (the
    iteration in fp32 on the slot's bf16 values, its result rounded back into the slot), recording the order of the
    host's work and refusing a slot still in use."""

    def __init__(self, log: list) -> None:  # no stream, events or pinned memory: nothing here needs CUDA
        self.device, self.max_numel, self.log, self.busy = torch.device("cuda", 0), 10**6, log, set()
        self._slots = [torch.empty(self.max_numel, dtype=torch.bfloat16) for _ in range(self.SLOTS)]

    def _submit(self, slot, view, steps):
        assert slot not in self.busy, f"slot {slot} refilled before its result was applied"
        self.busy.add(slot)
        self.log.append(("submit", slot))
        view.copy_(newton_schulz(view.float(), steps))

    def _finish(self, slot, view, apply):
        self.busy.remove(slot)
        self.log.append(("apply", slot))
        apply(view)


def test_orthogonalizer_pipeline_order():
    """The host makes matrix k+1 while the device has matrix k, then applies k: two slots, each refilled only after
    its result was applied."""
    log: list = []

    def make(k):
        return lambda out: log.append(("make", k)) or out.copy_(torch.eye(2))

    jobs = [(torch.Size([2, 2]), make(k), 1, lambda o: None) for k in range(3)]
    EagerOrthogonalizer(log).run(jobs)
    assert log == [("make", 0), ("submit", 0), ("make", 1), ("submit", 1), ("apply", 0),
                   ("make", 2), ("submit", 0), ("apply", 1), ("apply", 0)]


def test_host_matrices_through_the_device_pipeline(monkeypatch):
    """Muon with its iteration on a (stand-in) device for host parameters, three steps: each matrix gets its own
    result, bit for bit what the staged path must compute (the Nesterov blend rounded to bf16 in its slot, the
    iteration, its bf16 result applied to the fp32 master), and the AdamW group is the CPU path's."""
    log: list = []
    monkeypatch.setattr(Muon, "orthogonalizer", lambda self, device: EagerOrthogonalizer(log))
    params, ref = _params(), _params()
    muon = Muon([{"params": params[:3]}, {"params": params[3:], "use_muon": False}], lr=0.02, weight_decay=0.1)
    muon.ns_device = torch.device("cuda", 0)
    cpu = Muon([{"params": ref[3:], "use_muon": False}], lr=0.02, weight_decay=0.1)
    buffers = [torch.zeros_like(p) for p in ref[:3]]
    for step in range(3):
        _grads(params, step)
        _grads(ref, step)
        muon.step()
        cpu.step()
        with torch.no_grad():
            for p, buf in zip(ref[:3], buffers):
                buf.lerp_(p.grad, 1 - 0.95)
                o = newton_schulz(torch.lerp(p.grad, buf, 0.95).bfloat16().float()).bfloat16()
                p.mul_(1 - 0.02 * 0.1).add_(o, alpha=-0.02 * 0.2 * max(p.shape) ** 0.5)
    assert log.count(("apply", 0)) + log.count(("apply", 1)) == 3 * 3  # the stand-in device ran every matrix
    for p, q in zip(params, ref):
        assert torch.equal(p, q)
