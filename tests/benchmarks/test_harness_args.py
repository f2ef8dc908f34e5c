"""The decode-latency harness refuses bad arguments with one line before it needs a GPU."""

from __future__ import annotations

import pytest

from monodecode.errors import MonodecodeError
from monodecode_ops.decode_bench import harness


@pytest.mark.parametrize(
    "profiles, fp8, batches, context, fragment",
    [
        (["nope"], [], [1], 16, "unknown model profile 'nope'; known: tiny,"),
        (["tiny"], ["nope8"], [1], 16, "unknown model profile 'nope8'"),
        (["tiny"], [], [0], 16, "batches must be in 1..16"),
        (["tiny"], [], [], 16, "batches must be in 1..16"),
        (["tiny"], [], [1], 0, "context must be >= 1"),
    ],
)
def test_bad_arguments_are_one_line(tmp_path, profiles, fp8, batches, context, fragment):
    with pytest.raises(MonodecodeError) as err:
        harness.run(profiles, batches, context, None, fp8, 1, tmp_path)
    assert fragment in str(err.value) and "\n" not in str(err.value)
    assert not any(tmp_path.iterdir())  # nothing written
