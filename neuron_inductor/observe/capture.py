"""Watch the first call of each kernel of a loaded Program (for dumps and progress).

A `Program` calls kernels through its kernel table (`program.kernels.<name>`). `watch_first_calls`
puts a one-shot wrapper in front of each entry; after its first call the entry is the kernel it
was before, so steady-state runs pay nothing.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol


class KernelCallObserver(Protocol):
    def before(self, name: str, position: int, count: int, args: tuple) -> Any:
        """Called before the kernel runs; the return value is handed to `after`."""

    def after(self, name: str, state: Any, result: Any) -> None:
        ...


class _FirstCall:
    def __init__(self, table: Any, name: str, position: int, count: int, observers: list[KernelCallObserver]):
        self.table, self.name, self.position, self.count = table, name, position, count
        self.inner: Callable = getattr(table, name)
        self.observers = observers

    def __call__(self, *args):
        states = [o.before(self.name, self.position, self.count, args) for o in self.observers]
        result = self.inner(*args)
        setattr(self.table, self.name, self.inner)
        for observer, state in zip(self.observers, states):
            observer.after(self.name, state, result)
        return result


def watch_first_calls(table: Any, names: list[str], observers: list[KernelCallObserver]) -> None:
    if observers:
        for position, name in enumerate(names):
            setattr(table, name, _FirstCall(table, name, position, len(names), observers))
