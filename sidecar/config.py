"""The sidecar's configuration: one frozen dataclass, loaded in layers.

Load order, later layers winning key by key:

    defaults < YAML/JSON file < environment (KVSIDECAR_<KEY>) < explicit overrides

This is the only module that reads `os.environ`; everything else receives a
`Config` (or values taken from it). Keys are flat, so FlexKV's eviction section
(`eviction_policy`, `evict_start_threshold`, `evict_ratio`, `hit_reward_seconds`)
loads unchanged from a FlexKV yml/json file.

Every key is one dataclass field whose metadata holds a `FieldSpec`: its doc
line, type and allowed values. Validation, environment parsing and the table in
docs/configuration.md are all driven by those specs, so adding a key means
adding one field. `python -m sidecar.config --markdown` prints that table.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from decimal import Decimal
from pathlib import Path
from typing import Any, Literal, NamedTuple

import yaml

ENV_PREFIX = "KVSIDECAR_"
_SPEC = "spec"

Kind = Literal["int", "float", "bool", "str", "size", "str_list"]


class ConfigError(ValueError):
    """A configuration value or file is invalid.

    The message names the key (and where it came from), the bad value, and what
    is allowed, so that it can be shown to the user as is.
    """


# --- sizes -----------------------------------------------------------------

_SIZE_UNITS = (
    {"b": 1}
    | {prefix + "b": 1000 ** (i + 1) for i, prefix in enumerate("kmgt")}
    | {prefix + "ib": 1024 ** (i + 1) for i, prefix in enumerate("kmgt")}
)
_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*", re.IGNORECASE)
_SIZE_HELP = "a byte count or a string like '16GiB', '512MiB', '1.5GB', '4096'"


def parse_size(text: str) -> int:
    """Bytes in a size string: "16GiB", "512MiB", "1.5GB", "4096", "64 kb".

    Units are B, KB/MB/GB/TB (powers of 10) and KiB/MiB/GiB/TiB (powers of 2),
    case-insensitive; no unit means bytes. A fractional result is rounded down
    to whole bytes. Raises ValueError for anything else, negative sizes included.
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
        return float(value)
    raise TypeError


def _to_bool(value: object) -> bool:
    if isinstance(value, bool):
        return value
    raise TypeError


def _to_str(value: object) -> str:
    if isinstance(value, str):
        return value
    raise TypeError


def _to_size(value: object) -> int:
    return parse_size(value) if isinstance(value, str) else _to_int(value)


def _to_str_tuple(value: object) -> tuple[str, ...]:
    if isinstance(value, (list, tuple)) and all(isinstance(item, str) for item in value):
        return tuple(value)
    raise TypeError


_BOOL_WORDS = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}


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
    "int": _KindInfo("int", "an integer", _to_int, int),
    "float": _KindInfo("float", "a number", _to_float, float),
    "bool": _KindInfo("bool", "a boolean (env: 1/0/true/false/yes/no)", _to_bool, _bool_word),
    "str": _KindInfo("str", "a string", _to_str, str),
    "size": _KindInfo("size", f"a size ({_SIZE_HELP})", _to_size, parse_size),
    "str_list": _KindInfo("list[str]", "a list of strings", _to_str_tuple, _comma_list),
}


@dataclass(frozen=True)
class FieldSpec:
    """Type, documentation and allowed values of one configuration key.

    `low`/`high` bound numbers and sizes, inclusively unless `low_open`.
    `choices` restricts a string to a fixed set; `prefixes` requires a string to
    start with one of them. `optional` admits None, whose meaning `doc` states.
    """

    kind: Kind
    doc: str
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    choices: tuple[str, ...] = ()
    prefixes: tuple[str, ...] = ()
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
        below = self.low is not None and (
            stored <= self.low if self.low_open else stored < self.low
        )
        above = self.high is not None and stored > self.high
        # NaN compares false with everything, so the bounds alone would let it in.
        if below or above or stored != stored:
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


