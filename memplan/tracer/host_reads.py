"""Reads of a device value that fake tensors cannot give, answered where the answer is known without the value
(generate()'s right-padding check, APOLLO's norm-growth limiter): one dispatch mode, scoped by the caller's frame.
Any other read still raises (TraceFailed names the tracer's limit)."""
from __future__ import annotations

import sys
from collections.abc import Callable


def called_from(path_suffix: str, function: str | None = None) -> bool:
    """Whether a frame of the file ending in `path_suffix` (running `function`, if named) is on the stack, however
    deep under the dispatch modes' own frames."""
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_filename.replace("\\", "/").endswith(path_suffix) and function in (None, code.co_name):
            return True
        frame = frame.f_back
    return False


def answered_reads(answer: object, when: Callable[[], bool]):
    """A TorchDispatchMode answering `aten._local_scalar_dense` (`.item()`, `bool(t)`, `tolist()`) with `answer`
    while `when()` holds; every other op runs on."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class AnsweredReads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default and when():
                return answer
            return func(*args, **(kwargs or {}))
    return AnsweredReads()
