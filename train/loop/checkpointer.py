"""The run's checkpoints as the loop uses them: save (and prune) with the autopilot's health mark, resume
from the newest that verifies, roll back to a healthy one, and tell Ray Train about each. The files,
their verification and their publishing are `train.checkpoint`'s."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from train import checkpoint
from train.loop.context import Context, incident
from train.parallel.collectives import barrier


class Checkpointer:
    def __init__(self, engine, ctx: Context, *, every: int, keep: int, keep_healthy: int, max_steps: int):
        self.engine, self.ctx, self.dir = engine, ctx, ctx.ckpt_dir
        self.every, self.keep, self.keep_healthy, self.max_steps = every, keep, keep_healthy, max_steps

    def due(self, step: int) -> bool:
        return bool(self.every) and (step % self.every == 0 or step == self.max_steps)

    def save(self, step: int, meta: dict) -> Path:
        """Every rank writes its shard; rank 0 publishes, then prunes beyond the newest `keep` and `keep_healthy`."""
        path = checkpoint.save(self.engine, self.dir, step, meta)
        if self.ctx.leader:
            checkpoint.prune(self.dir, self.keep, self.keep_healthy)
        return path

    def resume(self) -> dict | None:
        """The newest checkpoint that verifies on every rank, loaded; its meta (None: a fresh start). Each one
        passed over is an incident."""
        def skipped(reason: str) -> None:
            incident(self.ctx, 0, f"checkpoint skipped on load: {reason}")

        resumed = checkpoint.load_latest(self.engine, self.dir, on_skip=skipped)
        if resumed is not None and self.ctx.leader:
            incident(self.ctx, resumed["step"], f"resumed from {Path(resumed['path']).name}")
        return resumed

    def healthy_before(self, step: int) -> dict | None:
        """The meta of the newest checkpoint before `step` marked healthy: a rollback target."""
        metas = (checkpoint.read_meta(p) or {} for p in checkpoint.published(self.dir))
        return next((m for m in metas if m.get("step", 10**18) < step and m.get("health", {}).get("healthy", False)),
                    None)

    def abandon_after(self, step: int, decided_at: float) -> None:
        """Checkpoints after `step` saved before `decided_at` (a rollback past them) out of sight (rank 0)."""
        if self.ctx.leader:
            checkpoint.abandon_after(self.dir, step, decided_at)

    def roll_back(self, step: int, decided_at: float) -> dict:
        """Every rank back to checkpoint `step`, the ones after it abandoned first; its meta."""
        barrier()
        self.abandon_after(step, decided_at)
        barrier()
        meta = checkpoint.load_latest(self.engine, self.dir, accept=lambda m: m.get("step") == step)
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
