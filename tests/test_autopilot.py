"""The autopilot's detectors and policy on synthetic metric streams (no training): what fires, what
does not (a clean noisy curve: no alarm), and how the actions escalate."""

from __future__ import annotations

import math
import random

from train.config import AutopilotConfig
from train import records
from train.autopilot_policy import Detectors, Incident, State, apply_to_state, decide
from train.loop.drill import SimulatedScaler


def clean(steps: int, seed: int = 0):
    """A realistic clean run: loss falling like a power law with noise, grad norm noisy, activations flat."""
    rng = random.Random(seed)
    for t in range(1, steps + 1):
        yield t, {"loss": 2.0 + 6.0 * t ** -0.3 + rng.gauss(0, 0.03), "grad_norm": 0.5 + 0.3 * abs(rng.gauss(0, 1)),
                  "loss_scale": 2.0 ** 14, "activation_norm": 10 + rng.gauss(0, 0.3), "overflow": False}


def run(stream, config=AutopilotConfig(), fp16=False):
    d = Detectors(config)
    return [inc for t, m in stream if (inc := d.observe(t, {**m, "fp16": fp16})) is not None]


def test_no_false_alarm_on_clean_noisy_runs():
    for seed in range(5):
        assert run(clean(3000, seed)) == []


def test_loss_spike_fires_at_the_spike_and_needs_both_sigma_and_ratio():
    def spiked(size):
        for t, m in clean(300):
            yield t, ({**m, "loss": m["loss"] * size} if t == 200 else m)
    incidents = run(spiked(1.5))
    assert [(i.step, i.kind) for i in incidents] == [(200, "loss_spike")]
    assert "rolling mean" in incidents[0].detail and "6 sigma" in incidents[0].detail
    assert run(spiked(1.05)) == []  # over 6 sigma of a smooth curve, but under the 10% ratio: noise, not a spike
    patient = AutopilotConfig(patience=2)
    assert run(spiked(1.5), patient) == []  # one step over the line is not enough when patience is 2


def test_grad_spike_non_finite_and_collapse():
    def with_at(step, **changes):
        for t, m in clean(300):
            yield t, ({**m, **changes} if t == step else m)
    assert run(with_at(150, grad_norm=25.0)) == []  # one step's burst: common in clean runs, not an incident

    def grad_burst():
        for t, m in clean(300):
            yield t, ({**m, "grad_norm": 25.0} if 150 <= t < 153 else m)
    assert [(i.step, i.kind) for i in run(grad_burst())] == [(152, "grad_spike")]  # the third step in a row
    assert [(i.step, i.kind) for i in run(with_at(3, loss=float("nan")))] == [(3, "non_finite")]  # no warmup needed
    assert [i.kind for i in run(with_at(40, grad_norm=math.inf))] == ["non_finite"]
    assert [(i.step, i.kind) for i in run(with_at(99, loss_scale=0.5), fp16=True)] == [(99, "loss_scale_collapse")]
    assert run(with_at(99, loss_scale=0.5), fp16=False) == []  # bf16/fp32: there is no scaler to collapse

    def overflows():
        for t, m in clean(300):
            yield t, {**m, "overflow": 100 <= t < 110}
    assert [(i.step, i.kind) for i in run(overflows(), fp16=True)] == [(109, "loss_scale_collapse")]


def test_activation_norm_trending_up():
    def growing():
        for t, m in clean(400):
            yield t, {**m, "activation_norm": 10 * (1.01 ** max(0, t - 200))}
    incidents = run(growing())
    assert incidents and incidents[0].kind == "activation_growth" and incidents[0].step > 200
    d = Detectors(AutopilotConfig())
    for t, m in clean(150):
        d.observe(t, {**m, "fp16": False})
    assert not d.trending_up()


def test_policy_escalates_then_stops():
    s = AutopilotConfig(budget=6, repeat_window=100)
    state = State()
    seen = []
    for n, step in enumerate([1000, 1050, 1090, 1150, 1200, 1240, 1280]):
        decision = decide(state, Incident(step, "loss_spike", "x"), s, fp16=True)
        seen.append(("stop",) if decision.stop else decision.actions)
        if not decision.stop:
            apply_to_state(state, decision, s, target_step=step - 50, batch_from=step - 40, batch_incident=step)
    assert seen == [("rollback", "skip"), ("rollback", "skip", "lower_lr"), ("rollback", "skip", "lower_lr", "lower_clip"),
                    ("rollback", "skip", "reset_loss_scale"), ("rollback", "skip", "reset_optimizer"),
                    ("rollback", "skip", "reset_optimizer"), ("stop",)]
    assert state.lr_factor == 0.25 and state.clip == 0.3 and state.interventions == 6
    assert state.rewarm_from == 1240 - 50  # Adam reset: a fresh warmup from the checkpoint rolled back to
    assert state.skip_ranges[0] == [960, 1000 + 1 + s.skip_margin]
    # Far apart, incidents start over at the first level; without fp16 there is no scaler to reset.
    calm = State(level=3, last_incident_step=0, interventions=3)
    assert decide(calm, Incident(5000, "grad_spike", "x"), s, fp16=False).actions == ("rollback", "skip")
    assert "reset_loss_scale" not in decide(State(level=3, last_incident_step=990), Incident(1000, "loss_spike", "x"),
                                            s, fp16=False).actions
    assert decide(State(), Incident(7, "loss_scale_collapse", "x"), s, fp16=True).actions == ("rollback", "skip", "reset_loss_scale")


def test_state_round_trip_and_logbook(tmp_path):
    state = State(interventions=2, level=2, skip_ranges=[[1, 5]], lr_factor=0.5, clip=0.3)
    assert State.from_dict(state.to_dict()) == state
    records.log_entry(tmp_path, time=0, step=81, kind="loss_spike", detail="loss 7.6 > ...", actions=["rollback", "skip"],
                      why="first incident", rolled_back_to=50, skipped_batches=[50, 91])
    assert [e["step"] for e in records.read(tmp_path, records.ENTRY)] == [81]
    text = (tmp_path / "LOGBOOK.md").read_text()
    assert "## Step 81: loss_spike" in text and "- Done: rollback, skip" in text and "rolled back to: 50" in text


def test_overflow_steps_are_not_divergence_and_the_simulated_scaler_collapses():
    def burst(start, count):
        for t, m in clean(300):
            yield t, ({**m, "overflow": True, "grad_norm": math.inf} if start <= t < start + count else m)
    # Overflow-skipped steps with infinite gradients: the scaler's business, not a non-finite incident;
    # ten of them within the window are a loss-scale collapse.
    assert run(burst(100, 3), fp16=True) == []
    assert [(i.step, i.kind) for i in run(burst(100, 12), fp16=True)] == [(109, "loss_scale_collapse")]
    scaler = SimulatedScaler(window=4)
    for _ in range(17):
        scaler.update(overflow=True)
    assert scaler.scale == 0.5  # 2^16 halved 17 times: under OPT's floor of 1.0
    for _ in range(4):
        scaler.update(overflow=False)
    assert scaler.scale == 1.0
    scaler.reset()
    assert scaler.scale == 2.0 ** 16
