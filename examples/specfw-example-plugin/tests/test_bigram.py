"""The plugin's own tests: only specfw's plugin test kit, as a third-party author would write them."""

import pytest

from specfw.testing import check_lossless


@pytest.mark.parametrize("overrides", [{}, {"num_steps": 4, "topk": 1}, {"num_steps": 2, "topk": 1, "min_gap": 2}])
def test_bigram_is_lossless(overrides):
    check_lossless("bigram", overrides)
