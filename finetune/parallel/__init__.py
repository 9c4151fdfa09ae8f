"""Parallelism beyond data parallel, on the libraries' own engines (docs/scale-out.md):

* `sizes`: which processes read the same rows, and the checks that need the engine (the number of
  processes, a GPU) or the model (its heads, its TP plan);
* `tensor`: tensor parallel, the model's own TP plan through transformers' DistributedConfig (DTensor),
  prepared without a data-parallel wrapper, checkpointed through torch.distributed.checkpoint;
* `sequence`: sequence parallel, DeepSpeed's Ulysses attention and loader adapter (ALST), with packed
  sequences kept apart after the heads-for-sequence exchange;
* `context`: context parallel, torch's ring attention through Accelerate's ParallelismConfig cp_size;
* `offload`: activation offloading to pinned host memory through saved-tensor hooks.
"""
