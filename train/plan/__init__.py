"""Planning a training layout before a GPU is used: the cost model (layout.py), the GPUs and nodes it prices
(hardware.py), the ranked plan and its command line (planner.py, `python -m pipelines.plan`), and the check that
NCCL took EFA between nodes (network.py)."""
