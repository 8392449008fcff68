"""TRL's release decides the precision its train_step is audited at: compared as numbers.

As text, "1.2" > "1.15" (the character '2' sorts after '1'), so TRL 1.2-1.9 were held to the
fused-LM-head float32 tolerance, ten times looser than their float64 log-softmax deserves.
Needs no TRL install: the rule is read from the release string alone.
"""

from __future__ import annotations

import pytest

from rlaudit.targets.peers.trl import train_precision_of


@pytest.mark.parametrize("version, expected", [
    ("1.0.0", "hf-float64"), ("1.2.0", "hf-float64"), ("1.9.3", "hf-float64"),
    ("1.14.2", "hf-float64"), ("1.15.0", "float32"), ("1.16.0", "float32"),
    ("1.16.0.dev0", "float32"), ("1.15rc1", "float32"), ("2.0.0", "float32"),
    ("0.29.1", "hf-float64"),
])
def test_release_to_precision_compares_numbers_not_text(version, expected):
    assert train_precision_of(version) == expected
