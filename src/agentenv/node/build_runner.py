"""The template build itself, in the background (node/template_api.py starts it): one at a time
(AENV_TEMPLATE_BUILDS), within its time (AENV_BUILD_TIMEOUT_SECONDS); a VM booted from an
image (pulled and converted by agentenv.template.pull) or from another template's snapshot,
the steps run through envd (agentenv.template.build), the VM paused into the template's boot
snapshot and only then the template registered, so a failed build leaves no half template and
its VM is killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from agentenv.api.event_models import BUILD_FAILED, BUILD_FINISHED, BUILD_STARTED
from agentenv.api.template_models import (
    TemplateBuildStartV2,
)
from agentenv.envd_client import ColdMemory, EnvdClient
from agentenv.errors import AgentEnvError
from agentenv.node.admission import space_reserve
from agentenv.node.backend import BackendError, SandboxSpec
from agentenv.node.base_template import default_cold_memory
from agentenv.node.build_records import BuildRecord, BuildRecords
from agentenv.node.events import Event
from agentenv.node.orchestrator import Orchestrator
from agentenv.node.records import DEFAULT_TAG, BuildSnapshot, TemplateRecord
from agentenv.node.security import new_id
from agentenv.registry.auth import Credentials
from agentenv.settings import get_settings, setting_text
from agentenv.storage.layer import inspect_layer
from agentenv.template.build import BASE_STEP, BuildContext, BuildFailed, StepRunner
from agentenv.template.convert import VIRTUAL_SIZE
from agentenv.template.layercache import layer_cache_dir
from agentenv.template.pull import pull_image

log = logging.getLogger("agentenv.node.template_api")

BUILD_TIMEOUT_ENV = "AENV_BUILD_TIMEOUT_SECONDS"


def build_timeout_seconds() -> float:
    """Seconds a build may run once it has its slot (AENV_BUILD_TIMEOUT_SECONDS, default 3600,
    0 = no limit): the guest is the team's, and a build holds a VM until it ends."""
    raw = setting_text(BUILD_TIMEOUT_ENV)
    try:
        seconds = float(raw) if raw else 3600.0
    except ValueError:
        seconds = -1.0
    if not seconds >= 0:  # also NaN
        raise AgentEnvError(f"{BUILD_TIMEOUT_ENV} must be a number of seconds (0 = no limit), "
                            f"got {raw!r}")
    return seconds



