"""The autopilot in the loop: it watches every step, decides (train/autopilot_policy.py, pure), and applies what it
decided to the engine, the schedule, the loader and the checkpoints, writing down why.

Every rank sees the same all-reduced numbers, so every rank reaches the same decision without talking.
An intervention's state is written before it is applied, so a crash from there on neither loses nor
repeats it."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from train import autopilot_policy, records
from train.loader import Loader
from train.loop.checkpointer import Checkpointer
from train.loop.config import LoopConfig
from train.loop.context import Context, incident
from train.loop.step import StepResult
from train.optim import INITIAL_SCALE_POWER
from train.schedule import Schedule

if TYPE_CHECKING:
    from train.loop.drill import SimulatedScaler


def loss_scale(engine) -> float:
    return float(getattr(engine.optimizer, "loss_scale", 1.0) or 1.0)


def reset_loss_scale(engine) -> tuple[float, float]:
    """DeepSpeed's dynamic loss scale back to its initial value, as if no overflow had happened: the scale
    through the `loss_scale` property every DeepSpeed fp16 wrapper has (ZeRO 1-3 and the fp16
    optimizers), the scaler's hysteresis refilled (else the next single overflow halves it at once)
    and the window to the next doubling started now. Raises when the engine does not take it, rather
    than let the logbook claim a reset that did not happen. Returns the scale before and after."""
    before = loss_scale(engine)
    engine.optimizer.loss_scale = 2.0 ** INITIAL_SCALE_POWER
    scaler = getattr(engine.optimizer, "loss_scaler", None)
    if scaler is not None and getattr(scaler, "dynamic", False):
        scaler.cur_hysteresis = scaler.delayed_shift
        scaler.last_overflow_iter = scaler.cur_iter - 1
    after = loss_scale(engine)
    if after != 2.0 ** INITIAL_SCALE_POWER or (scaler is not None and getattr(scaler, "dynamic", False)
                                               and scaler.cur_hysteresis != scaler.delayed_shift):
        raise RuntimeError(f"autopilot: the loss scale reset did not take ({type(engine.optimizer).__name__}: "
                           f"scale {after:g})")
    return before, after


def apply_settings(engine, schedule: Schedule, state: autopilot_policy.State, rewarm_steps: int, grad_clip: float) -> None:
    """The autopilot's standing changes: LR factor, a fresh warmup after an optimizer reset, the clip."""
    schedule.factor = state.lr_factor
    schedule.rewarm_from, schedule.rewarm_steps = state.rewarm_from, rewarm_steps
    clip = state.clip if state.clip is not None else grad_clip
    if hasattr(engine.optimizer, "clip_grad"):
        engine.optimizer.clip_grad = clip  # ZeRO 1-3 and the fp16/bf16 wrappers read this
    engine._config.gradient_clipping = clip  # ZeRO 0 fp32 reads the config


