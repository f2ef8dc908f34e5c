"""Fixtures shared by the runtime tests: the tiny model's weights and test backends selected by
name through the real registry and ``MonoConfig``."""

import pytest

from monodecode.model.profiles import profile_dims
from monodecode.model.weights import random_weights


@pytest.fixture(scope="module")
def weights():
    return random_weights(profile_dims("tiny"), seed=0)


@pytest.fixture
def backend(monkeypatch):
    """``backend(cls)`` registers a test backend and lets ``MonoConfig(backend=cls.name)`` pick it;
    every backend registered this way is removed afterwards."""
    import monodecode.config as config_mod
    from monodecode.kernels import registry

    names = []

    def use(cls):
        registry.register_backend(cls)
        names.append(cls.name)
        monkeypatch.setitem(config_mod._VALIDATORS, "backend", config_mod._choice(config_mod.BACKENDS + tuple(names)))
        return cls.name

    yield use
    for n in names:
        registry._LAZY.pop(n, None)
        registry._LOADED.pop(n, None)
