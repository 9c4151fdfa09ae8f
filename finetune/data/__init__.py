"""The data of LLM training, in four wings; a wing imports only the wings below it (the order is
checked by tests/unit/test_import_graph.py, `INNER_LAYERS`):

* `prepare/`: a recipe's datasets prepared once and cached: the build (load, tokenize, merge, split,
  weight, pack, save), what identifies a preparation (its fingerprint), the cache folders and their
  lock, the manifest.
* `batching/`: prepared rows into batches: packing, samplers, collation (text, preference pairs,
  images), the DataLoader, and the stream loader of data.streaming.
* `formats/`: raw rows into token ids and labels: one module per entry type, found through
  `formats/registry.py`, and the paths they share (rows, encode, chat, images, tokenize).
* `sources/`: where data lives and how it is read: an entry's location (no torch, datasets or
  transformers), the readers (files, folders, saved datasets, Hub ids, URLs; as streams too), and
  damaged files.
"""
