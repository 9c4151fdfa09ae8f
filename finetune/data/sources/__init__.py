"""Where a dataset entry's data lives and how its raw rows are read (the bottom wing of finetune.data).

* `location.py`: where an entry's path points (a URL, a local file or folder, a saved dataset, a Hub
  id), which files it reads, with which datasets builder, and what identifies their content: plain
  functions, no torch, datasets or transformers (a cache hit needs nothing more).
* `readers.py`: the raw rows of an entry, as a Dataset (`load_source`) or an IterableDataset
  (`load_stream`, data.streaming), every failure a DataError naming the entry.
* `damage.py`: the damaged lines of a local file (invalid JSON, bytes that are not UTF-8, ragged CSV
  rows), named or skipped.
"""
