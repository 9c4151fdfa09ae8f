"""finetune.train.main in process: errors that stop a run before any data is prepared."""

from __future__ import annotations

import pytest
import torch

from tests.integration._run import DEMO, demo_overrides


@pytest.mark.parametrize("backend", ["flex_attention", "flash_attention_2"])
def test_gpu_attention_backends_fail_before_data_preparation(
    tmp_path, capsys, backend, fresh_accelerator_state
):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    from finetune.train import main

    code = main([str(DEMO), *demo_overrides(tmp_path), "--model.attn_implementation", backend])
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: model.attn_implementation: {backend}") and "sdpa" in err
    assert not (tmp_path / "prepared").exists() and not (tmp_path / "out").exists()