def _key(default: object, kind: Kind, doc: str, **constraints: Any) -> Any:
    """A Config field: its default and its FieldSpec (the rest of FieldSpec's fields)."""
    return field(default=default, metadata={_SPEC: FieldSpec(kind, doc, **constraints)})


_MiB = 2**20
_GiB = 2**30


@dataclass(frozen=True)
class Config:
    """Every setting of the sidecar, validated and normalised on construction.

    Sizes are stored as int bytes, floats as float (an int is accepted), lists as
    tuples of str. Constructing one with a bad value (directly or through
    `dataclasses.replace`) raises ConfigError. Build it with `load_config`.
    """

    tokens_per_block: int = _key(
        16, "int", "Tokens per cached block; only full blocks are cached.", low=1, high=4096
    )
    eviction_policy: str = _key(
        "lru",
        "str",
        "Which unlocked, ready leaves are evicted first.",
        choices=("lru", "lfu", "fifo", "mru", "filo", "s3fifo"),
    )
    evict_start_threshold: float = _key(
        0.95,
        "float",
        "Tier utilisation at which eviction starts.",
        low=0.0,
        high=1.0,
        low_open=True,
    )
    evict_ratio: float = _key(
        0.01,
        "float",
        "Minimum share of a tier's capacity evicted at once (0 = only what is needed).",
        low=0.0,
        high=1.0,
    )
    hit_reward_seconds: float = _key(
        0.0,
        "float",
        "lru only: each hit adds this many seconds to a block's effective access time, "
        "cumulatively.",
        low=0.0,
    )
    cpu_capacity: int | None = _key(
        None,
        "size",
        "CPU (shared-memory) tier capacity; None lets the daemon pick 10% of RAM, at most 16GiB.",
        low=_MiB,
        optional=True,
    )
    ssd_dirs: tuple[str, ...] = _key(
        (), "str_list", "SSD tier directories, blocks striped across them; empty = SSD tier off."
    )
    ssd_capacity_per_dir: int = _key(
        64 * _GiB, "size", "SSD tier capacity of each directory.", low=_MiB
    )
    remote_url: str | None = _key(
        None,
        "str",
        "Redis/Valkey URL of the remote tier; None = remote tier off.",
        prefixes=("redis://", "rediss://", "unix://"),
        optional=True,
    )
    remote_capacity: int = _key(
        1024 * _GiB, "size", "Bytes of blocks the remote index assumes it may hold.", low=_MiB
    )
    write_policy: str = _key(
        "write_through",
        "str",
        "When blocks saved to the CPU tier are also written to SSD / remote.",
        choices=("write_through", "write_through_selective", "write_back"),
    )
    write_through_min_hits: int = _key(
        2, "int", "write_through_selective only: CPU hits before a block is written down.", low=1
    )
    hit_window: int = _key(
        1000, "int", "Number of recent requests in the sliding-window hit ratio.", low=1
    )
    key_hash: str = _key(
        "blake2b", "str", "Block-key hash function.", choices=("blake2b", "xxh3_128")
    )

    def __post_init__(self) -> None:
        for f in fields(self):
            # The documented way to normalise a field of a frozen dataclass.
            object.__setattr__(
                self, f.name, f.metadata[_SPEC].convert(f.name, getattr(self, f.name))
            )

    def to_dict(self) -> dict[str, object]:
        """Plain values (lists, not tuples) that `load_config` accepts back."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return {k: list(v) if isinstance(v, tuple) else v for k, v in values.items()}


SPECS: dict[str, FieldSpec] = {f.name: f.metadata[_SPEC] for f in fields(Config)}
"""Key name -> its spec, in declaration order."""


def env_var(key: str) -> str:
    """The environment variable that sets `key`: KVSIDECAR_<KEY>."""
    return ENV_PREFIX + key.upper()


# --- loading -------------------------------------------------------------------


def load_config(
    path: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, object] | None = None,
) -> Config:
    """Defaults, then the file at `path`, then `env`, then `overrides`.

    `env=None` reads `os.environ`; only variables starting with KVSIDECAR_ are
    looked at, and an unknown one is an error (it is most likely a typo).
    File and override values must already have the key's type; environment
    strings are parsed. Raises ConfigError, naming the source, key and value.
    """
    values: dict[str, object] = {}
    if path is not None:
        values.update(_convert_all(_read_file(Path(path)), f"config file {os.fspath(path)!r}"))
    environ = os.environ if env is None else env
    for name, text in environ.items():
        if name.startswith(ENV_PREFIX):
            key = name[len(ENV_PREFIX) :].lower()
            with _blame(f"${name}"):
                values[key] = _spec_of(key).convert_env(key, text)
    if overrides is not None:
        values.update(_convert_all(overrides, "overrides"))
    return Config(**values)


def _convert_all(raw: Mapping[Any, object], source: str) -> dict[str, object]:
    with _blame(source):
        return {key: _spec_of(key).convert(key, value) for key, value in raw.items()}


@contextmanager
def _blame(source: str) -> Iterator[None]:
    """Prefix a ConfigError raised inside with the source it came from."""
    try:
        yield
    except ConfigError as err:
        raise ConfigError(f"{source}: {err}") from None


def _spec_of(key: object) -> FieldSpec:
    if isinstance(key, str) and key in SPECS:
        return SPECS[key]
    near = difflib.get_close_matches(str(key), SPECS, n=1)
    if near:
        raise ConfigError(f"unknown key {key!r} (did you mean {near[0]!r}?)")
    raise ConfigError(f"unknown key {key!r}; allowed: {', '.join(SPECS)}")


def _load_yaml(text: str) -> object:
    data = yaml.safe_load(text)
    # An empty or all-comments file is an empty configuration, not an error.
    return {} if data is None else data


_LOADERS: dict[str, Callable[[str], object]] = {
    ".yml": _load_yaml,
    ".yaml": _load_yaml,
    ".json": json.loads,
}


def _read_file(path: Path) -> Mapping[Any, object]:
    where = f"config file {str(path)!r}"
    suffix = path.suffix.lower()
    if suffix not in _LOADERS:
        raise ConfigError(
            f"{where}: extension {suffix!r} is not allowed; allowed: .yml, .yaml, .json"
        )
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(
            f"{where} does not exist; allowed: an existing .yml, .yaml or .json file"
        ) from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{where} cannot be read: {err}") from None
    try:
        data = _LOADERS[suffix](text)
    except (yaml.YAMLError, ValueError) as err:
        raise ConfigError(f"{where} is not valid {suffix[1:].upper()}: {err}") from None
    if not isinstance(data, Mapping):
        raise ConfigError(
            f"{where}: top level is {type(data).__name__} {data!r}; allowed: a key: value mapping"
        )
    return data


# --- documentation -------------------------------------------------------------


def config_table_markdown() -> str:
    """The Markdown table of every key, as docs/configuration.md embeds it."""
    lines = [
        "| key | type | default | allowed | env var | description |",
        "|---|---|---|---|---|---|",
    ]
    for f in fields(Config):
        spec: FieldSpec = f.metadata[_SPEC]
        cells = (
            f"`{f.name}`",
            spec.type_name,
            f"`{spec.render(f.default)}`",
            spec.allowed(f.name),
            f"`{env_var(f.name)}`",
            spec.doc,
        )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sidecar.config",
        description="Print the effective configuration as JSON, or the docs table.",
    )
    parser.add_argument("path", nargs="?", help="config file (.yml/.yaml/.json) to load")
    parser.add_argument(
        "--markdown", action="store_true", help="print the key table of docs/configuration.md"
    )
    args = parser.parse_args(argv)
    if args.markdown:
        print(config_table_markdown(), end="")
    else:
        try:
            config = load_config(args.path)
        except ConfigError as err:
            parser.error(str(err))
        print(json.dumps(config.to_dict(), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
