"""Raw rows into token ids and labels (the wing of finetune.data above sources).

One module per dataset entry `type` (alpaca, chat_template, completion, input_output, kto,
preference, prompt, tokenized), each owning its encoding, found through `registry.py`; and the
paths they share:

* `rows.py`: the bad row and its reasons, checks of one value;
* `encode.py`: the tokenizer's Encoder and the tokenization paths (text, prompt and completion, chat,
  and image markup expanded into the model's image tokens);
* `chat.py`: chat messages normalized (their tool calls too), and the trained spans of a rendered
  conversation;
* `images.py`: the images of vision-language rows: where they come from, opened and checked;
* `tokenize.py`: a format run over a dataset (prepare) or a stream (data.streaming), the length
  policy, and every row accounted for.
"""
