"""Versions read where they are pinned, so that none is written twice: the product's Python packages in
pyproject.toml, the services docker-compose.yml runs as its image tags. The local services (pgcdc_dev.services)
and the testcontainers fallback (pgcdc_dev.discovery) run the same versions. Stdlib only."""

from __future__ import annotations

import re
import tomllib
from functools import cache

from pgcdc_dev import CHECKOUT


@cache
def pinned_python(name: str) -> str:
    """The version pyproject.toml pins ``name`` to (``name==X`` in the sinks extra)."""
    project = tomllib.loads((CHECKOUT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    for requirement in project["optional-dependencies"]["sinks"]:
        found = re.fullmatch(rf"{re.escape(name)}(\[[^\]]*\])?\s*==\s*([\w.]+)", requirement.split(";")[0].strip())
        if found:
            return found.group(2)
    raise RuntimeError(f"pyproject.toml pins no {name}== in its sinks extra")


@cache
def compose_tag(image: str) -> str:
    """The tag docker-compose.yml runs ``image`` at (``image: <image>:<tag>``)."""
    text = (CHECKOUT / "docker-compose.yml").read_text(encoding="utf-8")
    # The tag may be quoted or followed by a comment; a digest (@sha256:…) ends it.
    found = re.search(rf"^\s*image:\s*[\"']?{re.escape(image)}:([^\s\"'#@]+)", text, re.MULTILINE)
    if found is None:
        raise RuntimeError(f"docker-compose.yml runs no {image}:<tag>")
    return found.group(1)


def compose_image(image: str) -> str:
    """``image`` at the tag docker-compose.yml runs it."""
    return f"{image}:{compose_tag(image)}"
