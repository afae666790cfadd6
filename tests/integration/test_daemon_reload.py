"""SIGHUP on a real daemon: reloadable parts take the new values (token, peers: bootstrap list and
max_peers, long-poll bound),
the rest is listed as "restart to apply", and systemd hears RELOADING=1 then READY=1 (and
EXTEND_TIMEOUT_USEC before the start-up weights check)."""

import json
import signal
import socket
from pathlib import Path

from tests.integration.harness import Cluster, http, wait_until


def test_sighup_applies_reloadable_parts_lists_the_rest_and_notifies_systemd(tmp_path: Path
                                                                             ) -> None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(tmp_path / "notify.sock"))
    sock.settimeout(0.2)
    try:
        with Cluster(tmp_path) as c:
            t = c.trainer()
            r = c.region("r1", max_peers=4)
            other = c.region("r2")
            t.start()
            r.start(env_extra={"NOTIFY_SOCKET": str(tmp_path / "notify.sock")})
            c.start_all()
            messages: list[str] = []

            def drain() -> list[str]:
                while True:
                    try:
                        messages.append(sock.recv(4096).decode())
                    except TimeoutError:
                        return messages

            wait_until(lambda: any("READY=1" in m for m in drain()), 20, "READY=1 at start")
            # The start-up weights check asks systemd for time first (the unit promises it).
            extend = [i for i, m in enumerate(messages) if "EXTEND_TIMEOUT_USEC=" in m]
            assert extend and extend[0] < next(i for i, m in enumerate(messages)
                                               if "READY=1" in m), messages
            messages.clear()
            book = lambda: r.status()["detail"]["peer_book"]  # noqa: E731
            assert [p["url"] for p in book() if p["bootstrap"]] == [t.url]
            r.config |= {"token": "a-new-swarm-token", "region": "elsewhere",
                         "long_poll_timeout_s": 1, "bootstrap": [other.url], "max_peers": 1}
            r.write_config()
            r.proc.send_signal(signal.SIGHUP)
            wait_until(lambda: "restart to apply ['region']" in r.log(), 20,
                       "the reload to be logged")
            drain()
            reloading = [i for i, m in enumerate(messages) if "RELOADING=1" in m]
            ready = [i for i, m in enumerate(messages) if "READY=1" in m]
            assert reloading and ready and reloading[0] < ready[-1], messages
            assert http(f"{r.url}/v1/status", token="a-new-swarm-token")[0] == 200
            assert http(f"{r.url}/v1/status")[0] == 401
            # peers: the new bootstrap list replaced the old one, and max_peers=1 trimmed the
            # rest but the anchors (the trainer; each region's first-ranked members)
            code, raw, _ = http(f"{r.url}/v1/status", token="a-new-swarm-token")
            doc = json.loads(raw)
            after = doc["detail"]["peer_book"]
            assert [p["url"] for p in after if p["bootstrap"]] == [other.url], after
            assert len(after) <= 1 + doc["region_peering"]["anchors"], after
            assert all(p["role"] == "trainer" or p["region"] for p in after if not p["bootstrap"])
            code, _, _ = http(f"{r.url}/v1/chain/head?after=1000&timeout=30",
                              token="a-new-swarm-token", timeout=3)
            assert code == 200, "the long-poll bound is the reloaded 1 s, not 5 s"
            assert r.proc.poll() is None
    finally:
        sock.close()
