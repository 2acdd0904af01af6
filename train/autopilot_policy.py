"""The stability autopilot: what the OPT-175B team did by hand, as a policy the training loop consults.

Detectors watch the per-step metrics (every rank sees the same all-reduced numbers, so every
rank reaches the same decision without talking): a loss spike (above the rolling mean by k
sigma *and* by a ratio, for m steps: OLMo's 6-sigma rule plus a relative floor so that a very
flat curve does not alarm on noise), a grad-norm spike (the same test on the gradient norm), a
non-finite loss or gradient, a loss-scale collapse (the scale under a floor, or too many
overflow-skipped steps in a window) and final-layer activation norms trending up.

The policy answers an incident with escalating actions (OPT's chronicles, PaLM section 5.1):
roll back to the newest healthy checkpoint older than the incident's step - 1 (whose update shows
in the incident's loss) by at least `rollback_steps`, and
skip the batches from there to the incident plus `skip_margin` (the spike is a batch meeting a
parameter state: PaLM); if it happens again within `repeat_window` steps, also lower the LR;
then lower the clip (1.0 -> 0.3); then reset the loss scale; as a last resort reset Adam's
state with a short warmup. After `budget` interventions the run stops with a clear message.

Everything here is plain data and arithmetic: the loop applies the actions, and this state is
saved (in the run folder, written before any action is applied, and in every checkpoint) so a
restart neither loses nor repeats an intervention.
"""

from __future__ import annotations

import json
import math
import os
from collections import deque
from dataclasses import asdict, dataclass, field

from train.config import AutopilotConfig

ACTIONS = ("rollback", "skip", "lower_lr", "lower_clip", "reset_loss_scale", "reset_optimizer")


@dataclass
class Incident:
    step: int
    kind: str  # loss_spike | grad_spike | non_finite | loss_scale_collapse | activation_growth
    detail: str  # what was seen, with the numbers


class RollingStats:
    def __init__(self, window: int):
        self.values: deque = deque(maxlen=window)

    def add(self, value: float) -> None:
        self.values.append(value)

    def mean_std(self) -> tuple[float, float]:
        n = len(self.values)
        mean = sum(self.values) / n
        return mean, math.sqrt(sum((v - mean) ** 2 for v in self.values) / max(1, n - 1))


class Detectors:
    """Feed one step's metrics at a time; returns the incident it completes, if any.

    A value that sets off a detector is not added to its history (a spike must not raise the bar
    for the next one)."""

    def __init__(self, s: AutopilotConfig):
        self.s = s
        self.loss, self.grad = RollingStats(s.window), RollingStats(s.window)
        self.activation: deque = deque(maxlen=max(2, s.activation_window))
        self.overflows: deque = deque(maxlen=s.overflow_window)
        self.over = {"loss": 0, "grad": 0}

    def rolled_back(self) -> None:
        """The steps since the rollback target are undone: what they left in the windows goes too
        (the rolling loss and grad-norm levels stay: they describe the run, not those steps)."""
        self.overflows.clear()
        self.activation.clear()
        self.over = {"loss": 0, "grad": 0}

    def _spike(self, name: str, stats: RollingStats, value: float, sigma: float, ratio: float, step: int) -> Incident | None:
        if len(stats.values) >= self.s.warmup:
            mean, std = stats.mean_std()
            if value > mean + sigma * std and value > mean * (1 + ratio):
                self.over[name] += 1
                if self.over[name] >= (self.s.patience if name == "loss" else self.s.grad_patience):
                    self.over[name] = 0
                    return Incident(step, f"{name}_spike", f"{name} {value:.4g} > rolling mean {mean:.4g} + "
                                    f"{sigma:g} sigma ({std:.3g}) and > mean x {1 + ratio:g}, over {self.s.window} steps")
                return None
        self.over[name] = 0
        stats.add(value)
        return None

    def observe(self, step: int, m: dict) -> Incident | None:
        loss, grad, overflow = m["loss"], m.get("grad_norm"), bool(m.get("overflow"))
        if overflow:
            grad = None  # the scaler skipped this step: its gradients overflowed by design, not a divergence
        if not math.isfinite(loss) or (grad is not None and not math.isfinite(grad)):
            return Incident(step, "non_finite", f"loss {loss}, grad norm {grad}")
        self.overflows.append(1 if overflow else 0)
        scale = m.get("loss_scale")
        if m.get("fp16") and scale is not None and scale < self.s.scale_floor:
            return Incident(step, "loss_scale_collapse", f"loss scale {scale:g} < floor {self.s.scale_floor:g}")
        if sum(self.overflows) >= self.s.overflow_limit:
            self.overflows.clear()
            return Incident(step, "loss_scale_collapse", f"{self.s.overflow_limit} overflow-skipped steps within "
                            f"{self.s.overflow_window} (scale {scale})")
        incident = self._spike("loss", self.loss, loss, self.s.loss_sigma, self.s.loss_ratio, step)
        if incident is None and grad is not None:
            incident = self._spike("grad", self.grad, grad, self.s.grad_sigma, self.s.grad_ratio, step)
        if incident is not None:
            return incident
        return self._activation(step, m.get("activation_norm"))

    def _activation(self, step: int, value: float | None) -> Incident | None:
        if not self.s.activation_window or value is None:
            return None
        self.activation.append(value)
        if len(self.activation) < self.s.activation_window:
            return None
        values = list(self.activation)
        half = len(values) // 2
        first, second = sum(values[:half]) / half, sum(values[half:]) / (len(values) - half)
        if first > 0 and second / first - 1 > self.s.activation_growth and values[-1] > values[half]:
            self.activation.clear()
            return Incident(step, "activation_growth", f"final-layer activation norm {first:.3g} -> {second:.3g} "
                            f"over {len(values)} steps (+{second / first - 1:.0%})")
        return None

    def trending_up(self) -> bool:
        """For health: activation norms grew over the recent window (by half the alarm threshold)."""
        values = list(self.activation)
        if len(values) < 10:
            return False
        half = len(values) // 2
        first, second = sum(values[:half]) / half, sum(values[half:]) / (len(values) - half)
        return first > 0 and second / first - 1 > self.s.activation_growth / 2


