"""Ground truth without a GPU: the real step traced on fake tensors. training (trace(), the per-phase result and its
extrapolation from cut models), inference (prefill and generate()), sharded (rank 0 of FSDP2 / DeepSpeed ZeRO over a
fake process group). Imports runtime, model, the estimator's launcher configs and the ground floor.
"""
