"""The memory traffic of torch code, counted exactly: the bytes read and
written by every aten op (inputs and outputs of each op; views and metadata
ops count nothing; an in-place `index_put_` counts the entries it reads
and writes, not the whole tensor it writes into), and the host reads (`aten._local_scalar_dense`: a Python
branch on a device value, a device sync on a GPU), with a
`TorchDispatchMode`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

FREE = {"view", "_unsafe_view", "t", "detach", "alias", "expand", "as_strided"}


def traffic(run: Callable[[], Any]) -> tuple[float, int]:
    """Bytes moved and host reads of `run()`."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.bytes = 0
            self.host_reads = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            name = func.overloadpacket.__name__
            if name == "_local_scalar_dense":
                self.host_reads += 1
            if name in FREE:
                return out
            if name == "index_put_":  # in place: the entries it writes
                values = args[2]
                self.bytes += 2 * values.numel() * values.element_size()
                return out
            seen = set()
            for t in torch.utils._pytree.tree_leaves((args, kwargs, out)):
                if isinstance(t, torch.Tensor) and id(t) not in seen:
                    seen.add(id(t))
                    self.bytes += t.numel() * t.element_size()
            return out

    with Count() as count:
        run()
    return float(count.bytes), count.host_reads
