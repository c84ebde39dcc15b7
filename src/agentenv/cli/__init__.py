"""The `aenv` command line."""
