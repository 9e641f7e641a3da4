"""The shared setting checks (arvdm/setting_checks.py): what they accept, what they refuse, and with which words."""

import math

import pytest

from arvdm.errors import ConfigError, SamplingError
from arvdm.setting_checks import as_number, check_anchor_floor, check_anchor_sigma, check_eta, check_guidance


def test_as_number_refuses_bools_and_non_numbers():
    assert as_number(3) == 3.0 and as_number("0.5") == 0.5
    for value in (True, False, None, "x", [1]):
        assert math.isnan(as_number(value))


@pytest.mark.parametrize("check, good, bad", [
    (check_eta, [0, 0.5, 1], [-0.01, 1.01, float("nan"), True, "a"]),
    (check_guidance, [0, -1.5, 3], [float("inf"), float("nan"), False, None]),
    (check_anchor_sigma, [0, 1, 2.5], [-1, float("inf"), True]),
])
def test_number_checks_return_the_value_or_raise_naming_the_setting(check, good, bad):
    for value in good:
        assert check(value, "--flag") == float(value)
    for value in bad:
        with pytest.raises(ConfigError, match="--flag"):
            check(value, "--flag")
    with pytest.raises(SamplingError, match="--other"):  # the caller chooses the error family
        check(bad[0], "--other", SamplingError)


def test_anchor_floor_is_an_integer_level_below_k():
    assert check_anchor_floor(0, 1000, "f") == 0 and check_anchor_floor(999, 1000, "f") == 999
    for value in (-1, 1000, 1.0, True, "3"):
        with pytest.raises(ConfigError, match="0..999"):
            check_anchor_floor(value, 1000, "f")
