"""A public class's arguments, each declared once: in its constructor's
signature, as `name: Annotated[type, Check(...)] = default`.

From that one declaration `ArgumentSpec` reads the names, the defaults and
the checks; the class's attributes, its `get_config` and its checked,
frozen `Arguments` (what its parts read) all come from it, so an argument
is added or changed in one place.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Mapping
from typing import Any


class Check:
    """How one argument is checked: `function(name, value, *args, **kwargs)`
    returns the value to keep (e.g. as a float) or raises the argument's
    error (see `_validation`). `fixed`: the argument decides what the object
    is made of (its variables) and cannot be set once it exists."""

    def __init__(
        self,
        function: Callable[..., Any],
        *args: Any,
        fixed: bool = False,
        **kwargs: Any,
    ) -> None:
        self.function = function
        self.args = args
        self.kwargs = kwargs
        self.fixed = fixed

    def __call__(self, name: str, value: Any) -> Any:
        return self.function(name, value, *self.args, **self.kwargs)

    def __repr__(self) -> str:
        given = [repr(a) for a in self.args] + [
            f"{k}={v!r}" for k, v in self.kwargs.items()
        ]
        return f"Check({self.function.__name__}{''.join(', ' + g for g in given)})"


class Arguments(Mapping[str, Any]):
    """Checked argument values, read as attributes (`settings.clipnorm`) or
    as a mapping; frozen: `replaced` makes new ones, checked again."""

    __slots__ = ("_spec", "_values")

    def __init__(self, spec: ArgumentSpec, values: dict[str, Any]) -> None:
        object.__setattr__(self, "_spec", spec)
        object.__setattr__(self, "_values", values)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # not an argument (copy and pickle ask)
            raise AttributeError(name)
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(name) from None

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Arguments are frozen: use `replaced`.")

    def __getitem__(self, name: str) -> Any:
        return self._values[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"Arguments({self._values!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (Arguments, (self._spec, dict(self._values)))

    def replaced(self, context: Any = None, **changed: Any) -> Arguments:
        """These arguments with `changed` ones, all checked again."""
        return self._spec.checked({**self._values, **changed}, context)


class ArgumentSpec:
    """The arguments of `function` (a public class's `__init__`) that are
    annotated with a `Check`: their names in order, defaults and checks.

    `joint(arguments, context)`, if given, checks what involves several
    arguments or the object they configure (`context`, e.g. the optimizer a
    SafeOptimizer wraps): it raises, or returns nothing."""

    def __init__(
        self,
        function: Callable[..., Any],
        joint: Callable[[Arguments, Any], None] | None = None,
    ) -> None:
        # `eval_str`, not `typing.get_type_hints`: on Python 3.10 the latter
        # makes an argument whose default is None `Optional[Annotated[...]]`,
        # which hides the `Check`.
        self.defaults: dict[str, Any] = {}
        self.checks: dict[str, Check] = {}
        signature = inspect.signature(function, eval_str=True)
        for name, parameter in signature.parameters.items():
            found = [
                m
                for m in getattr(parameter.annotation, "__metadata__", ())
                if isinstance(m, Check)
            ]
            if found:
                self.defaults[name] = parameter.default
                self.checks[name] = found[0]
        self._joint = joint

    @property
    def names(self) -> list[str]:
        return list(self.checks)

    def checked(self, given: Mapping[str, Any], context: Any = None) -> Arguments:
        """The arguments from `given` (a mapping holding at least these
        names, e.g. the constructor's `locals()`), each checked in the
        signature's order, then together with `context` when given."""
        values = {name: check(name, given[name]) for name, check in self.checks.items()}
        arguments = Arguments(self, values)
        if self._joint is not None and context is not None:
            self._joint(arguments, context)
        return arguments

    def of(self, context: Any = None, **given: Any) -> Arguments:
        """The defaults with `given` ones, checked (as `checked`): the
        arguments of a call that passes only `given`."""
        return self.checked({**self.defaults, **given}, context)
