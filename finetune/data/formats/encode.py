"""Token ids and labels from normalized rows: the tokenization paths the data formats share.

A format (finetune/data/formats/<type>.py) turns a batch of raw rows into texts, (prompt,
completion) pairs or conversations, and hands them to one of these paths (`chat_examples` and
`pair_examples` take the dataset entry and read its options themselves: ``apply_chat_template``,
``train_on_inputs``, ``train_on_eos``, ``roles_to_train``, which mean the same in every format):

* `text_examples`: ``[bos] text eos``, all trained (completion).
* `prompt_completion_examples`: ``[bos] prompt completion eos`` with the prompt masked unless
  ``train_on_inputs``. The prompt and the completion are tokenized separately and their ids
  concatenated, so no token straddles the boundary and the mask is exact (alpaca, input_output).
* `chat_examples`: conversations rendered with the chat template, the tokens that overlap a trained
  span (finetune.data.formats.chat.chat_spans) trained (chat_template; alpaca and input_output with
  apply_chat_template).

* `expand`: for a vision-language model, a rendered text with images (finetune.data.formats.images: a
  `SENTINEL` per image, rendered as image parts) holds the template's own image markup (Qwen2-VL's
  ``<|vision_start|><|image_pad|><|vision_end|>``, Idefics3's ``<image>``, Gemma 3's
  ``<start_of_image>``); after the ids and labels are found as for text, the model's processor expands
  each image's markup into the tokens the model expects for that image (their number depends on the
  image's size: Qwen2-VL's grid, Idefics3's tiles, Gemma 3's fixed 256), and the labels are carried
  over by aligning the two id sequences (the processor changes only the tokens around images). Image
  tokens are never trained (chat_template's `image_examples`; preference and kto prompts with images).

``bos`` is whatever the tokenizer itself adds (its post-processor); the eos is trained unless
``train_on_eos: none``. The tokenizer's bos is prepended to a rendered chat when the text doesn't
start with it already. Labels here may still train the first token: tokenize.py sets it to -100.
"""

from __future__ import annotations

import difflib
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetune.constants import IGNORE_INDEX
from finetune.data.formats import images
from finetune.data.formats.chat import ChatTemplateError, chat_spans, empty_turns, pair_turns, render_messages
from finetune.data.formats.rows import BadRow, Example
from finetune.model.families import IMAGE_MARKUP_ATTRIBUTES


