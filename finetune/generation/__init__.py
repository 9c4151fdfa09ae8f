"""Generation with the model being trained or evaluated, below the objectives.

* `sampling`: the sampling primitive: chat prompts rendered and tokenized as training tokenizes
  them, left-padded batches, stop tokens (eos and the chat templates' end-of-turn tokens), greedy
  decoding with the KV cache, and streaming for `finetune chat`.
* `metrics`: answer extraction and scoring (exact_match, contains).
* `sets`: generation sets (eval.generation_sets) end to end: rows loaded with the data layer's
  loader, answers generated, scored and summarised; during training (main process, trackers) and in
  `finetune eval`.

Library code taking plain arguments (a model, a tokenizer, rows). Used by training-time evaluation
(finetune.objectives), `finetune eval` and `finetune chat` (finetune.evaluation).
"""
