"""What each backend module provides: `Backend`, a protocol of constants and
functions. Values are the backend's own tensors (a `keras.Variable`'s
`.value`), unless a docstring says otherwise."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable
from typing import Any, Protocol

import keras
import numpy as np

Tensor = Any
# A step's transaction: (gradients to decide on, variables, update or None);
# `update(clip)` runs the inner optimizer on gradients `clip` maps.
Run = Callable[[list[Any], list[keras.Variable], Any], None]


class Backend(Protocol):
    NAME: str
    #: Keras may run `on_train_batch_end` in worker threads (when every
    #: callback is `async_safe`).
    ASYNC_BATCH_END: bool
    #: `fit`'s step is stateless (`train_step(state, data)`), as on JAX.
    STATELESS_TRAIN_STEP: bool
    #: A read of a variable is a copy-on-write view: an in-place update of
    #: the variable while the read is alive copies its buffer (TensorFlow).
    COPIES_ON_WRITE: bool
    #: Device copies of a snapshot can be overwritten in place for reuse.
    REUSES_DEVICE_BUFFERS: bool

    # ------------------------------------------------- values and the host
    def host_view(self, value: Tensor) -> np.ndarray:
        """The value on the host, sharing memory where the backend allows
        (only for reading at once)."""
        ...

    def eager_read(self, variable: keras.Variable) -> np.ndarray:
        """The variable's value on the host, even while a step is being
        traced (TensorFlow builds optimizers inside `tf.function`)."""
        ...

    def device_copies(self, values: list[Tensor]) -> list[Tensor]:
        """Copies on the device, in new buffers (one dispatch on JAX)."""
        ...

    def start_host_copies(self, values: list[Tensor]) -> list[Tensor]:
        """Copies of `values` whose way to the host has begun: reading them a
        step later does not wait for the device (JAX starts the transfers;
        elsewhere device copies, read later)."""
        ...

    def device_room(self, variables: list[keras.Variable], need: int) -> bool:
        """Whether the device holding `variables` has `need` bytes free with
        a quarter of it left over (False: keep snapshots on the host)."""
        ...

    def held_value(self, variable: keras.Variable) -> Tensor:
        """The value of `variable` now, left as it is by later assigns."""
        ...

    def copy_values(self, values: list[Tensor], buffers: list | None) -> list:
        """`values` as they are now, unaffected by later in-place updates (on
        torch copied into `buffers` when given)."""
        ...

    def copy_into(self, buffers: list[Tensor], values: list[Tensor]) -> None:
        """Overwrites device `buffers` with `values` (REUSES_DEVICE_BUFFERS)."""
        ...

    def assignable(self, value: Tensor, variable: keras.Variable) -> Tensor:
        """`value` as it may be assigned to `variable`, whose later steps may
        donate or overwrite it: a device snapshot lends a copy on JAX, and a
        host value is placed as the variable is (across processes, each
        process its own part)."""
        ...

    def processes(self) -> tuple[int, int]:
        """This process's index and the number of processes that train
        together (JAX's processes, torch.distributed's world,
        MultiWorkerMirroredStrategy's workers); `(0, 1)` alone."""
        ...

    def gather_ints(self, values: list[int]) -> list[list[int]]:
        """Every process's `values` (int32, the same length on each), in
        process order: a collective that every process calls at the same
        point."""
        ...

    def held_whole(self, variables: list[keras.Variable]) -> bool:
        """Whether this process holds the whole value of each of `variables`
        (False: a layout splits one across processes)."""
        ...

    def replica_sum(self, value: Tensor) -> tuple[Tensor, int]:
        """In a replica's step (tf.distribute's replica context, a
        torch.distributed process), `value` summed over the replicas that
        train together, and their number; else `(value, 1)` (JAX's
        `keras.distribution` steps are global already)."""
        ...

    def sync_state(self, model: keras.Model) -> None:
        """Makes `model`'s variables current (JAX keeps them apart in fit)."""
        ...

    def live_value(self, variable: keras.Variable, model: Any) -> Tensor | None:
        """The value `variable` of `model`'s optimizer has in training now,
        without making the model's variables current (JAX's `fit` keeps the
        epoch's state apart from them); `None` where it cannot be found."""
        ...

    def frozen(self, value: Any) -> Any:
        """A log value that later steps cannot change (torch: a copy of a
        live variable's tensor); anything else as it is."""
        ...

    # --------------------------------------------------------- the step
    def restore_unless(
        self, ok: Tensor, state: list, backup: list, scales: list | None = None
    ) -> None:
        """Writes `backup` back into `state` unless `ok`: a select on the
        device, no branch, no host read. Where `scales` has a scalar (not
        `None`) below 1, an accepted entry keeps `old + (new - old) * scale`
        instead of `new` (bit for bit `new` where it is 1)."""
        ...

    def extra_forward_state(self, model: keras.Model) -> list[Tensor]:
        """State the forward pass may write that Keras does not track as
        variables (torch module buffers)."""
        ...

    def compiling(self) -> bool:
        """Whether torch is compiling the code running now."""
        ...

    def executing_eagerly(self, probe: keras.Variable) -> bool:
        """Whether the code running now is eager (not traced or compiled)."""
        ...

    def discarded_if_building(self) -> bool:
        """Whether a step traced now that makes variables is traced again
        before it runs, its first trace never run (TensorFlow, inside a
        `tf.function`): the optimizer's build is all that trace needs."""
        ...

    def constant_table(
        self,
        key: Hashable,
        values: Callable[[], np.ndarray],
        like: keras.Variable,
        cache: dict,
    ) -> Any:
        """The array `values()` (known on the host, named by the small
        `key`) as a constant a step reads, on `like`'s device: made once per
        `key` and kept in `cache` (TensorFlow and JAX: the NumPy array, a
        constant of each trace; torch: a tensor on the device, made in the
        graph under torch.compile)."""
        ...

    def rollback_buffers(self, state: list[keras.Variable], cache: dict) -> list | None:
        """Reusable buffers for the rollback copy of `state`, or None."""
        ...

    def run_step(
        self, run: Run, inner: keras.optimizers.Optimizer, grads: list, variables: list
    ) -> None:
        """Runs the transaction `run` once for the step (under
        `tf.distribute`, once in cross-replica context)."""
        ...

    def record_rows(
        self, record: Callable[[Tensor, Tensor], None], codes: Tensor, over: Tensor
    ) -> None:
        """Calls `record(codes, over)` once for the step: under
        `tf.distribute`, once in cross-replica context, with every
        replica's rows in replica order (`over` then one per row)."""
        ...

    def in_replica(self) -> bool:
        """Whether the code running now is one replica's of a `tf.distribute`
        step (where the optimizer's own variables are not written)."""
        ...

    def assign_block(
        self, variable: keras.Variable, row: Tensor, col: int, values: Tensor
    ) -> None:
        """Writes `values` into the 2-D `variable` at `[row, col:col + k]`,
        `row` a device int: in place where the backend can, no host read."""
        ...

    def no_grad(self) -> contextlib.AbstractContextManager:
        """A context in which an optimizer update records no gradient."""
        ...

    # --------------------------------------------------------- kernels
    def sums_of_squares(self, values: list[Tensor]) -> tuple[Tensor, Tensor]:
        """Per tensor, float32 sums of squares of `v` and of `v * 2**-64`."""
        ...

    def finite_flags(self, values: list[Tensor]) -> Tensor:
        """One bool per tensor: whether every entry is finite."""
        ...

    def update_sums(
        self, old: list[Tensor], new: list[Tensor]
    ) -> tuple[Tensor, Tensor]:
        """Per tensor, the float32 sums of squares of `new - old` and of
        `old`, reading each pair once where the backend allows."""
        ...

    def softmax_parts(
        self, x: Tensor, axis: int | tuple[int, ...], log: bool
    ) -> Tensor:
        """(Log-)softmax of float32 logits that may hold +-inf."""
        ...

    def gradient_pass(
        self, model: keras.Model, x: Any, loss_of: Callable[[Any], Any], outputs: bool
    ) -> tuple[Any, Any, Callable[[], list[np.ndarray | None]]]:
        """One eager training-mode pass and its gradients (see
        `diagnosis.probes.gradient_pass`)."""
        ...
