"""Downstream tasks through lm-evaluation-harness: each seed's exported model scored on `eval.downstream.tasks`
(stage.py, harness.py), among them one made offline from the held-out evaluation set (heldout.py, defined in
corpus/lm_eval_tasks/heldout_continuation.yaml). The names are checked at config load (corpus/lm_eval_names.py)."""
