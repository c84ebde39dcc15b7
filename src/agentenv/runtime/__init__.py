"""VM runtime on QEMU: boot, pause, restore, fork, network slots, warm pools."""
