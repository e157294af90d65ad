"""A table of named entries, the shape every registry of parts shares (the pipeline schedules, the optimizers, the
routers, the token dispatchers, the blocks): `register` an entry under its `name`, `registered` for the length of a
`with` block (a test's toy part), `names` in the order they were registered, `get` one, or a one-line ValueError
naming the config key, the value and the registered names. A name keeps its meaning for the life of the process."""
from __future__ import annotations

import importlib
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Generic, Iterator, Protocol, TypeVar


class Named(Protocol):
    name: str


T = TypeVar("T", bound=Named)


class Registry(Generic[T]):
    def __init__(self, what: str, key: str):
        self.what, self.key = what, key  # e.g. "token dispatcher", "model.moe.dispatcher"
        self._entries: dict[str, T] = {}

    def register(self, entry: T) -> T:
        if entry.name in self._entries:
            raise ValueError(f"a {self.what} named {entry.name!r} is already registered")
        self._entries[entry.name] = entry
        return entry

    def unregister(self, name: str) -> None:
        del self._entries[name]

    @contextmanager
    def registered(self, entry: T) -> Iterator[T]:
        """`entry` registered inside the block, gone after it."""
        self.register(entry)
        try:
            yield entry
        finally:
            self.unregister(entry.name)

    def names(self) -> tuple[str, ...]:
        return tuple(self._entries)

    def entries(self) -> tuple[T, ...]:
        return tuple(self._entries.values())

    def get(self, name: str) -> T:
        try:
            return self._entries[name]
        except KeyError:
            raise ValueError(f"{self.key}={name!r} is not one of {', '.join(self._entries)}") from None


def runtime(impl: type | str) -> type:
    """An entry's runtime: the class itself, or "module:Class" imported now (an entry is declared without torch; its
    runtime is imported where a model is built)."""
    if isinstance(impl, str):
        module, _, name = impl.partition(":")
        return getattr(importlib.import_module(module), name)
    return impl


@dataclass(frozen=True)
class Part:
    """What an entry with a runtime declares first (an MLP, an attention, a token dispatcher): its name, the config's
    value; its label, in words, for the dry run and the docs; its runtime, a class or "module:Class"."""

    name: str
    label: str
    impl: type | str

    def runtime(self) -> type:
        return runtime(self.impl)
