"""How a model is split over workers: the layout's process groups and the tensor-parallel form of an OPT
(groups.py), its Megatron-style layers (tensor.py), DeepSpeed pipeline stages (pipeline.py), collectives on
the process group's device (collectives.py), and where Ray Train puts the workers (placement.py,
`python -m pipelines.placement`)."""
