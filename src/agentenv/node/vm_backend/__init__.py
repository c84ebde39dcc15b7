"""The VM backend: every sandbox is a QEMU VM run by `agentenv.runtime`.

- start(): a block daemon (blockd.py), the guest assets (kernel, initramfs, tools disk), the
  egress proxy (egress.py), the runtime; VMs of a crashed run are taken over (adoption.py).
- default_templates(): the built-in `base` and `code-interpreter-v1` templates
  (node/base_template.py), built on first start (AENV_VM_CODE_INTERPRETER=0: base only).
- create = a ready-pool VM of the template + `/init`, else a restore of its boot snapshot;
  pause = runtime.pause (memory kept), or with memory=False a filesystem-only pause (envd's
  /aenv/sync, then only the disks are sealed);
  resume = restore the pause snapshot, or cold-boot a filesystem-only one from its disks;
  snapshot = snapshot with the VM kept running;
  fork = one snapshot, then one restore per child.

Modules, one concern each:
- backend.py: `VmBackend`, the protocol methods and the capabilities of node/backend.py;
- blockd.py: which blockd serves the disks, its supervision, what a restarted one brought back;
- adoption.py: the VM manifests and taking VMs over after a node crash;
- snapshots.py: the snapshot store (directories, owners, release and collection);
- egress.py: the egress proxy and what it is told about each VM's slot;
- metrics.py: resource samples of a VM; errors.py: runtime errors -> BackendError.

Crashes: VMs outlive a node killed with SIGKILL; the next start adopts each one whose QEMU and
blockd devices are still there and ends the others (adoption.py). The private blockd is reused
when it survived; a blockd started again reopens its devices from their records, and QEMU's NBD
disks reconnect to it (runtime/qemu.py), so the VMs are adopted then too. A graceful stop pauses
every VM first.

Creates take a pre-restored, warmed VM from a ready pool when one is parked for the template
(node/ready_pool.py; AENV_VM_POOL_LOW/_HIGH/_TEMPLATES/_IDLE, 0 disables): the create is then one
envd `/init` with the sandbox's identity. The pooled VMs are not sandboxes: the orchestrator never
sees them, a graceful stop kills them, and their manifests (<state>/vm-backend/pool/) let the next
start end them after a crash. Every guest gets E2B's identity variables (E2B_SANDBOX=true,
E2B_SANDBOX_ID, E2B_TEMPLATE_ID) with the sandbox's env vars at `/init`.

A VM that dies on its own (QEMU killed, crashed) is reported through the `on_sandbox_lost`
callback given at construction; the orchestrator then removes the sandbox. A sandbox's
cpu_count/memory_mb/disk_size_mb are the template's: a restore cannot change the machine a
snapshot was taken of, so a template record whose sizes differ from its snapshot's machine is
refused at create.
"""

from agentenv.node.vm_backend.backend import SLOT_COOLDOWN, SYNC_TIMEOUT, VmBackend
from agentenv.node.vm_backend.blockd import BLOCKD_WAIT
from agentenv.node.vm_backend.snapshots import RELEASED_MARK

__all__ = ["BLOCKD_WAIT", "RELEASED_MARK", "SLOT_COOLDOWN", "SYNC_TIMEOUT", "VmBackend"]
