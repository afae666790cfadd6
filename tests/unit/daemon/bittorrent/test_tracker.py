"""The swarm's loopback tracker: what it answers (bencoded, compact peers), to whom, and that a
real download announces to it and gets its peers from it."""

from __future__ import annotations

import os
import urllib.parse
import urllib.request
from pathlib import Path

import libtorrent as lt

from chain.blocks import block_id
from daemon.bittorrent import torrents
from daemon.bittorrent.swarm import Swarm, SwarmConfig
from daemon.bittorrent.tracker import LocalTracker, announce_hashes, compact


def test_it_answers_known_torrents_with_their_peers_and_refuses_others() -> None:
    tracker = LocalTracker("127.0.0.1")
    try:
        h = bytes(range(20))
        tracker.offer([h], [("127.0.0.5", 6881), ("::1", 7000), ("not-an-ip", 1)])
        tracker.offer([h], [("127.0.0.6", 6882)])
        url = tracker.url + "?" + urllib.parse.urlencode({"info_hash": h, "port": 1})
        with urllib.request.urlopen(url, timeout=10) as r:
            reply = lt.bdecode(r.read())
        assert reply[b"peers"] == bytes([127, 0, 0, 5, 0x1a, 0xe1, 127, 0, 0, 6, 0x1a, 0xe2])
        assert reply[b"peers6"] == compact([("::1", 7000)])[1] and len(reply[b"peers6"]) == 18
        assert reply[b"interval"] >= 600
        other = tracker.url + "?" + urllib.parse.urlencode({"info_hash": b"\xff" * 20})
        with urllib.request.urlopen(other, timeout=10) as r:
            assert b"failure reason" in lt.bdecode(r.read())
        tracker.forget([h])
        assert b"failure reason" in lt.bdecode(tracker.answer(h))
        assert lt.bdecode(tracker.answer(h, "stopped"))[b"peers"] == b""
        assert tracker.announces == 1
    finally:
        tracker.close()


def test_a_download_announces_to_its_own_tracker_and_dials_what_it_answers(tmp_path: Path) -> None:
    data = os.urandom(12000)
    store = tmp_path / "store" / block_id(data)
    store.parent.mkdir(parents=True)
    store.write_bytes(data)
    art = "v00000001.delta"
    tb = torrents.make_torrent(art, [(block_id(data), store)], 1 << 16)
    torrents.link_blocks(art, [(block_id(data), store)], tmp_path / "seed")
    with Swarm(SwarmConfig(listen="127.0.0.61:0")) as seed, \
            Swarm(SwarmConfig(listen="127.0.0.62:0")) as peer:
        seed.seed(art, tb, tmp_path / "seed")
        assert seed._tracker.announces == 0  # a seed announces nothing
        peer.download(art, tb, tmp_path / "peer", [seed.endpoint])
        hashes = announce_hashes(lt.torrent_info(lt.bdecode(tb)))
        assert lt.bdecode(peer._tracker.answer(hashes[-1]))[b"peers"] == compact(
            [seed.endpoint])[0]
        for _ in range(1000):
            if peer.progress(art).finished:
                break
            seed.pump(0.01)
            peer.pump(0.01)
        assert peer.progress(art).finished
        assert peer._tracker.announces >= 1
        peer.remove(art)
        assert b"failure reason" in lt.bdecode(peer._tracker.answer(hashes[-1]))
    with Swarm(SwarmConfig(listen="127.0.0.63:0", dial_at_once=False)) as off:
        assert off._tracker is None


def test_a_caller_hanging_up_mid_reply_prints_no_traceback_and_a_bug_still_does(capsys) -> None:
    """libtorrent drops announces it no longer needs; the server used to print each one's
    BrokenPipeError traceback into the daemon's log."""
    tracker = LocalTracker("127.0.0.1")
    try:
        for exc in (BrokenPipeError(32, "Broken pipe"), ConnectionResetError(104, "reset")):
            try:
                raise exc
            except ConnectionError:
                tracker._server.handle_error(None, ("127.0.0.1", 1))
        assert capsys.readouterr().err == ""
        try:
            raise ValueError("a bug in the handler")
        except ValueError:
            tracker._server.handle_error(None, ("127.0.0.1", 1))
        assert "ValueError: a bug in the handler" in capsys.readouterr().err
    finally:
        tracker.close()
