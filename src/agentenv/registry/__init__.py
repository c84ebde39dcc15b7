"""The OCI registry client: image references, Docker credentials, manifests and blobs.

Below template/, blockd/, snapshot/ and node/, which all fetch from registries; it imports
nothing of agentenv but `errors` and `boundedjson`.
"""
