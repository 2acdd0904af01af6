"""The ground floor every stage stands on: config types and loading (config.py), the DAG runner (dag.py) and
its check of completed outputs (outputs.py), Ray start-up (ray_session.py), storage paths and URIs (storage.py),
MLflow (tracking.py), the terminal (console.py), what this CPU is (cpu.py), the driver's one C heap arena (heap.py). It imports no stage package and nothing of `model/`
(docs/architecture.md; tests/test_architecture.py)."""
