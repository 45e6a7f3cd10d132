"""One configuration key's type, documentation and allowed values (`FieldSpec`),
and the value parsers behind them (sizes like '16GiB', booleans, lists).

`sidecar.config` declares every key as a dataclass field made by `config_key`;
validation, environment parsing and the docs table all read these specs.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any, Literal, NamedTuple

SPEC = "spec"
"""Metadata key under which a Config field keeps its FieldSpec."""

Kind = Literal["int", "float", "bool", "str", "size", "str_list", "name_or_id"]


class ConfigError(ValueError):
    """A configuration value or file is invalid.

    The message names the key (and where it came from), the bad value, and what
    is allowed, so that it can be shown to the user as is.
    """


# --- sizes -----------------------------------------------------------------

# Kubernetes' spelling: G (= GB) is a power of 1000, Gi (= GiB) a power of 1024.
_SIZE_UNITS = (
    {"b": 1}
    | {prefix + suffix: 1000 ** (i + 1) for i, prefix in enumerate("kmgt") for suffix in ("", "b")}
    | {
        prefix + suffix: 1024 ** (i + 1)
        for i, prefix in enumerate("kmgt")
        for suffix in ("i", "ib")
    }
)
# ASCII only: in Unicode mode \d takes other scripts' digits, \s a no-break
# space, and [a-z] with IGNORECASE the Kelvin sign (U+212A) as a "k".
_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*", re.IGNORECASE | re.ASCII)
_SIZE_HELP = "a byte count or a string like '16GiB', '16Gi', '512MiB', '1.5GB', '1G', '4096'"


def parse_size(text: str) -> int:
    """Bytes in a size string: "16GiB", "16Gi", "512MiB", "1.5GB", "1G", "4096", "64 kb".

    Units, case-insensitive: B; K, M, G, T and KB, MB, GB, TB (powers of 1000);
    Ki, Mi, Gi, Ti and KiB, MiB, GiB, TiB (powers of 1024). No unit means bytes.
    A fractional result is rounded down to whole bytes. Raises ValueError for
    anything else, negative sizes included.
    """
    match = _SIZE_RE.fullmatch(text)
    unit = (match.group(2).lower() or "b") if match else ""
    if match is None or unit not in _SIZE_UNITS:
        raise ValueError(f"{text!r} is not a size; allowed: {_SIZE_HELP}")
    return int(Decimal(match.group(1)) * _SIZE_UNITS[unit])


def format_size(n_bytes: int) -> str:
    """The shortest exact spelling of a byte count in binary units: 64GiB, 1536B."""
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        scale = _SIZE_UNITS[unit.lower()]
        if n_bytes and n_bytes % scale == 0:
            return f"{n_bytes // scale}{unit}"
    return f"{n_bytes}B"


# --- per-kind conversion -------------------------------------------------------
# A converter turns a typed value (from a file, an override or a parsed env
# string) into the stored form, raising TypeError/ValueError when it does not fit.


def _to_int(value: object) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise TypeError


def _to_float(value: object) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:  # an int past a double's range (from a file)
            raise ValueError from None
    raise TypeError


def _to_bool(value: object) -> bool:
    if isinstance(value, bool):
        return value
    raise TypeError


def _to_str(value: object) -> str:
    if isinstance(value, str):
        return value
    raise TypeError


def _to_name_or_id(value: object) -> str:
    """A name, or a numeric id (a YAML int included) kept as its digits."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return str(value)
    return _to_str(value)


def _to_size(value: object) -> int:
    return parse_size(value) if isinstance(value, str) else _to_int(value)


def _to_str_tuple(value: object) -> tuple[str, ...]:
    if isinstance(value, (list, tuple)) and all(isinstance(item, str) for item in value):
        return tuple(value)
    raise TypeError


_BOOL_WORDS = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}


def _ascii_int(text: str) -> int:
    """int(text) for ASCII text only: int() takes other scripts' digits too."""
    if not text.isascii():
        raise ValueError(text)
    return int(text)


def _ascii_float(text: str) -> float:
    """float(text) for ASCII text only, as `_ascii_int`."""
    if not text.isascii():
        raise ValueError(text)
    return float(text)


def _bool_word(text: str) -> bool:
    return _BOOL_WORDS[text.strip().lower()]


def _comma_list(text: str) -> tuple[str, ...]:
    return tuple(item.strip() for item in text.split(",") if item.strip())


class _KindInfo(NamedTuple):
    type_name: str
    noun: str
    convert: Callable[[object], object]
    parse_env: Callable[[str], object]
    """Environment string -> typed value, which `convert` then takes."""


