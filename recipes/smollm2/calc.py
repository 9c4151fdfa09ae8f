"""The calculator tool of the word-problems demo (recipes/smollm2/word_problems_calc.yaml): the model
writes `<<24-17=`, the trigger `<<([^<>=]*)=` hands `24-17` to `calculate`, and `7>>` is inserted.

Arithmetic only (numbers, + - * / // % **, parentheses), read with Python's own parser and evaluated
node by node: no names, calls or attributes, so no text the model writes can run code. Whole results
are written without a decimal point (`7`, not `7.0`), as GSM8K's annotations are.

>>> calculate("24-17"), calculate("(3+4)*2"), calculate("7/2"), calculate("10/4*2")
(7, 14, 3.5, 5)
>>> calculate("__import__('os')")
Traceback (most recent call last):
...
ValueError: not arithmetic: __import__('os')
"""

from __future__ import annotations

import ast
import operator

OPERATORS = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}  # fmt: skip


def calculate(expression: str) -> int | float:
    """The value of an arithmetic expression.

    Args:
        expression: numbers with + - * / // % ** and parentheses, e.g. 24-17
    """

    def value(node: ast.AST) -> int | float:
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, int | float)
            and not isinstance(node.value, bool)
        ):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
            return -value(node.operand) if isinstance(node.op, ast.USub) else value(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise ValueError(f"exponent too large: {right}")
            return OPERATORS[type(node.op)](left, right)
        raise ValueError(f"not arithmetic: {expression}")

    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"not arithmetic: {expression}") from None
    result = value(tree.body)
    if isinstance(result, float) and result.is_integer():
        return int(result)
    return round(result, 6) if isinstance(result, float) else result
