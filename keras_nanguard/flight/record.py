"""The record of a run on the host: rows of the flight recorder, in step order.

`FlightRecord` holds what was read of a SafeOptimizer's flight recorder
(`SafeOptimizer.flight_record()`), or what NaNGuard gathered over a run
(`NaNGuard.flight_record`): every probe row, and every row of the recent
steps (older ordinary rows are dropped, so a long run keeps a coarse
history and a fine recent one).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from keras_nanguard.flight.recorder import (
    COLUMN,
    GLOBAL_COLUMNS,
    FlightRecorder,
)

# Ordinary (non-probe) rows kept behind the newest step.
KEEP_STEPS = 4096


@dataclasses.dataclass
class FlightRecord:
    """Rows of health signals, one per recorded step, in step order.

    Attributes:
        columns: the name of each column (`GLOBAL_COLUMNS`, then one
            `grad_norm/<block>`, `weight_norm/<block>`, `update_norm/<block>`
            per layer block).
        blocks: the layer blocks (a layer's name, or `<layer>/<variable>`
            for a recurrent kernel, which is a block of its own).
        recurrent: per block, whether it is a recurrent kernel.
        rows: float array `(steps, len(columns))`.

    Example:

    >>> import numpy as np, keras, keras_nanguard as ng
    >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    >>> opt = ng.SafeOptimizer(keras.optimizers.SGD(0.1))
    >>> model.compile(opt, "mse")
    >>> _ = model.fit(np.ones((8, 3)), np.ones((8, 1)), batch_size=4, verbose=0)
    >>> record = opt.flight_record()
    >>> record.column("step").tolist()
    [1.0, 2.0]
    >>> bool(record.column("grad_norm")[0] > 0)
    True
    """

    columns: list[str]
    blocks: list[str]
    recurrent: list[bool]
    rows: np.ndarray

    @classmethod
    def empty(cls, columns: list[str], blocks: list[str], recurrent: list[bool]):
        return cls(
            list(columns),
            list(blocks),
            list(recurrent),
            np.zeros((0, len(columns)), "float32"),
        )

    # ------------------------------------------------------------ reading
    def __len__(self) -> int:
        return len(self.rows)

    def column(self, name: str) -> np.ndarray:
        """One column by name (e.g. `"loss"`, `"grad_norm/dense"`)."""
        if name not in self.columns:
            raise KeyError(
                f"No column {name!r} in the flight record. Its columns: {self.columns}"
            )
        return self.rows[:, self.columns.index(name)]

    def block(self, kind: str) -> np.ndarray:
        """The per-block columns of `kind` (`"grad_norm"`, `"weight_norm"`,
        `"update_norm"`) as `(steps, blocks)`."""
        start = len(GLOBAL_COLUMNS) + ("grad_norm", "weight_norm", "update_norm").index(
            kind
        ) * len(self.blocks)
        return self.rows[:, start : start + len(self.blocks)]

    def probes(self) -> FlightRecord:
        """Only the probe rows (every `probe_every`-th step)."""
        return self._where(self.rows[:, COLUMN["probe"]] > 0)

    def before(self, step: float | None) -> FlightRecord:
        """The rows of steps before `step` (all of them for `None`)."""
        if step is None:
            return self
        return self._where(self.rows[:, COLUMN["step"]] < step)

    def _where(self, keep: np.ndarray) -> FlightRecord:
        return dataclasses.replace(self, rows=self.rows[keep])

    def to_dict(self) -> dict[str, Any]:
        """The record as JSON-ready columns (NaN as None)."""
        return {
            "blocks": list(self.blocks),
            "columns": {
                name: [
                    None if not np.isfinite(v) else float(v) for v in self.rows[:, i]
                ]
                for i, name in enumerate(self.columns)
            },
        }

    # ------------------------------------------------------------ gathering
    def add(self, rows: np.ndarray) -> None:
        """Adds rows (any order; a step seen before keeps its newest row),
        then drops ordinary rows older than `KEEP_STEPS` behind the newest."""
        rows = np.asarray(rows, "float32").reshape(-1, len(self.columns))
        rows = rows[np.isfinite(rows[:, COLUMN["step"]])]
        if not len(rows):
            return
        both = np.concatenate([self.rows, rows])
        steps = both[:, COLUMN["step"]]
        # The newest row of each step: the last occurrence.
        _, last = np.unique(steps[::-1], return_index=True)
        both = both[len(both) - 1 - last]
        newest = both[:, COLUMN["step"]].max()
        keep = (both[:, COLUMN["probe"]] > 0) | (
            both[:, COLUMN["step"]] > newest - KEEP_STEPS
        )
        self.rows = both[keep]

    @classmethod
    def of(cls, recorder: FlightRecorder, values: list[Any] | None = None):
        """The rows of `recorder`: read now, or from `values`, what its
        `start_read` returned."""
        record = cls.empty(recorder.columns, recorder.layers, recorder.recurrent)
        if recorder.ring is not None:
            record.add_read(recorder.read(values))
        return record

    def add_read(self, read: dict[str, Any]) -> None:
        """Adds what `FlightRecorder.read` returned."""
        self.add(read["history"])
        self.add(read["ring"])
