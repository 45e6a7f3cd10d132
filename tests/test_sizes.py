"""Size spellings (sidecar/config_spec.py parse_size): G is a power of 1000,
Gi and GiB powers of 1024, as Kubernetes spells them; what parsed before
means what it meant."""

from __future__ import annotations

import pytest

from sidecar.config import load_config
from sidecar.config_spec import parse_size


@pytest.mark.parametrize(
    ("text", "n_bytes"),
    [
        ("1K", 10**3),
        ("1M", 10**6),
        ("1G", 10**9),
        ("2T", 2 * 10**12),
        ("1.5g", 1_500_000_000),
        ("1Ki", 2**10),
        ("1Mi", 2**20),
        ("1Gi", 2**30),
        ("1Ti", 2**40),
        ("16 gi", 16 * 2**30),
        ("0.5Gi", 2**29),
    ],
)
def test_short_units(text: str, n_bytes: int) -> None:
    assert parse_size(text) == n_bytes


@pytest.mark.parametrize("prefix", ["K", "M", "G", "T"])
def test_each_spelling_of_a_unit_means_the_same(prefix: str) -> None:
    assert parse_size(f"3{prefix}") == parse_size(f"3{prefix}B") == 3 * parse_size(f"1{prefix}B")
    assert parse_size(f"3{prefix}i") == parse_size(f"3{prefix}iB") == 3 * parse_size(f"1{prefix}iB")
    assert parse_size(f"1{prefix}iB") > parse_size(f"1{prefix}B")


@pytest.mark.parametrize(
    ("text", "n_bytes"),
    [("1GiB", 2**30), ("1GB", 10**9), ("4096", 4096), ("1 mib", 2**20), ("7b", 7)],
)
def test_spellings_accepted_before_keep_their_meaning(text: str, n_bytes: int) -> None:
    assert parse_size(text) == n_bytes


@pytest.mark.parametrize("text", ["1Gb i", "1iB", "1GiBs", "1Gii", "1X", "1KBi"])
def test_other_units_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="is not a size"):
        parse_size(text)


def test_a_configuration_takes_the_short_units() -> None:
    config = load_config(
        None, env={}, overrides={"cpu_capacity": "1Gi", "ssd_capacity_per_dir": "2G"}
    )
    assert config.cpu_capacity == 2**30 and config.ssd_capacity_per_dir == 2 * 10**9
