"""Preference pairs and kto examples in rows: packed whole, and KTO's KL rows.

Tokenized examples (the preference and kto formats, finetune/data/formats/preference.py) hold a
preference pair as one example: the chosen sequence then the rejected one in `input_ids` /
`labels`, `chosen_len` saying where the rejected one starts; a kto example is one sequence with
`desirable` and `prompt_len`. A pair is the unit of the length limit and of packing: it is never
split across rows.

Packed rows (`pack_examples`) carry what SFT rows carry (`input_ids`, `labels`, `position_ids`
restarting at 0 for every sequence, `seq_lens`) plus `num_units` (pairs or kto examples in the
row). Pairs are laid out chosen_0, rejected_0, chosen_1, rejected_1, ... (each a sequence of its
own: prompt, completion, end of turn), the layout finetune.losses.preference reads with
`sums[0::2]` / `sums[1::2]`; pairs with a margin column (field_margin) add `margins`, one per pair.
Kto rows add `desirable` and `prompt_lens` per example; the collator
builds each row's KL row from them (`kto_kl_row`): every prompt followed by the previous example's
completion, as TRL rotates completions within a batch, so the KL row holds the same tokens as the
row and is as long.

Without packing (`bins=None`) a row holds one pair (both sequences) or one kto example.

>>> kto_kl_row([1, 5, 6, 1, 7, 8, 9], [-100, -100, 6, -100, -100, -100, 9], [3, 4], [2, 3])[:2]
([1, 5, 9, 1, 7, 8, 6], [-100, -100, 9, -100, -100, -100, 6])
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import datasets
import numpy as np
import pyarrow as pa

from finetune.constants import IGNORE_INDEX
from finetune.data.batching.packing import build_packed_rows

PACKED_KINDS = ("preference", "kto")


# ------------------------------------------------------------------------------------------ packing


def pack_examples(
    ds: datasets.Dataset,
    bins: list[list[int]] | None,
    kind: str,
    *,
    pad_to_multiple_of: int | None,
    pad_token_id: int,
) -> datasets.Dataset:
    """Rows of pairs (`kind` preference) or kto examples, `bins` giving the examples of each row
    (None: one per row); see the module docstring for the columns."""
    if kind not in PACKED_KINDS:
        raise ValueError(f"kind must be one of {PACKED_KINDS}, not {kind!r}")
    bins = [[i] for i in range(len(ds))] if bins is None else bins
    if kind == "preference":
        sequences = split_pairs(ds)
        sequence_bins = [[s for i in b for s in (2 * i, 2 * i + 1)] for b in bins]
        rows = build_packed_rows(
            sequences, sequence_bins, pad_to_multiple_of=pad_to_multiple_of, pad_token_id=pad_token_id
        )
        rows = rows.add_column("num_units", [len(b) for b in bins])
        if "margin" in ds.column_names:  # field_margin (train.objective reward): the row's pairs' margins
            margin = ds["margin"]
            rows = rows.add_column("margins", [[margin[i] for i in b] for b in bins])
        return rows
    rows = build_packed_rows(ds, bins, pad_to_multiple_of=pad_to_multiple_of, pad_token_id=pad_token_id)
    desirable, prompt_len = ds["desirable"], ds["prompt_len"]
    rows = rows.add_column("num_units", [len(b) for b in bins])
    rows = rows.add_column("desirable", [[desirable[i] for i in b] for b in bins])
    return rows.add_column("prompt_lens", [[prompt_len[i] for i in b] for b in bins])


def split_pairs(ds: datasets.Dataset) -> datasets.Dataset:
    """The pairs of `ds` as 2N sequences chosen_0, rejected_0, chosen_1, ... (`input_ids`, `labels`).

    No token is copied: the chosen and rejected sequences of a pair are contiguous in the flat
    token buffer, so the sequence lists are the pair lists with one more offset per pair.
    """
    table = ds.select_columns(["input_ids", "labels", "chosen_len"]).with_format("arrow")[:]
    chosen = table.column("chosen_len").to_numpy().astype(np.int64)
    columns = {}
    for name in ("input_ids", "labels"):
        column = table.column(name).combine_chunks()
        lengths = np.asarray(column.value_lengths(), dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(lengths)])
        offsets = np.empty(2 * len(lengths) + 1, dtype=np.int64)
        offsets[0:-1:2], offsets[1::2], offsets[-1] = starts[:-1], starts[:-1] + chosen, starts[-1]
        kind = pa.ListArray if offsets[-1] < 2**31 else pa.LargeListArray
        offsets = offsets.astype(np.int32 if kind is pa.ListArray else np.int64)
        columns[name] = kind.from_arrays(pa.array(offsets), column.flatten())
    digest = hashlib.sha256(f"split_pairs:{ds._fingerprint}".encode()).hexdigest()[:16]
    return datasets.Dataset(pa.table(columns), fingerprint=digest)


# ---------------------------------------------------------------------------------------- kto rows


def kto_kl_row(
    input_ids: Sequence[int], labels: Sequence[int], seq_lens: Sequence[int], prompt_lens: Sequence[int]
) -> tuple[list[int], list[int], list[int]]:
    """(input_ids, labels, position_ids) of a packed kto row's KL row.

    Example j of the row becomes its prompt followed by the completion of example j - 1 (the first
    takes the last one's), as TRL pairs prompts with mismatched completions (`kto_mismatched_
    completions` in finetune.losses.preference); labels mark that completion. The row's padding
    stays at the end, so the KL row is exactly as long as the row. A row of one example gets its own
    completion back (the KL estimate then equals its log-ratio).
    """
    n = len(prompt_lens)
    starts = np.concatenate([[0], np.cumsum(seq_lens[:n])]).tolist()
    ids, labs, pos = [], [], []
    for j in range(n):
        i = (j - 1) % n
        prompt = slice(starts[j], starts[j] + prompt_lens[j])
        completion = slice(starts[i] + prompt_lens[i], starts[i + 1])
        seq_ids = [*input_ids[prompt], *input_ids[completion]]
        ids += seq_ids
        labs += [IGNORE_INDEX] * prompt_lens[j] + list(labels[completion])
        pos += range(len(seq_ids))
    tail = slice(starts[n], len(input_ids))
    ids += input_ids[tail]
    labs += labels[tail]
    pos += range(len(input_ids) - starts[n])
    if labs:
        labs[0] = IGNORE_INDEX
    return list(ids), labs, list(pos)