@dataclass(frozen=True)
class Encoder:
    """The tokenizer and what every format's tokenization needs of it, computed once per entry."""

    tokenizer: Any
    prefix_ids: list[int]  # the ids the tokenizer puts before a text by itself (usually [bos] or nothing)
    eos_id: int | None
    chat_template: str | None = None  # an override of the tokenizer's template (model.chat_template)
    vocab_size: int = 0  # ids of pre-tokenized rows must be below it
    processor: Any = (
        None  # a vision-language model's processor (finetune.data.batching.vision): rows may hold images
    )
    image_root: Path | None = None  # where relative image paths start (the data file's folder)
    image_max_pixels: int | None = None  # images are resized to at most this many pixels (aspect kept)
    image_paths_outside: bool = False  # data.allow_image_paths_outside: paths may leave image_root

    def ids(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, without special tokens, in one call for the whole batch."""
        return [e.ids for e in self.encode(texts, offsets=False)]

    def encode(self, texts: list[str], *, offsets: bool) -> list[Any]:
        """``tokenizers.Encoding`` per text (a batch call: the Rust tokenizer uses every core).

        The transformers wrapper costs about twice the tokenization itself in Python conversions,
        so the backend is called directly once the wrapper has set its state (no truncation or
        padding, its split_special_tokens choice) with a call on an empty string.
        """
        if not getattr(self.tokenizer, "is_fast", False):
            ids = self.tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]
            return [_Ids(x) for x in ids]
        self.tokenizer("", add_special_tokens=False)
        backend = self.tokenizer.backend_tokenizer
        if offsets:
            return backend.encode_batch(texts, add_special_tokens=False)
        return backend.encode_batch_fast(texts, add_special_tokens=False)

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = False,
    ) -> str:
        """A conversation rendered by the chat template (the override, else the tokenizer's own),
        with the row's tool definitions when it has any. For a vision-language model every content
        is a list of parts, its images as image parts (finetune.data.formats.images.as_parts)."""
        if self.processor is not None:
            messages = images.as_parts(messages)
        return self.tokenizer.apply_chat_template(
            messages,
            tools=tools,
            tokenize=False,
            chat_template=self.chat_template,
            add_generation_prompt=add_generation_prompt,
        )

    def template(self) -> str:
        """The chat template that renders the rows (the override, else the tokenizer's own)."""
        return self.chat_template or self.tokenizer.chat_template

    def renders_tools(self) -> bool:
        """Whether the chat template reads a ``tools`` variable (the definitions a row passes)."""
        # transformers' own parse of the template (its Jinja environment knows the {% generation %}
        # tag that a plain jinja2 parse would reject); cached per template.
        from transformers.utils.chat_template_utils import _get_template_variables

        return "tools" in _get_template_variables(self.template())

    def labelled(self, encoding: Any, spans: list[tuple[int, int]] | None) -> tuple[list[int], list[int]]:
        """(ids, labels) of a rendered text: tokens overlapping a trained span get labels (every token
        when `spans` is None), and the tokenizer's bos goes first unless the text starts with it."""
        ids = encoding.ids
        if spans is None:
            labels = list(ids)
        else:
            labels = [IGNORE_INDEX] * len(ids)
            for a, b in spans:
                t0, t1 = _token_range(encoding, a, b)
                labels[t0:t1] = ids[t0:t1]
        prefix = self.prefix_ids
        if prefix and ids[: len(prefix)] != prefix:
            ids, labels = [*prefix, *ids], [IGNORE_INDEX] * len(prefix) + labels
        return ids, labels


def make_encoder(tokenizer: Any, chat_template: str | None = None, processor: Any = None) -> Encoder:
    """The Encoder of `tokenizer`: its prefix ids found by tokenizing a text with and without them."""
    with_special = tokenizer("a", add_special_tokens=True)["input_ids"]
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    start = next((k for k in range(len(with_special)) if with_special[k : k + len(plain)] == plain), 0)
    return Encoder(
        tokenizer,
        list(with_special[:start]),
        tokenizer.eos_token_id,
        chat_template,
        len(tokenizer),
        processor,
    )


@dataclass
class _Ids:
    """Stand-in for ``tokenizers.Encoding`` with a slow tokenizer (ids only)."""

    ids: list[int]


def _token_range(encoding: Any, start: int, end: int) -> tuple[int, int]:
    """Tokens [t0, t1) that overlap the characters [start, end) (via the offset mapping)."""
    t0 = next((t for c in range(start, end) if (t := encoding.char_to_token(c)) is not None), None)
    if t0 is None:
        return 0, 0
    t1 = next(t for c in range(end - 1, start - 1, -1) if (t := encoding.char_to_token(c)) is not None)
    return t0, t1 + 1


# ----------------------------------------------------------------------------------------------- paths


def text_examples(texts: list[str | BadRow], enc: Encoder, *, train_eos: bool) -> list[Example | BadRow]:
    """``[bos] text eos`` per text, every token trained (the eos when `train_eos`)."""
    all_ids = enc.ids([t if isinstance(t, str) else "" for t in texts])
    prefix, eos = enc.prefix_ids, enc.eos_id
    rows: list[Example | BadRow] = []
    for text, ids in zip(texts, all_ids, strict=True):
        if isinstance(text, BadRow):
            rows.append(text)
            continue
        ids = [*prefix, *ids, eos]
        rows.append((ids, [*ids[:-1], eos if train_eos else IGNORE_INDEX]))
    return rows


def prompt_completion_examples(
    pairs: list[tuple[str, str] | BadRow], enc: Encoder, *, train_on_inputs: bool, train_eos: bool
) -> list[Example | BadRow]:
    """``[bos] prompt completion eos`` per pair, the prompt masked unless `train_on_inputs`."""
    ok = [p if isinstance(p, tuple) else ("", "") for p in pairs]
    prompt_ids = enc.ids([p for p, _ in ok])
    completion_ids = enc.ids([c for _, c in ok])
    prefix, eos = enc.prefix_ids, enc.eos_id
    end = eos if train_eos else IGNORE_INDEX
    rows: list[Example | BadRow] = []
    for pair, p_ids, c_ids in zip(pairs, prompt_ids, completion_ids, strict=True):
        if isinstance(pair, BadRow):
            rows.append(pair)
            continue
        ids = [*prefix, *p_ids, *c_ids, eos]
        if train_on_inputs:
            labels = [*ids[:-1], end]
        else:
            labels = [IGNORE_INDEX] * (len(prefix) + len(p_ids)) + [*c_ids, end]
        rows.append((ids, labels))
    return rows


def chat_examples(
    convs: list[list[dict[str, Any]] | BadRow],
    enc: Encoder,
    entry: Any,
    *,
    field: str,
    tools: list[list[dict[str, Any]] | None] | None = None,
) -> list[Example | BadRow]:
    """Each conversation rendered with the chat template (with its row's tool definitions, `tools`,
    when given); the turns of the entry's `roles_to_train` (and their end-of-turn text, per its
    `train_on_eos`) trained, or every token with its `train_on_inputs`. `field` names the column in
    the problems of a row (an empty trained turn, a template that rejects it)."""
    texts, found = chat_texts(convs, enc, entry, field=field, tools=tools)
    rows: list[Example | BadRow] = []
    for spans, encoding in zip(found, enc.encode(texts, offsets=True), strict=True):
        if isinstance(spans, BadRow):
            rows.append(spans)
        else:
            rows.append(enc.labelled(encoding, None if entry.train_on_inputs else spans))
    return rows


def chat_texts(
    convs: list[list[dict[str, Any]] | BadRow],
    enc: Encoder,
    entry: Any,
    *,
    field: str,
    tools: list[list[dict[str, Any]] | None] | None = None,
) -> tuple[list[str], list[list[tuple[int, int]] | BadRow]]:
    """Each conversation's rendered text ("" for a bad row) and its trained character spans (or the
    BadRow): the first half of `chat_examples`, which finetune.data.batching.vision shares."""
    texts: list[str] = []
    found: list[list[tuple[int, int]] | BadRow] = []
    for conv, row_tools in zip(convs, tools or [None] * len(convs), strict=True):
        text, spans = "", conv if isinstance(conv, BadRow) else None
        if spans is None and not entry.train_on_inputs:
            spans = empty_turns(conv, entry.roles_to_train, field)
        if spans is None:
            render = functools.partial(enc.render, tools=row_tools) if row_tools else enc.render
            try:
                text, spans = _chat_text(conv, render, entry)
            except ChatTemplateError as e:
                spans = BadRow(field, e.reason, str(e))
        texts.append(text)
        found.append(spans)
    return texts, found


def _chat_text(conv: list[dict[str, Any]], render: Any, entry: Any) -> tuple[str, list[tuple[int, int]]]:
    """(rendered text, trained spans) of one conversation; every token trains with train_on_inputs."""
    if entry.train_on_inputs:
        return render_messages(render, conv), []
    return chat_spans(conv, render, roles_to_train=entry.roles_to_train, train_on_eos=entry.train_on_eos)


def pair_examples(
    pairs: list[tuple[str, str] | BadRow], enc: Encoder, entry: Any, *, field: str
) -> list[Example | BadRow]:
    """(prompt, completion) pairs: as a user and an assistant turn rendered with the chat template
    when the entry has `apply_chat_template` (`chat_examples`), else as ``[bos] prompt completion eos``
    (its `train_on_inputs` and `train_on_eos` apply either way)."""
    if entry.apply_chat_template:
        return chat_examples(pair_turns(pairs), enc, entry, field=field)
    return prompt_completion_examples(
        pairs, enc, train_on_inputs=entry.train_on_inputs, train_eos=entry.train_on_eos != "none"
    )


# ---------------------------------------------------------------------------------------------- images


PROCESSOR_REJECTED = "processor_rejected"
"""Bad-row reason: the processor could not turn the row's text and images into model inputs."""


def load_images(conv: list[dict[str, Any]], enc: Encoder, field: str) -> list[bytes] | BadRow:
    """The bytes of a conversation's images in order, each opened and checked (images.load_image)."""
    out = []
    for j, message in enumerate(conv):
        for k, ref in enumerate(message.get("images") or []):
            where = f"{field}[{j}].content (image {k})"
            data = images.load_image(
                ref, where, enc.image_root, enc.image_max_pixels, outside_ok=enc.image_paths_outside
            )
            if isinstance(data, BadRow):
                return data
            out.append(data)
    return out


def expand(
    enc: Encoder, text: str, imgs: list[bytes], ids: list[int], labels: list[int], *, field: str
) -> tuple[list[int], list[int]] | BadRow:
    """(ids, labels) with each image's markup expanded by the processor into the model's image tokens;
    the labels carried over from the unexpanded ids, image tokens masked."""
    try:
        out = enc.processor(text=[text], images=[[images.decode(b) for b in imgs]], add_special_tokens=False)
    except Exception as exc:  # the processor's own checks (too small an image, token count mismatch ...)
        return BadRow(field, PROCESSOR_REJECTED, f"the processor rejected the row's text and images: {exc}")
    full = [int(t) for t in out["input_ids"][0]]
    prefix = enc.prefix_ids
    if prefix and full[: len(prefix)] != prefix:
        full = [*prefix, *full]
    return full, align(ids, labels, full, image_token_ids(enc.processor))


def align(ids: list[int], labels: list[int], full: list[int], masked: set[int]) -> list[int]:
    """Labels for `full` (the processor's ids): those of `ids` where the two sequences match (difflib's
    matching blocks), -100 on what the processor inserted or changed and on the `masked` ids.

    >>> align([5, 9, 7, 8], [-100, -100, 7, 8], [5, 3, 9, 9, 9, 3, 7, 8], {9})
    [-100, -100, -100, -100, -100, -100, 7, 8]
    """
    out = [IGNORE_INDEX] * len(full)
    matcher = difflib.SequenceMatcher(None, ids, full, autojunk=False)
    for a, b, size in matcher.get_matching_blocks():
        out[b : b + size] = labels[a : a + size]
    return [IGNORE_INDEX if t in masked else label for t, label in zip(full, out, strict=True)]


def image_token_ids(processor: Any) -> set[int]:
    """The ids of the image markup tokens a processor and its tokenizer name (never trained): the
    attributes the vision families table lists (finetune.model.families.IMAGE_MARKUP_ATTRIBUTES)."""
    tokenizer = processor.tokenizer
    ids = set()
    for owner in (processor, tokenizer):
        if isinstance(getattr(owner, "image_token_id", None), int):
            ids.add(owner.image_token_id)
        for name in IMAGE_MARKUP_ATTRIBUTES:
            token = getattr(owner, name, None)
            token = getattr(token, "content", token)  # an AddedToken
            if isinstance(token, str) and token:
                token_id = tokenizer.convert_tokens_to_ids(token)
                if isinstance(token_id, int) and token_id != tokenizer.unk_token_id:
                    ids.add(token_id)
    return ids
