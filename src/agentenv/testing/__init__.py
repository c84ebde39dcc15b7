"""What the tests, the benches and `aenv vm smoke` share to drive VMs without a node: the
busybox test guest (`guest`) and the harness (`harness`: a blockd, a runtime on a private loop,
shell commands in the test guest). Nothing of the product imports it (a contract in
pyproject.toml)."""
