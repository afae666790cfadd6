"""`deltaswarm delta …` and `deltaswarm chain …`: inspect and exercise the format by hand.

    deltaswarm delta encode OLD.safetensors NEW.safetensors -o FILE
    deltaswarm delta apply OLD.safetensors FILE -o OUT.safetensors
    deltaswarm delta stats FILE [--tensors]
    deltaswarm chain ls DIR [--json]
    deltaswarm chain show|verify DIR [ARTIFACT] [--key HEX] [--require-all]
"""

import argparse
import json
import sys
from pathlib import Path

from rich.table import Table

from chain import codec
from chain.errors import ChainError
from chain.keys import parse_public
from chain.sizes import Sizes, new_file_bytes
from chain.sources import FileSource
from chain.store import ChainStore
from chain.textout import console as make_console
from chain.textout import print_table

console = make_console()


def _bits_per_change(nbytes: int, changed: int) -> str:
    return f"{8 * nbytes / changed:.2f}" if changed else "-"


def delta_encode(a: argparse.Namespace) -> int:
    from chain.deltafile import write_delta_file

    stats = write_delta_file(Path(a.output), FileSource(Path(a.old)), FileSource(Path(a.new)))
    density = 100 * stats.changed_elements / max(1, stats.elements)
    bits = _bits_per_change(stats.encoded_bytes, stats.changed_elements)
    console.print(
        f"wrote {a.output}: {stats.encoded_bytes:,} bytes for {stats.changed_elements:,} changed "
        f"of {stats.elements:,} elements ({density:.3f} %), {bits} bits/change, "
        f"{stats.dense_bytes / max(1, stats.encoded_bytes):.1f}x smaller than dense, "
        f"{stats.seconds:.2f} s"
    )
    return 0


def delta_apply(a: argparse.Namespace) -> int:
    from chain.deltafile import read_delta_file
    from chain.digest import state_digest, tensor_digests
    from chain.fill import Fill
    from chain.safetensors_io import WritableFiles, allocate

    header, tensors, reader = read_delta_file(Path(a.delta))
    old = FileSource(Path(a.old))
    names = old.names()
    base_digests = dict(zip(names, tensor_digests([(*old.meta(n), old.bits(n)) for n in names]),
                            strict=True))
    if state_digest(base_digests) != header["parent_state_digest"]:
        raise ChainError(f"{a.old} is not the base this delta was made from (state digest "
                         "differs); use the OLD file given to `delta encode`")
    out = Path(a.output)
    tmp = out.with_name(f".{out.name}.tmp")
    allocate(tmp, [(t.name, t.dtype, t.shape, t.nbytes) for t in tensors])
    try:
        files = WritableFiles(tmp.parent, [tmp.name])
        Fill(files, tensors, str(a.delta), old.files, base_digests).run(reader)
        files.flush()
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)
    console.print(f"wrote {out}: every tensor verified, state digest {header['state_digest']}")
    return 0


def delta_stats(a: argparse.Namespace) -> int:
    from chain.deltafile import read_delta_file

    _header, tensors, reader = read_delta_file(Path(a.delta))
    changed = nbytes = covered = 0
    rows = []
    while (h := reader.next_header()) is not None:
        payload = reader.read(h.n)
        if h.op != "full":
            s = codec.payload_stats(payload)
            c, n = s["changed"], s["total"]
        else:
            c = n = len(payload) // max(1, _itemsize(h.dtype))
        changed += c
        nbytes += len(payload)
        covered += h.count if h.op == "group" else 1
        # a group's changes are not split by tensor without the base: one row, its first
        # tensor named with how many follow it
        name = f"{h.name} +{h.count - 1}" if h.op == "group" else h.name
        rows.append((name, h.op, h.dtype, n, c, len(payload)))
    total = sum(t.numel for t in tensors)
    console.print(f"{a.delta}: {len(tensors)} tensors, {covered} in {len(rows)} records; "
                  f"{changed:,}/{total:,} elements changed ({100 * changed / max(1, total):.3f} %),"
                  f" {nbytes:,} payload bytes, {_bits_per_change(nbytes, changed)} bits/change")
    if a.tensors:
        t = Table("tensor", "op", "dtype", "numel", "changed", "density %", "bytes", "bits/chg")
        for name, op, dtype, n, c, b in rows:
            t.add_row(name, op, dtype, f"{n:,}", f"{c:,}", f"{100 * c / max(1, n):.3f}",
                      f"{b:,}", _bits_per_change(b, c))
        console.print(t)
    return 0


