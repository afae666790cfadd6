"""One node of bench/swarm.py, run inside its network namespace by the orchestrator.

Talks JSON lines: prints {"ready": ...} once listening, waits for "go" on stdin, fetches (or
serves), prints {"done": unix time, "verified": bool} when it holds every block, keeps serving until
"stop", then prints {"final": {...}} and exits. Roles: swarm-seed, swarm-peer
(daemon.bittorrent.swarm),
http-seed (aiohttp static server), http-peer (aiohttp client). Not meant to be run by hand.
"""

import argparse
import asyncio
import json
import queue
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from chain.digest import block_id
from daemon.bittorrent import torrents


def say(**msg: object) -> None:
    print(json.dumps(msg), flush=True)


def stdin_lines() -> "queue.Queue[str]":
    q: queue.Queue[str] = queue.Queue()

    def read() -> None:
        for line in sys.stdin:
            q.put(line.strip())
        q.put("stop")

    threading.Thread(target=read, daemon=True).start()
    return q


def verify(save_path: Path, artifact: str, blocks: list[str]) -> bool:
    return all(block_id(torrents.block_path(save_path, artifact, b).read_bytes()) == b
               for b in blocks)


def run_swarm(args: argparse.Namespace, commands: "queue.Queue[str]") -> None:
    from daemon.bittorrent.swarm import Swarm, SwarmConfig

    tb = Path(args.torrent).read_bytes()
    artifact, blocks = torrents.torrent_blocks(tb)
    swarm = Swarm(SwarmConfig(listen=args.listen, seed_mode=args.role == "swarm-seed"))
    try:
        if args.role == "swarm-seed":
            swarm.seed(artifact, tb, args.dir)
        say(ready=True, endpoint=f"{swarm.endpoint[0]}:{swarm.endpoint[1]}")
        if args.role == "swarm-peer":
            while commands.get() != "go":
                pass
            peers = [(h, int(p)) for h, p in (x.rsplit(":", 1) for x in args.peers.split(",") if x)]
            swarm.download(artifact, tb, args.dir, peers)
            while not swarm.progress(artifact).finished:
                swarm.pump(0.1)
            say(done=time.time(), verified=verify(Path(args.dir), artifact, list(blocks)))
        last_up, last_change = 0, time.time()
        while True:
            swarm.pump(0.2)
            up = swarm.progress(artifact).uploaded
            if up != last_up:
                last_up, last_change = up, time.time()
            try:
                if commands.get_nowait() == "stop":
                    break
            except queue.Empty:
                pass
        st = swarm.status()
        say(final={"uploaded": st["uploaded"], "downloaded": st["downloaded"],
                   "hash_failures": st["hash_failures"], "bans": st["bans"],
                   "last_upload": last_change})
    finally:
        swarm.close()


async def run_http(args: argparse.Namespace, commands: "queue.Queue[str]") -> None:
    import aiohttp
    from aiohttp import web

    tb = Path(args.torrent).read_bytes()
    artifact, blocks = torrents.torrent_blocks(tb)
    loop = asyncio.get_running_loop()
    if args.role == "http-seed":
        app = web.Application()
        app.router.add_static("/", Path(args.dir) / artifact)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        host, port = args.listen.rsplit(":", 1)
        await web.TCPSite(runner, host, int(port)).start()
        say(ready=True, endpoint=args.listen)
        while await loop.run_in_executor(None, commands.get) != "stop":
            pass
        await runner.cleanup()
    else:
        say(ready=True, endpoint=None)
        while await loop.run_in_executor(None, commands.get) != "go":
            pass
        async with aiohttp.ClientSession() as http:
            for block in sorted(blocks):
                dst = torrents.block_path(args.dir, artifact, block)
                dst.parent.mkdir(parents=True, exist_ok=True)
                async with http.get(f"http://{args.peers}/{block[:2]}/{block}") as resp:
                    resp.raise_for_status()
                    with open(dst, "wb") as f:
                        async for chunk in resp.content.iter_chunked(1 << 20):
                            f.write(chunk)
        say(done=time.time(), verified=verify(Path(args.dir), artifact, list(blocks)))
        while await loop.run_in_executor(None, commands.get) != "stop":
            pass
    say(final={})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--role", required=True,
                   choices=["swarm-seed", "swarm-peer", "http-seed", "http-peer"])
    p.add_argument("--listen", default="0.0.0.0:6881")
    p.add_argument("--dir", required=True)
    p.add_argument("--torrent", required=True)
    p.add_argument("--peers", default="", help="host:port,... (swarm) or host:port (http)")
    args = p.parse_args()
    commands = stdin_lines()
    if args.role.startswith("swarm"):
        run_swarm(args, commands)
    else:
        asyncio.run(run_http(args, commands))


if __name__ == "__main__":
    main()
