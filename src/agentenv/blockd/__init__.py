"""blockd: the per-host block daemon serving every sandbox disk over NBD and FUSE.

- `daemon.Blockd` (`aenv blockd`): the daemon shell (state lock, start/stop, FUSE, metrics) and
  its table of control operations, documented in daemon.py's docstring.
- `rpc`: the control transport (unix socket, JSON lines, dispatch, errors as JSON).
- `manager.DeviceManager`: the devices, their records and uppers; the state layout.
- `results`: the typed records the operations return (`DeviceInfo`, ...) and clients read.
- `device.Device`: one image behind a gate with counters; `nbd`: the NBD server, one unix
  socket per device; `fuse`: every device as a regular file under STATE/fuse.
- `client.BlockdClient` / `client.AsyncBlockdClient`: what the node and the VM runtime call;
  `DeviceInfo.uri` is the `nbd+unix:///EXPORT?socket=PATH` string QEMU takes.
- `serve.serve_image` (`aenv nbd serve`): one image over NBD without the daemon.
"""
