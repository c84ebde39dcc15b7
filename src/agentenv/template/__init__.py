"""Templates: OCI images into overlaybd layers, build steps, boot snapshots."""
