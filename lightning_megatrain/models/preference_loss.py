"""Preference losses on per-sequence log-probabilities: DPO (sigmoid), IPO, SimPO and ORPO.

Notation, per pair ``i`` of a micro-batch of ``B`` pairs: ``c_i``, ``r_i`` the policy's summed log-probabilities of
the chosen and rejected responses, ``n^c_i``, ``n^r_i`` their token counts, ``c^ref_i``, ``r^ref_i`` the reference
model's, ``s(x) = log sigmoid(x)``. The loss is the mean over the ``B`` pairs of:

- ``"sigmoid"`` (DPO, Rafailov et al. 2023, eq. 7; with ``label_smoothing = e`` the conservative DPO of Mitchell
  2023): ``h = beta * ((c - c^ref) - (r - r^ref))``, loss ``-(1 - e) * s(h) - e * s(-h)``.
- ``"ipo"`` (Azar et al. 2023, eq. 17, with ``tau = beta``): ``h = (c - c^ref) - (r - r^ref)``, loss
  ``(h - 1 / (2 * beta))^2``, on summed log-probabilities as the paper writes it (TRL divides each by its length).
- ``"simpo"`` (Meng et al. 2024, eq. 6): no reference, length-normalised: ``h = beta * (c / n^c - r / n^r) - gamma``,
  loss ``-(1 - e) * s(h) - e * s(-h)``.
- ``"orpo"`` (Hong et al. 2024, eq. 6-7): no reference, ``beta`` weighting the odds-ratio term:
  ``log odds(y) = a - log(1 - exp(a))`` with ``a = min(logp / n, -1e-6)`` the mean token log-probability, loss
  ``NLL - beta * mean_i s(log odds(chosen_i) - log odds(rejected_i))`` where ``NLL = -sum_i c_i / sum_i n^c_i`` is
  SFT's token-mean loss on the chosen responses.

Rewards, logged as metrics: ``beta * (logp - logp^ref)`` for ``"sigmoid"`` and ``"ipo"``, ``beta * logp / n`` for the
reference-free losses.

``beta=None`` takes :func:`default_beta`: 2.0 for ``"simpo"`` (the paper's range is 2.0-2.5, its ``beta`` scaling a
mean token log-probability), 0.1 for the others (DPO's and TRL's default).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

LOSS_TYPES = ("sigmoid", "ipo", "simpo", "orpo")
REFERENCE_FREE = ("simpo", "orpo")  # the losses that read no reference log-probabilities
_DEFAULT_BETA = {"simpo": 2.0}  # the others: 0.1 (see the module docstring)
# ORPO's log odds: a mean log-probability of 0 (every target certain) would make log(1 - exp(a)) = -inf and its
# gradient NaN; a is capped just below it.
_ORPO_MAX_MEAN_LOGP = -1e-6


def default_beta(loss_type: str) -> float:
    """``beta`` when none is given: 2.0 for ``"simpo"``, 0.1 for ``"sigmoid"``, ``"ipo"`` and ``"orpo"``."""
    return _DEFAULT_BETA.get(loss_type, 0.1)


@dataclass(frozen=True)
class PreferenceLoss:
    """A micro-batch's loss and each pair's rewards.

    Attributes:
        loss: ``[]`` the mean over the pairs (ORPO: plus the chosen responses' NLL).
        chosen_rewards: ``[B]`` (detached).
        rejected_rewards: ``[B]`` (detached).
    """

    loss: Tensor
    chosen_rewards: Tensor
    rejected_rewards: Tensor

    def metrics(self) -> dict[str, Tensor]:
        """``rewards/chosen``, ``rewards/rejected``, ``rewards/accuracies`` (share of pairs whose chosen reward is
        higher) and ``rewards/margins``, each the mean over the pairs."""
        chosen, rejected = self.chosen_rewards, self.rejected_rewards
        return {
            "rewards/chosen": chosen.mean(),
            "rewards/rejected": rejected.mean(),
            "rewards/accuracies": (chosen > rejected).float().mean(),
            "rewards/margins": (chosen - rejected).mean(),
        }


def _log1m_exp(a: Tensor) -> Tensor:
    """``log(1 - exp(a))`` for ``a < 0``, accurate on both sides of ``-log 2`` (Maechler 2012)."""
    return torch.where(a > -0.6931471805599453, torch.log(-torch.expm1(a)), torch.log1p(-torch.exp(a)))


def preference_loss(
    chosen_logps: Tensor,
    rejected_logps: Tensor,
    chosen_tokens: Tensor,
    rejected_tokens: Tensor,
    reference_chosen_logps: Tensor | None = None,
    reference_rejected_logps: Tensor | None = None,
    *,
    loss_type: str = "sigmoid",
    beta: float | None = None,
    label_smoothing: float = 0.0,
    simpo_gamma: float = 0.5,
) -> PreferenceLoss:
    """The preference loss of ``loss_type`` (module docstring) from per-sequence log-probabilities.

    Args:
        chosen_logps: ``[B]`` summed target log-probabilities of the chosen responses under the policy.
        rejected_logps: ``[B]`` the same for the rejected responses.
        chosen_tokens: ``[B]`` target tokens of each chosen response (SimPO, ORPO).
        rejected_tokens: ``[B]`` target tokens of each rejected response (SimPO, ORPO).
        reference_chosen_logps: ``[B]`` the reference model's ``chosen_logps`` (``"sigmoid"``, ``"ipo"``).
        reference_rejected_logps: ``[B]`` the reference model's ``rejected_logps``.
        loss_type: ``"sigmoid"``, ``"ipo"``, ``"simpo"`` or ``"orpo"``.
        beta: The inverse temperature of DPO and SimPO, IPO's ``tau``, ORPO's ``lambda``; ``None``:
            :func:`default_beta` of ``loss_type``.
        label_smoothing: Probability that a pair's preference is flipped (``"sigmoid"``, ``"simpo"``).
        simpo_gamma: SimPO's target reward margin ``gamma``.

    Raises:
        ValueError: An unknown ``loss_type``, or a reference-based one without reference log-probabilities.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type={loss_type!r}: must be one of {list(LOSS_TYPES)}")
    beta = default_beta(loss_type) if beta is None else beta
    if loss_type in REFERENCE_FREE:
        chosen_mean = chosen_logps / chosen_tokens.clamp(min=1)  # [B]
        rejected_mean = rejected_logps / rejected_tokens.clamp(min=1)  # [B]
        rewards = (beta * chosen_mean.detach(), beta * rejected_mean.detach())
        if loss_type == "simpo":
            h = beta * (chosen_mean - rejected_mean) - simpo_gamma  # [B]
            losses = -(1 - label_smoothing) * F.logsigmoid(h) - label_smoothing * F.logsigmoid(-h)
            return PreferenceLoss(losses.mean(), *rewards)
        chosen_a, rejected_a = chosen_mean.clamp(max=_ORPO_MAX_MEAN_LOGP), rejected_mean.clamp(max=_ORPO_MAX_MEAN_LOGP)
        log_odds = (chosen_a - _log1m_exp(chosen_a)) - (rejected_a - _log1m_exp(rejected_a))  # [B]
        nll = -chosen_logps.sum() / chosen_tokens.sum().clamp(min=1)  # []
        return PreferenceLoss(nll - beta * F.logsigmoid(log_odds).mean(), *rewards)
    if reference_chosen_logps is None or reference_rejected_logps is None:
        raise ValueError(f"loss_type={loss_type!r} needs the reference model's log-probabilities; pass "
                         f"reference_chosen_logps and reference_rejected_logps, or use one of {list(REFERENCE_FREE)}")
    chosen_ratio = chosen_logps - reference_chosen_logps  # [B]
    rejected_ratio = rejected_logps - reference_rejected_logps  # [B]
    h = chosen_ratio - rejected_ratio  # [B]
    if loss_type == "ipo":
        losses = (h - 1 / (2 * beta)) ** 2
    else:
        losses = -(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)
    return PreferenceLoss(losses.mean(), beta * chosen_ratio.detach(), beta * rejected_ratio.detach())
