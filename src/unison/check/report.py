"""The comparison and the report of `unison check-exact` (`unison.check.runs` runs the script).

Two probe records (1 process and W, the same dtype) become a `Comparison`: per tensor the largest
difference, per step the losses, the epoch values. `describe` gives the report's lines, `verdict`
the one line and the exit status, and `noise_hint` names a differing parameter whose gradient was
float noise (a bias that a following BatchNorm cancels), the likely cause of a difference.

    cmp = compare(record_1_process, record_2_processes)
    verdict(cmp, None, 2, None)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "Comparison",
    "compare",
    "describe",
    "noise_hint",
    "rounding_noise_gradients",
    "verdict",
]

#: Default tolerances (relative) of the decisive comparison. float64 rounding (2e-16) amplified
#: stays far below 1e-8: a deep BatchNorm stack measured 1.5e-14; a bias before a BatchNorm under
#: AdamW (its zero gradient's rounding noise divided by eps = 1e-8) 1e-10 after 8 steps, growing
#: with steps. A real divergence does not shrink with precision: 2.7e-3 in the tests' example.
RTOL_FLOAT64 = 1e-8
RTOL_FLOAT32 = 1e-5
#: A gradient at most this many epsilons of its dtype times the model's largest is rounding noise.
NOISE_EPSILONS = 100
#: How many parameters the report names.
TOP = 5
#: How many steps' losses the report lists.
LOSS_ROWS = 20


# ---- the comparison -------------------------------------------------------------------------
def _rel(diff: float, a: float, b: float) -> float:
    scale = max(abs(a), abs(b))
    if diff == 0:
        return 0.0
    return diff / scale if scale > 0 else math.inf


def _diff(a: float, b: float) -> float:
    """|a - b|; NaN when neither run has a value (a validation loss nothing recorded): not compared."""
    if math.isnan(a) and math.isnan(b):
        return math.nan
    if math.isnan(a) or math.isnan(b):
        return math.inf
    return abs(a - b)


@dataclass
class Comparison:
    """The differences between a 1-process record and a W-process record of the same dtype.

    `weights`: (name, max |dw|, relative) per tensor, relative to the tensor's largest entry,
    most different first; `losses`: (batch, loss 1, loss W, |d|) per training batch; `metrics`:
    (name, value 1, value W, |d|) for the last recorded epoch row. A |d| of NaN: neither run
    recorded that value (not compared). `loss_float32`: the loss came in float32 in a float64 run
    (a loss function that computes in float32): judged at float32's tolerance, the weights decide.
    """

    weights: list[tuple[str, float, float]] = field(default_factory=list)
    losses: list[tuple[int, float, float, float]] = field(default_factory=list)
    metrics: list[tuple[str, float, float, float]] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    loss_float32: bool = False

    @property
    def max_abs_weight(self) -> float:
        return max((d for _, d, _ in self.weights), default=0.0)

    @property
    def max_rel_weight(self) -> float:
        return max((r for _, _, r in self.weights), default=0.0)

    @property
    def max_rel_loss(self) -> float:
        """The largest relative difference of the per-batch losses (those compared)."""
        return max((_rel(d, a, b) for _, a, b, d in self.losses if not math.isnan(d)), default=0.0)

    @property
    def max_rel(self) -> float:
        """The largest relative difference of the weights and (unless in float32) the per-batch losses."""
        rels = [self.max_rel_weight, 0.0 if self.loss_float32 else self.max_rel_loss]
        return max(rels) if not self.missing else math.inf

    @property
    def max_rel_metric(self) -> float:
        """The largest relative difference of the epoch values (train_loss, valid_loss, metrics) compared."""
        return max((_rel(d, a, b) for _, a, b, d in self.metrics if not math.isnan(d)), default=0.0)

    @property
    def not_compared(self) -> list[str]:
        """The epoch values neither run recorded (NaN in both)."""
        return [name for name, _, _, d in self.metrics if math.isnan(d)]

    def diverging(self, rtol: float) -> list[str]:
        """The tensors whose relative difference exceeds `rtol`, most different first."""
        return [name for name, _, rel in self.weights if rel > rtol]


def compare(one: dict[str, Any], many: dict[str, Any]) -> Comparison:
    """Compare the records of a 1-process run and a W-process run."""
    import torch

    result = Comparison(loss_float32=bool(one.get("float64")) and one.get("loss_float64") is False)
    w1, ww = one["weights"], many["weights"]
    result.missing = sorted(set(w1) ^ set(ww))
    for name in w1:
        if name not in ww:
            continue
        a, b = w1[name], ww[name]
        if a.shape != b.shape:
            result.missing.append(f"{name} (shape {tuple(a.shape)} vs {tuple(b.shape)})")
            continue
        if a.numel() == 0:
            result.weights.append((name, 0.0, 0.0))
            continue
        a64, b64 = a.to(torch.float64), b.to(torch.float64)
        same = (a64 == b64) | (a64.isnan() & b64.isnan())  # equal infinities and NaNs: no difference
        gaps = torch.where(same, torch.zeros_like(a64), (a64 - b64).abs()).nan_to_num(nan=math.inf)
        diff = float(gaps.max())
        scale = max(float(a64.abs().max().nan_to_num()), float(b64.abs().max().nan_to_num()))
        result.weights.append((name, diff, _rel(diff, scale, 0.0)))
    result.weights.sort(key=lambda t: (-t[2], -t[1], t[0]))
    for i, (a, b) in enumerate(zip(one["losses"], many["losses"], strict=False), start=1):
        result.losses.append((i, a, b, _diff(a, b)))
    if one["values"] and many["values"]:
        names = ["train_loss", "valid_loss", *one["metric_names"][2:]]
        for name, a, b in zip(names, one["values"][-1], many["values"][-1], strict=False):
            result.metrics.append((name, a, b, _diff(a, b)))
    return result


# ---- the report ---------------------------------------------------------------------------------
def procs(n: int) -> str:
    """ "1 process" or "N processes".

    >>> procs(2)
    '2 processes'
    """
    return "1 process" if n == 1 else f"{n} processes"


def describe(cmp: Comparison, nproc: int, dtype: str, rtol: float | None) -> list[str]:
    """The report's lines for one dtype."""
    lines = [f"{dtype}:"]
    if cmp.missing:
        lines.append(f"  tensors in only one run: {', '.join(cmp.missing)}")
    if cmp.weights:
        name, d, r = cmp.weights[0]
        lines.append(f"  weights: max |dw| {cmp.max_abs_weight:.2e}; largest relative {r:.2e}, in {name}")
        shown = [w for w in cmp.weights[:TOP] if w[1] > 0]
        if shown:
            width = max(len(n) for n, _, _ in shown)
            lines.append("    most different tensors (max |dw|, relative to the tensor's largest entry):")
            for n, d, r in shown:
                flag = "  <- diverges" if rtol is not None and r > rtol else ""
                lines.append(f"      {n.ljust(width)}  {d:.2e}  {r:.2e}{flag}")
    compared = [t for t in cmp.losses if not math.isnan(t[3])]
    if compared:
        worst = max(compared, key=lambda t: t[3])
        in32 = ", computed in float32 by the loss function" if cmp.loss_float32 else ""
        lines.append(
            f"  losses ({len(cmp.losses)} training batches{in32}): max |dloss| {worst[3]:.2e} at batch "
            f"{worst[0]} (relative {_rel(worst[3], worst[1], worst[2]):.2e})"
        )
        lines.append(f"    batch {'1 process':>14}  {procs(nproc):>14}  {'|d|':>9}")
        for step, a, b, d in cmp.losses[:LOSS_ROWS]:
            lines.append(f"    {step:<4}  {a:>14.8g}  {b:>14.8g}  {d:>9.2e}")
        if len(cmp.losses) > LOSS_ROWS:
            lines.append(f"    ... ({len(cmp.losses) - LOSS_ROWS} more)")
    if cmp.metrics:
        cells = [
            f"{n} not compared (neither run recorded it)"
            if math.isnan(d)
            else f"{n} {a:.6g} vs {b:.6g} (|d| {d:.2e})"
            for n, a, b, d in cmp.metrics
        ]
        lines.append("  after the last step: " + "; ".join(cells))
    return lines


