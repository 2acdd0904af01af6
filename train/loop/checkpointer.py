"""The run's checkpoints as the loop uses them: save (and prune) with the autopilot's health mark, resume
from the newest that verifies, roll back to a healthy one, and tell Ray Train about each. The files,
their verification and their publishing are `train.checkpoint_files`'s."""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

from train import checkpoint_files
from train.loop.context import Context, incident
from train.parallel.collectives import barrier


class Checkpointer:
    """With `background`, a save blocks training only while DeepSpeed's state is copied to host memory (and
    while the previous save, if still being written, finishes); the files are written, hashed and published
    by a thread. The previous checkpoint stays the newest until the new one is published."""

    def __init__(self, engine, ctx: Context, *, every: int, keep: int, keep_healthy: int, last_step: int,
                 background: bool = False, on_written=None):
        self.engine, self.ctx, self.dir = engine, ctx, ctx.ckpt_dir
        self.every, self.keep, self.keep_healthy, self.last_step = every, keep, keep_healthy, last_step
        self.background = background
        self.on_written = on_written  # on_written(step, blocked_seconds, write_seconds), every rank
        self.pending: tuple | None = None  # (Write, blocked seconds, the loss to report or None)

    @property
    def data_group(self):
        """The replicas of this rank's part of the model (None: all ranks): they read a checkpoint's shared files once."""
        return self.ctx.groups.data if self.ctx.groups else None

    def due(self, step: int) -> bool:
        return bool(self.every) and (step % self.every == 0 or step == self.last_step)

    def save(self, step: int, meta: dict, report_loss: float | None = None) -> None:
        """Every rank writes its shard; rank 0 publishes, then prunes beyond the newest `keep` and `keep_healthy`.
        With `report_loss`, Ray Train hears of it once it is published. The wait for the previous save's write
        is that save's blocked time (flush counts it), so this one's clock starts after it: each wait counted once."""
        self.flush()
        started = time.monotonic()
        write = checkpoint_files.save(self.engine, self.dir, step, meta, background=self.background)
        self.pending = (write, time.monotonic() - started, report_loss)
        if not self.background:
            self.flush()

    def flush(self) -> Path | None:
        """Wait for the save under way (raising what its write raised); then prune, report and measure it."""
        if self.pending is None:
            return None
        (write, blocked, loss), self.pending = self.pending, None
        waited = time.monotonic()
        path = write.wait()
        barrier()  # rank 0 has published
        if self.background:
            blocked += time.monotonic() - waited  # still writing when the next save (or the end) came
        if self.ctx.leader:
            checkpoint_files.prune(self.dir, self.keep, self.keep_healthy)
        if loss is not None:
            self.report(write.step, loss, path)
        if self.on_written is not None:
            self.on_written(write.step, blocked, write.seconds)
        return path

    def resume(self) -> dict | None:
        """The newest checkpoint that verifies on every rank, loaded; its meta (None: a fresh start). Each one
        passed over is an incident."""
        def skipped(reason: str) -> None:
            incident(self.ctx, 0, f"checkpoint skipped on load: {reason}")

        resumed = checkpoint_files.load_latest(self.engine, self.dir, on_skip=skipped, data_group=self.data_group)
        if resumed is not None and self.ctx.leader:
            incident(self.ctx, resumed["step"], f"resumed from {Path(resumed['path']).name}")
            if change := resumed.get("reshaped"):
                was, now = change["from"], change["to"]
                split = {k: _split(v) for k, v in (("was", was), ("now", now))}
                incident(self.ctx, resumed["step"], f"layout changed: {was['data_parallel']} data-parallel replicas"
                         f"{split['was']} under ZeRO-{was['zero_stage']} wrote {Path(resumed['path']).name}, "
                         f"{now['data_parallel']}{split['now']} under ZeRO-{now['zero_stage']} go on from it (converted "
                         f"to DeepSpeed's universal format and loaded in {change['seconds']:.1f} s)")
        return resumed

    def healthy_before(self, step: int) -> dict | None:
        """The meta of the newest checkpoint before `step` marked healthy: a rollback target."""
        self.flush()
        metas = (checkpoint_files.read_meta(p) or {} for p in checkpoint_files.published(self.dir))
        return next((m for m in metas if m.get("step", 10**18) < step and m.get("health", {}).get("healthy", False)),
                    None)

    def abandon_after(self, step: int, decided_at: float) -> None:
        """Checkpoints after `step` saved before `decided_at` (a rollback past them) out of sight (rank 0)."""
        if self.ctx.leader:
            checkpoint_files.abandon_after(self.dir, step, decided_at)

    def roll_back(self, step: int, decided_at: float) -> dict:
        """Every rank back to checkpoint `step`, the ones after it abandoned first; its meta."""
        self.flush()
        barrier()
        self.abandon_after(step, decided_at)
        barrier()
        meta = checkpoint_files.load_latest(self.engine, self.dir, accept=lambda m: m.get("step") == step,
                                      data_group=self.data_group)
        if meta is None:
            raise RuntimeError(f"autopilot: checkpoint step {step} no longer verifies")
        return meta

    def report(self, step: int, loss: float, path: Path) -> None:
        """Tell Ray Train about the checkpoint: a small pointer (the data stays where DeepSpeed wrote it),
        so Ray's own records and dashboard list it without copying terabytes."""
        import ray.train

        with tempfile.TemporaryDirectory() as tmp:
            checkpoint_arg = None
            if self.ctx.leader:
                (Path(tmp) / "pointer.json").write_text(json.dumps({"step": step, "path": str(path)}))
                checkpoint_arg = ray.train.Checkpoint.from_directory(tmp)
            ray.train.report({"step": step, "loss": loss}, checkpoint=checkpoint_arg)


def _split(layout: dict) -> str:
    """How a layout splits each replica, for the incident: ` of a model split over 2 tensor ranks x 2 pipeline
    stages`, or nothing for a whole one."""
    parts = [f"{layout.get(key, 1)} {what}" for key, what in (("tensor", "tensor ranks"), ("pipeline", "pipeline stages"))
             if layout.get(key, 1) > 1]
    return f" of a model split over {' x '.join(parts)}" if parts else ""
