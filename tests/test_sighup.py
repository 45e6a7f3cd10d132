"""SIGHUP (a closed terminal, or `systemctl kill -s HUP`) stops a sidecar the
way SIGTERM does: drained, its shm segments, socket and lock removed, exit 0.
Nothing is reloaded."""

from __future__ import annotations

import os
import signal

from sidecar_proc import Sidecar, connect, make_kv, tokens


def test_sighup_is_a_clean_stop() -> None:
    sidecar = Sidecar()
    try:
        sidecar.start()
        client = connect(sidecar.endpoint, make_kv(1))
        try:
            assert client.save(tokens(3), [0, 1, 2]).wait() == 3 * 16
        finally:
            client.close()
        assert sidecar.shm_segments()
        assert sidecar.proc is not None
        sidecar.proc.send_signal(signal.SIGHUP)
        _, err = sidecar.proc.communicate(timeout=30)
        assert sidecar.proc.returncode == 0, err
        assert "kvsidecar: stopped" in err  # the log, on stderr
        assert sidecar.shm_segments() == []
        assert os.listdir(sidecar.runtime_dir) == []  # no socket, no lock file
    finally:
        sidecar.cleanup()
