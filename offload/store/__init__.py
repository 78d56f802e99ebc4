"""Where a unit's bytes come from: host masters staged one unit at a time (`staging`; the model laid out against its file first: `model_layout`; which file key holds which
tensor: `file_keys`; which file tensor holds each leaf, as stored or cast, quantized weights' inner tensors
included: `leaf_match`), the safetensors file read in
positioned ranges with change detection (`storage`; a GGUF file with the same interface: `gguf_file`), the sources a unit is copied from (`sources`: pinned RAM,
pageable RAM through a bounce buffer, the disk tier), the packed execution-ordered disk format (`packed` reads
it, `pack_writer` writes it, `index_check` validates its index; units may be stored compressed), the host copy
several processes offloading the same file share (`shared_host`; its segment files, only our own user's:
`shm_segment`; its header, with each unit's form: `shared_forms`; the models of one process mapping it, under one
lock: `shared_local`), and the compressed host form: `codec` (the lossless "expwin" encoding, decoded on the device in
place, one chunk at a time by `chunk_decode`), `compressed` (a unit held encoded in RAM: staging and its
`CompressedSource`), `spill` (the copy-on-write map its tensors view between passes). Every header and index is
checked by one validator first (`header_check`: files are untrusted).

Layer: below plan/, budget/ and stream/; imports only model/, backends/ and the config vocabulary.
Used from outside: `model_layout.lay_out_model` / `verify_for_disk` / `ModelLayout` / `shared_tensor_ids`,
`staging.stage_model`, `staging.StagedModel`, `storage.SafetensorsFile`,
`storage.CorruptFileError`, `storage.SourceChangedError`, `sources.HostSource` / `BouncedSource` / `DiskSource`,
`packed.open_weights`, `pack_writer.pack_file`, `pack_writer.pack_handle`, `shared_host.available`,
`shared_host.SharedUnit` (`written`, `has_private_pages`, `copy.alone` / `give_back`), `shared_host.SharedHostCopy.peek`
(the forms a joining process plans with), `header_check.CorruptFileError`,
`header_check.read_json_object` / `read_json_file` (small JSON files), `header_check.safetensors_tensors`,
`codec.encode` / `decode_into` / `CODEC`, `compressed.CompressedSource` / `unit_host_bytes` / `unit_compression` /
`unit_shared` / `unit_segment` / `estimate_layout_size` / `measure_decode_gbps` / `disk_source` /
`StoredDiskSource`, `file_keys.stored_units`, `leaf_match.holding_map` / `leaf_from_file` / `FileMap` /
`planned_casts`, `sources.cast_scratch_bytes`, `gguf_file.read_gguf_header` / `GGML_TYPES` / `GgufFile`.
"""
