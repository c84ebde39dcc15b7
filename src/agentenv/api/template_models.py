"""Request and response bodies of the E2B template build API (node/template_api.py), with E2B's
field names (the SDK's models are the contract, docs/e2b-api.md §1.7). Kept apart from the routes
so that api/openapi.py can describe them without importing the server."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from agentenv.api.models import DateTime, Omitted, Response, absent
from agentenv.envd_client import ColdMemory

UPLOAD_PREFIX = "/template-files/"  # the signed upload URLs handed out for COPY files
#: what a build file's hash (the name of its tar) may be, in the upload URL and its link
FILES_HASH = re.compile(r"[A-Za-z0-9_-]{1,128}")


class TemplateBuildRequestV3(BaseModel):
    """`POST /v3/templates` (E2B TemplateBuildRequestV3). `alias` is the deprecated spelling of
    `name`; `teamID` is ignored (one team per node). `coldMemory` is ours (not E2B's): the
    template's cold-memory reclaim (docs/templates.md §7)."""

    model_config = ConfigDict(extra="ignore", strict=True)
    name: str | None = Field(default=None, min_length=1, max_length=128)
    alias: str | None = Field(default=None, min_length=1, max_length=128)
    tags: list[str] | None = Field(default=None, max_length=100)
    teamID: str | None = None
    cpuCount: int | None = Field(default=None, ge=1, le=64)
    memoryMB: int | None = Field(default=None, ge=128, le=256 * 1024)
    minFreeDiskMb: int | None = None
    #: an extension: the default idlePauseAfter of the template's sandboxes (node/idle.py);
    #: a build without it keeps the template's
    idlePauseAfter: int | None = None
    coldMemory: ColdMemory | None = None


class TemplateStep(BaseModel):
    """One build step (E2B TemplateStep); its meaning is checked by build.parse_steps."""

    model_config = ConfigDict(extra="ignore", strict=True)
    type: str
    args: list[str] | None = None
    filesHash: str | None = None
    force: bool | None = None


class TemplateBuildStartV2(BaseModel):
    """`POST /v2/templates/{tid}/builds/{bid}` (E2B TemplateBuildStartV2)."""

    model_config = ConfigDict(extra="ignore", strict=True)
    fromImage: str | None = None
    fromTemplate: str | None = None
    fromImageRegistry: dict[str, Any] | None = None  # {type: "registry", username, password}
    force: bool | None = None
    steps: list[TemplateStep] | None = None
    startCmd: str | None = None
    readyCmd: str | None = None


class AssignTemplateTagsRequest(BaseModel):
    """`POST /templates/tags`: point `tags` at the build that `target` ("name:tag", or "name"
    for its default build) names."""

    model_config = ConfigDict(extra="ignore", strict=True)
    target: str = Field(min_length=1, max_length=300)
    tags: list[str] = Field(max_length=100)


class DeleteTemplateTagsRequest(BaseModel):
    """`DELETE /templates/tags`: remove `tags` of template `name` ("default" cannot go)."""

    model_config = ConfigDict(extra="ignore", strict=True)
    name: str = Field(min_length=1, max_length=300)
    tags: list[str] = Field(max_length=100)


# --- responses (api/openapi.py's schemas) -----------------------------------------------------


class TemplateRequestResponseV3(Response):
    templateID: str
    buildID: str
    public: bool
    names: list[str]
    tags: list[str]
    aliases: list[str]


class TemplateBuildFileUpload(Response):
    present: bool
    url: str | Omitted = absent()
    headers: dict[str, str] | Omitted = absent()


class BuildLogEntry(Response):
    timestamp: DateTime
    message: str
    level: Literal["debug", "info", "warn", "error"]
    step: str | Omitted = absent()


class BuildStatusReason(Response):
    message: str
    step: str | Omitted = absent()
    logEntries: list[BuildLogEntry] | Omitted = absent()


class TemplateBuildInfo(Response):
    templateID: str
    buildID: str
    status: Literal["building", "waiting", "ready", "error"]
    logs: list[str]
    logEntries: list[BuildLogEntry]
    reason: BuildStatusReason | Omitted = absent()


class TemplateTag(Response):
    tag: str
    buildID: str
    createdAt: DateTime


class AssignedTemplateTags(Response):
    tags: list[str]
    buildID: str