class Pilot:
    def __init__(self, cfg: LoopConfig, ctx: Context, engine, schedule: Schedule, checkpointer: Checkpointer, *,
                 scaler: SimulatedScaler | None):
        self.cfg, self.ctx, self.engine, self.schedule, self.checkpointer = cfg, ctx, engine, schedule, checkpointer
        self.settings = cfg.train.autopilot
        # Without fp16 there is no loss scale to collapse; when a drill injects overflows, a simulated one (`scaler`).
        self.scaler = scaler
        self.fp16 = cfg.train.precision == "fp16" or scaler is not None
        self.state_file = ctx.run_dir / records.AUTOPILOT
        self.state = autopilot_policy.State()
        self.detectors = autopilot_policy.Detectors(self.settings)
        self.clean_steps = 0  # steps since the last incident: a checkpoint is healthy after a window of them
        self.saved = autopilot_policy.load_state(self.state_file)  # written before every intervention: newer than any checkpoint
        if self.saved is not None:  # a rollback decided before a crash: its abandoned checkpoints stay out
            checkpointer.abandon_after(self.saved[1]["rolled_back_to"], self.saved[1]["decided_at"])

    @property
    def enabled(self) -> bool:
        return self.settings.enabled

    def resume(self, resumed: dict | None) -> None:
        """The state to go on with: the one saved before the last intervention, else the checkpoint's."""
        if self.saved is not None:
            self.state = self.saved[0]
        elif resumed is not None and "autopilot" in resumed:
            self.state = autopilot_policy.State.from_dict(resumed["autopilot"])
        if resumed is not None and self.scaler is not None:
            self.scaler.scale = resumed.get("loss_scale", self.scaler.initial)
        self._apply()

    def _apply(self) -> None:
        apply_settings(self.engine, self.schedule, self.state, self.settings.rewarm_steps, self.cfg.train.grad_clip)

    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else loss_scale(self.engine)

    def after_step(self, overflow: bool) -> float:
        """The (simulated) scaler's update for this step; the loss scale now."""
        if self.scaler is not None:
            self.scaler.update(overflow)
        return self.loss_scale()

    def observe(self, step: int, result: StepResult) -> autopilot_policy.Decision | None:
        """What to do about this step, if anything."""
        observed = {"loss": result.loss, "grad_norm": result.grad_norm, "loss_scale": self.loss_scale(),
                    "fp16": self.fp16, "overflow": result.overflow, "activation_norm": result.activation_norm}
        found = self.detectors.observe(step, observed) if self.enabled else None
        if found is None:
            # An overflow-skipped step is not clean: a checkpoint in the middle of an overflow burst is no
            # rollback target (a rollback there would land inside the burst it is escaping).
            self.clean_steps = 0 if result.overflow else self.clean_steps + 1
            return None
        self.clean_steps = 0
        return autopilot_policy.decide(self.state, found, self.settings, self.fp16)

    def healthy(self, step: int) -> bool:
        """Whether a checkpoint now is a rollback target: a window of clean steps, the scale above its floor,
        the activations not trending up."""
        return self.clean_steps >= min(self.settings.window, step) and \
            not (self.fp16 and self.loss_scale() < self.settings.scale_floor) and not self.detectors.trending_up()

    def stop(self, step: int, decision: autopilot_policy.Decision) -> str:
        found = decision.incident
        if self.ctx.leader:
            records.log_entry(self.ctx.run_dir, time=time.time(), step=step, kind=found.kind, detail=found.detail,
                              actions=["stop"], why=decision.why)
        return f"autopilot stopped the run at step {step}: {found.kind} ({found.detail}); {decision.why}"

    def intervene(self, decision: autopilot_policy.Decision, batch: int, loader: Loader) -> dict:
        """Roll back, skip, lower the LR or the clip, reset the scaler or Adam: the state is written first,
        then applied; the loader continues from the target with the new skip ranges. Returns the target
        checkpoint's meta."""
        incident_step = decision.incident.step
        before = incident_step - 1 - self.settings.rollback_steps  # the update of step s - 1 shows in the loss of step s
        target = self.checkpointer.healthy_before(before)
        if target is None:
            raise RuntimeError(f"autopilot: no healthy checkpoint before step {before} to roll back to")
        target_step = target["step"]
        autopilot_policy.apply_to_state(self.state, decision, self.settings, target_step,
                                 loader.position_of(target["loader"]), batch)
        decided_at = time.time()
        if self.ctx.leader:
            self._write_down(decision, target_step, decided_at)
        meta = self.checkpointer.roll_back(target_step, decided_at)
        self._act(decision, incident_step, meta)
        loader.set_skip_ranges(self.state.skip_ranges)
        loader.load_state_dict(meta["loader"])
        return meta

    def _write_down(self, decision: autopilot_policy.Decision, target_step: int, decided_at: float) -> None:
        state = self.state
        autopilot_policy.save_state(self.state_file, state, {"rolled_back_to": target_step, "decided_at": decided_at})
        records.log_entry(
            self.ctx.run_dir, time=decided_at, step=decision.incident.step, kind=decision.incident.kind,
            detail=decision.incident.detail, actions=list(decision.actions), why=decision.why,
            rolled_back_to=target_step, skipped_batches=state.skip_ranges[-1] if "skip" in decision.actions else None,
            lr_factor=state.lr_factor, clip=state.clip, intervention=state.interventions)
        incident(self.ctx, decision.incident.step, f"autopilot: {decision.incident.kind}: "
                                                   f"{', '.join(decision.actions)} (back to step {target_step})")

    def _act(self, decision: autopilot_policy.Decision, incident_step: int, meta: dict) -> None:
        """The decision's actions on the engine and the scaler, after the rollback loaded the target."""
        if "reset_optimizer" in decision.actions:
            inner = getattr(self.engine.optimizer, "optimizer", self.engine.optimizer)
            inner.state.clear()  # Adam's moments and step counts; a fresh warmup follows
        if "reset_loss_scale" in decision.actions and self.cfg.train.precision == "fp16":  # else: the simulated scaler
            before_reset, after = reset_loss_scale(self.engine)
            if self.ctx.leader:
                incident(self.ctx, incident_step, f"loss scale reset: {before_reset:g} -> {after:g}, hysteresis and "
                                                  f"the window to the next doubling restarted")
        self._apply()
        self.detectors.rolled_back()
        if self.scaler is not None:
            self.scaler.scale = meta.get("loss_scale", self.scaler.initial)
            if "reset_loss_scale" in decision.actions:
                self.scaler.reset()
