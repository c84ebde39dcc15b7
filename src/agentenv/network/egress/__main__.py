"""`python -m agentenv.network.egress`: the proxy process (what process.py starts)."""

from agentenv.network.egress.cli import main

main()
