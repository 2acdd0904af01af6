"""Each seed's model through lm-evaluation-harness, in a process of its own: `python -P -m train.downstream.harness
< REQUEST.json` (train/downstream/stage.py's Request, on stdin: stage.evaluate starts it in a private folder, so
that nothing in the shared workdir is imported or read as its request).

The downstream stage starts it (from a Ray task, on a GPU where `eval.downstream.gpus` asks for one) so that what
lm-eval does to a process stays in this one: it seeds Python's, numpy's and torch's generators, sets up loggers,
draws progress bars, and loads models onto a device that is freed when it exits. The models go one after another,
through one index of the tasks. Everything said (lm-eval's logs, transformers', each seed's results table) goes to
this process's output, which the stage writes into its log. Each seed's results, as lm-eval returns them (less the
per-sample records), go to `<out>/seed-<s>/results.json`, written once they are complete.
"""

from __future__ import annotations

import gc
import json
import logging
import sys
from pathlib import Path


def evaluate(request: dict, manager, pretrained: str) -> dict:
    import lm_eval
    from lm_eval.utils import make_table

    model_args = {"pretrained": pretrained, "dtype": request["dtype"]}
    if request["parallelize"]:
        model_args["parallelize"] = True
    results = lm_eval.simple_evaluate(
        model="hf", model_args=model_args, tasks=request["tasks"], num_fewshot=request["num_fewshot"],
        batch_size=request["batch_size"], device=request["device"], limit=request["limit"], task_manager=manager,
        log_samples=False, random_seed=request["seed"], numpy_random_seed=request["seed"],
        torch_random_seed=request["seed"], fewshot_random_seed=request["seed"])
    print(make_table(results))
    if results.get("groups"):
        print(make_table(results, "groups"))
    return {k: results[k] for k in ("results", "groups", "group_subtasks", "configs", "versions", "n-shot",
                                    "higher_is_better", "n-samples", "config") if k in results}


def main() -> int:
    sys.stdout.reconfigure(line_buffering=True)  # prints and log records in the order they were made
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    request = json.load(sys.stdin)
    import torch
    from lm_eval.tasks import TaskManager
    from lm_eval.utils import handle_non_serializable

    torch.set_num_threads(max(1, request["threads"]))
    manager = TaskManager(include_path=request["include_path"], include_defaults=request["include_defaults"])
    for seed, pretrained in request["models"]:
        print(f"== seed {seed}: {pretrained}", flush=True)
        results = evaluate(request, manager, pretrained)
        out = Path(request["out"]) / f"seed-{seed}" / "results.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        partial = out.with_name(f".{out.name}.partial")
        partial.write_text(json.dumps(results, indent=2, default=handle_non_serializable))
        partial.rename(out)  # complete when it appears: the stage counts the seeds done by these files
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the last model's memory, before the next one loads
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
