"""Fixtures shared by the runtime tests: the tiny model's weights (test backends: ``backend`` in
tests/conftest.py)."""

import pytest

from monodecode.model.profiles import profile_dims
from monodecode.model.weights import random_weights


@pytest.fixture(scope="module")
def weights():
    return random_weights(profile_dims("tiny"), seed=0)
