"""A config as commented YAML: every field of the model tree, in the model's order, each under
its own documentation (the attribute docstrings every `Section` keeps as descriptions).

Why generated: examples written by hand drifted from the code (defaults, missing fields, wrong
descriptions); a file rendered from the models cannot, and `tests/unit/test_configs.py` holds
the shipped `configs/` to what this writes. What `load_yaml` reads back from the text equals the
model it was rendered from.

Pure (pydantic and yaml only), like chain/config_base.py.
"""

import textwrap

import yaml
from pydantic import BaseModel

WIDTH = 96


def render(cfg: BaseModel, header: str = "") -> str:
    """`cfg` as YAML with each field's description as a comment above it; `header` (plain
    text, one paragraph per blank line) goes first, commented."""
    lines: list[str] = []
    if header:
        lines += [_comment(header, ""), ""]
    lines += _fields(cfg, "")
    return "\n".join(lines).rstrip("\n") + "\n"


def _fields(cfg: BaseModel, indent: str) -> list[str]:
    out: list[str] = []
    dumped = cfg.model_dump(mode="json")  # paths as strings, the form load_yaml reads back
    for name, field in type(cfg).model_fields.items():
        value = getattr(cfg, name)
        if field.description:
            out.append(_comment(field.description, indent))
        if isinstance(value, BaseModel):
            out.append(f"{indent}{name}:")
            out += _fields(value, indent + "  ")
        else:
            text = yaml.safe_dump({name: dumped[name]}, sort_keys=False, width=WIDTH,
                                  default_flow_style=False, allow_unicode=True)
            out += [indent + line for line in text.strip("\n").splitlines()]
        if not indent:
            out.append("")
    return out


def _comment(text: str, indent: str) -> str:
    """`text` as `# ` lines wrapped to WIDTH, keeping its paragraph breaks."""
    width = max(40, WIDTH - len(indent) - 2)
    paragraphs = [" ".join(p.split()) for p in text.strip().split("\n\n")]
    lines = []
    for i, p in enumerate(paragraphs):
        if i:
            lines.append(f"{indent}#")
        lines += [f"{indent}# {line}" for line in textwrap.wrap(p, width)]
    return "\n".join(lines)
