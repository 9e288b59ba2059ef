"""What the harness read from a guest once and keeps for as long as the machine lives.

``PerMachine`` holds a table of values per machine through a weak reference to it, so a
machine's entries go with it. A stand-in machine without weak references (a unit test's
fake) gets a fresh table each time: nothing is kept for it.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class PerMachine(Generic[K, V]):
    """A table of values per machine (``table(vm)``), dropped with the machine."""

    def __init__(self) -> None:
        self._by_machine: "weakref.WeakKeyDictionary[Any, dict[K, V]]" = weakref.WeakKeyDictionary()

    def table(self, vm: Any) -> dict[K, V]:
        """``vm``'s table, made empty on first use; a new one, not kept, for a machine
        without weak references."""
        try:
            return self._by_machine.setdefault(vm, {})
        except TypeError:
            return {}

    def get(self, vm: Any, key: K, make: Callable[[], V]) -> V:
        """``vm``'s value for ``key``, made by ``make()`` the first time."""
        t = self.table(vm)
        if key not in t:
            t[key] = make()
        return t[key]
