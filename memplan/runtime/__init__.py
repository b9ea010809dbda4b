"""The real training and inference step, run on the CPU or on fake tensors: building the model and batch (steps), the
storage accounting (tracker), bitsandbytes stand-ins (standins), the CUDA code paths a CPU would not take (emulate/),
and PyTorch's CUDA caching allocator replayed over recorded storages (allocator). Shared by the tracer, the inventory
and the validator. Imports model and the ground floor.
"""
