"""The node app in-process: extension points other subsystems use (extra routes, templates)."""

from __future__ import annotations

import time
import warnings
from pathlib import Path

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from agentenv.api.tenancy import LOCAL_TEAM
from agentenv.node.backend import TemplateRef
from agentenv.node.records import TemplateRecord
from agentenv.node.server import ServeOptions, build_app

with warnings.catch_warnings():  # starlette 1.x nags about httpx here; TestClient still works
    warnings.simplefilter("ignore")
    from starlette.testclient import TestClient


async def build_status(request: Request) -> Response:
    return JSONResponse({"templateID": request.path_params["tid"], "status": "ready"})


def test_extra_routes_and_registered_templates(tmp_path: Path) -> None:
    route = Route("/templates/{tid}/builds/{bid}/status", build_status, methods=["GET"])
    app = build_app(ServeOptions(state_dir=tmp_path / "state", backend="process"), extra_routes=[route])
    key = (tmp_path / "state" / "secrets" / "api-key").read_text().strip()
    with TestClient(app, headers={"X-API-KEY": key}) as client:
        answer = client.get("/templates/t1/builds/b1/status")
        assert answer.json() == {"templateID": "t1", "status": "ready"}
        base_dir = app.orchestrator.catalogue.resolve("base", LOCAL_TEAM).ref.data["dir"]
        now = time.time()
        template = TemplateRecord(
            template_id="tpl1",
            kind="template",
            names=["my-image"],
            ref=TemplateRef("template", {"dir": base_dir}, ("layer-a",)),
            cpu_count=1,
            memory_mb=256,
            disk_size_mb=2048,
            envd_version="0.6.4",
            created_at=now,
            updated_at=now,
        )
        client.portal.call(app.orchestrator.catalogue.register, template)  # type: ignore[union-attr]
        detail = client.get("/templates/my-image").json()
        assert detail["templateID"] == "tpl1" and detail["diskSizeMB"] == 2048
        created = client.post("/v2/sandboxes", json={"templateID": "my-image", "timeout": 30})
        assert created.status_code == 201, created.text
        sid = created.json()["sandboxID"]
        info = client.get(f"/sandboxes/{sid}").json()
        assert info["memoryMB"] == 256 and info["alias"] == "my-image"
        assert client.delete(f"/sandboxes/{sid}").status_code == 204
        counts = client.portal.call(app.orchestrator.store.layer_ref_counts)  # type: ignore[union-attr]
        assert counts == {"layer-a": 1}  # the template pins it; the killed sandbox no longer