def _names(cmp: Comparison, tol: float) -> str:
    names = cmp.diverging(tol)
    if not names:  # only the losses or the metrics differ
        return "no single tensor beyond the tolerance (the losses or metrics differ)"
    more = f" and {len(names) - TOP} more" if len(names) > TOP else ""
    return ", ".join(names[:TOP]) + more


def verdict(
    cmp32: Comparison | None, cmp64: Comparison | None, nproc: int, rtol: float | None
) -> tuple[int, str]:
    """(exit status, verdict line).

    Weights and per-step losses are judged at `rtol` (float64: 1e-8, float32: 1e-5 by default).
    The epoch values (train_loss, valid_loss, metrics) are judged at float32's tolerance in
    both cases: unison reduces them over ranks in float32 whatever the model's dtype.
    """
    many = procs(nproc)
    decisive = cmp64 if cmp64 is not None else cmp32
    assert decisive is not None, "no comparison to judge"
    tol = (RTOL_FLOAT64 if cmp64 is not None else RTOL_FLOAT32) if rtol is None else rtol
    metric_tol = max(tol, RTOL_FLOAT32)
    gap, metric_gap = decisive.max_rel, decisive.max_rel_metric
    loss_gap = decisive.max_rel_loss if decisive.loss_float32 else 0.0
    agree = gap <= tol and metric_gap <= metric_tol and loss_gap <= metric_tol
    weights = f"{gap:.1e} relative ({'<=' if gap <= tol else '>'} {tol:g})"
    metric_note = ""
    if decisive.loss_float32:  # float32 noise in a float32 loss says nothing of the float64 weights
        sign = "<=" if loss_gap <= metric_tol else ">"
        metric_note += (
            f", losses to {loss_gap:.1e} ({sign} {metric_tol:g}: the loss function computes in float32)"
        )
    if decisive.metrics:  # judged at their own tolerance, stated beside their figure
        why = "" if metric_tol == tol else ": unison reduces them in float32"
        sign = "<=" if metric_gap <= metric_tol else ">"
        metric_note += f", metrics to {metric_gap:.1e} ({sign} {metric_tol:g}{why})"
    if cmp64 is not None:
        if agree:
            rounding = (
                ""
                if cmp32 is None
                else f"; the float32 difference ({cmp32.max_rel:.1e} relative) is rounding"
            )
            return (
                0,
                f"exact to float noise: in float64, {many} agree with 1 to {weights}{metric_note}{rounding}",
            )
        return 1, (
            f"DIVERGES: in float64, {many} differ from 1 by {weights}{metric_note}: not float noise. "
            f"Diverging: {_names(decisive, tol)}"
        )
    if agree:
        return 0, (
            f"agrees to float32 rounding: {many} and 1 differ by {weights}{metric_note}; --float64 "
            "proves it is float noise"
        )
    return 1, (
        f"DIFFERS: {many} and 1 differ by {weights}{metric_note}, most in {_names(decisive, tol)}. Run "
        "again with --float64: float64 agreeing means amplified float noise (deep BatchNorm stacks do "
        "this), not agreeing means a real divergence"
    )


