"""`chain` stays pure: importing all of it pulls in no network, event loop, swarm or engine
library, and none of the other deltaswarm packages."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
FORBIDDEN = ["asyncio", "aiohttp", "libtorrent", "vllm", "uvloop", "daemon", "trainer",
             "rollout"]


def test_chain_imports_no_network_event_loop_or_sibling_package():
    modules = sorted(p.stem for p in (REPO / "chain").glob("*.py") if p.stem != "__init__")
    code = (
        "import sys, importlib\n"
        f"for m in {modules!r}: importlib.import_module('chain.' + m)\n"
        "import chain.codec\n"
        "from chain.codec import encode_tensor_delta\n"
        f"print(sorted(m for m in {FORBIDDEN!r} if m in sys.modules))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]", f"chain pulled in: {r.stdout.strip()}"
