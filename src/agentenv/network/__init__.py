"""Host-side network policy: sandbox egress policies (policy.py), the node-wide egress proxy
and metadata service (proxy process), and the node's client for it (control.py)."""
