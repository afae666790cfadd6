"""Promises of THREAT_MODEL.md held by real daemon processes: the open /metrics names no peer
address or peer node, and raw bytes in `Authorization` are a 401."""

import socket
from pathlib import Path
from urllib.parse import urlsplit

from tests.integration.harness import TOKEN, Cluster, http, wait_until


def test_open_metrics_name_no_peer_address_or_peer_node(tmp_path: Path) -> None:
    with Cluster(tmp_path) as c:
        trainer = c.trainer()
        region = c.region("far-region-7")
        c.start_all()
        region_host = urlsplit(region.url).hostname

        def knows_region() -> bool:
            return any(p.get("node") == "far-region-7" for p in trainer.status()["peers"])

        wait_until(knows_region, 30, "the trainer to learn the region from its requests")
        code, body, _ = http(f"{trainer.url}/metrics", token=None)
        text = body.decode()
        assert code == 200 and "deltaswarm_peers " in text
        assert region_host not in text and "far-region-7" not in text


def test_raw_bytes_in_authorization_are_a_401(tmp_path: Path) -> None:
    with Cluster(tmp_path) as c:
        trainer = c.trainer()
        c.start_all()
        parts = urlsplit(trainer.url)
        for raw in (b"Bearer \xff\xfe\x80", b"Bearer " + TOKEN.encode() + b"\xc3"):
            with socket.create_connection((parts.hostname, parts.port), timeout=10) as s:
                s.sendall(b"GET /v1/status HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                          b"Authorization: " + raw + b"\r\n\r\n")
                status_line = s.makefile("rb").readline()
            assert status_line.split()[1] == b"401", (raw, status_line)
        assert trainer.proc is not None and trainer.proc.poll() is None
