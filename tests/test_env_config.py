"""The environment as a deployment fills it: variables of the KVSIDECAR_ prefix
that name no key (Kubernetes' `<SERVICE>_SERVICE_HOST` and `_PORT` for a
Service named kvsidecar) are warned about and ignored, while a known key with
a bad value is still an error; KVSIDECAR_CONFIG names the config file.
"""

from __future__ import annotations

import logging
import uuid
from pathlib import Path

import pytest
from sidecar_proc import Sidecar

from contract.endpoint import default_endpoint
from sidecar.config import ConfigError, load_config

# What Kubernetes injects for a Service named `kvsidecar` with port 5555.
K8S_SERVICE_VARS = {
    "KVSIDECAR_SERVICE_HOST": "10.96.0.12",
    "KVSIDECAR_SERVICE_PORT": "5555",
    "KVSIDECAR_PORT": "tcp://10.96.0.12:5555",
    "KVSIDECAR_PORT_5555_TCP": "tcp://10.96.0.12:5555",
    "KVSIDECAR_PORT_5555_TCP_PROTO": "tcp",
    "KVSIDECAR_PORT_5555_TCP_PORT": "5555",
    "KVSIDECAR_PORT_5555_TCP_ADDR": "10.96.0.12",
}


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_kubernetes_service_variables_are_warnings(caplog: pytest.LogCaptureFixture) -> None:
    env = {**K8S_SERVICE_VARS, "KVSIDECAR_HIT_WINDOW": "77"}
    with caplog.at_level(logging.WARNING):
        config = load_config(env=env)
    assert config.hit_window == 77
    messages = warnings_of(caplog)
    for name in K8S_SERVICE_VARS:
        assert sum(f"${name} " in m for m in messages) == 1, (name, messages)


def test_unknown_variable_names_the_closest_key_and_is_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A fresh name per run: the warning is once per process and variable.
    name = f"KVSIDECAR_EVICT_RATO_{uuid.uuid4().hex[:6].upper()}"
    with caplog.at_level(logging.WARNING):
        load_config(env={name: "0.1"})
        load_config(env={name: "0.1"})
    messages = [m for m in warnings_of(caplog) if name in m]
    assert len(messages) == 1, messages
    assert "ignored" in messages[0]
    assert "did you mean $KVSIDECAR_EVICT_RATIO, key 'evict_ratio'?" in messages[0]


def test_unknown_variable_without_a_close_key(caplog: pytest.LogCaptureFixture) -> None:
    name = f"KVSIDECAR_ZZZ{uuid.uuid4().hex[:6].upper()}"
    with caplog.at_level(logging.WARNING):
        load_config(env={name: "1"})
    (message,) = [m for m in warnings_of(caplog) if name in m]
    assert "did you mean" not in message


def test_known_key_with_a_bad_value_is_still_an_error() -> None:
    with pytest.raises(ConfigError, match=r"\$KVSIDECAR_HIT_WINDOW: hit_window: 'x'"):
        load_config(env={**K8S_SERVICE_VARS, "KVSIDECAR_HIT_WINDOW": "x"})


def test_kvsidecar_config_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "sidecar.yml"
    path.write_text("hit_window: 33\nevict_ratio: 0.5\n")
    env = {"KVSIDECAR_CONFIG": str(path), "KVSIDECAR_EVICT_RATIO": "0.25"}
    config = load_config(env=env)
    assert config.hit_window == 33  # from the file
    assert config.evict_ratio == 0.25  # the environment beats the file, as for --config


def test_a_config_path_given_wins_over_kvsidecar_config(tmp_path: Path) -> None:
    given, named = tmp_path / "given.yml", tmp_path / "named.yml"
    given.write_text("hit_window: 1\n")
    named.write_text("hit_window: 2\n")
    assert load_config(given, env={"KVSIDECAR_CONFIG": str(named)}).hit_window == 1


def test_kvsidecar_config_errors_name_the_variable(tmp_path: Path) -> None:
    missing = tmp_path / "missing.yml"
    with pytest.raises(ConfigError, match=r"\$KVSIDECAR_CONFIG: config file .*missing\.yml"):
        load_config(env={"KVSIDECAR_CONFIG": str(missing)})


def test_empty_kvsidecar_config_means_no_file(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        assert load_config(env={"KVSIDECAR_CONFIG": ""}).hit_window == 1000
    assert not [m for m in warnings_of(caplog) if "KVSIDECAR_CONFIG" in m]


def test_engine_side_ignores_the_service_variables(tmp_path: Path) -> None:
    # The engine reads only KVSIDECAR_ENDPOINT, _INSTANCE and _RUNTIME_DIR.
    env = {**K8S_SERVICE_VARS, "KVSIDECAR_RUNTIME_DIR": str(tmp_path)}
    assert default_endpoint(env) == f"ipc://{tmp_path}/default.sock"


def test_an_engine_refuses_a_default_runtime_dir_someone_else_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With no runtime directory named, the default falls back to
    /tmp/kvsidecar-<uid>, which any user may create first and serve a
    sidecar of their own in: the engine sent it its KV."""
    import os

    from contract import endpoint

    planted = tmp_path / "kvsidecar-planted"
    monkeypatch.setattr(endpoint, "default_runtime_dir", lambda: planted)
    assert default_endpoint({}) == f"ipc://{planted}/default.sock"  # not made yet: fine
    planted.mkdir(mode=0o700)
    assert default_endpoint({}) == f"ipc://{planted}/default.sock"  # ours
    planted.chmod(0o777)
    with pytest.raises(ValueError, match="may be written by others"):
        default_endpoint({})
    planted.chmod(0o700)
    if os.getuid() == 0:
        os.chown(planted, 65534, 65534)
        with pytest.raises(ValueError, match="belongs to uid 65534"):
            default_endpoint({})
    named = {"KVSIDECAR_RUNTIME_DIR": str(planted)}  # named: the operator's choice
    assert default_endpoint(named) == f"ipc://{planted}/default.sock"


def test_serve_starts_beside_a_kubernetes_service(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in K8S_SERVICE_VARS.items():
        monkeypatch.setenv(name, value)
    config = tmp_path / "sidecar.yml"
    config.write_text("eviction_policy: lfu\n")
    monkeypatch.setenv("KVSIDECAR_CONFIG", str(config))
    sidecar = Sidecar()
    try:
        sidecar.start()
        assert "policy lfu" in sidecar.banner  # the file KVSIDECAR_CONFIG names
        assert sidecar.proc is not None
        sidecar.terminate()
        _, err = sidecar.proc.communicate(timeout=30)
        assert sidecar.proc.returncode == 0, err
        logged = "".join(sidecar.early) + err  # all it writes goes to stderr
        assert "$KVSIDECAR_SERVICE_HOST " in logged and "ignored" in logged
        assert "KVSIDECAR_CONFIG" not in logged
    finally:
        sidecar.cleanup()
