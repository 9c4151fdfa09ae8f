"""Fixtures of the vision-language data tests (test_vlm_masking.py, test_vision_pairs.py)."""

from __future__ import annotations

import pytest

from tests.vlm_processors import PROCESSORS, ready


@pytest.fixture(scope="module", params=list(PROCESSORS))
def processor(request):
    """(name, processor, end-of-turn marker) of each model in tests/vlm_processors.PROCESSORS, built once
    per module."""
    return request.param, *ready(request.param)