def rounding_noise_gradients(records: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Parameters whose gradient was rounding noise in every run of `records`, with its largest size.

    Each record holds, per parameter, the largest over steps of max|grad| relative to the
    model's largest gradient (`grad_ratio`). A parameter whose true gradient is zero (a bias
    that a following BatchNorm cancels) has a computed gradient of float noise: measured 0.4
    to 0.6 of the dtype's epsilon (8.5e-17 in float64, 7e-8 in float32); a real gradient is
    orders of magnitude above NOISE_EPSILONS epsilons.

    >>> rounding_noise_gradients([{"float64": True, "grad_ratio": {"0.bias": 8.5e-17, "0.weight": 0.55}}])
    {'0.bias': 8.5e-17}
    """
    found: dict[str, float] = {}
    for i, record in enumerate(records):
        ratios = record.get("grad_ratio") or {}
        eps = 2.0**-52 if record.get("float64") else 2.0**-23
        noise = {n: r for n, r in ratios.items() if r <= NOISE_EPSILONS * eps}
        if i == 0:
            found = noise
        found = {n: max(r, noise[n]) for n, r in found.items() if n in noise}
    return found


def noise_hint(noise: dict[str, float], differing: Sequence[str], dtype: str) -> str | None:
    """One line naming the parameters of `differing` whose gradient is rounding noise, or None.

    >>> noise_hint({"0.bias": 8.5e-17}, ["0.bias", "1.running_mean"], "float64")
    "hint: 0.bias's gradient is zero but for rounding (at most 8.5e-17 of the model's largest, ..."
    """
    named = list(dict.fromkeys(n for n in differing if n in noise))
    if not named:
        return None
    whose = f"{named[0]}'s gradient is" if len(named) == 1 else f"the gradients of {', '.join(named)} are"
    return (
        f"hint: {whose} zero but for rounding (at most {max(noise[n] for n in named):.1e} of the model's "
        f"largest, in {dtype}): the likely cause of this difference. A parameter whose true gradient is "
        "zero, such as a bias that a following BatchNorm cancels, gets float noise that Adam and AdamW "
        "turn into full-size steps, different for every summation order: build that layer with "
        "bias=False (docs/exact.md, When float noise grows)"
    )
