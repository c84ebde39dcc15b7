"""blockd: the per-host block daemon serving every sandbox disk over NBD and FUSE."""
