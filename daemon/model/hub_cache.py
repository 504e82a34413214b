"""A model named as on the Hugging Face Hub (`--model Qwen/Qwen3-8B`), found in the local Hugging
Face cache, as vLLM finds one offline. kvd downloads nothing: a model that is not in the cache is
refused with where kvd looked and how to fetch it.

The cache is `HF_HUB_CACHE`, else `$HF_HOME/hub`, else `$XDG_CACHE_HOME/huggingface/hub`, else
`~/.cache/huggingface/hub` (huggingface_hub's own order). A model `ORG/NAME` lives in
`models--ORG--NAME/snapshots/COMMIT/`, and `refs/main` names the commit a plain download took.

    model_dir, hub_name = resolve_model("Qwen/Qwen3-8B")   # (snapshot folder, "Qwen/Qwen3-8B")
    model_dir, hub_name = resolve_model("/srv/models/x")   # (Path("/srv/models/x"), None)
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Mapping

from .errors import ModelError

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")


def hub_cache_dir(env: Mapping[str, str] | None = None) -> Path:
    """Where huggingface_hub keeps downloaded models, by its own environment variables."""
    env = os.environ if env is None else env
    if env.get("HF_HUB_CACHE"):
        return Path(env["HF_HUB_CACHE"]).expanduser()
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]).expanduser() / "hub"
    base = Path(env["XDG_CACHE_HOME"]).expanduser() if env.get("XDG_CACHE_HOME") else Path.home() / ".cache"
    return base / "huggingface" / "hub"


def resolve_model(value: str, env: Mapping[str, str] | None = None) -> tuple[Path, str | None]:
    """The checkpoint folder `value` names, and its Hub id when it was one (None for a folder);
    ModelError saying where kvd looked."""
    path = Path(value).expanduser()
    if path.is_dir():
        return path, None
    if not HUB_ID.match(value):
        raise ModelError(f"model: {value!r} is not a directory")
    cache = hub_cache_dir(env)
    repo = cache / ("models--" + value.replace("/", "--"))
    if not repo.is_dir():
        raise ModelError(f"model: {value!r} is not a directory, nor in the Hugging Face cache at {cache} (kvd "
                         f"downloads nothing: fetch it first, e.g. `huggingface-cli download {value}`, or give "
                         "its folder)")
    snapshots = repo / "snapshots"
    ref = repo / "refs" / "main"
    if ref.is_file():
        snapshot = snapshots / ref.read_text(encoding="utf-8").strip()
        if not snapshot.is_dir():
            raise ModelError(f"model: {value!r}: {ref} names snapshot {snapshot.name!r}, which is not in {snapshots}")
    else:
        found = sorted(p for p in snapshots.iterdir() if p.is_dir()) if snapshots.is_dir() else []
        if len(found) != 1:
            raise ModelError(f"model: {value!r} has no refs/main in the Hugging Face cache and "
                             + (f"{len(found)} snapshots ({', '.join(p.name[:12] for p in found)})" if found
                                else "no snapshot") + f" in {snapshots}; give the snapshot's folder")
        snapshot = found[0]
    if not (snapshot / "config.json").is_file():
        raise ModelError(f"model: {value!r}: the cached snapshot {snapshot} has no config.json (a download that "
                         "did not finish?)")
    return snapshot, value
