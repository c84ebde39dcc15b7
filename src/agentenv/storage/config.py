"""Image config JSON (docs/overlaybd.md §9): `lowers` (bottom -> top) and an optional `upper`.

Compatible with C++ `config.v1.json` and AgentENV `image.json`: unknown keys are kept and
ignored. A lower resolves as `file`, else `dir/overlaybd.commit`, `dir/.commit`,
`dir/overlaybd.sealed` (C++ order). Remote (`digest` only) lowers are not supported here.
Relative paths resolve against the config file's directory.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentenv.fsutil import atomic_write
from agentenv.storage.errors import LayerFormatError

CONFIG_NAME = "image.json"
_DIR_CANDIDATES = ("overlaybd.commit", ".commit", "overlaybd.sealed")


@dataclass
class ImageConfig:
    path: Path | None
    lowers: list[Path]
    upper_data: Path | None = None
    upper_index: Path | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def upper_dir(self) -> Path | None:
        return self.upper_data.parent if self.upper_data is not None else None

    def to_json(self) -> dict[str, Any]:
        doc = dict(self.extra)
        doc["lowers"] = [{"file": str(p)} for p in self.lowers]
        if self.upper_data is not None and self.upper_index is not None:
            doc["upper"] = {"index": str(self.upper_index), "data": str(self.upper_data)}
        else:
            doc.pop("upper", None)
        return doc

    def save(self, path: Path | None = None) -> None:
        """Write atomically (temp file, fsync, rename)."""
        path = path or self.path
        if path is None:
            raise ValueError("config has no path")
        atomic_write(path, json.dumps(self.to_json(), indent=2) + "\n", mode=0o644)
        self.path = path


def load_config(path: Path) -> ImageConfig:
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError as exc:
        raise LayerFormatError(path, None, "image config does not exist") from exc
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise LayerFormatError(path, exc.pos, f"invalid JSON in image config: {exc.msg}") from exc
    if not isinstance(doc, dict) or not isinstance(doc.get("lowers", []), list):
        raise LayerFormatError(path, 0, "image config must be an object with a `lowers` list")
    base = path.parent
    lowers: list[Path] = []
    for i, entry in enumerate(doc.get("lowers", [])):
        if not isinstance(entry, dict):
            raise LayerFormatError(path, None, f"lowers[{i}] is not an object")
        found: Path | None = None
        if entry.get("file"):
            cand = base / entry["file"]
            if cand.is_file():
                found = cand
        if found is None and entry.get("dir"):
            for name in _DIR_CANDIDATES:
                cand = base / entry["dir"] / name
                if cand.is_file():
                    found = cand
                    break
        if found is None:
            named = entry.get("file") or entry.get("dir") or entry.get("digest") or "nothing"
            raise LayerFormatError(path, None,
                                   f"lowers[{i}] names a missing layer ({named})")
        lowers.append(found.absolute())
    upper_data = upper_index = None
    upper = doc.get("upper") or {}
    if not isinstance(upper, dict):
        raise LayerFormatError(path, None, "`upper` is not an object")
    if upper.get("data") and upper.get("index"):  # C++ needs both, else read-only
        upper_data = (base / upper["data"]).absolute()
        upper_index = (base / upper["index"]).absolute()
    extra = {k: v for k, v in doc.items() if k not in ("lowers", "upper")}
    return ImageConfig(path, lowers, upper_data, upper_index, extra)
