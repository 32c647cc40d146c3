"""kiln's version, in a module of its own: modules inside kiln that need it (cache keys,
archive headers) import it from here, never from the package face, and pyproject.toml
reads it (`[tool.setuptools.dynamic]`), so it is written in one place."""

__version__ = "0.1.0"
