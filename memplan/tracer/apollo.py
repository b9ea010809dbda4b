"""APOLLO's host-side decisions answered on fake tensors (apollo_torch APOLLOAdamW, optim="apollo_adamw").

Two reads of a value would stop a fake-tensor step, neither of which changes what the device holds:
- random_projector.next_seed draws the next projection seed on a CPU generator and reads it back (`tolist()`): run
  for real, outside the fake mode (host memory only);
- the norm-growth limiter `max(norm / previous, 1.01)` compares two 0-d tensors on the host: answered True (the
  limiter 1.01). Either answer divides the [m, n] scaled gradient once more, so the bytes are the same.
"""
from __future__ import annotations

import contextlib

from memplan.tracer.host_reads import answered_reads, called_from


@contextlib.contextmanager
def apollo_answers():
    """Inside: next_seed runs on real CPU tensors, and APOLLOAdamW.step's scalar reads are answered."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from apollo_torch import random_projector

    original = random_projector.next_seed

    def next_seed(seed, *args, **kwargs):
        with unset_fake_temporarily():
            return original(seed, *args, **kwargs)

    random_projector.next_seed = next_seed
    try:
        with answered_reads(True, lambda: called_from("apollo_torch/apollo.py")):
            yield
    finally:
        random_projector.next_seed = original
