"""A recipe's datasets prepared once and cached (the top wing of finetune.data).

* `build.py`: `prepare(recipe)`, `load_prepared`, `prepare_on_main_process`: load, tokenize, merge,
  split, weight, pack and save.
* `fingerprint.py`: what identifies a preparation, and `cached`, the complete preparation of a recipe,
  found without importing datasets or transformers.
* `cache.py`: the folders, atomic writes, the lock and stale-folder cleanup (shared with the image
  prepare step, finetune.diffusion.cache).
* `manifest.py`: the manifest of a preparation (every row accounted for) and the summary printed from it.
* `mixture.py`: weighted mixtures: which rows each training dataset contributes.
"""
