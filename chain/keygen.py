"""`deltaswarm keygen FILE`: create the trainer's Ed25519 signing key and print the public key
that every daemon's config pins as `trainer_public_key`."""

import argparse
from pathlib import Path

from chain import keys


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="deltaswarm keygen", description=__doc__)
    p.add_argument("file", help="where to write the private key (mode 0600)")
    p.add_argument("--force", action="store_true", help="overwrite an existing key")
    a = p.parse_args(argv)
    path = Path(a.file)
    if path.exists() and not a.force:
        print(f"{path} exists; pass --force to replace it (daemons pin the old public key)")
        return 2
    key = keys.generate(path)
    print(keys.public_hex(key))
    return 0