_KINDS: dict[Kind, _KindInfo] = {
    "int": _KindInfo("int", "an integer", _to_int, _ascii_int),
    "float": _KindInfo("float", "a number", _to_float, _ascii_float),
    "bool": _KindInfo("bool", "a boolean (env: 1/0/true/false/yes/no)", _to_bool, _bool_word),
    "str": _KindInfo("str", "a string", _to_str, str),
    "size": _KindInfo("size", f"a size ({_SIZE_HELP})", _to_size, parse_size),
    "str_list": _KindInfo("list[str]", "a list of strings", _to_str_tuple, _comma_list),
    "name_or_id": _KindInfo("str", "a name or a numeric id", _to_name_or_id, str),
}


@dataclass(frozen=True)
class FieldSpec:
    """Type, documentation and allowed values of one configuration key.

    `low`/`high` bound numbers and sizes, inclusively unless `low_open`.
    `choices` restricts a string to a fixed set; `prefixes` requires a string to
    start with one of them; `pattern` is a regular expression it must match whole.
    `optional` admits None, whose meaning `doc` states.
    """

    kind: Kind
    doc: str
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    choices: tuple[str, ...] = ()
    prefixes: tuple[str, ...] = ()
    pattern: str = ""
    optional: bool = False

    @property
    def type_name(self) -> str:
        name = _KINDS[self.kind].type_name
        return f"{name} or None" if self.optional else name

    def allowed(self, key: str) -> str:
        """What `key` accepts, in words: "0.0 <= evict_ratio <= 1.0", "one of a, b"."""
        if self.choices:
            rule = "one of " + ", ".join(self.choices)
        elif self.prefixes:
            rule = "a string starting with " + ", ".join(self.prefixes)
        elif self.pattern:
            rule = f"a string matching {self.pattern}"
        elif self.low is not None or self.high is not None:
            rule = self._range_text(key)
        else:
            rule = "any " + _KINDS[self.kind].noun.removeprefix("a ")
        return f"None or {rule}" if self.optional else rule

    def convert(self, key: str, value: object) -> Any:
        """`value` (already typed, as from a file) in stored form, or ConfigError.

        Idempotent: converting a stored value returns it unchanged.
        """
        if value is None and self.optional:
            return None
        try:
            stored = _KINDS[self.kind].convert(value)
        except (TypeError, ValueError):
            raise self._error(key, value, f"is not {_KINDS[self.kind].noun}") from None
        self._check(key, value, stored)
        return stored

    def convert_env(self, key: str, text: str) -> Any:
        """An environment string parsed to this key's type, then `convert`ed.

        For optional keys an empty string or "none" means None.
        """
        if self.optional and text.strip().lower() in ("", "none"):
            return None
        try:
            value = _KINDS[self.kind].parse_env(text)
        except (KeyError, ValueError):
            raise self._error(key, text, f"is not {_KINDS[self.kind].noun}") from None
        return self.convert(key, value)

    def render(self, value: object) -> str:
        """A stored value as the docs table shows it."""
        if value is None:
            return "None"
        if self.kind == "size":
            return format_size(_to_int(value))
        if self.kind == "str_list":
            return "[" + ", ".join(_to_str_tuple(value)) + "]"
        return str(value)

    def _check(self, key: str, raw: object, stored: Any) -> None:
        if self.choices and stored not in self.choices:
            near = difflib.get_close_matches(stored, self.choices, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise self._error(key, raw, f"is not a valid choice{hint}")
        if self.prefixes and not stored.startswith(self.prefixes):
            raise self._error(key, raw, "has an unsupported scheme")
        if self.pattern and not re.fullmatch(self.pattern, stored):
            raise self._error(key, raw, "is not a valid name")
        below = self.low is not None and (
            stored <= self.low if self.low_open else stored < self.low
        )
        above = self.high is not None and stored > self.high
        # NaN compares false with everything, so the bounds alone would let it
        # in; infinity passes an open upper bound but breaks arithmetic (an
        # infinite hit reward times zero hits is NaN).
        not_finite = self.kind == "float" and not math.isfinite(stored)
        if below or above or not_finite:
            raise self._error(key, raw, "is out of range")

    def _range_text(self, key: str) -> str:
        low_op = "<" if self.low_open else "<="
        low = "" if self.low is None else f"{self._bound(self.low)} {low_op} "
        high = "" if self.high is None else f" <= {self._bound(self.high)}"
        if self.low is not None and self.high is None:  # "key >= 1" reads better than "1 <= key"
            return f"{key} {'>' if self.low_open else '>='} {self._bound(self.low)}"
        return f"{low}{key}{high}"

    def _bound(self, bound: float) -> str:
        return format_size(int(bound)) if self.kind == "size" else repr(bound)

    def _error(self, key: str, value: object, problem: str) -> ConfigError:
        return ConfigError(f"{key}: {value!r} {problem}; allowed: {self.allowed(key)}")


def config_key(default: object, kind: Kind, doc: str, **constraints: Any) -> Any:
    """A Config field: its default and its FieldSpec (the rest of FieldSpec's fields)."""
    return field(default=default, metadata={SPEC: FieldSpec(kind, doc, **constraints)})
