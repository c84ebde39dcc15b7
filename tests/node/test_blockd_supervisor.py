"""The node's blockd supervisor against real blockd processes: a blockd killed with SIGKILL is
started again with its devices (same ids, same sockets), the new process is announced, and a
blockd the node cannot start is reported with the reason."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path
from typing import Any

from agentenv.blockd.client import AsyncBlockdClient
from agentenv.node.blockd_supervisor import BlockdLaunch, BlockdSupervisor


def _launch(root: Path) -> BlockdLaunch:
    return BlockdLaunch(root / "state", root / "blockd.sock", root / "blockd.log",
                        root / "blockd.pid")


def test_killed_blockd_comes_back_with_its_devices(tmp_path: Path) -> None:
    async def main() -> None:
        seen: list[dict[str, Any]] = []

        async def announced(identity: dict[str, Any]) -> None:
            seen.append(identity)

        launch = _launch(tmp_path)
        sup = BlockdSupervisor(launch.socket, launch=launch, interval=0.2,
                               on_new_blockd=announced)
        await sup.start()  # no blockd yet: the supervisor starts it
        try:
            assert sup.problem() is None and sup.pid is not None
            client = AsyncBlockdClient(launch.socket)
            device = await client.create_blank(size=16 << 20)
            first = sup.pid
            assert int(launch.pidfile.read_text()) == first

            os.kill(first, signal.SIGKILL)
            t0 = time.monotonic()
            deadline = t0 + 5
            while sup.problem() is None:  # noticed within a few ping intervals
                assert time.monotonic() < deadline, "a dead blockd was not noticed"
                await asyncio.sleep(0.05)
            noticed = time.monotonic() - t0
            assert "blockd" in (sup.problem() or "")
            assert await sup.wait_up(60), sup.problem()
            back = time.monotonic() - t0
            assert sup.pid != first and sup.restarts == 1
            assert [s["pid"] for s in seen] == [sup.pid]
            assert int(launch.pidfile.read_text()) == sup.pid
            # The same device, at the same socket, from its record.
            again = {d.id: d for d in await client.list()}
            assert again[device.id].nbd == device.nbd
            await client.close()
            print(f"\nblockd killed: noticed after {noticed:.2f} s, answering again after "
                  f"{back:.2f} s")
        finally:
            await sup.close()
            await asyncio.to_thread(sup.stop_blockd)
        assert not launch.pidfile.exists()

    asyncio.run(main())


def test_blockd_the_node_cannot_start_is_reported(tmp_path: Path) -> None:
    async def main() -> None:
        # Only watched (no launch): a socket nobody serves.
        sup = BlockdSupervisor(tmp_path / "nobody.sock", interval=0.2)
        await sup.start()
        try:
            problem = sup.problem() or ""
            assert str(tmp_path / "nobody.sock") in problem and "does not answer" in problem
            assert not await sup.wait_up(0.3)
        finally:
            await sup.close()

    asyncio.run(main())