def _itemsize(dtype: str) -> int:
    from chain.dtypes import lookup

    return lookup(dtype).itemsize


LS_COLUMNS = ("artifact", "kind", "parent", "tensor-bytes", "file-bytes", "new-file-bytes",
              "smaller", "changed%", "tensors", "blocks", "signed-by")
LS_RIGHT = frozenset(LS_COLUMNS[3:10])
LS_NOTE = ("tensor-bytes: the tensor payload. file-bytes: the files carried besides tensors "
           "(config, tokenizer and the like), listed by every version; new-file-bytes: those not "
           "in the version before (the rest are the same blocks, stored and fetched once per "
           "node). smaller: dense tensor bytes / tensor-bytes.")


def ls_rows(store: ChainStore) -> list[dict]:
    """One record per artifact: what `chain ls` shows, whole (and what --json prints)."""
    out = []
    for name in store.artifacts():
        m = store.manifest(name)
        size = Sizes.of(m)
        before = [p for p in (store.get(m.version - 1, "delta"),
                              store.get(m.version - 1, "snapshot")) if p is not None]
        out.append({
            "artifact": name, "kind": m.kind, "version": m.version,
            "parent": m.parent.version if m.parent else None,
            "tensor_bytes": size.tensor_bytes, "file_bytes": size.file_bytes,
            "new_file_bytes": new_file_bytes(m, before), "dense_bytes": size.dense_bytes,
            "smaller_on_tensors": round(size.smaller, 2) if size.smaller else None,
            "files": [f.name for f in m.files],
            "changed_elements": m.stats.get("changed_elements"),
            "elements": m.stats.get("elements"), "tensors": len(m.tensors),
            "blocks": len(m.blocks), "signed_by": m.signature.key if m.signature else None})
    return out


def _ls_cells(r: dict, short_key: bool) -> list[str]:
    dens = 100 * (r["changed_elements"] or 0) / max(1, r["elements"] or 1)
    key = r["signed_by"]
    return [r["artifact"], r["kind"], "-" if r["parent"] is None else f"v{r['parent']}",
            f"{r['tensor_bytes']:,}", f"{r['file_bytes']:,}", f"{r['new_file_bytes']:,}",
            f"{r['dense_bytes'] / r['tensor_bytes']:.1f}x" if r["tensor_bytes"] else "-",
            f"{dens:.3f}", str(r["tensors"]), str(r["blocks"]),
            "UNSIGNED" if key is None else key[:12] + "…" if short_key else key]


def chain_ls(store: ChainStore, as_json: bool) -> int:
    """`chain ls`: sizes as tensors and carried files apart (chain/sizes.py). Off a terminal
    the rows are plain and whole (the signer's full key too); --json gives every number."""
    rows = ls_rows(store)
    head = store.head()
    if as_json:
        sys.stdout.write(json.dumps({"head": head, "artifacts": rows}, indent=1) + "\n")
        return 0
    print_table(console, LS_COLUMNS, [_ls_cells(r, console.is_terminal) for r in rows],
                right=LS_RIGHT)
    console.print(f"head: v{head}" if head is not None else "empty chain")
    if rows:
        console.print(LS_NOTE, style="dim", highlight=False)
    return 0


