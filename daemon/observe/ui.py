"""The live fleet page (`GET /ui`): one static HTML file shipped in the package
(daemon/observe/ui.html,
its script and style inline; no build step, no CDN, works air-gapped) that polls `/v1/fleet` and
`/v1/status` and long-polls `/v1/chain/head`, so a new version shows as it lands.

The page is open (it holds nothing secret); the API it calls is not. It asks for the swarm
token, keeps it in the tab's sessionStorage and sends it as `Authorization: Bearer`, never in a
URL. What it renders comes from other nodes' reports, so it writes text only (never HTML), and
the response's Content-Security-Policy allows exactly its own inline script and style (by hash)
and requests to the same origin: an injected script or a form posting elsewhere does not run.
"""

import base64
import hashlib
import re
from importlib.resources import files

from aiohttp import web

PATH = "/ui"
PAGE: bytes = files("daemon.observe").joinpath("ui.html").read_bytes()


def _hashes(tag: str) -> str:
    """CSP source expressions for every inline `<tag>` block of the page."""
    blocks = re.findall(rf"<{tag}>(.*?)</{tag}>".encode(), PAGE, re.S)
    if not blocks:
        raise RuntimeError(f"daemon/observe/ui.html has no inline <{tag}>")
    return " ".join("'sha256-" + base64.b64encode(hashlib.sha256(b).digest()).decode() + "'"
                    for b in blocks)


CSP = ("default-src 'none'; "
       f"script-src {_hashes('script')}; style-src {_hashes('style')}; "
       "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; "
       "frame-ancestors 'none'")
HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff",
           "X-Frame-Options": "DENY", "Referrer-Policy": "no-referrer",
           "Cache-Control": "no-store"}


async def fleet_page(request: web.Request) -> web.Response:
    return web.Response(body=PAGE, content_type="text/html", charset="utf-8", headers=HEADERS)
