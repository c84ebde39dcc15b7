"""agentenv.rollout over a process-backend node (the VM backend's branch of a paused
trajectory and rollback are in test_rl_lifecycle.py): trajectories are made, stepped, paused,
resumed, branched and mapped with bounded concurrency; a create refused by admission (429) is
retried until a place frees, or fails naming the limit; closing the pool kills what is left."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from agentenv.rollout import RolloutError, RolloutPool

from .conftest import NodeProcess


@pytest.fixture(scope="module")
def two_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    """A process node that runs at most two sandboxes."""
    base = tmp_path_factory.mktemp("rollout")
    node = NodeProcess(base / "state", base / "node.log",
                       extra_env={"AENV_MAX_SANDBOXES": "2"})
    node.start()
    yield node
    node.cleanup()


def _pool(node: NodeProcess, **overrides: object) -> RolloutPool:
    return RolloutPool(api_url=node.url, api_key=node.api_key, timeout=120, **overrides)


def _live(node: NodeProcess) -> set[str]:
    with node.client() as api:
        return {s["sandboxID"] for s in api.get("/v2/sandboxes").json()}


def test_trajectories_step_pause_resume_branch_and_close(two_node: NodeProcess) -> None:
    async def scenario() -> None:
        async with _pool(two_node, concurrency=2) as pool:
            root = await pool.create()
            await root.write("/tmp/state", "root")
            assert (await root.step("cat /tmp/state")).stdout == "root"
            await root.pause()
            await root.resume()
            assert await root.read("/tmp/state") == "root"
            (child,) = await root.branch(1)  # a running root: a checkpoint in place
            outs = await pool.map(lambda t: t.step("cat /tmp/state"), [root, child])
            assert [o.stdout for o in outs] == ["root", "root"]
            with two_node.client() as api:  # they pause themselves when idle, branches too
                for t in (root, child):
                    detail = api.get(f"/sandboxes/{t.sandbox_id}").json()
                    assert detail["lifecycle"]["idlePauseAfter"] == 30
            assert {t.sandbox_id for t in pool.live} == {root.sandbox_id, child.sandbox_id}
            with pytest.raises(RolloutError, match="AENV_MAX_SANDBOXES"):
                await _pool(two_node, retries=0).create()
        assert _live(two_node) == set()  # the pool killed what it made

    asyncio.run(scenario())


def test_a_refused_create_is_retried_until_a_place_frees(two_node: NodeProcess) -> None:
    async def scenario() -> None:
        async with _pool(two_node, retries=30, backoff=0.1) as pool:
            first = await pool.create()
            await pool.create()
            third = asyncio.create_task(pool.create())
            while pool.retried == 0:  # refused (429) at least once, past the SDK's retries
                assert not third.done(), third
                await asyncio.sleep(0.05)
            await first.close()
            made = await third
            assert await made.read("/etc/hostname") is not None
        assert _live(two_node) == set()

    asyncio.run(scenario())
