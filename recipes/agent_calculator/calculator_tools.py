"""The calculator tool of recipes/agent_calculator: arithmetic on numbers, nothing else.

The expression is parsed, never run: only numbers, + - * / // % ** and parentheses are
accepted (``x``/``×`` read as ``*``, ``÷`` as ``/``, ``^`` as ``**``). Anything else raises, and the
agent is shown the error.
"""

from __future__ import annotations

import ast
import operator

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def calculate(expression: str) -> str:
    """The value of ``expression``, as text (an integer when the value is whole)."""
    text = expression.replace("×", "*").replace("÷", "/").replace("^", "**").replace("x", "*").replace("X", "*")
    text = text.replace(",", "").strip().rstrip("=").strip()
    if len(text) > 200:
        raise ValueError("expression is too long (200 characters at most)")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from None
    value = _eval(tree.body)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(round(value, 6) if isinstance(value, float) else value)


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and (abs(right) > 64 or abs(left) > 10**6):
            raise ValueError("exponent too large")
        return _OPS[type(node.op)](left, right)
    raise ValueError(f"only numbers and + - * / ** ( ) are allowed, got {type(node).__name__}")
