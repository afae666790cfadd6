"""A hostile peer: a real aiohttp server on loopback, run as its own process, that answers the
daemon API with the bad replies an adversarial review used (issue 10), or serves a large signed
chain (issue 9) from files.

    python -m tests.integration.hostile --host 127.0.0.60 --port 8000 --mode liar \
        --token T --log requests.log

Modes (every mode but `victim` proves it holds `--token` at /healthz?challenge=, as a token
holder can):
- liar: head version 10**12; its index lists nothing it can back.
- silent: accepts connections and never answers (but /healthz).
- deep: head reply of 10 KB of '['.   huge: head version 10**400.
- big: head reply of 256 MiB, streamed.   hostbt: head with bt "evil.example:6881".
- victim: a third party: never proves; answers every path with VICTIM_TEXT.
- upstream: POST /ingest answers 429 with Retry-After "nan" then "-1" alternately.
- chain: serves --chain-dir's head.json, index.json, manifests/*.json and torrents/*.torrent.
- gateway: a node of `--region` named `--node` whose BitTorrent endpoint (`--bt-port`, same
  host) accepts connections and never sends a byte; its head is empty (held open like a real
  long-poll) and its index says which region it is in (issue 20, finding 4).
Every request is logged as `<method> <path> auth=<0|1>` to --log.
"""

import argparse
import asyncio
import hashlib
import hmac
from pathlib import Path

from aiohttp import web

VICTIM_TEXT = "VICTIM-INTERNAL-ADMIN-KEYS-0123"
HUGE = 256 << 20


def hello_proof(token: str, nonce: str, url: str) -> str:
    """The proof a token holder gives (written out here, independently of
    daemon/peering/peer_client.py,
    so the test checks the protocol rather than one function against itself)."""
    msg = b"deltaswarm-hello\0" + nonce.encode() + b"\0" + url.rstrip("/").encode()
    return hmac.new(token.encode(), msg, hashlib.sha256).hexdigest()


def build(mode: str, token: str, url: str, log: Path, chain_dir: Path | None,
          node: dict | None = None) -> web.Application:
    count = {"n": 0}
    node = node or {}

    @web.middleware
    async def record(request: web.Request, handler):
        with log.open("a") as f:
            f.write(f"{request.method} {request.path} "
                    f"auth={int('Authorization' in request.headers)}\n")
        return await handler(request)

    async def healthz(request: web.Request) -> web.StreamResponse:
        challenge = request.query.get("challenge")
        if mode == "victim":
            return web.Response(text=VICTIM_TEXT, status=403)
        doc = {"ok": True, "node": mode, "role": "region"}
        if challenge:
            doc |= {"url": url, "proof": hello_proof(token, challenge, url)}
        return web.json_response(doc)

    async def head(request: web.Request) -> web.StreamResponse:
        if mode == "victim":
            return web.Response(text=VICTIM_TEXT, status=500)
        if mode == "silent":
            await asyncio.sleep(3600)
        if mode == "deep":
            return web.Response(body=b"[" * 10240, content_type="application/json")
        if mode == "huge":
            return web.Response(text='{"version": 1' + "0" * 400 + "}",
                                content_type="application/json")
        if mode == "big":
            resp = web.StreamResponse(headers={"Content-Type": "application/json"})
            await resp.prepare(request)
            await resp.write(b'{"version": 5, "pad": "')
            chunk = b"x" * (1 << 20)
            for _ in range(HUGE >> 20):
                await resp.write(chunk)
            await resp.write(b'"}')
            return resp
        if mode == "hostbt":
            return web.json_response({"version": 0, "bt": "evil.example:6881", "node": "hostbt",
                                      "url": url})
        if mode == "chain" and chain_dir is not None:
            return web.Response(body=(chain_dir / "head.json").read_bytes(),
                                content_type="application/json")
        if mode == "gateway":
            await asyncio.sleep(min(float(request.query.get("timeout") or 5), 5.0))
            return web.json_response({"version": None, "artifacts": [], "bt": node["bt"],
                                      "node": node["name"], "url": url})
        await asyncio.sleep(0.5)
        return web.json_response({"version": 10**12, "node": mode, "url": url,
                                  "artifacts": []})

    async def index(request: web.Request) -> web.StreamResponse:
        if mode == "silent":
            await asyncio.sleep(3600)
        if mode == "victim":
            return web.Response(text=VICTIM_TEXT, status=500)
        if mode == "chain" and chain_dir is not None:
            return web.Response(body=(chain_dir / "index.json").read_bytes(),
                                content_type="application/json")
        if mode == "gateway":
            return web.json_response({"artifacts": [], "head": None, "held": [], "seeding": [],
                                      "bt": node["bt"], "node": node["name"], "url": url,
                                      "region": node["region"], "role": "region", "peers": []})
        return web.json_response({"artifacts": [], "head": 10**12, "peers": []})

    async def files(request: web.Request) -> web.StreamResponse:
        if mode == "silent":
            await asyncio.sleep(3600)
        name = request.match_info["name"]
        sub = "manifests" if request.path.startswith("/v1/chain/manifests") else "torrents"
        ext = ".json" if sub == "manifests" else ".torrent"
        path = (chain_dir / sub / f"{name}{ext}") if chain_dir is not None else None
        if mode != "chain" or path is None or not path.is_file() or "/" in name:
            return web.Response(text=VICTIM_TEXT if mode == "victim" else "no", status=404)
        return web.Response(body=path.read_bytes())

    async def ingest(request: web.Request) -> web.StreamResponse:
        await request.read()
        count["n"] += 1
        value = "nan" if count["n"] % 2 else "-1"
        return web.Response(status=429, text="full", headers={"Retry-After": value})

    async def anything(request: web.Request) -> web.StreamResponse:
        if mode == "silent":
            await asyncio.sleep(3600)
        return web.Response(text=VICTIM_TEXT, status=200 if mode == "victim" else 404)

    app = web.Application(middlewares=[record])
    app.add_routes([
        web.get("/healthz", healthz),
        web.get("/v1/chain/head", head),
        web.get("/v1/chain/index", index),
        web.get("/v1/chain/manifests/{name}", files),
        web.get("/v1/chain/torrents/{name}", files),
        web.post("/ingest", ingest),
        web.route("*", "/{tail:.*}", anything),
    ])
    return app


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--host", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--mode", required=True)
    ap.add_argument("--token", required=True)
    ap.add_argument("--log", type=Path, required=True)
    ap.add_argument("--chain-dir", type=Path)
    ap.add_argument("--node", default="hostile")
    ap.add_argument("--region", default="hostile")
    ap.add_argument("--bt-port", type=int)
    a = ap.parse_args()
    url = f"http://{a.host}:{a.port}"
    node = {"name": a.node, "region": a.region, "bt": f"{a.host}:{a.bt_port}"}
    app = build(a.mode, a.token, url, a.log, a.chain_dir, node)
    if a.bt_port:
        async def silent_bt(app: web.Application):
            async def swallow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
                while await reader.read(65536):
                    pass  # reads what it is sent, never answers
                writer.close()
            server = await asyncio.start_server(swallow, a.host, a.bt_port)
            yield
            server.close()
        app.cleanup_ctx.append(silent_bt)
    web.run_app(app, host=a.host, port=a.port, print=None, access_log=None,
                shutdown_timeout=0.5)


if __name__ == "__main__":
    main()
