"""The PyTorch backend's side of keras_nanguard (see `interface.Backend`)."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Hashable
from typing import Any

import keras
import numpy as np
import torch
from torch.nn.modules import module as torch_module

from keras_nanguard._backend import common

Tensor = Any

NAME = "torch"
ASYNC_BATCH_END = True
STATELESS_TRAIN_STEP = False
COPIES_ON_WRITE = False  # an assign copies in place
REUSES_DEVICE_BUFFERS = True

run_step = common.plain_step
in_replica = common.in_replica


def assign_block(
    variable: keras.Variable, row: Tensor, col: int, values: Tensor
) -> None:
    # In place: Keras's scatter clones the buffer, and `assign` copies it.
    buffer = variable.value
    k = int(values.shape[0])
    rows = torch.as_tensor(row, device=buffer.device).reshape(1).long()
    cols = torch.arange(col, col + k, device=buffer.device)
    with torch.no_grad():
        buffer.index_put_((rows, cols), values.to(buffer.dtype))


def host_view(value: Tensor) -> np.ndarray:
    if hasattr(value, "detach"):
        return value.detach().cpu().numpy()
    return np.asarray(value)


def eager_read(variable: keras.Variable) -> np.ndarray:
    return variable.value.detach().cpu().numpy().copy()


def device_copies(values: list[Tensor]) -> list[Tensor]:
    return [v.detach().clone() for v in values]


def start_host_copies(values: list[Tensor]) -> list[Tensor]:
    return device_copies(values)  # queued after the step; read a step later


def device_room(variables: list[keras.Variable], need: int) -> bool:
    value = variables[0].value if variables else None
    if value is None or value.device.type != "cuda":
        return True  # host memory: as for a host snapshot
    free, total = torch.cuda.mem_get_info(value.device)
    return need < free - total // 4


def held_value(variable: keras.Variable) -> Tensor:
    return variable.value.detach().clone()  # an assign copies in place


def copy_values(values: list[Tensor], buffers: list | None) -> list:
    """Copies, into `buffers` when given: reusing the same buffers each step
    is several times faster than fresh clones (no allocation, no page
    faults), at the price of holding them between steps."""
    detached = [t.detach() for t in values]
    if buffers is None:
        return [t.clone() for t in detached]
    with torch.no_grad():
        torch._foreach_copy_(buffers, detached)
    return buffers


def copy_into(buffers: list[Tensor], values: list[Tensor]) -> None:
    for buffer, value in zip(buffers, values, strict=True):
        buffer.copy_(value.detach())


def assignable(value: Tensor, variable: keras.Variable) -> Tensor:
    return value


def sync_state(model: keras.Model) -> None:
    return None


def live_value(variable: keras.Variable, model: Any) -> Tensor | None:
    return variable.value


def frozen(value: Any) -> Any:
    # A torch variable's value is the live tensor that later steps update in
    # place; callbacks run in Keras's worker threads may read the logs a step
    # or two later, so they get this step's. (A `Sum` metric's `result()` is
    # such a value too.)
    if isinstance(value, torch.nn.Parameter):
        return value.detach().clone()
    return value


def restore_unless(
    ok: Tensor, state: list, backup: list, scales: list | None = None
) -> None:
    ok = torch.as_tensor(ok)
    with torch.no_grad():
        for t, old, scale in zip(
            state, backup, scales or [None] * len(state), strict=True
        ):
            t = t.value if isinstance(t, keras.Variable) else t
            if scale is not None:
                kept = torch.where(
                    scale >= 1.0, t, torch.lerp(old, t, scale.to(t.dtype))
                )
                torch.where(ok, kept, old, out=t)
            else:
                torch.where(ok, t, old, out=t)


# --------------------------------------------- module buffers Keras misses
# model -> (what the walk below depends on, its result). The walk costs about
# 90 µs a step on a 3-layer model; what it finds changes only when a module
# or a buffer is registered somewhere (torch's global registration hooks
# count those; the model's rebuilt `Functional` after `Sequential.add` is
# one) or the model's weights change (it is built).
_BUFFERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_registrations = [0]


def _count_registration(*args: Any) -> None:
    _registrations[0] += 1


# Counted from this import on, in eager code: registering them at the first
# step would put a branch on `_registrations` into the compiled step, which
# `torch.compile` would guard on and compile twice.
torch_module.register_module_module_registration_hook(_count_registration)
torch_module.register_module_buffer_registration_hook(_count_registration)


def extra_forward_state(model: keras.Model) -> list[Tensor]:
    """The buffers of torch modules (inside `TorchModuleWrapper`)."""
    key = (_registrations[0], tuple(map(id, model.weights)))
    cached = _BUFFERS.get(model)
    if cached is None or cached[0] != key:
        cached = _BUFFERS[model] = (key, _walk_buffers(model))
    return cached[1]


def _walk_buffers(model: keras.Model) -> list[Tensor]:
    # Every Keras layer is a torch module on this backend, but Sequential and
    # functional models keep their layers in plain lists that torch does not
    # see: walk both the Keras layers and the torch submodules, each module
    # once.
    found: dict[int, Any] = {}
    stack: list[Any] = [model]
    seen: set[int] = set()
    while stack:
        module = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        for buffer in module.buffers(recurse=False):
            found.setdefault(id(buffer), buffer)
        stack.extend(module.children())
        stack.extend(getattr(module, "layers", None) or [])
    return list(found.values())


# --------------------------------------------------------------- the step
def compiling() -> bool:
    return torch.compiler.is_compiling()


def executing_eagerly(probe: keras.Variable) -> bool:
    return not torch.compiler.is_compiling()


def discarded_if_building() -> bool:
    return False  # traced once: what is traced runs


def constant_table(
    key: Hashable, values: Callable[[], np.ndarray], like: keras.Variable, cache: dict
) -> Any:
    """A tensor on `like`'s device, made once per `key` in eager steps (no
    host work or copy per step), and made in the graph in compiled ones (a
    NumPy array there would break the graph; Dynamo traces the NumPy that
    makes it)."""

    def make() -> Any:
        return torch.tensor(values(), device=like.value.device)

    if torch.compiler.is_compiling():
        return make()
    if key not in cache:
        cache[key] = make()
    return cache[key]


def rollback_buffers(state: list[keras.Variable], cache: dict) -> list | None:
    """Eager: buffers the rollback copy is made into, made once and reused
    every step; compiled: `None` (no Python-held tensors in a graph)."""
    if torch.compiler.is_compiling():
        return None
    key = tuple(id(v) for v in state)
    if key not in cache:
        # The variables are kept with their buffers, so their ids cannot be
        # reused by other variables while the key lives.
        cache[key] = (list(state), [torch.empty_like(v.value) for v in state])
    return cache[key][1]


def no_grad() -> contextlib.AbstractContextManager:
    return torch.no_grad()


# ---------------------------------------------------------------- kernels
def sums_of_squares(values: list[Tensor]) -> tuple[Tensor, Tensor]:
    # One multi-tensor kernel; a float64 accumulator cannot overflow, so one
    # sum serves both (the second is the first, rescaled).
    norms = torch._foreach_norm([common.raw(v) for v in values], 2, torch.float64)
    sq = torch.stack(norms) ** 2
    return sq.float(), (sq * (2.0**-64) ** 2).float()


def update_sums(old: list[Tensor], new: list[Tensor]) -> tuple[Tensor, Tensor]:
    # `dist` reads both tensors once, with no temporary of their difference.
    with torch.no_grad():
        d = [
            torch.dist(common.raw(n).float(), common.raw(o).float()) ** 2
            for o, n in zip(old, new, strict=True)
        ]
        w = torch._foreach_norm([common.raw(v) for v in old], 2, torch.float32)
        return torch.stack(d), torch.stack(w) ** 2


def finite_flags(values: list[Tensor]) -> Tensor:
    # One multi-tensor kernel for all of them (torch's largest-magnitude
    # norm is 8x slower on CPU). float64 values, whose squares could
    # overflow even float64, take the largest magnitude.
    raw = [common.raw(v) for v in values]
    narrow = [v for v in raw if v.dtype != torch.float64]
    wide = [v for v in raw if v.dtype == torch.float64]
    sums = iter(torch._foreach_norm(narrow, 2, torch.float64) if narrow else ())
    maxabs = iter(torch._foreach_norm(wide, float("inf")) if wide else ())
    norms = [next(maxabs if v.dtype == torch.float64 else sums) for v in raw]
    return torch.isfinite(torch.stack(norms))


def softmax_parts(x: Tensor, axis: int | tuple[int, ...], log: bool) -> Tensor:
    """The fused (log-)softmax on logits made safe by selects, with no host
    read. Rows with +inf logits share among them; fully masked rows (all
    -inf) run on zeros, so their gradient is 0, and give 0 (log: -inf)."""
    if not isinstance(axis, int):
        return common.careful_softmax_parts(x, axis, log)
    m = torch.amax(x, dim=axis, keepdim=True)
    pos_inf = torch.isposinf(m)
    masked = torch.isneginf(m)
    z = torch.where(
        pos_inf,
        torch.where(torch.isposinf(x), 0.0, -torch.inf),
        torch.where(masked, 0.0, x),
    )
    out = torch.log_softmax(z, axis) if log else torch.softmax(z, axis)
    return torch.where(masked, -torch.inf if log else 0.0, out)


def gradient_pass(
    model: keras.Model, x: Any, loss_of: Callable[[Any], Any], outputs: bool
) -> tuple[Any, Any, Callable[[], list[np.ndarray | None]]]:
    tv = model.trainable_variables
    _clear_grads(tv)
    y_pred = model(x, training=True)
    loss = loss_of(y_pred)

    def gradients() -> list[np.ndarray | None]:
        loss.backward()
        grads = [v.value.grad for v in tv]
        _clear_grads(tv)
        return common.numpy_grads(grads)

    return y_pred, loss, gradients


def _clear_grads(variables: list[keras.Variable]) -> None:
    for v in variables:
        v.value.grad = None


def processes() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def gather_ints(values: list[int]) -> list[list[int]]:
    import torch.distributed as dist

    _, count = processes()
    if count == 1:
        return [list(values)]
    gathered: list[Any] = [None] * count
    dist.all_gather_object(gathered, [int(v) for v in values])
    return [list(g) for g in gathered]


def held_whole(variables: list[keras.Variable]) -> bool:
    return True  # a torch process holds its tensors whole


def replica_sum(value: Tensor) -> tuple[Tensor, int]:
    import torch.distributed as dist

    _, count = processes()
    if count == 1:
        return value, 1
    total = value.detach().clone()
    dist.all_reduce(total)
    return total, count


def record_rows(record: Callable[[Any, Any], None], codes: Any, over: Any) -> None:
    """`record_rows` under torch.distributed: every process records the
    rows of the global batch, each process's in rank order (sizes may
    differ), so that the counters and the log are the same on all."""
    _, count = processes()
    if count == 1:
        record(codes, over)
        return
    import torch.distributed as dist

    size = torch.tensor([codes.shape[0]], device=codes.device)
    sizes = [torch.zeros_like(size) for _ in range(count)]
    dist.all_gather(sizes, size)
    most = int(max(int(s) for s in sizes))
    padded = torch.nn.functional.pad(codes, (0, most - codes.shape[0]))
    parts = [torch.zeros_like(padded) for _ in range(count)]
    dist.all_gather(parts, padded)
    rows = torch.cat([p[: int(s)] for p, s in zip(parts, sizes, strict=True)])
    record(rows, over)  # `over`: decided on the global batch, alike
