"""Generation-based evaluation: batched greedy generation from chat prompts, answer extraction and
scoring, and one function that runs an evaluation set end to end.

Library code taking plain arguments (a model, a tokenizer, rows); `finetune eval`, `finetune chat`
and the in-training evaluation call it.
"""
