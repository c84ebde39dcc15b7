"""overlaybd storage engine: LSMT layers, ZFile, tar wrapper, image stacks."""
