"""The plugin's fixtures, as a user's conftest gets them (here by import, not by
``pytest_plugins``, which only the root conftest may use)."""

from aiohicache.testing import (  # noqa: F401  (fixtures, found by name)
    faulty_storage,
    hicache,
    hicache_config,
    hicache_factory,
    kv,
)
