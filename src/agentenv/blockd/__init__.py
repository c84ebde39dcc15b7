"""blockd: the per-host block daemon serving every sandbox disk over NBD and FUSE.

- `daemon.Blockd` (`aenv blockd`): owns every device; control RPC and state layout are in
  daemon.py's docstring.
- `client.BlockdClient` / `client.AsyncBlockdClient`: what the node and the VM runtime call;
  `DeviceInfo.uri` is the `nbd+unix:///EXPORT?socket=PATH` string QEMU takes.
- `nbd`: the NBD server (fixed newstyle, simple replies), one unix socket per device.
- `fuse`: every device as a regular file under STATE/fuse (loop-mountable).
- `serve.serve_image` (`aenv nbd serve`): one image over NBD without the daemon.
"""
