"""The model and how the processes share it: built (models.py), placed and wrapped by one small Strategy
interface for single, dp, ddp and fsdp (base.py, data_parallel.py, ddp.py, fsdp.py; factory.py builds the
one topology.py chose), with its precision, compilation, optimizer and synced BatchNorm.

Each strategy places and wraps the model, moves the collectives the trainer needs, skips
gradient reduction on accumulation micro-steps, builds the optimizer (ZeRO-1 wraps it) and
gives its state keyed by parameter name so any other strategy can load it.
"""
