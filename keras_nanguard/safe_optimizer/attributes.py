"""SafeOptimizer's attributes over its parts: its arguments (`Arguments`),
read and set on the optimizer, and its counters (`Counters`), read on it."""

from __future__ import annotations

import dataclasses
from typing import Any, Generic, Protocol, TypeVar, overload

import keras

from keras_nanguard import _kernels as kernels
from keras_nanguard._arguments import Arguments
from keras_nanguard.safe_optimizer.counters import Counters


class _Owner(Protocol):
    """What the descriptors need of the optimizer they are attributes of."""

    _settings: Arguments
    inner_optimizer: keras.optimizers.Optimizer

    def _configure(self, settings: Arguments) -> None: ...


T = TypeVar("T")


class SettingAttribute(Generic[T]):
    """An argument of SafeOptimizer, read and set on it: setting one hands
    new `Arguments`, checked again, to the optimizer's parts. A `fixed` one
    decides what the optimizer is made of and is only read."""

    def __init__(self, name: str, fixed: bool = False) -> None:
        self._name = name
        self._fixed = fixed

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> SettingAttribute[T]: ...
    @overload
    def __get__(self, obj: _Owner, owner: type | None = None) -> T: ...
    def __get__(
        self, obj: _Owner | None, owner: type | None = None
    ) -> T | SettingAttribute[T]:
        if obj is None:
            return self
        value: T = getattr(obj._settings, self._name)
        return value

    def __set__(self, obj: _Owner, value: T) -> None:
        # The base class's __init__ writes its own `clipnorm` before the
        # settings are made; that is not the user's and is dropped.
        if "_settings" in obj.__dict__:
            if self._fixed:
                raise AttributeError(
                    f"`{self._name}` is set when the SafeOptimizer is made (it "
                    "decides which variables it has): make a new one. "
                    f"Received: {self._name}={value!r}"
                )
            # Checked as the constructor checks it.
            obj._configure(
                obj._settings.replaced(obj.inner_optimizer, **{self._name: value})
            )


class CounterAttribute:
    """One of the optimizer's `Counters` (a `keras.Variable`), read on it as
    `opt.<name>`, e.g. `int(opt.skipped_steps)`. A `coded` counter (a norm
    that may be non-finite, held as a finite code) reads as its value, NaN
    or inf included: a tensor, not the variable."""

    def __init__(self, coded: bool = False) -> None:
        self._coded = coded

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name
        field = {f.name: f for f in dataclasses.fields(Counters)}[name]
        self.__doc__ = field.metadata["doc"]

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> CounterAttribute: ...
    @overload
    def __get__(self, obj: _Owner, owner: type | None = None) -> keras.Variable: ...
    def __get__(
        self, obj: _Owner | None, owner: type | None = None
    ) -> keras.Variable | CounterAttribute:
        if obj is None:
            return self
        counters = obj.__dict__.get("_counters")
        variable = None if counters is None else getattr(counters, self._name)
        if variable is None:
            raise AttributeError(
                f"SafeOptimizer has no `{self._name}`"
                + (" without `spike_factor`" if counters is not None else "")
            )
        if self._coded:
            return kernels.decode_finite(variable.value)
        return variable

    def __set__(self, obj: _Owner, value: Any) -> None:
        raise AttributeError(
            f"`{self._name}` is a counter of the SafeOptimizer: assign its value "
            f"with `optimizer.{self._name}.assign(...)`."
        )
