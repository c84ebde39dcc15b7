"""Request and response bodies of E2B's volume API and volume content API (node/volume_api.py),
with E2B's field names (the SDK's models are the contract, docs/volumes.md). Kept apart from the
routes so that api/openapi.py can describe them without importing the server."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from agentenv.api.models import DateTime, Omitted, Response, absent

CONTENT_PREFIX = "/volumecontent/"  # the content API, authenticated by the volume's token
#: the answer to a content request without its volume's token (401), whether the volume exists
#: or not: ids are not probed (node/volumes.py, the gateway's control/gateway/volumes.py)
TOKEN_NEEDED = ("a volume content request needs Authorization: Bearer <the volume's token> "
                "(from Volume.create or GET /volumes/{id})")


class NewVolume(BaseModel):
    """`POST /volumes` (E2B NewVolume); `sizeMB` is our extension."""

    model_config = ConfigDict(extra="ignore", strict=True)
    name: str = Field(min_length=1, max_length=128)
    sizeMB: int | None = None


class VolumeCommit(BaseModel):
    """`POST /volumes/{id}/commit` (our extension): the volume's content becomes what the
    sandbox's copy-on-write mount of it holds (the mount at `path`, when it has several)."""

    model_config = ConfigDict(extra="ignore", strict=True)
    sandboxID: str = Field(min_length=1, max_length=64)
    path: str | None = Field(default=None, min_length=1, max_length=1024)


class VolumeMetadataUpdate(BaseModel):
    """`PATCH /volumecontent/{id}/path`: what to change of an entry."""

    model_config = ConfigDict(extra="ignore", strict=True)
    uid: int | None = None
    gid: int | None = None
    mode: int | None = None


class Volume(Response):
    volumeID: str
    name: str
    #: an extension: the volume's size
    sizeMB: int


class VolumeAndToken(Volume):
    #: the bearer token of the volume content API
    token: str


class VolumeEntryStat(Response):
    name: str
    type: Literal["file", "directory", "symlink", "unknown"]
    path: str
    size: int
    mode: int
    uid: int
    gid: int
    atime: DateTime
    mtime: DateTime
    ctime: DateTime
    target: str | Omitted = absent()
