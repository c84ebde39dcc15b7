"""Snapshot records: memory layers, disk layers, device state, machine config."""
