"""The control plane's gRPC contracts (*.proto) and the code `make proto` generates from them."""