@dataclass
class State:
    """What the autopilot has done: saved before each intervention is applied, and in every checkpoint."""

    interventions: int = 0
    level: int = 0  # escalation reached (0: next incident gets the first level)
    last_incident_step: int = -(10**9)
    skip_ranges: list = field(default_factory=list)  # [start, end) global batches
    lr_factor: float = 1.0
    clip: float | None = None  # None: the configured clip
    rewarm_from: int | None = None  # optimizer reset: a fresh warmup from this step

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "State":
        return cls(**data)


LEVELS = (  # the actions at each escalation level: the first incident, a repeat, a third, ...
    ("rollback", "skip"),
    ("rollback", "skip", "lower_lr"),
    ("rollback", "skip", "lower_lr", "lower_clip"),
    ("rollback", "skip", "reset_loss_scale"),
    ("rollback", "skip", "reset_optimizer"),
)


@dataclass
class Decision:
    incident: Incident
    actions: tuple[str, ...]
    why: str
    stop: bool = False


def decide(state: State, incident: Incident, s: AutopilotConfig, fp16: bool) -> Decision:
    """The actions for an incident given what was done before (pure: the caller updates the state)."""
    if state.interventions >= s.budget:
        return Decision(incident, (), f"the budget of {s.budget} interventions is spent", stop=True)
    repeat = incident.step - state.last_incident_step <= s.repeat_window
    level = min(state.level if repeat else 0, len(LEVELS) - 1)
    if incident.kind == "loss_scale_collapse" and fp16:
        actions = ("rollback", "skip", "reset_loss_scale")
        why = "the loss scale collapsed: roll back, skip the batches, reset the scaler (OPT, WeLM)"
    else:
        actions = LEVELS[level]
        if not fp16:
            actions = tuple(a for a in actions if a != "reset_loss_scale")
        why = (f"repeat #{level + 1} within {s.repeat_window} steps: " if repeat and level else "first incident: ") + \
            {0: "roll back and skip the batches (PaLM)", 1: "also lower the LR (OPT)", 2: "also lower the clip to "
             f"{s.clip_to} (OPT)", 3: "reset the loss scale (OPT)", 4: "reset Adam's state with a fresh warmup (OPT's backup plan)"}[level]
    return Decision(incident, actions, why)


def apply_to_state(state: State, decision: Decision, s: AutopilotConfig, target_step: int, batch_from: int,
                   batch_incident: int) -> None:
    """The state after the decision, rolling back to `target_step` whose data position is global batch
    `batch_from`: skip ranges, LR factor, clip, warmup restart, counters."""
    repeat = decision.incident.step - state.last_incident_step <= s.repeat_window
    state.level = (state.level + 1) if repeat else 1
    state.interventions += 1
    state.last_incident_step = decision.incident.step
    if "skip" in decision.actions:
        state.skip_ranges.append([batch_from, batch_incident + 1 + s.skip_margin])
    if "lower_lr" in decision.actions:
        state.lr_factor *= s.lr_factor
    if "lower_clip" in decision.actions:
        state.clip = s.clip_to
    if "reset_optimizer" in decision.actions:
        state.rewarm_from = target_step


# --------------------------------------------------------------------------- the saved state


def save_state(path, state: State, extra: dict) -> None:
    """Atomically: the state the run continues with, written before the intervention is applied."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump({"state": state.to_dict(), **extra}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_state(path) -> tuple[State, dict] | None:
    try:
        data = json.loads(open(path).read())
    except FileNotFoundError:
        return None
    return State.from_dict(data.pop("state")), data
