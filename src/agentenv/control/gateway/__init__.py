"""`aenv gateway`: the one entry point of a cluster (E2B API, sandbox traffic, teams).

app.py is the ASGI app, placement.py the scheduler link (gRPC), store.py the teams and
ownership records (Redis), server.py runs it. Sandbox traffic goes through agentenv.relay, the
same relay as the node's proxy.
"""