class BuildRunner:
    def __init__(self, orchestrator: Orchestrator, records: BuildRecords, state_dir: Path) -> None:
        #: called with (name, build id, template id) once a build is ready
        self.on_published: Callable[[str, str, str], None] | None = None
        self.orchestrator = orchestrator
        self.catalogue = orchestrator.catalogue
        #: the backend the build VMs run on
        self.backend = orchestrator.backend
        #: the backend's optional capabilities, resolved once at assembly (node/server.py)
        self.capabilities = orchestrator.capabilities
        #: the node's settings (node/orchestrator.py NodeConfig), fixed once it is assembled
        self.config = orchestrator.config
        self.records = records
        self.state_dir = state_dir
        #: the builds under way, by build id
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self._slots: asyncio.Semaphore | None = None
        self.concurrency = max(1, get_settings().template_builds)
        self.build_timeout = build_timeout_seconds()
        self.cold_memory = default_cold_memory()

    async def run(self, rec: BuildRecord, steps: list[Any], body: TemplateBuildStartV2,
                   files_dir: Path) -> None:
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.concurrency)
        t0 = time.monotonic()
        self._build_event(BUILD_STARTED, rec)
        try:
            if self._slots.locked():
                rec.log("info", "waiting for another build to finish", BASE_STEP)
            async with self._slots:
                await self._build_in_time(rec, steps, body, files_dir)
        except BuildFailed as exc:
            self._fail(rec, exc.message, exc.step)
        except asyncio.CancelledError:
            self._fail(rec, "the build was cancelled", None)
            raise
        except (AgentEnvError, BackendError) as exc:
            self._fail(rec, str(exc), BASE_STEP)
        except Exception as exc:
            log.exception("template build crashed", extra={"build_id": rec.build_id})
            self._fail(rec, f"internal error: {type(exc).__name__}: {exc}", None)
        else:
            self._build_event(BUILD_FINISHED, rec, seconds=round(time.monotonic() - t0, 1))
            rec.log("info", f"build ready in {time.monotonic() - t0:.1f} s", None)
            log.info("template built", extra={"template_id": rec.template_id,
                                              "build_id": rec.build_id,
                                              "seconds": round(time.monotonic() - t0, 1)})
        finally:
            self.records.save(rec)
            self.catalogue.collect_soon()  # its uploads may be unused now (node/gc.py)

    async def _build_in_time(self, rec: BuildRecord, steps: list[Any],
                             body: TemplateBuildStartV2, files_dir: Path) -> None:
        """`_build` within the build deadline; past it, the build is cancelled (which kills
        its VM) and fails."""
        try:
            async with asyncio.timeout(self.build_timeout or None) as limit:
                await self._build(rec, steps, body, files_dir)
        except TimeoutError:
            if not limit.expired():
                raise
            raise BuildFailed(f"the build did not finish within {self.build_timeout:g} s "
                              f"({BUILD_TIMEOUT_ENV}); its VM was stopped", None) from None

    def _build_event(self, kind: str, rec: BuildRecord, **data: Any) -> None:
        self.orchestrator.record_event(Event(
            type=kind, team=rec.team, template_id=rec.template_id, build_id=rec.build_id,
            data={"name": rec.name, **data}))

    def _fail(self, rec: BuildRecord, message: str, step: str | None) -> None:
        rec.status = "error"
        rec.reason = {"message": message, "step": step}
        rec.log("error", message, step)
        rec.finished_at = rec.updated_at = time.time()
        self._build_event(BUILD_FAILED, rec, reason=rec.reason)
        log.warning("template build failed", extra={"template_id": rec.template_id,
                                                    "build_id": rec.build_id, "error": message})

    async def _build(self, rec: BuildRecord, steps: list[Any], body: TemplateBuildStartV2,
                     files_dir: Path) -> None:
        backend = self.backend
        builder = self.capabilities.templates
        assert builder is not None  # builds are refused at the request otherwise
        vm_id = new_id("b")
        placement = None
        envd = None
        try:
            if body.fromTemplate:
                parent = self.catalogue.resolve(body.fromTemplate, rec.team)
                rec.log("info", f"FROM template {parent.names[0] if parent.names else parent.template_id}"
                        f" ({parent.template_id})", BASE_STEP)
                if (rec.cpu_count, rec.memory_mb) != (parent.cpu_count, parent.memory_mb):
                    rec.log("warn", f"the VM keeps the base template's size ({parent.cpu_count} "
                            f"vCPUs, {parent.memory_mb} MiB): a snapshot cannot be resized",
                            BASE_STEP)
                rec.cpu_count, rec.memory_mb = parent.cpu_count, parent.memory_mb
                rec.disk_size_mb = parent.disk_size_mb
                context = BuildContext.from_json(
                    self.records.context_of(parent.template_id, parent.build_id) or {})
                # the request's setting, else the base template's (as its size and user)
                context.cold_memory = self._cold_memory(rec) or context.cold_memory \
                    or self.cold_memory
                spec = SandboxSpec(
                    sandbox_id=vm_id, source=parent.ref, cpu_count=parent.cpu_count,
                    memory_mb=parent.memory_mb, disk_size_mb=parent.disk_size_mb, env_vars={},
                    access_token=None, allow_internet_access=True, metadata={})
                placement = await self._start_vm(rec, vm_id, lambda: backend.create(spec))
            else:
                assert body.fromImage is not None
                lowers, disk_bytes, config = await self._pull(rec, body)
                rec.disk_size_mb = disk_bytes >> 20
                context = BuildContext.from_image_config(config)
                context.cold_memory = self._cold_memory(rec) or self.cold_memory
                rec.log("info", f"booting the build VM ({rec.cpu_count} vCPUs, "
                        f"{rec.memory_mb} MiB)", BASE_STEP)
                t0 = time.monotonic()
                placement = await self._start_vm(rec, vm_id, lambda: builder.boot_image(
                    vm_id, lowers, disk_bytes, rec.cpu_count, rec.memory_mb))
                rec.log("info", f"build VM up in {time.monotonic() - t0:.1f} s", BASE_STEP)
            rec.envd_version = placement.envd_version
            envd = EnvdClient(placement.envd_url)
            runner = StepRunner(envd, context, rec.log, files_dir)
            try:
                await runner.prepare()
                await runner.run_steps(steps)
                await runner.start_and_wait_ready(body.startCmd, body.readyCmd)
                await runner.finish()
            finally:
                await runner.detach()
            rec.log("info", "pausing the VM into the template's snapshot", None)
            ref = await builder.capture_template(vm_id)
            placement = None  # the VM is gone; its snapshot is the template's
            await self._publish(rec, ref, context)
        finally:
            if envd is not None:
                await envd.close()
            if placement is not None:
                with contextlib.suppress(Exception):
                    await backend.kill(vm_id, placement)

    @staticmethod
    def _cold_memory(rec: BuildRecord) -> ColdMemory | None:
        return ColdMemory.model_validate(rec.cold_memory) if rec.cold_memory else None

    async def _start_vm(self, rec: BuildRecord, vm_id: str,
                        start: Callable[[], Awaitable[Any]]) -> Any:
        """Start the build VM; one more try when the first fails (seen on loaded hosts: QEMU's
        spawn failing in its network namespace, a TCG assertion at boot)."""
        try:
            return await start()
        except Exception as exc:
            rec.log("warn", f"starting the build VM failed ({type(exc).__name__}: {exc}); "
                    "trying once more", BASE_STEP)
            log.warning("build VM start failed, retrying",
                        extra={"build_id": rec.build_id, "error": repr(exc)})
            with contextlib.suppress(Exception):
                await self.backend.kill(vm_id, None)
        return await start()

    async def _pull(self, rec: BuildRecord, body: TemplateBuildStartV2) -> tuple[list[Path], int, dict[str, Any]]:
        assert body.fromImage is not None
        rec.log("info", f"FROM image {body.fromImage}: pulling", BASE_STEP)
        credentials = None
        creds = body.fromImageRegistry or {}
        if creds.get("username") or creds.get("password"):
            # In memory for this pull only: no docker config file, nothing in the record.
            credentials = Credentials(str(creds.get("username", "")), str(creds.get("password", "")))
        try:
            # Never the node's docker config: a team pulls with what its request carries only.
            pulled = await asyncio.to_thread(
                pull_image, body.fromImage, state_dir=self.state_dir,
                cache_dir=layer_cache_dir(self.state_dir), credentials=credentials,
                use_docker_config=False, team=rec.team,
                reserve=space_reserve(self.orchestrator.admission))
        except AgentEnvError as exc:
            raise BuildFailed(f"pulling {body.fromImage} failed: {exc}", BASE_STEP) from exc
        rec.log("info", f"pulled {pulled.reference} ({pulled.manifest_digest[:19]}): "
                f"{pulled.layers_converted} layers converted, {pulled.layers_cached} cached, "
                f"{pulled.layers_fetched} overlaybd layers fetched as they are, "
                f"{pulled.bytes_downloaded / 1e6:.1f} MB in {pulled.seconds:.1f} s", BASE_STEP)
        if pulled.format == "converted":
            disk_bytes = VIRTUAL_SIZE
        else:
            disk_bytes = int(inspect_layer(pulled.lowers[-1])["virtual_size"])
        return pulled.lowers, disk_bytes, pulled.config

    async def _publish(self, rec: BuildRecord, ref: Any, context: Any) -> None:
        """Register the build under its tags (a new template, or its new "default" snapshot);
        the build no tag names any more is released (node/template_tags.py)."""
        old = self.catalogue.get(rec.template_id)
        now = time.time()
        tpl = TemplateRecord(
            template_id=rec.template_id, kind="template", names=[rec.name], ref=ref,
            cpu_count=rec.cpu_count, memory_mb=rec.memory_mb, disk_size_mb=rec.disk_size_mb,
            envd_version=rec.envd_version or self.config.default_envd_version,
            created_at=old.created_at if old else now, updated_at=now,
            spawn_count=old.spawn_count if old else 0,
            last_spawned_at=old.last_spawned_at if old else None, build_status="ready",
            team=rec.team, idle_pause_after=rec.idle_pause_after if rec.idle_pause_after
            is not None else old.idle_pause_after if old else None)
        build = BuildSnapshot(
            build_id=rec.build_id, template_id=rec.template_id, ref=ref, cpu_count=rec.cpu_count,
            memory_mb=rec.memory_mb, disk_size_mb=rec.disk_size_mb, envd_version=tpl.envd_version,
            created_at=rec.created_at)
        try:
            if old is not None:
                await self.catalogue.tags.adopt_untagged(
                    rec.template_id, self.records.newest_ready(rec.template_id))
            await self.catalogue.tags.publish(tpl, build, rec.tags or [DEFAULT_TAG])
        except BaseException:
            with contextlib.suppress(Exception):
                await self.backend.delete_snapshot(ref)
            raise
        rec.context = context.to_json()
        rec.status = "ready"
        rec.finished_at = rec.updated_at = time.time()
        if self.on_published is not None:  # AENV_SNAPSHOT_PUBLISH (node/snapshot_api.py)
            self.on_published(rec.name, rec.build_id, rec.template_id)
