"""first_good: a silent peer costs only its slot and the grace; failures are booked; a good
answer lets peers still serving finish (settle) or cancels them (settle=False)."""

import asyncio
import time

from daemon.peering.asking import first_good
from daemon.peering.peer_client import PeerUnreachable
from daemon.peering.peers import PeerBook


def book_of(n: int) -> PeerBook:
    b = PeerBook("http://127.0.0.1:8700", ("127.0.0.1", 6881), "me", [], 16)
    for i in range(n):
        b.learn(f"http://10.0.0.{i + 1}:7000").proven = True
    return b


async def test_silent_peers_cost_only_the_grace_and_failures_are_booked() -> None:
    book = book_of(4)
    peers = list(book.peers.values())
    finished: list[str] = []

    async def ask(p):
        if p is peers[0] or p is peers[1]:
            await asyncio.sleep(3600)  # silent
        if p is peers[2]:
            raise PeerUnreachable(p.url, "refused")
        await asyncio.sleep(0.05)
        finished.append(p.url)
        return False

    t0 = time.monotonic()
    got = await first_good(peers, ask, book, fanout=3, grace=0.3)
    took = time.monotonic() - t0
    assert got is None and took < 2.0 and len(finished) == 1
    failed = [p for p in book.peers.values() if p.failures]
    assert len(failed) == 1 and "PeerUnreachable" in failed[0].last_error


async def test_a_good_answer_lets_running_peers_settle_unless_told_not_to() -> None:
    async def main(settle: bool) -> tuple[object, list[str]]:
        book = book_of(2)
        peers = list(book.peers.values())
        finished: list[str] = []

        async def ask(p):
            # the slow one far behind: a stalled loop must not let both finish at once
            await asyncio.sleep(0.01 if p is peers[0] else 0.6)
            finished.append(p.url)
            return p.url

        return await first_good(peers, ask, book, grace=2.0, settle=settle), finished

    got, finished = await main(True)
    assert got.endswith("10.0.0.1:7000") and len(finished) == 2
    got, finished = await main(False)
    assert got.endswith("10.0.0.1:7000") and len(finished) == 1
