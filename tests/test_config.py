"""Tests of sidecar.config: layering, parsing, error messages, docs table."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from sidecar.config import (
    SPECS,
    Config,
    ConfigError,
    FieldSpec,
    config_table_markdown,
    env_var,
    format_size,
    load_config,
    parse_size,
)

REPO = Path(__file__).resolve().parents[1]
GiB = 2**30
MiB = 2**20


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_defaults() -> None:
    config = load_config(env={})
    assert config == Config()
    assert config.ssd_io_threads == 4
    assert config.eviction_policy == "auto"
    assert config.evict_start_threshold == 0.95
    assert config.evict_ratio == 0.01
    assert config.hit_reward_seconds == 0.0
    assert config.cpu_capacity is None
    assert config.ssd_dirs == ()
    assert config.ssd_capacity_per_dir == 64 * GiB
    assert config.remote_url is None
    assert config.remote_capacity == 1024 * GiB
    assert config.write_policy == "write_through"
    assert config.write_through_min_hits == 2
    assert config.hit_window == 1000
    assert config.remote_namespace == "kvsidecar"


YAML_TEXT = """\
ssd_io_threads: 32
eviction_policy: s3fifo
ssd_dirs: [/mnt/a, /mnt/b]
ssd_capacity_per_dir: 500GiB
cpu_capacity: 1073741824
remote_url: rediss://cache:6380/1
write_policy: write_through_selective
remote_namespace: prod-a
"""

FILE_VALUES = {
    "ssd_io_threads": 32,
    "eviction_policy": "s3fifo",
    "ssd_dirs": ["/mnt/a", "/mnt/b"],
    "ssd_capacity_per_dir": "500GiB",
    "cpu_capacity": GiB,
    "remote_url": "rediss://cache:6380/1",
    "write_policy": "write_through_selective",
    "remote_namespace": "prod-a",
}


def assert_file_values(config: Config) -> None:
    assert config.ssd_io_threads == 32
    assert config.eviction_policy == "s3fifo"
    assert config.ssd_dirs == ("/mnt/a", "/mnt/b")
    assert config.ssd_capacity_per_dir == 500 * GiB
    assert config.cpu_capacity == GiB
    assert config.remote_url == "rediss://cache:6380/1"
    assert config.write_policy == "write_through_selective"
    assert config.remote_namespace == "prod-a"
    assert config.hit_window == 1000  # untouched keys keep their defaults


@pytest.mark.parametrize("name", ["sidecar.yml", "sidecar.yaml", "SIDECAR.YML"])
def test_yaml_file(tmp_path: Path, name: str) -> None:
    assert_file_values(load_config(write(tmp_path, name, YAML_TEXT), env={}))


def test_json_file(tmp_path: Path) -> None:
    path = write(tmp_path, "sidecar.json", json.dumps(FILE_VALUES))
    assert_file_values(load_config(str(path), env={}))


def test_empty_yaml_file_is_empty_config(tmp_path: Path) -> None:
    path = write(tmp_path, "empty.yml", "# every key commented out\n")
    assert load_config(path, env={}) == Config()


def test_flexkv_eviction_section_loads_unchanged(tmp_path: Path) -> None:
    text = """\
