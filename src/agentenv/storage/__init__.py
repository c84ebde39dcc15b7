"""overlaybd storage engine: LSMT layers, ZFile, tar wrapper, image stacks.

Byte-compatible with containerd/overlaybd (docs/overlaybd.md). Modules:

- `lsmt`: header/trailer blocks, 16-byte segment mappings, index algebra (insert, merge, compress)
- `upper`: the writable upper (upper.data + upper.index log), in-place seal (C++ close_seal)
- `builder`: `LayerBuilder`, `commit_upper`, `commit_sealed` (C++ compact, docs/overlaybd.md §4.4)
- `zfile`, `tarwrap`, `crc`: ZFile compression, the tar wrapper, raw CRC-32C
- `layer`: opening sealed layers through their wrappers, `inspect_layer`
- `config`: image config JSON; `image`: `Image`, the stack used for block I/O
- `export`: `export_raw` (sparse raw disk), `import_raw` (raw disk -> layer)

Where C++ and Rust (kvcache-ai/AgentENV) differ, this follows C++: uppercase UUID text and the
null UUID as the all-zero string; compress merge limit `< 16383`; 64-sector compaction
pieces; trailer right after the 256-entry-padded index (512-aligned, not 4 KiB); parent uuid
defaulting to the source header's; close_seal with zero padding to 512 (C++ leaves it
uninitialised), trailer not 4 KiB-aligned and an empty user_tag; RW index log tags =
number of lowers; the 1e6 / 1.28e8 entry limits. Reads beyond the virtual size are refused
(neither served as C++ nor clamped as Rust): the block daemon checks ranges anyway.
Not byte-exact: LZ4 blocks (python-lz4 is LZ4 1.9.x, C++ vendors 1.8.3; decoding is compatible)
and ZSTD blocks (libzstd version dependent). Not supported: sparse RW uppers (flag 0x10),
remote (`digest`-only) lowers, TurboOCI/gzip warp layers, Rust's hybrid uppers.
"""
