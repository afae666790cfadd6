"""The config style every process shares (daemon, trainer, rollout worker, demo): a frozen
pydantic tree whose fields are documented by their attribute docstrings and bounded, loaded from
YAML with relative paths resolved against the file, and one `ConfigError` that lists every bad
field at once with the file's name, so an operator fixes a config in one pass.

Pure (pydantic and yaml only): daemon, trainer and rollout each build their tree on it without
importing one another.
"""

import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

M = TypeVar("M", bound=BaseModel)
NAME_PATTERN = r"^[A-Za-z0-9_.\-]{1,64}$"


class ConfigError(ValueError):
    """A config file is missing, malformed, or names a field with an invalid value."""


class Section(BaseModel):
    """Base of every config model: unknown fields refused, values frozen after load, and each
    field's attribute docstring kept as its description (help texts, the docs test)."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


def read_yaml(path: str | os.PathLike) -> dict[str, Any]:
    """The top-level mapping of a YAML file; every failure is a `ConfigError` naming the file."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"config {path}: cannot read it ({e.strerror or e})") from None
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"config {path}: not valid YAML: {e}") from None
    if doc is None:
        doc = {}
    if not isinstance(doc, dict):
        raise ConfigError(f"config {path}: expected a mapping of fields at the top level")
    return doc


def read_token(path: Path, field: str = "token_file") -> str:
    """The bearer token on the first line of `path` (every process reads it the same way, so the
    same file serves the daemon, the ingest and the publishers). ConfigError naming `field`."""
    try:
        tok = path.read_text().strip().splitlines()[0].strip()
    except (OSError, IndexError) as e:
        raise ConfigError(f"{field} {path}: cannot read a token ({e}); write one line of at "
                          "least 8 characters there, the same on every node and publisher "
                          "(e.g. python -c 'import secrets; print(secrets.token_urlsafe(24))')"
                          ) from None
    if len(tok) < 8:
        raise ConfigError(f"{field} {path}: token shorter than 8 characters")
    return tok


def one_token(token: str | None, token_file: Path | None) -> None:
    """The `token` / `token_file` pair every process's config has: exactly one must be set."""
    if (token is None) == (token_file is None):
        raise ValueError("set exactly one of `token` and `token_file`")


def bearer_token(token: str | None, token_file: Path | None) -> str:
    """The bearer token of a config holding the `token` / `token_file` pair (validated by
    `one_token`): the inline one, or the file's first line."""
    if token is not None:
        return token
    assert token_file is not None
    return read_token(token_file, "token_file")


def resolve_paths(doc: dict[str, Any], base: Path, fields: Iterable[str]) -> None:
    """Make the (dotted) path `fields` of `doc` absolute against `base`, expanding `~`."""
    for dotted in fields:
        *parents, key = dotted.split(".")
        node: Any = doc
        for p in parents:
            node = node.get(p) if isinstance(node, dict) else None
        if isinstance(node, dict) and isinstance(node.get(key), str):
            p = Path(os.path.expanduser(node[key]))
            node[key] = str(p if p.is_absolute() else base / p)


def describe(e: ValidationError, path: str | os.PathLike | None,
             tagged: Iterable[str] = ()) -> str:
    """One line per invalid field, `field a.b.c: what is wrong (got …)`. For the `type:` unions
    at the dotted fields `tagged`, pydantic's member tag is left out of the field's name."""
    tagged = set(tagged)
    lines = []
    for err in e.errors():
        parts = [str(p) for p in err["loc"]]
        for i in range(len(parts) - 1, 0, -1):
            if ".".join(parts[:i]) in tagged:
                del parts[i]
        where = ".".join(parts) or "(top level)"
        msg = re.sub(r"^Value error, ", "", err["msg"])
        got = err.get("input")
        shown = "" if isinstance(got, dict | list) or got is None else f" (got {got!r:.60})"
        lines.append(f"  field {where}: {msg}{shown}")
    head = f"config {path}" if path is not None else "config"
    return f"{head}: {len(lines)} invalid field(s):\n" + "\n".join(lines)


def validate(model: type[M], doc: dict[str, Any], path: str | os.PathLike | None = None,
             tagged: Iterable[str] = ()) -> M:
    """`model` from `doc`, or a `ConfigError` listing every invalid field."""
    try:
        return model.model_validate(doc)
    except ValidationError as e:
        raise ConfigError(describe(e, path, tagged)) from None


def load_yaml(model: type[M], path: str | os.PathLike, paths: Iterable[str] = (),
              tagged: Iterable[str] = ()) -> M:
    """Read, resolve the path fields `paths` against the file's directory, and validate."""
    path = Path(path)
    doc = read_yaml(path)
    resolve_paths(doc, path.parent.resolve(), paths)
    return validate(model, doc, path, tagged)


def replace(cfg: M, **changes: Any) -> M:
    """A copy of `cfg` with `changes` applied and re-validated (unlike `model_copy`). A mapping
    given for a section is merged into it (`http={"port": 1}` keeps `http.host`); a model
    replaces it whole. Bad values raise `ConfigError` naming every field."""
    return validate(type(cfg), merge(cfg.model_dump(), changes))


def merge(base: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def to_yaml(cfg: BaseModel) -> str:
    """`cfg` as YAML that `load_yaml` reads back to an equal model (every field written)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def undocumented(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Dotted names of fields in `model`'s tree without a description (held empty by a test)."""
    missing = []
    for name, field in model.model_fields.items():
        if not field.description:
            missing.append(prefix + name)
        for sub in _models(field.annotation):
            missing += undocumented(sub, f"{prefix}{name}.")
    return missing


def _models(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    out: list[type[BaseModel]] = []
    for arg in getattr(annotation, "__args__", ()) or ():
        out += _models(arg)
    return out
