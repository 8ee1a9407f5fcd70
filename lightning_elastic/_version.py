"""The library's version, in a module of its own: a durable snapshot's manifest records it,
and a module inside the package reads it from here rather than from the package's facade
(``lightning_elastic/__init__.py``, which names every public module)."""

__version__ = "0.1.0"
