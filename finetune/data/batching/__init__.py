"""Prepared rows into batches (the wing of finetune.data above formats and sources).

* `packing.py`: examples packed into rows (sequential, multipack, the stream's bounded buffer).
* `pairs.py`: preference pairs and kto examples packed whole; KTO's KL rows.
* `collate.py`, `vision.py`: rows into tensors (text; preference rows; rows with images, with their
  pixels processed at collate time).
* `sampler.py`, `loader.py`: which rows each process trains on, and the DataLoader over them.
* `streaming.py`: data.streaming's loader: rows read, tokenized and packed while the model trains,
  its position checkpointed.
"""
