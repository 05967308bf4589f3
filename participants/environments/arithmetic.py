"""Integer arithmetic with + - * only, for the math tasks and the scripted player that answers them.

Never eval(): the text may come from a model."""

from __future__ import annotations

import ast
import operator

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def evaluate(expression: str) -> int:
    """The value of `expression`; ValueError (or SyntaxError) for anything but integers and + - *."""

    def walk(node: ast.AST) -> int:
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -walk(node.operand)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        raise ValueError(f"unsupported expression: {expression!r}")

    return walk(ast.parse(expression.strip(), mode="eval").body)