eviction_policy: lfu
evict_start_threshold: 0.7
evict_ratio: 0.05
hit_reward_seconds: 10
"""
    config = load_config(write(tmp_path, "flexkv.yml", text), env={})
    assert config.eviction_policy == "lfu"
    assert config.evict_start_threshold == 0.7
    assert config.evict_ratio == 0.05
    assert config.hit_reward_seconds == 10.0
    assert isinstance(config.hit_reward_seconds, float)


def test_precedence_file_env_overrides(tmp_path: Path) -> None:
    path = write(
        tmp_path, "sidecar.yml", "ssd_io_threads: 8\nevict_ratio: 0.1\nwrite_policy: write_back\n"
    )
    env = {"KVSIDECAR_SSD_IO_THREADS": "16", "KVSIDECAR_EVICT_RATIO": "0.2", "HOME": "/x"}
    config = load_config(path, env=env, overrides={"ssd_io_threads": 32})
    assert config.ssd_io_threads == 32  # override > env > file
    assert config.evict_ratio == 0.2  # env > file
    assert config.write_policy == "write_back"  # file > default
    assert config.hit_window == 1000  # default


def test_env_none_reads_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSIDECAR_HIT_WINDOW", "77")
    assert load_config().hit_window == 77


def test_env_strings_are_parsed_to_field_types() -> None:
    env = {
        "KVSIDECAR_SSD_IO_THREADS": " 8 ",
        "KVSIDECAR_HIT_REWARD_SECONDS": "2.5",
        "KVSIDECAR_CPU_CAPACITY": "1.5GB",
        "KVSIDECAR_SSD_DIRS": "/mnt/a, /mnt/b,",
        "KVSIDECAR_REMOTE_URL": "unix:///run/valkey.sock",
        "KVSIDECAR_REMOTE_CAPACITY": "4096MiB",
    }
    config = load_config(env=env)
    assert config.ssd_io_threads == 8
    assert config.hit_reward_seconds == 2.5
    assert config.cpu_capacity == 1_500_000_000
    assert config.ssd_dirs == ("/mnt/a", "/mnt/b")
    assert config.remote_url == "unix:///run/valkey.sock"
    assert config.remote_capacity == 4 * GiB


@pytest.mark.parametrize("text", ["", "none", "None"])
def test_env_empty_or_none_clears_optional_key(tmp_path: Path, text: str) -> None:
    path = write(tmp_path, "sidecar.yml", "remote_url: redis://h:6379\ncpu_capacity: 2GiB\n")
    env = {"KVSIDECAR_REMOTE_URL": text, "KVSIDECAR_CPU_CAPACITY": text}
    config = load_config(path, env=env)
    assert config.remote_url is None
    assert config.cpu_capacity is None


def test_env_empty_list_turns_ssd_tier_off(tmp_path: Path) -> None:
    path = write(tmp_path, "sidecar.yml", "ssd_dirs: [/mnt/a]\n")
    assert load_config(path, env={"KVSIDECAR_SSD_DIRS": ""}).ssd_dirs == ()


@pytest.mark.parametrize(
    ("text", "expected"),
    [("1", True), ("0", False), ("true", True), ("False", False), (" YES ", True), ("no", False)],
)
def test_env_bool_words(text: str, expected: bool) -> None:
    assert FieldSpec("bool", "a flag").convert_env("flag", text) is expected


def test_direct_construction_validates_and_normalises() -> None:
    config = Config(ssd_capacity_per_dir="2GiB", ssd_dirs=["/a"], hit_reward_seconds=3)
    assert config.ssd_capacity_per_dir == 2 * GiB
    assert config.ssd_dirs == ("/a",)
    assert isinstance(config.hit_reward_seconds, float)
    with pytest.raises(ConfigError, match=r"evict_ratio: 1\.5 is out of range"):
        dataclasses.replace(config, evict_ratio=1.5)


def test_config_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        Config().ssd_io_threads = 8  # type: ignore[misc]


def test_to_dict_round_trips_through_a_json_file(tmp_path: Path) -> None:
    config = load_config(env={}, overrides=FILE_VALUES)
    data = config.to_dict()
    assert data["ssd_dirs"] == ["/mnt/a", "/mnt/b"]
    assert list(data) == list(SPECS)
    path = write(tmp_path, "dump.json", json.dumps(data))
    assert load_config(path, env={}) == config


# --- errors: each names the key (or file), the bad value and what is allowed -----

ERROR_CASES = {
    "unknown key with suggestion": (
        {"evict_rato": 0.1},
        ["unknown key 'evict_rato'", "(did you mean 'evict_ratio'?)"],
    ),
    "unknown key without suggestion": (
        {"zzz": 1},
        ["unknown key 'zzz'", "allowed: eviction_policy, evict_start_threshold, evict_ratio"],
    ),
    "string for int": (
        {"ssd_io_threads": "16"},
        ["ssd_io_threads: '16' is not an integer", "allowed: 1 <= ssd_io_threads <= 64"],
    ),
    "bool for int": ({"hit_window": True}, ["hit_window: True is not an integer"]),
    "float for int": ({"hit_window": 10.0}, ["hit_window: 10.0 is not an integer"]),
    "bool for float": ({"evict_ratio": False}, ["evict_ratio: False is not a number"]),
    "string for list": ({"ssd_dirs": "/mnt/a"}, ["ssd_dirs: '/mnt/a' is not a list of strings"]),
    "None for required": ({"ssd_io_threads": None}, ["ssd_io_threads: None is not an integer"]),
    "above range": (
        {"evict_ratio": 1.5},
        ["evict_ratio: 1.5 is out of range; allowed: 0.0 <= evict_ratio <= 1.0"],
    ),
    "open lower bound": (
        {"evict_start_threshold": 0.0},
        ["evict_start_threshold: 0.0 is out of range", "0.0 < evict_start_threshold <= 1.0"],
    ),
    "below range": ({"ssd_io_threads": 0}, ["ssd_io_threads: 0 is out of range"]),
    "above int range": (
        {"ssd_io_threads": 65},
        ["ssd_io_threads: 65 is out of range; allowed: 1 <= ssd_io_threads <= 64"],
    ),
    "nan": ({"hit_reward_seconds": float("nan")}, ["hit_reward_seconds: nan is out of range"]),
    "infinite": ({"hit_reward_seconds": float("inf")}, ["hit_reward_seconds: inf is out of range"]),
    "negative reward": (
        {"hit_reward_seconds": -1},
        ["hit_reward_seconds: -1 is out of range; allowed: hit_reward_seconds >= 0.0"],
    ),
    "size too small": (
        {"ssd_capacity_per_dir": "1KiB"},
        ["ssd_capacity_per_dir: '1KiB' is out of range", "ssd_capacity_per_dir >= 1MiB"],
    ),
    "bad enum": (
        {"eviction_policy": "lfx"},
        [
            "eviction_policy: 'lfx' is not a valid choice (did you mean 'lfu'?)",
            "allowed: one of lru, lfu, fifo, mru, filo, s3fifo, s3fifo_adaptive, s3fifo_blocks, "
            "arc, auto",
        ],
    ),
    "bad enum, no suggestion": (
        {"write_policy": "sync"},
        [
            "write_policy: 'sync' is not a valid choice; "
            "allowed: one of write_through, write_through_selective, write_back"
        ],
    ),
    "bad size string": (
        {"cpu_capacity": "16 gigs"},
        ["cpu_capacity: '16 gigs' is not a size", "'16GiB'", "None or cpu_capacity >= 1MiB"],
    ),
    "bad url scheme": (
        {"remote_url": "http://cache:6379"},
        ["remote_url: 'http://cache:6379' has an unsupported scheme", "redis://, rediss://"],
    ),
}


@pytest.mark.parametrize("case", ERROR_CASES, ids=list(ERROR_CASES))
def test_override_errors_name_key_value_and_allowed(case: str) -> None:
    overrides, fragments = ERROR_CASES[case]
    with pytest.raises(ConfigError) as info:
        load_config(env={}, overrides=overrides)
    message = str(info.value)
    assert message.startswith("overrides: ")
    for fragment in fragments:
        assert fragment in message


@pytest.mark.parametrize(
    ("key", "env_value", "value"),
    [("tokens_per_block", "16", 16), ("key_hash", "xxh3_128", "xxh3_128")],
)
def test_engine_chosen_settings_are_not_sidecar_keys(
    key: str, env_value: str, value: object
) -> None:
    # Each engine gives tokens per block and the key hash at register (its block-key namespace).
    assert key not in SPECS
    with pytest.raises(ConfigError, match=f"unknown key '{key}'"):
        load_config(env={}, overrides={key: value})
    # In the environment it is ignored (with a warning: tests/test_env_config.py).
    assert load_config(env={env_var(key): env_value}) == Config()


def test_file_errors_name_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "sidecar.yml", "evict_rato: 0.5\n")
    with pytest.raises(ConfigError, match=r"sidecar\.yml': unknown key 'evict_rato' \(did you"):
        load_config(path, env={})


@pytest.mark.parametrize(
    ("env", "fragments"),
    [
        (
            {"KVSIDECAR_SSD_IO_THREADS": "abc"},
            ["$KVSIDECAR_SSD_IO_THREADS: ssd_io_threads: 'abc' is not an integer"],
        ),
        ({"KVSIDECAR_EVICT_RATIO": "lots"}, ["evict_ratio: 'lots' is not a number"]),
        ({"KVSIDECAR_EVICT_RATIO": "2"}, ["evict_ratio: 2.0 is out of range"]),
        ({"KVSIDECAR_SSD_CAPACITY_PER_DIR": "12XB"}, ["'12XB' is not a size"]),
        ({"KVSIDECAR_HIT_WINDOW": ""}, ["hit_window: '' is not an integer"]),
        ({"KVSIDECAR_HIT_WINDOW": "\u0664"}, ["hit_window: '\u0664' is not an integer"]),
        ({"KVSIDECAR_EVICT_RATIO": "\u0660.5"}, ["evict_ratio: '\u0660.5' is not a number"]),
        ({"KVSIDECAR_WRITE_POLICY": "none"}, ["write_policy: 'none' is not a valid choice"]),
    ],
)
def test_env_errors_name_variable_key_and_value(env: dict[str, str], fragments: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(env=env)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_bad_env_bool_names_key_value_and_words() -> None:
    with pytest.raises(ConfigError) as info:
        FieldSpec("bool", "a flag").convert_env("use_odirect", "maybe")
    assert "use_odirect: 'maybe' is not a boolean" in str(info.value)
    assert "1/0/true/false/yes/no" in str(info.value)


@pytest.mark.parametrize(
    ("name", "text", "fragment"),
    [
        ("list.yml", "- evict_ratio\n- 0.5\n", "top level is list"),
        ("scalar.json", "42", "top level is int 42; allowed: a key: value mapping"),
        ("null.json", "null", "top level is NoneType None"),
        ("broken.yml", "a: [1, 2\n", "is not valid YML"),
        ("broken.json", "{", "is not valid JSON"),
        ("sidecar.toml", "a = 1", "extension '.toml' is not allowed; allowed: .yml, .yaml, .json"),
    ],
)
def test_bad_files(tmp_path: Path, name: str, text: str, fragment: str) -> None:
    path = write(tmp_path, name, text)
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    assert name in str(info.value)
    assert fragment in str(info.value)


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.yml"
    with pytest.raises(ConfigError, match=r"nope\.yml' does not exist; allowed: an existing"):
        load_config(path, env={})


# --- sizes -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "n_bytes"),
    [
        ("4096", 4096),
        ("0", 0),
        ("1B", 1),
        ("1KB", 1000),
        ("1kb", 1000),
        ("2MB", 2_000_000),
        ("1.5GB", 1_500_000_000),
        ("3TB", 3 * 10**12),
        ("1KiB", 1024),
        ("512MiB", 512 * MiB),
        ("16GiB", 16 * GiB),
        ("16 gib", 16 * GiB),
        (" 1TiB ", 2**40),
        ("0.5KiB", 512),
        (".5MiB", MiB // 2),
        ("1.0001KiB", 1024),  # a fraction of a byte is dropped
    ],
)
def test_parse_size(text: str, n_bytes: int) -> None:
    assert parse_size(text) == n_bytes


# Past "1 Kx": ASCII only, not Arabic-Indic or fullwidth digits, the Kelvin
# sign for a "K" or a no-break space.
@pytest.mark.parametrize(
    "text",
    [
        *("", "GiB", "-1GiB", "1e9", "16 GiBs", "1.2.3MB", "1 Kx"),
        *("\u0661\u0666GiB", "\uff11MiB", "1\u212aB", "1\u00a0MiB"),
    ],
)
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="is not a size"):
        parse_size(text)


@pytest.mark.parametrize(
    ("n_bytes", "text"), [(0, "0B"), (1536, "1536B"), (3072, "3KiB"), (64 * GiB, "64GiB")]
)
def test_format_size(n_bytes: int, text: str) -> None:
    assert format_size(n_bytes) == text
    assert parse_size(text) == n_bytes


# --- docs ------------------------------------------------------------------------


def test_docs_table_is_in_sync() -> None:
    text = (REPO / "docs" / "configuration.md").read_text(encoding="utf-8")
    begin, end = "<!-- BEGIN CONFIG TABLE -->\n", "<!-- END CONFIG TABLE -->"
    assert text.count(begin) == 1 and text.count(end) == 1
    table = text.split(begin)[1].split(end)[0]
    assert table == config_table_markdown(), "run: python -m sidecar.config --markdown"


def test_table_has_a_row_per_key() -> None:
    rows = config_table_markdown().splitlines()[2:]
    assert len(rows) == len(SPECS)
    for row, key in zip(rows, SPECS, strict=True):
        assert row.startswith(f"| `{key}` |")
        assert f"`{env_var(key)}`" in row


def test_main_prints_table() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "sidecar.config", "--markdown"],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
    )
    assert result.stdout == config_table_markdown()


def test_remote_write_streams_may_not_exceed_the_remote_threads() -> None:
    assert load_config(overrides={"remote_io_threads": 3, "remote_write_streams": 3})
    with pytest.raises(ConfigError, match=r"remote_write_streams \(5\) must not exceed"):
        load_config(overrides={"remote_io_threads": 4, "remote_write_streams": 5})


# --- endpoints: a port engines can find, and only sockets the host's permissions guard ---

ENDPOINT_KEYS = ["endpoint", "events_endpoint", "events_resync_endpoint"]


def endpoint_overrides(key: str, value: str) -> dict[str, object]:
    """`key` set to `value`; a resync endpoint comes with an events endpoint."""
    overrides: dict[str, object] = {key: value}
    if key == "events_resync_endpoint":
        overrides["events_endpoint"] = "ipc:///tmp/kvs-events.pub"
    return overrides


@pytest.mark.parametrize("key", ENDPOINT_KEYS)
@pytest.mark.parametrize(
    "value",
    [
        "tcp://127.0.0.1:99999",  # ZeroMQ would listen on 99999 % 65536
        "tcp://localhost:0",  # ... and on a random port here
        "tcp://127.0.0.1:*",
        "tcp://127.0.0.1:65536",
        "tcp://127.0.0.1:-1",
        "tcp://127.0.0.1:",
        "tcp://127.0.0.1",
        "tcp://:5555",
    ],
)
def test_a_tcp_endpoint_needs_a_port_from_1_to_65535(key: str, value: str) -> None:
    with pytest.raises(ConfigError, match=rf"{key}: '{re.escape(value)}' is not tcp://HOST:PORT"):
        load_config(env={}, overrides=endpoint_overrides(key, value))


@pytest.mark.parametrize("key", ENDPOINT_KEYS)
@pytest.mark.parametrize("port", [1, 5555, 65535])
def test_a_tcp_endpoint_with_a_port_in_range_loads(key: str, port: int) -> None:
    value = f"tcp://127.0.0.1:{port}"
    assert getattr(load_config(env={}, overrides=endpoint_overrides(key, value)), key) == value


@pytest.mark.parametrize("key", ENDPOINT_KEYS)
def test_an_abstract_ipc_endpoint_is_refused_unless_remote_endpoints_are_allowed(
    key: str,
) -> None:
    """An abstract socket has no file: any local user may connect, and `group`
    cannot narrow that. Like an endpoint off loopback, it needs the opt-in."""
    overrides = endpoint_overrides(key, "ipc://@kvsidecar-test")
    with pytest.raises(ConfigError, match=rf"{key} 'ipc://@kvsidecar-test' is an abstract"):
        load_config(env={}, overrides=overrides)
    with pytest.raises(ConfigError, match="allow_remote_endpoints"):
        load_config(env={env_var(key): "ipc://@kvsidecar-test"}, overrides=overrides)
    allowed = load_config(env={}, overrides={**overrides, "allow_remote_endpoints": True})
    assert getattr(allowed, key) == "ipc://@kvsidecar-test"
    path = "ipc:///tmp/kvs-test.sock"  # a socket file: the runtime directory guards it
    assert getattr(load_config(env={}, overrides=endpoint_overrides(key, path)), key) == path


@pytest.mark.parametrize(
    ("entry", "error"),
    [
        ("tenant=a cpu=99999999TiB", "cpu quota over 1 EiB"),  # past int64: stats failed
        ("tenant=a", "no limit"),
        ("tenant=a ttl=0", "ttl must be a positive"),
        ("tenant=a ttl=1e16", "at most 1e9"),  # Redis refused every write's expiry
        ("tenant=a cpu=1GiB cpu=2GiB", "cpu given twice"),
        ("colour=red cpu=1GiB", "unknown name 'colour'"),
    ],
)
def test_bad_namespace_limits_are_refused_naming_the_entry(entry, error):
    with pytest.raises(ConfigError, match=f"namespace_limits: .*{error}"):
        load_config(env={}, overrides={"namespace_limits": [entry]})
    assert load_config(env={}, overrides={"namespace_limits": ["tenant=a cpu=1048576TiB"]})


@pytest.mark.parametrize("suffix", ["yml", "json"])
def test_an_integer_past_a_floats_range_in_a_file_is_a_config_error(
    tmp_path: Path, suffix: str
) -> None:
    """A float key given a 400-digit integer in a file: an error naming the
    key, not an OverflowError traceback."""
    text = f"evict_ratio: 1{'0' * 400}\n" if suffix == "yml" else f'{{"evict_ratio": 1{"0" * 400}}}'
    with pytest.raises(ConfigError, match="evict_ratio"):
        load_config(write(tmp_path, f"big.{suffix}", text), env={})