def chain_cmd(a: argparse.Namespace) -> int:
    store = ChainStore(Path(a.dir))
    key = parse_public(a.key) if a.key else None
    if a.action == "ls":
        return chain_ls(store, a.json)
    if a.action == "show":
        name = a.artifact or store.artifacts()[-1]
        sys.stdout.write(json.dumps(json.loads(store.manifest_bytes(name)), indent=1) + "\n")
        return 0
    return verify(store, key, a.require_all, a.artifact)


VERIFY_EPILOG = """chain verify exit codes:
  0  every block this node holds matches its id (artifacts whose blocks are not here are listed
     as "not held": a region never fetches snapshots it did not need, and retention drops
     artifacts)
  1  corrupt: a manifest fails its signature or chain checks, or a held block's bytes do not
     match its id (delete the block; the daemon refetches it)
  2  the command could not run (bad arguments, unreadable directory)
  3  only with --require-all: nothing is corrupt, but some artifacts are not fully held
"""


def verify(store: ChainStore, key, require_all: bool, only: str | None = None) -> int:
    """Signatures (if a key is given), parents, and the content of every held block; blocks
    that are absent are "not held", never "bad" (see VERIFY_EPILOG for the exit codes)."""
    from chain.errors import BadBlock
    from chain.manifest import Manifest

    names = [only] if only else store.artifacts()
    ok = bad = absent = 0
    for name in names:
        try:
            m = Manifest.parse(store.manifest_bytes(name), key)
            store.check(m)
        except ChainError as e:
            bad += 1
            console.print(f"[red]BAD[/] {name}: {e}")
            continue
        missing, corrupt = 0, []
        for b in m.blocks:
            if not store.blocks.has(b.id):
                missing += 1
                continue
            try:
                store.blocks.get(b.id, b.size)
            except BadBlock as e:
                corrupt.append(str(e))
        if corrupt:
            bad += 1
            console.print(f"[red]BAD[/] {name}: {len(corrupt)} corrupt block(s): {corrupt[0]}")
        elif missing:
            absent += 1
            console.print(f"[yellow]not held[/] {name}: {missing} of {len(m.blocks)} blocks "
                          "not in this store")
        else:
            ok += 1
            console.print(f"[green]ok[/] {name}")
    console.print(f"{ok} ok, {bad} bad, {absent} not held"
                  + ("" if key else " (signatures not checked: pass --key)"))
    if bad:
        return 1
    return 3 if absent and require_all else 0


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="deltaswarm", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="group", required=True)
    d = sub.add_parser("delta", help="encode, apply and inspect delta files")
    dsub = d.add_subparsers(dest="action", required=True)
    e = dsub.add_parser("encode")
    e.add_argument("old")
    e.add_argument("new")
    e.add_argument("-o", "--output", required=True)
    e.set_defaults(fn=delta_encode)
    ap = dsub.add_parser("apply")
    ap.add_argument("old")
    ap.add_argument("delta")
    ap.add_argument("-o", "--output", required=True)
    ap.set_defaults(fn=delta_apply)
    s = dsub.add_parser("stats")
    s.add_argument("delta")
    s.add_argument("--tensors", action="store_true",
                   help="one line per record (a tensor, or a group of small ones)")
    s.set_defaults(fn=delta_stats)
    c = sub.add_parser("chain", help="list, show and verify a chain directory",
                       epilog=VERIFY_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    c.add_argument("action", choices=["ls", "show", "verify"])
    c.add_argument("dir")
    c.add_argument("artifact", nargs="?")
    c.add_argument("--key", help="trainer public key (hex) to check signatures against")
    c.add_argument("--json", action="store_true",
                   help="ls: one JSON document with every artifact's numbers, keys whole")
    c.add_argument("--require-all", action="store_true",
                   help="verify: exit 3 when some artifact's blocks are not all held")
    c.set_defaults(fn=chain_cmd)
    a = p.parse_args(argv)
    try:
        return a.fn(a)
    except ChainError as err:
        console.print(f"[red]error:[/] {err}")
        return 2
